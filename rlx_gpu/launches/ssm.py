"""Launch geometry of selective_scan and mamba2 (ABI.md §4): one work-item per state row (mamba2: per M2_PB rows)."""
from __future__ import annotations

from .core import ARENA, Launch, LaunchPlan, Thunk, grid, i64, linear_local
from .limits import DeviceLimits


def _tensors(t: Thunk, fields: tuple[str, ...]) -> tuple:
    return tuple(v for f in fields for v in (ARENA, i64(t[f])))


def _selective_scan(t: Thunk, lim: DeviceLimits, **_: object) -> LaunchPlan:
    b, s, h, n = t["batch"], t["seq"], t["hidden"], t["state_size"]
    args = (i64(b), i64(s), i64(h), i64(n)) + _tensors(t, ("x", "delta", "a", "b", "c", "dst"))
    local = (linear_local(h), 1)
    return LaunchPlan((Launch("ssm", "selective_scan", t["dtype"], grid((h, b), local), local, args, target=lim.target),))


def _mamba2(t: Thunk, lim: DeviceLimits, **_: object) -> LaunchPlan:
    b, s, heads, p, n = t["batch"], t["seq"], t["heads"], t["head_dim"], t["state_size"]
    args = (i64(b), i64(s), i64(heads), i64(p), i64(n)) + _tensors(t, ("x", "dt", "a", "b", "c", "dst"))
    items = -(-p // lim.tune("M2_PB"))  # one work-item per M2_PB state rows
    local = (linear_local(items), 1, 1)
    return LaunchPlan((Launch("ssm", "mamba2", t["dtype"], grid((items, heads, b), local), local, args, target=lim.target),))


def unsupported(t: Thunk, lim: DeviceLimits) -> str | None:
    if t["state_size"] > lim.tune("STATE_MAX"):
        return f"{t['op']} keeps a state row of state_size={t['state_size']} in private memory; the kernel holds at most {lim.tune('STATE_MAX')}"
    return None


PLANNERS = {"selective_scan": _selective_scan, "mamba2": _mamba2}
