"""Launch geometry of selective_scan_backward, mamba2_backward and gated_delta_net_backward (ABI.md §9),
every target.

One launch walks the state rows (gated_delta_net: state columns) in reverse, kernels/ssm_backward.cl
and kernels/gdn_backward.cl: a work-item per (row, group or key head, block of its channels / heads),
``SSMB_BLOCKS`` blocks at most, each item with its own checkpoint workspace in scratch. Then launches
sum the partials the items wrote, in a fixed order: ``ssm_backward_reduce`` d_b and d_c over the
blocks, d_a, d_d and the delta bias's gradient over the rows; ``gdn_backward_qk`` d_q and d_k over the
blocks. The version-2 fields are compile-time variants (for selective_scan and mamba2 the forward's,
``ssm.field_defines``). gated_delta_net_backward given a saved forward (ABI.md §9.1) reads its states: at the
cpu target ``gdn_backward_saved`` (GDN_CJ state columns per work-item, the chunks' steps rebuilt from the
reserve), at the gpu target the walk above with its checkpoints copied from the reserve; with batch rows (either
gate), at either target, the chunked form of launches/gdn_backward.py instead (unless ``ssm_kernel="lanes"``).
"""
from __future__ import annotations

from host_fallback.abi import complete, forward_op
from host_fallback.abi.gdn import RESERVE_CHUNK, gdn_scale, reserve_slots

from . import gdn, gdn_backward, mamba2_backward, ssm
from .arguments import kernel_launch
from .core import ARENA, SCRATCH, Launch, LaunchPlan, Thunk, ceil_to, grid, linear_local, real_size
from .limits import DeviceLimits
from .registry import register
from .ssm import FIELDS_TEXT, RESERVE_FIELDS, TENSOR_PARAMS, dt_limits, field_defines, rows, saved, tensors

#: the §8/§9 fields the backward kernels implement: their forwards' (each op has only its own), and the
#: optional inputs' gradients
V2_FIELDS = ssm.V2_FIELDS | gdn.V2_FIELDS | {"d_delta_bias", "d_dt_bias", "d_d", "d_z", "d_state"}
#: gated_delta_net_backward's: V2_FIELDS and the saved forward it reads (ABI.md §9.1)
GDN_V2_FIELDS = V2_FIELDS | gdn.RESERVE_FIELDS

#: per op: (the delta field, the width of a token's delta: channels or heads, and its kernel parameter)
_DELTA = {"selective_scan": ("delta", "hidden", "H"), "mamba2": ("dt", "heads", "HD")}
#: field -> the kernels' tensor parameter that takes it, the forward's and the gradients (kernels/ssm_backward.cl)
_TENSOR_PARAMS = {**TENSOR_PARAMS, "d_dst": "gb", "d_x": "dxb", "d_delta": "ddeb", "d_dt": "ddtb", "d_z": "dzb",
                  "d_state": "dstb"}
#: scratch part -> the kernels' offset parameter of it, after the scratch buffer ``scb`` with the workspaces' offset
_SCRATCH_OFFSETS = {"delta_sums": "ddlo", "db": "dbo", "dc": "dco", "da": "pao", "dd": "pdo", "dbias": "pbo"}


def _layout(dtype: str, parts: dict[str, int]) -> tuple[dict[str, int], int]:
    """Byte offsets in scratch of ``parts`` (name -> reals of the compute type of ``dtype``), each on 256
    bytes, and the bytes in all."""
    at, offsets = 0, {}
    for name, reals in parts.items():
        offsets[name] = at
        at = ceil_to(at + reals * real_size(dtype), 256)
    return offsets, at


