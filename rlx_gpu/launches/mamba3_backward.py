"""Launch geometry of mamba3_backward (ABI.md §9, §11), every target, kernels/mamba3_backward.cl.

The step recurrence reversed, the same launches at both targets: the turned q and k of every token into scratch
(a work-item per (row, head, pair)); the reverse walk (a work-item per (row, head, block of state rows), each row
recomputed from checkpoints every ``SSMB_Q`` steps, the block's shares of the per-token gradients summed row after
row into its partials); a work-item per (token, head) summing the blocks' partials and undoing the turns; one per
(row, head) summing the angle's gradient from the last token back; then fixed-order sums (``mamba3_backward_reduce``)
of d_q and d_k over a group's heads, of the biases' gradients over the tokens and of d_d over rows and blocks.
Every sum has one order: the same bytes on every run, no atomics. What runs on the host instead: the forward's
element-type limits (``mamba3.wider_types``).
"""
from __future__ import annotations

from host_fallback.abi import complete, forward_op

from .arguments import kernel_launch
from .core import ARENA, SCRATCH, Launch, LaunchPlan, Thunk, ceil_to, grid, linear_local, real_size
from .limits import DeviceLimits
from .mamba3 import V2_FIELDS as FORWARD_FIELDS
from .mamba3 import arguments, wider_types
from .registry import register

#: the forward's §8/§11 fields and the optional inputs' and states' gradients
V2_FIELDS = FORWARD_FIELDS | {"d_q_bias", "d_k_bias", "d_d", "d_z", "d_angle_state", "d_state", "d_k_state",
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
                                                    "dtsb")),
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


def _plan(t: Thunk, lim: DeviceLimits, **_: object) -> LaunchPlan:
    t = complete(t)
    fwd = {**t, "op": forward_op(t["op"])}
    args = arguments(fwd)  # its dst (db): no field of the backward, no kernel's argument
    r, s, h, p, n, a, g, dt = args["R"], t["seq"], t["heads"], t["head_dim"], t["state_size"], t["num_angles"], \
        t["groups"], t["dtype"]
    tokens, q = t["batch"] * s, lim.tune("SSMB_Q")
    blocks = max(1, min(p, lim.tune("SSMB_BLOCKS"), PARTIAL_REALS // (tokens * h * n)))
    per = -(-p // blocks)
    blocks = -(-p // per)  # none empty
    items = r * h * blocks
    at, total = _layout(dt, {"qr": tokens * h * n, "kr": tokens * h * n, "th": tokens * h * a,
                             "ws": items * (-(-s // q) + q + 2) * lim.tune("M3B_PB") * n,
                             "part": blocks * tokens * h * (2 * n + 3), "dk0": r * blocks * h * n, "ddp": r * blocks * h,
                             "dts": tokens * h})
    args.update(T=tokens, blocks=blocks, per=per, **{f"{part}b": (SCRATCH, offset) for part, offset in at.items()},
                **{param: (ARENA, t.get(field) or 0) for field, param in _GRADIENTS.items()})

    def launch(kernel: str, extent: int) -> Launch:
        local, (groups, own) = (linear_local(extent),), _KERNELS[kernel]
        names = [name for group in groups for name in _GROUPS[group]] + list(own)
        return kernel_launch("mamba3_backward", kernel, dt, grid((extent,), local), local,
                             {name: args[name] for name in names}, target=lim.target)
    out = [launch("mamba3_backward_turn", r * h * n // 2), launch("mamba3_backward_walk", items),
           launch("mamba3_backward_tokens", tokens * h), launch("mamba3_backward_angles", r * h)]
    hg, param_real = h // g, t["param_dtype"] != dt
    sums = [("d_q", tokens * g * n, hg, n, hg * n, n, "qr", False), ("d_k", tokens * g * n, hg, n, hg * n, n, "kr", False),
            ("d_q_bias", h * n, tokens, h * n, 0, h * n, "qr", param_real),
            ("d_k_bias", h * n, tokens, h * n, 0, h * n, "kr", param_real),
            ("d_d", h, r * blocks, h, 0, h, "ddp", param_real)]
    out += [_reduce(t[field], m, k, inner, outer, kstride, at[part], is_real, dt, lim)
            for field, m, k, inner, outer, kstride, part, is_real in sums if t.get(field) is not None]
    return LaunchPlan(tuple(out), total, (f"checkpoints every {q} steps, {blocks} block(s) of {per} state rows",))


def _reduce(out: int, m: int, k: int, inner: int, outer: int, kstride: int, part: int, is_real: bool, dt: str,
            lim: DeviceLimits) -> Launch:
    """``mamba3_backward_reduce``: ``out`` (an arena offset) = the ``k`` partials of each of ``m`` values."""
    local = (linear_local(m),)
    return kernel_launch("mamba3_backward", "mamba3_backward_reduce", dt, grid((m,), local), local,
                         dict(M=m, K=k, inner=inner, outer=outer, kstride=kstride, is_real=is_real, pb=(SCRATCH, part),
                              ob=(ARENA, out)), target=lim.target)


def unsupported(t: Thunk, lim: DeviceLimits) -> str | None:
    """The forward's element-type limits (a state, step input or parameter wider than the compute type)."""
    return wider_types(complete(t))


register("mamba3_backward", _plan, unsupported, v2_fields=V2_FIELDS, family="mamba3_backward")
