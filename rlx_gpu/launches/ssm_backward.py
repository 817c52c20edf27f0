"""Launch geometry of selective_scan_backward and mamba2_backward (ABI.md §9), every target.

One launch walks the state rows in reverse (kernels/ssm_backward.cl): a work-item per (row, group,
block of the group's channels / heads), ``SSMB_BLOCKS`` blocks at most, each item with its own
checkpoint workspace in scratch. Then ``ssm_backward_reduce`` launches sum the partials the items
wrote, in a fixed order: d_b and d_c over the blocks, d_a, d_d and the delta bias's gradient over the
rows. The version-2 fields are the forward's compile-time variant (``ssm.field_defines``).
"""
from __future__ import annotations

from dataclasses import dataclass

from host_fallback.fields import complete
from host_fallback.gradients import forward_op

from .core import ARENA, SCRATCH, Launch, LaunchPlan, Thunk, ceil_to, grid, i32, i64, linear_local, real_size
from .limits import DeviceLimits
from . import ssm
from .ssm import _limits, _tensors, field_defines, rows

#: the §8/§9 fields of the two backward ops the kernels implement: the forward's and the optional gradients
V2_FIELDS = ssm.V2_FIELDS | {"d_delta_bias", "d_dt_bias", "d_d", "d_z", "d_state"}

#: per op: (the delta field, the width of a token's delta: channels or heads)
_DELTA = {"selective_scan": ("delta", "hidden"), "mamba2": ("dt", "heads")}


@dataclass(frozen=True)
class Scratch:
    """Byte offsets of the scratch parts (all in the compute type) and the bytes in all."""

    workspaces: int
    delta_sums: int
    db: int
    dc: int
    da: int
    dd: int
    dbias: int
    total: int


def _scratch(t: Thunk, items: int, blocks: int, lanes: int, q: int) -> Scratch:
    """The scratch of ``t`` (completed, forward op) for ``items`` work-items of ``blocks`` blocks, with
    ``lanes`` delta values per token (channels or heads) and checkpoints every ``q`` steps."""
    r, n, g, tokens, size = rows(t), t["state_size"], t["groups"], t["batch"] * t["seq"], real_size(t["dtype"])
    parts = {
        "workspaces": items * (-(-t["seq"] // q) + q + 1) * n, "delta_sums": tokens * lanes,
        "db": blocks * tokens * g * n, "dc": blocks * tokens * g * n, "da": r * lanes * n, "dd": r * lanes,
        "dbias": r * lanes,
    }
    at, offsets = 0, {}
    for name, reals in parts.items():
        offsets[name] = at
        at = ceil_to(at + reals * size, 256)
    return Scratch(**offsets, total=at)


def _plan(t: Thunk, lim: DeviceLimits, **_: object) -> LaunchPlan:
    op = forward_op(t["op"])
    fwd = {**complete(t), "op": op}  # the forward's view: its field names and variant switches
    delta, width = _DELTA[op]
    r, g, n, dt = rows(fwd), fwd["groups"], fwd["state_size"], fwd["dtype"]
    lanes = fwd[width]
    per_group = lanes // g
    blocks = min(per_group, lim.tune("SSMB_BLOCKS"))
    per = -(-per_group // blocks)
    blocks = -(-per_group // per)  # no empty block
    items = r * g * blocks
    sc = _scratch(fwd, items, blocks, lanes, lim.tune("SSMB_Q"))
    tokens = fwd["batch"] * fwd["seq"]
    dims = (i64(r), i64(fwd["seq"]), i64(tokens), i64(lanes))
    if op == "mamba2":
        dims += (i64(fwd["head_dim"]),)
    dims += (i64(n), i64(g), i64(blocks), i64(per))
    args = (dims + _tensors(fwd, ("x", delta, "a", "b", "c", "bias", "d", "z", "state", "cu_seqlens", "state_slots",
                                  "d_dst", "d_x", f"d_{delta}", "d_z", "d_state"))
            + (SCRATCH,) + tuple(i64(getattr(sc, f)) for f in ("workspaces", "delta_sums", "db", "dc", "da",
                                                                       "dd", "dbias")))
    if op == "mamba2":
        args += _limits(fwd)
    fields = field_defines(fwd)
    local = (linear_local(items),)
    walk = Launch("ssm_backward", f"{op}_backward", dt, grid((items,), local), local, args, target=lim.target,
                  defines=fields)
    bias = "d_delta_bias" if op == "selective_scan" else "d_dt_bias"
    sums = [("d_b", tokens * g * n, blocks, 1, sc.db, False), ("d_c", tokens * g * n, blocks, 1, sc.dc, False),
            ("d_a", lanes * n if op == "selective_scan" else lanes, r, 1 if op == "selective_scan" else n, sc.da, True),
            ("d_d", lanes, r, 1, sc.dd, True), (bias, lanes, r, 1, sc.dbias, True)]
    launches = [walk] + [_reduce(fwd[field], m, k, j, at, as_param, dt, lim, fields)
                         for field, m, k, j, at, as_param in sums if fwd.get(field) is not None]
    return LaunchPlan(tuple(launches), sc.total, (f"checkpoints every {lim.tune('SSMB_Q')} steps, {blocks} blocks",))


def _reduce(out: int, m: int, k: int, j: int, part: int, as_param: bool, dt: str, lim: DeviceLimits,
            fields: tuple) -> Launch:
    """``ssm_backward_reduce``: ``out`` (an arena offset) = the ``k`` x ``j`` partials at scratch ``part``."""
    local = (linear_local(m),)
    return Launch("ssm_backward", "ssm_backward_reduce", dt, grid((m,), local), local,
                  (i64(m), i64(k), i64(j), SCRATCH, i64(part), ARENA, i64(out), i32(as_param)), target=lim.target,
                  defines=fields)


def unsupported(t: Thunk, lim: DeviceLimits) -> str | None:
    """The forward's limits: the state kept in the compute type (f64 state or parameters beside a narrower
    thunk run on the host)."""
    return ssm.unsupported({**complete(t), "op": forward_op(t["op"])}, lim)


PLANNERS = {"selective_scan_backward": _plan, "mamba2_backward": _plan}
