"""Launch geometry of mamba3 (ABI.md §11), every target, kernels/mamba3.cl.

From M3C_MIN_SEQ tokens on (or with ``ssm_kernel="chunked"``), the chunked prefill of §11's informative note, where the
device takes its work-groups and LOCAL tiles (f64 at the gpu target does not: they would pass CUDA's 48 KiB of static
shared memory): four launches over scratch in the compute type, chunks of ``M3C_Q`` tokens, a row starting a chunk
(``chunk_slots`` slots per head): each token's turned q and k (cpu: a work-item per (row, head); gpu: per (row,
head, pair)), the angle walked as the step kernels walk it; each chunk's own state (a work-group per (head, chunk
slot, ``M3C_PT`` state rows)); the inter-chunk pass (a work-item per state column and ``M3C_PP`` rows of a (row,
head)); the chunk outputs, the intra-chunk products per token at the cpu target and in LOCAL tiles at the gpu target
(groups as the second launch's).
Else (decode, short sequences, ``ssm_kernel="lanes"``) the step recurrence over the tokens of each (row, head), a
row being a batch row or one packed sequence: at the cpu target one launch, one work-item per M3_PB state rows, the
items of a (row, head) in one work-group; at the gpu target each state row spread over ``SSM_L`` lanes (the
state-size variant), one work-group per (row, head) walking the sequence once per block of its rows, or from
M3_MIN_SEQ steps on one group per M3_SPLIT_ROWS rows (more groups for a prefill), the final angle and key then
written by a second launch. A decode step (seq 1, carried state, slots) is one launch, straight on the pool. The
optional fields are runtime flags of the one program per dtype (and state size). What runs on the host instead:
state, parameters or the step inputs kept in f64 beside a thunk computing in f32.

mamba3_backward (ABI.md §9), kernels/mamba3_backward.cl after kernels/mamba3.cl (whose helpers it shares): the step
recurrence reversed, the same launches at both targets: the turned q and k of every token into scratch (a work-item
per (row, head, pair)); the reverse walk (a work-item per (row, head, block of state rows), each row recomputed
from checkpoints every ``SSMB_Q`` steps, the block's shares of the per-token gradients summed row after row into
its partials); a work-item per (token, head) summing the blocks' partials and undoing the turns; one per (row,
head) summing the angle's gradient from the last token back; then fixed-order sums (``mamba3_backward_reduce``) of
d_q and d_k over a group's heads, of the biases' gradients over the tokens and of d_d over rows and blocks. Every
sum has one order: the same bytes on every run, no atomics. What runs on the host instead: the forward's
element-type limits (``wider_types``). At the gpu target, long batch rows below f64 run chunked instead of the walk
(``mamba3_chunk_backward``: three launches between the turn and the per-token launch, by the forward's rule).
"""
from __future__ import annotations

from host_fallback.abi import complete, forward_op

from .arguments import kernel_launch
from .core import ARENA, SCRATCH, Launch, LaunchPlan, Thunk, ceil_to, grid, linear_local, real_size
from . import mamba3_chunk_backward
from .limits import SSM_VARIANTS, DeviceLimits, add_tuning, add_variants, state_variant
from .mma import MMA_TF32, mma_defines
from .registry import register
from .ssm import chunk_slots, takes_chunked

# The chunked prefill: chunks of M3C_Q tokens, work-groups of M3C_LANES items, M3C_PT state rows per tile (M3C_PS per
# item of a chunk's own state; M3C_PT a multiple of M3C_PP, the rows per item of the inter-chunk pass), state columns
# staged M3C_NT at a time (gpu). M3C_MIN_SEQ: where it overtakes the step recurrence at B2 H8 P64 N64 f32 (paired
# medians on the 2-core test machine, loaded): cpu target, PoCL 3.1 at 12-16 tokens (Intel's CPU runtime about 16);
# gpu target on PoCL 40-48 (it ranks the forms' work and barrier counts, not a GPU's latency hiding; no GPU measured).
add_tuning(__name__, cpu={
    "M3_PB": 16,  # state rows (head_dim positions) per work-item of the mamba3 kernel
    "M3B_PB": 4,  # mamba3_backward: state rows of a block walked together (each token's q, k read once for them)
    "M3C_Q": 32, "M3C_LANES": 32, "M3C_PT": 64, "M3C_PS": 64, "M3C_NT": 16, "M3C_PP": 64, "M3C_MIN_SEQ": 16,
}, gpu={
    # from M3_MIN_SEQ steps on, a head's state rows walk the sequence M3_SPLIT_ROWS to a group (a warp at
    # state_size 64), so that a prefill of few (row, head) pairs exposes more groups
    "M3_MIN_SEQ": 64, "M3_SPLIT_ROWS": 4,
    "M3B_PB": 1,  # mamba3_backward: state rows walked together per work-item (more cost registers at sm_90)
    "M3C_Q": 64, "M3C_LANES": 256, "M3C_PT": 16, "M3C_PS": 4, "M3C_NT": 16, "M3C_PP": 1, "M3C_MIN_SEQ": 48,
})
# () builds the chunked prefill, the others the lanes kernel at every state size (its optional fields are runtime
# flags)
add_variants("mamba3", gpu=((),) + tuple(state_variant(n) for n in SSM_VARIANTS))

