"""Launch geometry of mamba3 (ABI.md §11), every target, kernels/mamba3.cl.

The step recurrence over the tokens of each (row, head), a row being a batch row or one packed sequence: at
the cpu target one launch, one work-item per M3_PB state rows, the items of a (row, head) in one work-group; at
the gpu target each state row spread over ``SSM_L`` lanes (the state-size variant), one work-group per (row,
head) walking the sequence once per block of its rows, or from M3_MIN_SEQ steps on one group per M3_SPLIT_ROWS rows (more
groups for a prefill), the final angle and key then written by a second launch. A decode step (seq 1, carried
state, slots) is one launch, straight on the pool. The optional fields are runtime flags of the one program per dtype (and
state size). What runs on the host instead: state, parameters or the step inputs kept in f64 beside a thunk
computing in f32. mamba3_backward: launches/mamba3_backward.py.
"""
from __future__ import annotations

from host_fallback.abi import complete

from .arguments import kernel_launch
from .core import ARENA, LaunchPlan, Thunk, grid, linear_local
from .limits import DeviceLimits, state_variant
from .registry import register

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


def _forward(t: Thunk, lim: DeviceLimits, **_: object) -> LaunchPlan:
    t = complete(t)
    args = arguments(t)
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


register("mamba3", _forward, unsupported, v2_fields=V2_FIELDS, family="mamba3")
