"""Launch geometry of selective_scan and mamba2 (ABI.md §4).

cpu target: one work-item per state row (mamba2: per M2_PB rows). gpu target: the state of one row
spread across the lanes of a work-group (``state_lanes``), its size fixed at compile time.
"""
from __future__ import annotations

from .core import ARENA, SCRATCH, Launch, Plan, Thunk, ceil_to, grid, i64, linear_local, real_size
from .limits import M2_LANES, M2_PB, M2_PT, M2_Q, SSC_CB, SSC_SL, SSM_LANE_W, SSM_VARIANTS, SSM_WG, STATE_MAX, DeviceLimits

#: gpu target: from this many steps on, selective_scan runs chunked over the sequence
SSC_MIN_SEQ = 64
#: gpu target: from this many steps on, mamba2 runs chunked (SSD); f64 always takes the step kernel
M2_MIN_SEQ = 64

Defines = tuple[tuple[str, int], ...]


def state_lanes(n: int, rows: int, outer: int, lim: DeviceLimits) -> tuple[Defines, tuple[int], tuple[int]]:
    """gpu geometry for ``outer`` independent blocks of ``rows`` state rows of ``n`` values: the
    compile-time variant (``SSM_N`` >= n), ``SSM_L`` lanes per row holding SSM_LANE_W values each, and
    a 1-D grid of work-groups of up to SSM_WG lanes, each covering a power of two of rows of one block."""
    variant = next(v for v in SSM_VARIANTS if v >= n)
    lanes = max(1, variant // SSM_LANE_W)
    wg = min(SSM_WG, lim.max_work_group)
    per_group = linear_local(rows, max(1, wg // lanes))
    local = lanes * per_group
    groups = outer * -(-rows // per_group)
    return (("SSM_N", variant), ("SSM_L", lanes), ("SSM_WG", SSM_WG)), (groups * local,), (local,)


def _tensors(t: Thunk, fields: tuple[str, ...]) -> tuple:
    return tuple(v for f in fields for v in (ARENA, i64(t[f])))


def _selective_scan(t: Thunk, lim: DeviceLimits, **_: object) -> Plan:
    b, s, h, n = t["batch"], t["seq"], t["hidden"], t["state_size"]
    args = (i64(b), i64(s), i64(h), i64(n)) + _tensors(t, ("x", "delta", "a", "b", "c", "dst"))
    if lim.target == "gpu":
        defines, glob, local = state_lanes(n, h, b, lim)
        if s >= SSC_MIN_SEQ:  # one group per (batch row, SSC_CB channels); the same program variant
            groups = b * -(-h // SSC_CB)
            launch = Launch("ssm", "selective_scan_chunked", t["dtype"], (groups * SSC_CB * SSC_SL,), (SSC_CB * SSC_SL,),
                            args, defines=defines)
        else:
            launch = Launch("ssm", "selective_scan_lanes", t["dtype"], glob, local, args, defines=defines)
        return Plan((launch,))
    local = (linear_local(h), 1)
    return Plan((Launch("ssm", "selective_scan", t["dtype"], grid((h, b), local), local, args),))


def _mamba2(t: Thunk, lim: DeviceLimits, **_: object) -> Plan:
    b, s, heads, p, n = t["batch"], t["seq"], t["heads"], t["head_dim"], t["state_size"]
    args = (i64(b), i64(s), i64(heads), i64(p), i64(n)) + _tensors(t, ("x", "dt", "a", "b", "c", "dst"))
    if lim.target == "gpu":
        defines, glob, local = state_lanes(n, p, b * heads, lim)
        if s >= M2_MIN_SEQ and t["dtype"] != "f64":
            return _mamba2_chunked(t, defines)
        return Plan((Launch("ssm", "mamba2_lanes", t["dtype"], glob, local, args, defines=defines),))
    items = -(-p // M2_PB)  # one work-item per M2_PB state rows
    local = (linear_local(items), 1, 1)
    return Plan((Launch("ssm", "mamba2", t["dtype"], grid((items, heads, b), local), local, args),))


def _mamba2_chunked(t: Thunk, defines: Defines) -> Plan:
    """Three launches over scratch: each chunk's own state, the inter-chunk pass, the chunk outputs."""
    b, s, heads, p, n, dt = t["batch"], t["seq"], t["heads"], t["head_dim"], t["state_size"], t["dtype"]
    chunks = -(-s // M2_Q)
    states = b * heads * chunks * p * n
    dec_at = ceil_to(states * real_size(dt), 256)
    dims = (i64(b), i64(s), i64(heads), i64(p), i64(n))
    groups = b * heads * chunks * -(-p // M2_PT)
    tile = ((groups * M2_LANES,), (M2_LANES,))
    st, dec = (SCRATCH, i64(0)), (SCRATCH, i64(dec_at))
    state = Launch("ssm", "mamba2_chunk_state", dt, *tile, dims + _tensors(t, ("x", "dt", "a", "b")) + st + dec,
                   defines=defines)
    pas = Launch("ssm", "mamba2_state_pass", dt, grid((b * heads * p * n,), (M2_LANES,)), (M2_LANES,), dims + st + dec,
                 defines=defines)
    scan = Launch("ssm", "mamba2_chunk_scan", dt, *tile, dims + _tensors(t, ("x", "dt", "a", "b", "c", "dst")) + st,
                  defines=defines)
    return Plan((state, pas, scan), dec_at + b * heads * chunks * real_size(dt), (f"chunked Q={M2_Q}",))


def unsupported(t: Thunk, lim: DeviceLimits) -> str | None:
    if t["state_size"] > STATE_MAX:
        return f"{t['op']} keeps a state row of state_size={t['state_size']} in private memory; the kernel holds at most {STATE_MAX}"
    return None


PLANNERS = {"selective_scan": _selective_scan, "mamba2": _mamba2}