#: the version-2 fields of §11 (and §8's machinery) the kernels implement: all of the forward's
V2_FIELDS = frozenset({"groups", "q_bias", "k_bias", "d", "z", "dt_dtype", "param_dtype", "carry_state",
                       "angle_state", "state", "k_state", "v_state", "state_dtype", "cu_seqlens", "num_seqs",
                       "state_slots", "num_slots"})
#: field -> the kernels' tensor parameter that takes it
_PARAMS = {"q": "qb", "k": "kb", "v": "vb", "z": "zb", "dst": "db", "adt": "adtb", "dt": "dtb", "trap": "trb",
           "angles": "anb", "q_bias": "qbb", "k_bias": "kbb", "d": "skb", "angle_state": "asb", "state": "stb",
           "k_state": "ksb", "v_state": "vsb", "cu_seqlens": "cub", "state_slots": "slb"}
#: the compute type of each dtype: the state's type on the device, and the one other type the step inputs and
#: parameters may have there
_COMPUTE = {"f32": "f32", "f16": "f32", "bf16": "f32", "f64": "f64"}


def arguments(t: Thunk) -> dict[str, object]:
    """Every kernel argument of ``t`` (completed): an absent tensor at offset 0 (its flag is off)."""
    varlen = t["cu_seqlens"] is not None
    return dict(R=t["num_seqs"] if varlen else t["batch"], S=t["seq"], H=t["heads"], P=t["head_dim"],
                N=t["state_size"], A=t["num_angles"], G=t["groups"], has_q_bias=t["q_bias"] is not None,
                has_k_bias=t["k_bias"] is not None, has_d=t["d"] is not None, has_z=t["z"] is not None,
                carry=bool(t["carry_state"]), varlen=varlen, slotted=t["state_slots"] is not None,
                dt_real=t["dt_dtype"] != t["dtype"], param_real=t["param_dtype"] != t["dtype"],
                **{param: (ARENA, t.get(field) or 0) for field, param in _PARAMS.items()})


