"""Launch geometry of gated_delta_net (ABI.md §4). cpu target: one work-item per GDN_CJ state
columns, or for a decode step per GDN_DJ columns straight on the state; gpu target: each column's key
indices spread across the lanes of a work-group (ssm.state_lanes) for decode and short sequences, from
GDN_MIN_SEQ steps on the chunked WY form."""
from __future__ import annotations

from .core import ARENA, SCRATCH, Launch, LaunchPlan, Thunk, arena_args, ceil_to, grid, i32, i64, linear_local, real_size
from .limits import DeviceLimits
from .ssm import state_lanes, takes_chunked

GDN_DECAY_MAX = 1 << 24  # reals of per-channel decays one block of steps may hold in scratch (64 MiB at f32)


def _plan(t: Thunk, lim: DeviceLimits, ssm_kernel: str = "auto", **_: object) -> LaunchPlan:
    """One recurrent launch; with per-channel gates, per block of steps a parallel kernel first
    writes exp(g) to scratch and the state waits there between blocks."""
    b, s, heads, n, dt = t["batch"], t["seq"], t["heads"], t["state_size"], t["dtype"]
    carry, per_channel = bool(t["carry_state"]), bool(t["gate_per_channel"])
    if lim.target == "gpu":
        if takes_chunked(lim, s, "GDN_MIN_SEQ", ssm_kernel) and dt != "f64":
            return _plan_chunked(t, lim)
        return _plan_lanes(t, lim)
    if s == 1:
        return _plan_step(t, lim)
    rs = real_size(dt)
    steps = max(1, min(s, GDN_DECAY_MAX // max(1, b * heads * n))) if per_channel else max(1, s)
    blocks = max(1, -(-s // steps))
    parked = blocks > 1  # the state waits in scratch (compute type) between blocks
    state_bytes = ceil_to(b * heads * n * n * rs, 256) if parked else 0
    decay_bytes = b * steps * heads * n * rs if per_channel else 0
    arena_state, scratch_state = (ARENA, i64(t["state"] if carry else 0)), (SCRATCH, i64(0))
    items = -(-n // lim.tune("GDN_CJ"))
    local = (linear_local(items), 1, 1)
    dec_local = (linear_local(steps * heads * n, 256), 1)
    launches = []
    for k in range(blocks):
        t0 = k * steps
        tb = min(steps, s - t0)
        if per_channel:
            launches.append(Launch("gdn", "gdn_decay", dt, grid((tb * heads * n, b), dec_local), dec_local,
                                   (i64(b), i64(s), i64(heads * n), i64(t0), i64(tb), ARENA, i64(t["g"]),
                                    SCRATCH, i64(state_bytes)), target=lim.target))
        first, last = k == 0, k == blocks - 1
        if per_channel:
            kernel, args = "gated_delta_net_pc", (i64(b), i64(s), i64(heads), i64(n), i64(t0), i64(tb),
                                                  i32(carry or not first), i32(not first),
                                                  i32(carry or not last), i32(not last))
            fields = ("q", "k", "v", "beta")
        else:
            kernel, args, fields = "gated_delta_net", (i64(b), i64(s), i64(heads), i64(n), i32(carry)), ("q", "k", "v", "g", "beta")
        args += arena_args(t, fields)
        if per_channel:
            args += (arena_state if first else scratch_state) + (arena_state if last else scratch_state)
        else:
            args += arena_state
        args += (ARENA, i64(t["dst"]))
        if per_channel:
            args += (SCRATCH, i64(state_bytes))
        launches.append(Launch("gdn", kernel, dt, grid((items, heads, b), local), local, args, target=lim.target))
    notes = (f"blocked T={steps}",) if per_channel else ()
    return LaunchPlan(tuple(launches), state_bytes + decay_bytes, notes)


def _tensors(t: Thunk) -> tuple:
    """The arena arguments of q, k, v, g, beta, state (offset 0 without carry_state) and dst."""
    state = (ARENA, i64(t["state"] if t["carry_state"] else 0))
    return arena_args(t, ("q", "k", "v", "g", "beta")) + state + arena_args(t, ("dst",))


def _plan_step(t: Thunk, lim: DeviceLimits) -> LaunchPlan:
    """A decode step (seq 1) at the cpu target: one launch on the state in place, both gate kinds."""
    b, heads, n = t["batch"], t["heads"], t["state_size"]
    args = (i64(b), i64(heads), i64(n), i32(t["carry_state"]), i32(t["gate_per_channel"])) + _tensors(t)
    items = -(-n // lim.tune("GDN_DJ"))
    local = (linear_local(items), 1, 1)
    return LaunchPlan((Launch("gdn", "gated_delta_net_step", t["dtype"], grid((items, heads, b), local), local, args,
                              target=lim.target),))


def _plan_lanes(t: Thunk, lim: DeviceLimits) -> LaunchPlan:
    """The whole sequence in one launch, both gate kinds (a per-channel decay is taken in the kernel)."""
    b, heads, n = t["batch"], t["heads"], t["state_size"]
    args = (i64(b), i64(t["seq"]), i64(heads), i64(n), i32(t["carry_state"]), i32(t["gate_per_channel"])) + _tensors(t)
    defines, glob, local = state_lanes(n, n, b * heads, lim)
    return LaunchPlan((Launch("gdn", "gated_delta_net_lanes", t["dtype"], glob, local, args, target="gpu", defines=defines),))


def _plan_chunked(t: Thunk, lim: DeviceLimits) -> LaunchPlan:
    """Three launches over scratch holding, per (batch row, head, chunk), the cumulative log-decays,
    the q.k products P, W, U (U0 until the state pass) and the state entering the chunk (f64 keeps
    the lanes kernel: its tiles would pass CUDA's 48 KiB of static shared memory)."""
    b, s, heads, n, dt = t["batch"], t["seq"], t["heads"], t["state_size"], t["dtype"]
    per_channel, carry = int(t["gate_per_channel"]), int(t["carry_state"])
    q, lanes = lim.tune("GDN_Q"), lim.tune("GDN_LANES")
    slots = b * heads * -(-s // q)
    sizes = {"gam": slots * q * (n if per_channel else 1), "p": slots * q * q, "w": slots * q * n,
             "u": slots * q * n, "states": slots * n * n}
    at, offset = {}, 0
    for name, count in sizes.items():
        at[name] = (SCRATCH, i64(offset))
        offset += ceil_to(count * real_size(dt), 256)
    dims = (i64(b), i64(s), i64(heads), i64(n), i32(per_channel))
    arena = {f: (ARENA, i64(t[f])) for f in ("q", "k", "v", "g", "beta", "dst")}
    arena["state"] = (ARENA, i64(t["state"] if carry else 0))

    def args(*names: str) -> tuple:
        return tuple(v for name in names for v in (arena[name] if name in arena else at[name]))

    strips = min(lanes // n, lim.tune("GDN_SPMAX"))  # the kernel's GDN_STRIPS
    blocks = -(-n // (strips * lim.tune("GDN_PJ")))
    tiles = -(-n // lim.tune("GDN_OT"))
    prep = Launch("gdn", "gated_delta_net_chunk_prep", dt, (slots * lanes,), (lanes,),
                  dims + args("q", "k", "v", "g", "beta", "gam", "p", "w", "u"), target="gpu")
    carry_pass = Launch("gdn", "gated_delta_net_state_pass", dt, (b * heads * blocks * lanes,), (lanes,),
                        dims + (i32(carry),) + args("k", "state", "gam", "w", "u", "states"), target="gpu")
    out = Launch("gdn", "gated_delta_net_chunk_out", dt, (slots * tiles * lanes,), (lanes,),
                 dims + args("q", "dst", "gam", "p", "u", "states"), target="gpu")
    return LaunchPlan((prep, carry_pass, out), offset, (f"chunked Q={q}",))


def unsupported(t: Thunk, lim: DeviceLimits) -> str | None:
    if t["state_size"] > lim.tune("STATE_MAX"):
        return f"gated_delta_net keeps a state column of state_size={t['state_size']} in private memory; the kernel holds at most {lim.tune('STATE_MAX')}"
    return None


PLANNERS = {"gated_delta_net": _plan}