def _blocks(width: int, lim: DeviceLimits) -> tuple[int, int]:
    """(blocks, per): ``width`` channels (heads) cut into at most ``SSMB_BLOCKS`` blocks of ``per``, none empty."""
    per = -(-width // min(width, lim.tune("SSMB_BLOCKS")))
    return -(-width // per), per


def _plan(t: Thunk, lim: DeviceLimits, ssm_kernel: str = "auto", **_: object) -> LaunchPlan:
    op = forward_op(t["op"])
    fwd = {**complete(t), "op": op}  # the forward's view: its field names and variant switches
    if op == "mamba2" and mamba2_backward.takes(fwd, lim, ssm_kernel):  # long rows at the gpu target: chunked
        return mamba2_backward.plan(fwd, lim, _layout, _reduce)
    delta, width, width_param = _DELTA[op]
    r, g, n, dt, lanes = rows(fwd), fwd["groups"], fwd["state_size"], fwd["dtype"], fwd[width]
    tokens, q = fwd["batch"] * fwd["seq"], lim.tune("SSMB_Q")
    blocks, per = _blocks(lanes // g, lim)
    items = r * g * blocks
    # at the cpu target selective_scan's workspaces keep a chunk's decays too, and the checkpoints of the state rows
    # walked together: a block's channels, a head's P rows (SSMB_KEEP_DECAYS, SSMB_ROWS_TOGETHER)
    decays = op == "selective_scan" and lim.target == "cpu"
    walked_together = (fwd["head_dim"] if op == "mamba2" else per) if lim.target == "cpu" else 1
    steps = 2 * q if decays else q
    workspace = items * (steps + walked_together * (-(-fwd["seq"] // q) + 1)) * n
    at, total = _layout(dt, {"workspaces": workspace, "delta_sums": tokens * lanes,
                             "db": blocks * tokens * g * n, "dc": blocks * tokens * g * n, "da": r * lanes * n,
                             "dd": r * lanes, "dbias": r * lanes})
    args = {"R": r, "S": fwd["seq"], "T": tokens, width_param: lanes, "N": n, "G": g, "blocks": blocks, "per": per,
            **tensors(fwd, ("x", delta, "a", "b", "c", "bias", "d", "z", "state", "cu_seqlens", "state_slots", "d_dst",
                            "d_x", f"d_{delta}", "d_z", "d_state"), _TENSOR_PARAMS),
            "scb": (SCRATCH, at["workspaces"]), **{param: at[part] for part, param in _SCRATCH_OFFSETS.items()},
            **saved(fwd)}
    if op == "mamba2":
        args.update(P=fwd["head_dim"], **dt_limits(fwd))
    fields = field_defines(fwd)
    # PoCL runs a work-group's items on one thread: at the cpu target each item is a group of its own, so that the
    # items spread over the cores
    local = (linear_local(items, 1 if lim.target == "cpu" else 64),)
    walk = kernel_launch("ssm_backward", f"{op}_backward", dt, grid((items,), local), local, args, target=lim.target,
                         defines=fields)
    bias = "d_delta_bias" if op == "selective_scan" else "d_dt_bias"
    shared_a = op == "mamba2"  # one a per head: its partials sum over n too
    sums = [("d_b", tokens * g * n, blocks, 1, "db", False), ("d_c", tokens * g * n, blocks, 1, "dc", False),
            ("d_a", lanes if shared_a else lanes * n, r, n if shared_a else 1, "da", True),
            ("d_d", lanes, r, 1, "dd", True), (bias, lanes, r, 1, "dbias", True)]
    launches = [walk] + [_reduce(fwd[field], m, k, j, at[part], as_param, dt, lim, fields)
                         for field, m, k, j, part, as_param in sums if fwd.get(field) is not None]
    walked = "the saved forward's states" if fwd.get("reserve") is not None else f"checkpoints every {q} steps"
    return LaunchPlan(tuple(launches), total, (f"{walked}, {blocks} blocks",))


def _reduce(out: int, m: int, k: int, j: int, part: int, as_param: bool, dt: str, lim: DeviceLimits,
            fields: tuple) -> Launch:
    """``ssm_backward_reduce``: ``out`` (an arena offset) = the ``k`` x ``j`` partials at scratch ``part``."""
    local = (linear_local(m),)
    return kernel_launch("ssm_backward", "ssm_backward_reduce", dt, grid((m,), local), local,
                         dict(M=m, K=k, J=j, pb=(SCRATCH, part), ob=(ARENA, out), as_param=as_param), target=lim.target,
                         defines=fields)




def _gdn_defines(t: Thunk) -> tuple[tuple[str, int], ...]:
    """kernels/gdn_backward.cl's variant of ``t`` (completed): the gate's shape, the norm, and the rows,
    slots and state switches it shares with kernels/ssm_fields.cl."""
    on = {"GDNB_GATE_K": t["gate_per_channel"], "GDNB_NORM": t["qk_l2norm"], "SSM_CARRY": t["carry_state"],
          "SSM_VARLEN": t["cu_seqlens"] is not None, "SSM_SLOTS": t["state_slots"] is not None,
          "SSM_STATE_F32": t["dtype"] in ("f16", "bf16") and t["state_dtype"] == "f32"}
    return tuple((name, 1) for name, value in on.items() if value)


#: field -> the kernels' tensor parameter that takes it (kernels/gdn_backward.cl)
_GDN_TENSOR_PARAMS = {"q": "qb", "k": "kb", "v": "vb", "g": "gb", "beta": "betab", "state": "stb", "cu_seqlens": "cub",
                      "state_slots": "slb", "d_dst": "gob", "d_v": "dvb", "d_g": "dgb", "d_beta": "dbetab",
                      "d_state": "dstb", "d_q": "dqb", "d_k": "dkb"}


def _gdn_saved(t: Thunk, q: int) -> dict[str, object]:
    """The walk's saved-forward arguments: its checkpoints read from the reserve's states when it holds those of
    chunks of ``q`` steps (``abi.gdn.RESERVE_CHUNK``), else walked (``saved`` 0)."""
    if t.get("reserve") is None or q != RESERVE_CHUNK:
        return dict(saved=False, rsb=(ARENA, 0))
    states = next(s for s in reserve_slots(t) if s.name == "states")
    return dict(saved=True, rsb=(ARENA, t["reserve"] + states.offset))


def _plan_gdn(t: Thunk, lim: DeviceLimits, ssm_kernel: str = "auto", **_: object) -> LaunchPlan:
    t = complete(t)
    if gdn_backward.takes(t, ssm_kernel):  # batch rows: the chunked form
        return gdn_backward.plan(t, lim, _layout, _gdn_defines(t))
    r, h, hv, k, v, dt = rows(t), t["heads"], t["value_heads"], t["state_size"], t["value_size"], t["dtype"]
    tokens, q = t["batch"] * t["seq"], lim.tune("SSMB_Q")
    if lim.target == "cpu" and _gdn_saved(t, q)["saved"]:
        return _plan_gdn_saved(t, lim)
    blocks, per = _blocks(hv // h, lim)
    items = r * h * blocks
    gk = k if t["gate_per_channel"] else 1
    offsets, total = _layout(dt, {"workspaces": items * (-(-t["seq"] // q) + q + 1) * k,
                                  "dq": blocks * tokens * h * k, "dk": blocks * tokens * h * k,
                                  "dbeta": tokens * hv, "dg": tokens * hv * gk})
    defines = _gdn_defines(t)

    def tensors(*names: str) -> dict[str, tuple]:
        return {_GDN_TENSOR_PARAMS[f]: (ARENA, t.get(f) or 0) for f in names}  # state, d_state: with carry_state
    walk_args = dict(R=r, S=t["seq"], T=tokens, H=h, HV=hv, K=k, V=v, blocks=blocks, per=per, scale=gdn_scale(t),
                     **tensors("q", "k", "v", "g", "beta", "state", "cu_seqlens", "state_slots", "d_dst", "d_v", "d_g",
                               "d_beta", "d_state"),
                     scb=(SCRATCH, offsets["workspaces"]), dqo=offsets["dq"], dko=offsets["dk"],
                     dbso=offsets["dbeta"], dgso=offsets["dg"], **_gdn_saved(t, q))
    local = (linear_local(items),)
    walk = kernel_launch("gdn_backward", "gated_delta_net_backward", dt, grid((items,), local), local, walk_args,
                         target=lim.target, defines=defines)
    e = tokens * h
    local_qk = (linear_local(e),)
    qk = kernel_launch("gdn_backward", "gdn_backward_qk", dt, grid((e,), local_qk), local_qk,
                       dict(E=e, K=k, blocks=blocks, **tensors("q", "k", "d_q", "d_k"), scb=(SCRATCH, offsets["dq"]),
                            dkso=offsets["dk"]), target=lim.target, defines=defines)
    return LaunchPlan((walk, qk), total, (f"checkpoints every {q} steps, {blocks} blocks",))


#: kernels/gdn_backward.cl's GDNB_W: gdn_backward_saved pads its key rows to a multiple of it
GDNB_W = 8


def _plan_gdn_saved(t: Thunk, lim: DeviceLimits) -> LaunchPlan:
    """The cpu target with a saved forward: ``gdn_backward_saved`` over (row, value head, GDN_CJ state columns),
    the chunks' states rebuilt from the reserve's, then the sums of its partials in order (``gdn_backward_qk``,
    ``gdn_backward_sums``)."""
    b, s, h, hv, k, v, dt = t["batch"], t["seq"], t["heads"], t["value_heads"], t["state_size"], t["value_size"], \
        t["dtype"]
    tokens, q, cj = b * s, lim.tune("SSMB_Q"), lim.tune("GDN_CJ")
    nb, gk, kp = -(-v // cj), k if t["gate_per_channel"] else 1, -(-k // GDNB_W) * GDNB_W
    items, blocks = b * hv * nb, hv // h * nb
    offsets, total = _layout(dt, {"workspaces": items * (q + 1) * kp * cj, "dq": blocks * tokens * h * k,
                                  "dk": blocks * tokens * h * k, "dbeta": nb * tokens * hv,
                                  "dg": nb * tokens * hv * gk})
    slots = {slot.name: (ARENA, t["reserve"] + slot.offset) for slot in reserve_slots(t)}

    def tensors(*names: str) -> dict[str, tuple]:
        return {_GDN_TENSOR_PARAMS[f]: (ARENA, t.get(f) or 0) for f in names}  # state, d_state: with carry_state

    def launch(kernel: str, count: int, args: dict[str, object], cap: int = 64) -> Launch:
        local = (linear_local(count, cap),)
        return kernel_launch("gdn_backward", kernel, dt, grid((count,), local), local, args, target=lim.target,
                             defines=_gdn_defines(t))
    walk = launch("gdn_backward_saved", items, dict(
        B=b, S=s, H=h, HV=hv, K=k, KP=kp, V=v, NB=nb, scale=gdn_scale(t), rsb=slots["states"], rub=slots["u"],
        **tensors("q", "k", "v", "g", "beta", "state", "state_slots", "d_dst", "d_v", "d_state"),
        scb=(SCRATCH, offsets["workspaces"]), dqo=offsets["dq"], dko=offsets["dk"], dbso=offsets["dbeta"],
        dgso=offsets["dg"]), cap=8)  # small work-groups: PoCL keeps each item's private gs beside the others'
    qk = launch("gdn_backward_qk", tokens * h, dict(E=tokens * h, K=k, blocks=blocks, **tensors("q", "k", "d_q", "d_k"),
                                                   scb=(SCRATCH, offsets["dq"]), dkso=offsets["dk"]))
    sums = [launch("gdn_backward_sums", m, dict(M=m, NB=nb, pb=(SCRATCH, offsets[part]), ob=(ARENA, t[field])))
            for field, part, m in (("d_beta", "dbeta", tokens * hv), ("d_g", "dg", tokens * hv * gk))]
    return LaunchPlan((walk, qk, *sums), total, (f"saved forward, {nb} column blocks",))


def unsupported(t: Thunk, lim: DeviceLimits) -> str | None:
    """The forward's limits (a state or parameters in f64 beside a narrower thunk run on the host)."""
    op = forward_op(t["op"])
    return (gdn if op == "gated_delta_net" else ssm).unsupported({**complete(t), "op": op}, lim)


register("selective_scan_backward", _plan, unsupported, v2_fields=V2_FIELDS | RESERVE_FIELDS, family="ssm_backward",
         shared_texts=FIELDS_TEXT)
# (mamba2's step walk is in the ssm_backward program too; its chunked form's program is its own)
register("mamba2_backward", _plan, unsupported, v2_fields=V2_FIELDS | RESERVE_FIELDS,
         family=mamba2_backward.FAMILY, shared_texts=mamba2_backward.SHARED_TEXTS)
register("gated_delta_net_backward", _plan_gdn, unsupported, v2_fields=GDN_V2_FIELDS, family=gdn_backward.FAMILY,
         shared_texts=FIELDS_TEXT + (gdn_backward.TEXT,))