def _lanes(t: Thunk, lim: DeviceLimits, args: dict[str, object]) -> LaunchPlan:
    """gpu: one group per (row, head), or from M3_MIN_SEQ steps on one per M3_SPLIT_ROWS of its state rows (a
    prefill exposes more groups; with carry_state a second launch writes each head's final angle and key, which
    the groups all read first)."""
    defines = state_variant(t["state_size"])
    lanes, p = dict(defines)["SSM_L"], t["head_dim"]
    split = t["seq"] >= lim.tune("M3_MIN_SEQ") and p > lim.tune("M3_SPLIT_ROWS")
    rows = lim.tune("M3_SPLIT_ROWS") if split else linear_local(p, max(1, min(lim.tune("SSM_WG"), lim.max_work_group)
                                                                        // lanes))
    blocks, heads, local = -(-p // rows) if split else 1, args["R"] * args["H"], lanes * rows
    args = dict(args, blocks=blocks)
    out = [kernel_launch("mamba3", "mamba3_lanes", t["dtype"], (heads * blocks * local,), (local,), args,
                         target="gpu", defines=defines)]
    if blocks > 1 and args["carry"]:
        pairs = linear_local(t["state_size"] // 2)
        out.append(kernel_launch("mamba3", "mamba3_lanes_final", t["dtype"],
                                 grid((heads * t["state_size"] // 2,), (pairs,)), (pairs,), args, target="gpu",
                                 defines=defines))
    return LaunchPlan(tuple(out), notes=(f"{blocks} group(s) of {rows} state rows per head",))


#: the chunked prefill's kernels, in launch order
CHUNKED_KERNELS = ("mamba3_chunk_turn", "mamba3_chunk_state", "mamba3_state_pass", "mamba3_chunk_scan")


def _chunked(t: Thunk, lim: DeviceLimits, args: dict[str, object]) -> LaunchPlan:
    """The chunked prefill's launches; scratch (kernels/mamba3.cl's m3c_scratch): q~ and k~ per (head, slot, step),
    a state (its rows rounded up to whole tiles) and a decay per (head, slot), each row's initial key. On a device
    with tensor cores every launch takes the MMA variant of the chunk products (``mma``: the chunk's own state,
    q~.k~^T, q~.S_in^T and the masked product with v), so that one program holds the plan's kernels."""
    q, lanes, dt, h, n = lim.tune("M3C_Q"), lim.tune("M3C_LANES"), t["dtype"], t["heads"], t["state_size"]
    slots, rows, gpu = chunk_slots(t, q), args["R"], lim.target == "gpu"
    args = dict(args, K=slots, sb=(SCRATCH, 0))
    tiles = h * slots * -(-t["head_dim"] // lim.tune("M3C_PT"))
    turns = rows * h * (n // 2 if gpu else 1)  # gpu: an item per pair; cpu: all of a head's
    passes = rows * h * n * -(-t["head_dim"] // lim.tune("M3C_PP"))
    # cpu: small groups of independent items (a group runs on one core); gpu: up to 256 lanes
    turn_local, pass_local = linear_local(turns, 64 if gpu else 1), linear_local(passes, 256 if gpu else 16)
    shapes = {"mamba3_chunk_turn": (grid((turns,), (turn_local,)), (turn_local,)),
              "mamba3_chunk_state": ((tiles * lanes,), (lanes,)),
              "mamba3_state_pass": (grid((passes,), (pass_local,)), (pass_local,)),
              "mamba3_chunk_scan": ((tiles * lanes,), (lanes,))}
    reals = (2 * h * slots * q * n + h * slots * ceil_to(t["head_dim"], lim.tune("M3C_PT")) * n + h * slots
             + rows * h * n)
    return LaunchPlan(tuple(kernel_launch("mamba3", kernel, dt, *shapes[kernel], args, target=lim.target,
                                          defines=mma_defines(lim, dt)) for kernel in CHUNKED_KERNELS),
                      reals * real_size(dt), (f"chunked Q={q}",))


def _mma_local(q: int, pt: int, lanes: int, variant: int) -> int:
    """Bytes of LOCAL memory the larger of the MMA variant's chunk_state and chunk_scan takes (kernels/mamba3.cl:
    operands of 2 bytes, or 4 with TF32, whose operands below the diagonal are the f32 tile itself)."""
    op, columns = 4 if variant == MMA_TF32 else 2, lanes // 32 * 16
    state = q * columns * op + pt * columns * 4
    scan = q * q * 4 + q * pt * 4 + (0 if variant == MMA_TF32 else q * q * op) + (2 * q + pt) * 16 * op
    return 3 * q * 4 + 4 * q + q * pt * op + max(state, scan)


def _chunked_fits(t: Thunk, lim: DeviceLimits) -> bool:
    """Whether the device takes the chunked form's work-groups of M3C_LANES items and its kernels' LOCAL tiles
    (kernels/mamba3.cl's mamba3_chunk_scan at the target, or the larger MMA variant's; f64 at the gpu target would
    pass CUDA's 48 KiB)."""
    q, pt, nt = lim.tune("M3C_Q"), lim.tune("M3C_PT"), lim.tune("M3C_NT")
    tiles = q * q if lim.target == "cpu" else 2 * q * (nt + 1) + pt * (nt + 1) + q * (q + 1)
    local = (3 * q + q * pt + tiles) * real_size(t["dtype"]) + 4 * q
    mma = dict(mma_defines(lim, t["dtype"])).get("RLX_MMA")
    if mma:
        local = _mma_local(q, pt, lim.tune("M3C_LANES"), mma)
    return (lim.max_work_group >= lim.tune("M3C_LANES") and local <= lim.local_mem_bytes
            and not (lim.target == "gpu" and t["dtype"] == "f64"))


def _forward(t: Thunk, lim: DeviceLimits, ssm_kernel: str = "auto", **_: object) -> LaunchPlan:
    t = complete(t)
    args = arguments(t)
    # the chunked form by ``ssm_kernel`` ("auto": from M3C_MIN_SEQ tokens on) where the device takes it
    if takes_chunked(lim, t["seq"], "M3C_MIN_SEQ", ssm_kernel) and _chunked_fits(t, lim):
        return _chunked(t, lim, args)
    if lim.target == "gpu":
        return _lanes(t, lim, args)
    items = -(-t["head_dim"] // lim.tune("M3_PB"))
    local = linear_local(items, lim.max_work_group)  # every item of a (row, head) in one work-group
    return LaunchPlan((kernel_launch("mamba3", "mamba3", t["dtype"], (local, args["H"], args["R"]), (local, 1, 1),
                                     args, target=lim.target),))


def wider_types(t: Thunk) -> str | None:
    """Why ``t`` (completed; mamba3 or its backward) runs on the host for its element types, or ``None``."""
    compute = _COMPUTE[t["dtype"]]
    wider = [f"{f}={t[f]}" for f in ("dt_dtype", "param_dtype") if t[f] not in (t["dtype"], compute)]
    wider += [f"state_dtype={t['state_dtype']}"] if t["state_dtype"] != compute else []
    if wider:
        return (f"mamba3's device kernels keep the state in the compute type of dtype={t['dtype']} ({compute}) and "
                f"read the other fields in it or the dtype; {' and '.join(wider)} runs on the host")
    return None


def unsupported(t: Thunk, lim: DeviceLimits) -> str | None:
    t = complete(t)
    if t["state_size"] > lim.tune("STATE_MAX"):
        return (f"mamba3 keeps a state row of state_size={t['state_size']} in private memory; the kernel holds at "
                f"most {lim.tune('STATE_MAX')}")
    wider = wider_types(t)
    if wider:
        return wider
    if lim.target == "cpu" and -(-t["head_dim"] // lim.tune("M3_PB")) > lim.max_work_group:
        return (f"mamba3 at the cpu target puts the {-(-t['head_dim'] // lim.tune('M3_PB'))} work-items of a head "
                f"in one work-group; the device takes at most {lim.max_work_group}")
    return None


#: the forward's §8/§11 fields and the optional inputs' and states' gradients
BACKWARD_FIELDS = V2_FIELDS | {"d_q_bias", "d_k_bias", "d_d", "d_z", "d_angle_state", "d_state", "d_k_state",
                              "d_v_state"}
#: gradient field -> the kernels' tensor parameter that takes it (d_q, d_k and the parameters' gradients: the sums)
_GRADIENTS = {"d_dst": "gob", "d_v": "dvb", "d_z": "dzb", "d_adt": "dadtb", "d_dt": "ddtb", "d_trap": "dtrb",
              "d_angles": "danb", "d_angle_state": "dasb", "d_state": "dstb", "d_k_state": "dksb", "d_v_state": "dvsb"}
#: the forward's arguments in the groups its text builds them by (kernels/mamba3.cl: m3_io_base, then m3_with_*)
_GROUPS = {"base": ("R", "S", "H", "P", "N", "A", "G", "carry", "dt_real", "param_real", "dtb"),
           "qk": ("has_q_bias", "has_k_bias", "qb", "kb", "qbb", "kbb"), "coeffs": ("adtb", "trb"),
           "values": ("has_d", "has_z", "vb", "zb", "skb"), "state": ("stb", "ksb", "vsb"),
           "rows": ("varlen", "cub", "slotted", "slb")}
#: each kernel's groups, then its own arguments: sizes, inputs outside the groups, gradients and scratch parts (a
#: part's tensor parameter is its name and "b")
_KERNELS = {
    "mamba3_backward_turn": (("base", "qk", "rows"), ("anb", "asb", "qrb", "krb", "thb")),
    "mamba3_backward_walk": (("base", "coeffs", "values", "state", "rows"),
                             ("T", "blocks", "per", "gob", "dvb", "dzb", "dstb", "dksb", "dvsb", "qrb", "krb", "partb",
                              "wsb", "dk0b", "ddpb")),
    "mamba3_backward_tokens": (("base", "coeffs"), ("T", "blocks", "dadtb", "dtrb", "qrb", "krb", "partb", "thb",
                                                    "dtsb", "direct")),
    "mamba3_backward_angles": (("base", "rows"), ("anb", "blocks", "ddtb", "danb", "dasb", "dksb", "thb", "dk0b",
                                                  "dtsb"))}
#: the most reals the blocks' partials of the gradients of q~ and k~ take (each): blocks are fewer beyond it
PARTIAL_REALS = 1 << 26


def _layout(dtype: str, parts: dict[str, int]) -> tuple[dict[str, int], int]:
    """Byte offsets in scratch of ``parts`` (name -> reals of the compute type), each on 256 bytes, and the total."""
    at, offsets = 0, {}
    for name, reals in parts.items():
        offsets[name] = at
        at = ceil_to(at + reals * real_size(dtype), 256)
    return offsets, at


def _backward(t: Thunk, lim: DeviceLimits, ssm_kernel: str = "auto", **_: object) -> LaunchPlan:
    t = complete(t)
    fwd = {**t, "op": forward_op(t["op"])}
    args = arguments(fwd)  # its dst (db): no field of the backward, no kernel's argument
    r, s, h, p, n, a, g, dt = args["R"], t["seq"], t["heads"], t["head_dim"], t["state_size"], t["num_angles"], \
        t["groups"], t["dtype"]
    tokens, q = t["batch"] * s, lim.tune("SSMB_Q")
    chunked = mamba3_chunk_backward.takes(fwd, lim, ssm_kernel)  # long batch rows at the gpu target
    blocks = 1 if chunked else max(1, min(p, lim.tune("SSMB_BLOCKS"), PARTIAL_REALS // (tokens * h * n)))
    per = -(-p // blocks)
    blocks = -(-p // per)  # none empty
    items, sets = r * h * blocks, mamba3_chunk_backward.slots(fwd, lim) if chunked else r * blocks
    own = mamba3_chunk_backward.scratch(fwd, lim) if chunked else {
        "ws": items * (-(-s // q) + q + 2) * lim.tune("M3B_PB") * n}
    at, total = _layout(dt, {"qr": tokens * h * n, "kr": tokens * h * n, "th": tokens * h * a, **own,
                             "part": blocks * tokens * h * (2 * n + 3), "dk0": r * blocks * h * n, "ddp": sets * h,
                             "dts": tokens * h})
    args.update(T=tokens, blocks=blocks, per=per, W=2 * n + 3, direct=chunked,
                **{f"{part}b": (SCRATCH, offset) for part, offset in at.items()},
                **{param: (ARENA, t.get(field) or 0) for field, param in _GRADIENTS.items()})
    args.update(mamba3_chunk_backward.arguments(fwd, lim) if chunked else {})

    def launch(kernel: str, size: tuple, local: tuple, defines: tuple = ()) -> Launch:
        groups, own_args = {**_KERNELS, **mamba3_chunk_backward.KERNELS}[kernel]
        names = [name for group in groups for name in _GROUPS[group]] + list(own_args)
        return kernel_launch("mamba3_backward", kernel, dt, size, local, {name: args[name] for name in names},
                             target=lim.target, defines=defines)

    def spread(kernel: str, extent: int) -> Launch:
        local = (linear_local(extent),)
        return launch(kernel, grid((extent,), local), local)
    middle = (mamba3_chunk_backward.launches(fwd, lim, launch) if chunked
              else [spread("mamba3_backward_walk", items)])
    out = [spread("mamba3_backward_turn", r * h * n // 2), *middle, spread("mamba3_backward_tokens", tokens * h),
           spread("mamba3_backward_angles", r * h)]
    hg, param_real = h // g, t["param_dtype"] != dt
    sums = [("d_q", tokens * g * n, hg, n, hg * n, n, "qr", False), ("d_k", tokens * g * n, hg, n, hg * n, n, "kr", False),
            ("d_q_bias", h * n, tokens, h * n, 0, h * n, "qr", param_real),
            ("d_k_bias", h * n, tokens, h * n, 0, h * n, "kr", param_real),
            ("d_d", h, sets, h, 0, h, "ddp", param_real)]
    out += [_reduce(t[field], m, k, inner, outer, kstride, at[part], is_real, dt, lim)
            for field, m, k, inner, outer, kstride, part, is_real in sums if t.get(field) is not None]
    note = f"chunked Q={lim.tune('M3C_Q')}" if chunked else f"checkpoints every {q} steps, {blocks} block(s) of {per} state rows"
    return LaunchPlan(tuple(out), total, (note,))


def _reduce(out: int, m: int, k: int, inner: int, outer: int, kstride: int, part: int, is_real: bool, dt: str,
            lim: DeviceLimits) -> Launch:
    """``mamba3_backward_reduce``: ``out`` (an arena offset) = the ``k`` partials of each of ``m`` values."""
    local = (linear_local(m),)
    return kernel_launch("mamba3_backward", "mamba3_backward_reduce", dt, grid((m,), local), local,
                         dict(M=m, K=k, inner=inner, outer=outer, kstride=kstride, is_real=is_real, pb=(SCRATCH, part),
                              ob=(ARENA, out)), target=lim.target)


def unsupported_backward(t: Thunk, lim: DeviceLimits) -> str | None:
    """The forward's element-type limits (a state, step input or parameter wider than the compute type)."""
    return wider_types(complete(t))


register("mamba3", _forward, unsupported, v2_fields=V2_FIELDS, family="mamba3")
register("mamba3_backward", _backward, unsupported_backward, v2_fields=BACKWARD_FIELDS, family="mamba3_backward",
         shared_texts=("mamba3.cl", "mma_split.cl", "mamba3_chunk_backward.cl"))
