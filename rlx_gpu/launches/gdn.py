"""Launch geometry of gated_delta_net (ABI.md §4): one work-item per state column."""
from __future__ import annotations

from .core import ARENA, Launch, Plan, Thunk, grid, i32, i64, linear_local
from .limits import STATE_MAX, DeviceLimits


def _plan(t: Thunk, lim: DeviceLimits, **_: object) -> Plan:
    b, s, heads, n = t["batch"], t["seq"], t["heads"], t["state_size"]
    carry = bool(t["carry_state"])
    args = (i64(b), i64(s), i64(heads), i64(n), i32(t["gate_per_channel"]), i32(carry))
    for f in ("q", "k", "v", "g", "beta"):
        args += (ARENA, i64(t[f]))
    args += (ARENA, i64(t["state"] if carry else 0), ARENA, i64(t["dst"]))
    local = (linear_local(n), 1, 1)
    return Plan((Launch("gdn", "gated_delta_net", t["dtype"], grid((n, heads, b), local), local, args),))


def unsupported(t: Thunk, lim: DeviceLimits) -> str | None:
    if t["state_size"] > STATE_MAX:
        return f"gated_delta_net keeps a state column of state_size={t['state_size']} in private memory; the kernel holds at most {STATE_MAX}"
    return None


PLANNERS = {"gated_delta_net": _plan}
