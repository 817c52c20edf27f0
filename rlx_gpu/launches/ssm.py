"""Launch geometry of selective_scan and mamba2 (ABI.md §4).

cpu target: one work-item per state row (mamba2: per M2_PB rows) walks the sequence. gpu target: the
state of one row spread across the lanes of a work-group (``state_lanes``, its size a compile-time
variant) for decode and short sequences; from SSC_MIN_SEQ / M2_MIN_SEQ steps on, the chunked forms.
"""
from __future__ import annotations

from .core import SCRATCH, Launch, LaunchPlan, Thunk, arena_args, ceil_to, grid, i64, linear_local, real_size
from .limits import DeviceLimits, state_variant

Defines = tuple[tuple[str, int], ...]


def state_lanes(n: int, rows: int, outer: int, lim: DeviceLimits) -> tuple[Defines, tuple[int], tuple[int]]:
    """gpu geometry for ``outer`` independent blocks of ``rows`` state rows of ``n`` values: the program
    variant (``SSM_N`` >= n, ``SSM_L`` lanes per row) and a 1-D grid of work-groups of up to SSM_WG
    lanes, each covering a power of two of rows of one block."""
    defines = state_variant(n)
    lanes = dict(defines)["SSM_L"]
    per_group = linear_local(rows, max(1, min(lim.tune("SSM_WG"), lim.max_work_group) // lanes))
    local = lanes * per_group
    return defines, (outer * -(-rows // per_group) * local,), (local,)


#: the state-space kernel choices at the gpu target (the ``ssm_kernel`` run option)
SSM_KERNELS = ("auto", "lanes", "chunked")


def takes_chunked(lim: DeviceLimits, seq: int, rule: str, ssm_kernel: str) -> bool:
    """gpu target: whether the chunked form runs (``ssm_kernel``: "auto" by the ``rule`` tuning
    constant, "lanes" or "chunked" to force one, as benchmarks/ssm_device.py does)."""
    if ssm_kernel not in SSM_KERNELS:
        raise ValueError(f"ssm_kernel={ssm_kernel!r}: expected one of {', '.join(SSM_KERNELS)}")
    return ssm_kernel == "chunked" or (ssm_kernel == "auto" and seq >= lim.tune(rule))


def _selective_scan(t: Thunk, lim: DeviceLimits, ssm_kernel: str = "auto", **_: object) -> LaunchPlan:
    b, s, h, n, dt = t["batch"], t["seq"], t["hidden"], t["state_size"], t["dtype"]
    args = (i64(b), i64(s), i64(h), i64(n)) + arena_args(t, ("x", "delta", "a", "b", "c", "dst"))
    if lim.target == "gpu":
        defines, glob, local = state_lanes(n, h, b, lim)
        if takes_chunked(lim, s, "SSC_MIN_SEQ", ssm_kernel):  # one group per (batch row, SSC_CB channels)
            lanes = lim.tune("SSC_CB") * lim.tune("SSC_SL")
            glob, local = (b * -(-h // lim.tune("SSC_CB")) * lanes,), (lanes,)
            return LaunchPlan((Launch("ssm", "selective_scan_chunked", dt, glob, local, args, target="gpu"),))
        return LaunchPlan((Launch("ssm", "selective_scan_lanes", dt, glob, local, args, target="gpu", defines=defines),))
    local = (linear_local(h), 1)
    return LaunchPlan((Launch("ssm", "selective_scan", dt, grid((h, b), local), local, args, target=lim.target),))


def _mamba2(t: Thunk, lim: DeviceLimits, ssm_kernel: str = "auto", **_: object) -> LaunchPlan:
    b, s, heads, p, n = t["batch"], t["seq"], t["heads"], t["head_dim"], t["state_size"]
    args = (i64(b), i64(s), i64(heads), i64(p), i64(n)) + arena_args(t, ("x", "dt", "a", "b", "c", "dst"))
    if lim.target == "gpu":
        defines, glob, local = state_lanes(n, p, b * heads, lim)
        if takes_chunked(lim, s, "M2_MIN_SEQ", ssm_kernel) and t["dtype"] != "f64":
            return _mamba2_chunked(t, lim)
        return LaunchPlan((Launch("ssm", "mamba2_lanes", t["dtype"], glob, local, args, target="gpu", defines=defines),))
    items = -(-p // lim.tune("M2_PB"))  # one work-item per M2_PB state rows
    local = (linear_local(items), 1, 1)
    return LaunchPlan((Launch("ssm", "mamba2", t["dtype"], grid((items, heads, b), local), local, args, target=lim.target),))


def _mamba2_chunked(t: Thunk, lim: DeviceLimits) -> LaunchPlan:
    """Three launches over scratch holding one state per (batch row, head, chunk): each chunk's own
    state, the inter-chunk pass, the chunk outputs (f64 keeps the lanes kernel: its tiles would pass
    CUDA's 48 KiB of static shared memory)."""
    b, s, heads, p, n, dt = t["batch"], t["seq"], t["heads"], t["head_dim"], t["state_size"], t["dtype"]
    chunks, lanes = -(-s // lim.tune("M2_Q")), lim.tune("M2_LANES")
    dec_at = ceil_to(b * heads * chunks * p * n * real_size(dt), 256)
    dims = (i64(b), i64(s), i64(heads), i64(p), i64(n))
    tile = ((b * heads * chunks * -(-p // lim.tune("M2_PT")) * lanes,), (lanes,))
    st, dec = (SCRATCH, i64(0)), (SCRATCH, i64(dec_at))
    state = Launch("ssm", "mamba2_chunk_state", dt, *tile, dims + arena_args(t, ("x", "dt", "a", "b")) + st + dec,
                   target="gpu")
    carry = Launch("ssm", "mamba2_state_pass", dt, grid((b * heads * p * n,), (lanes,)), (lanes,), dims + st + dec,
                   target="gpu")
    scan = Launch("ssm", "mamba2_chunk_scan", dt, *tile, dims + arena_args(t, ("x", "dt", "a", "b", "c", "dst")) + st,
                  target="gpu")
    return LaunchPlan((state, carry, scan), dec_at + b * heads * chunks * real_size(dt), (f"chunked Q={lim.tune('M2_Q')}",))


def unsupported(t: Thunk, lim: DeviceLimits) -> str | None:
    if t["state_size"] > lim.tune("STATE_MAX"):
        return f"{t['op']} keeps a state row of state_size={t['state_size']} in private memory; the kernel holds at most {lim.tune('STATE_MAX')}"
    return None


PLANNERS = {"selective_scan": _selective_scan, "mamba2": _mamba2}
