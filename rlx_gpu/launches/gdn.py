"""Launch geometry of gated_delta_net (ABI.md §4 and §8). cpu target: one work-item per GDN_CJ state
columns, or for a decode step per GDN_DJ columns straight on the state; gpu target: each column's key
indices spread across the lanes of a work-group (ssm.state_lanes) for decode and short sequences, from
GDN_MIN_SEQ steps on the chunked WY form. Every target takes every field of §8: the ones that change
what a kernel reads (varlen, state slots, q/k L2-norm, a state kept wider than the thunk) run in the
program variant ``GDN_V2``, so the version-1 program keeps its plain loops."""
from __future__ import annotations

from dataclasses import dataclass

from host_fallback.fields import complete, gdn_scale

from .core import ARENA, SCRATCH, Launch, LaunchPlan, Thunk, arena_args, ceil_to, grid, i32, i64, linear_local, real, real_size
from .limits import GDN_V2 as V2_VARIANT, DeviceLimits
from .registry import register
from .ssm import state_lanes, takes_chunked

GDN_DECAY_MAX = 1 << 24  # reals of per-channel decays one block of steps may hold in scratch (64 MiB at f32)

#: the §8 fields of gated_delta_net its device kernels implement (launches.unsupported sends a thunk that
#: uses any other to the host)
V2_FIELDS = frozenset({"value_heads", "value_size", "scale", "qk_l2norm", "state_dtype", "cu_seqlens", "num_seqs",
                       "state_slots", "num_slots"})

#: a state element type the kernels keep: the thunk's own, or its compute type (f32 for f16 / bf16)
_COMPUTE = {"f32": "f32", "f16": "f32", "bf16": "f32", "f64": "f64"}


@dataclass(frozen=True)
class Shape:
    """A gated_delta_net thunk as its kernels see it: R state rows of HV value heads, H key heads, K key
    and V value channels, and the version-2 flags."""

    rows: int
    batch: int
    seq: int
    heads: int
    value_heads: int
    key_size: int
    value_size: int
    scale: float
    carry: bool
    per_channel: bool
    state_real: bool  # the state is kept in the compute type, wider than the thunk's dtype
    varlen: bool
    slotted: bool
    qk_norm: bool

    @property
    def v2(self) -> bool:
        """Whether the launches need the GDN_V2 program variant."""
        return self.state_real or self.varlen or self.slotted or self.qk_norm

    @property
    def flags(self) -> tuple:
        """The kernels' runtime flags, in their order: state_real, varlen, slotted, qk_norm."""
        return (i32(self.state_real), i32(self.varlen), i32(self.slotted), i32(self.qk_norm))


def shape(t: Thunk) -> Shape:
    """The geometry and flags of ``t`` (absent version-2 fields take their defaults)."""
    t = complete(t)
    varlen = t["cu_seqlens"] is not None
    return Shape(rows=t["num_seqs"] if varlen else t["batch"], batch=t["batch"], seq=t["seq"], heads=t["heads"],
                 value_heads=t["value_heads"], key_size=t["state_size"], value_size=t["value_size"],
                 scale=gdn_scale(t), carry=bool(t["carry_state"]), per_channel=bool(t["gate_per_channel"]),
                 state_real=t["state_dtype"] != t["dtype"], varlen=varlen, slotted=t["state_slots"] is not None,
                 qk_norm=bool(t["qk_l2norm"]))


def _optional(t: Thunk, field: str) -> tuple:
    """The arena argument of an optional int tensor (offset 0 when absent: the kernels' flag is off)."""
    offset = t.get(field)
    return (ARENA, i64(0 if offset is None else offset))


def _state(t: Thunk) -> tuple:
    return (ARENA, i64(t["state"] if t["carry_state"] else 0))


def _scratch(sizes: dict[str, int], dtype: str) -> tuple[dict[str, tuple], int]:
    """Scratch regions of ``sizes`` reals of the compute type, each 256-byte aligned: their arguments and
    the bytes they take. An empty region, which its kernel never reads, points at the arena (a plan
    without scratch has no scratch buffer to point at)."""
    at, offset = {}, 0
    for name, count in sizes.items():
        at[name] = (SCRATCH, i64(offset)) if count else (ARENA, i64(0))
        offset += ceil_to(count * real_size(dtype), 256)
    return at, offset


def _norms(t: Thunk, sh: Shape, lim: DeviceLimits, nrm: tuple) -> tuple[Launch, ...]:
    """With qk_l2norm: the launch that writes 1/|q| and 1/|k| of every (token, key head) to ``nrm``."""
    if not sh.qk_norm:
        return ()
    count = sh.batch * sh.seq * sh.heads
    local = (linear_local(count, 256 if lim.target == "gpu" else 64),)
    return (Launch("gdn", "gdn_qk_norm", t["dtype"], grid((count,), local), local,
                   (i64(count), i64(sh.key_size)) + arena_args(t, ("q", "k")) + nrm, target=lim.target,
                   defines=V2_VARIANT),)


def _plan(t: Thunk, lim: DeviceLimits, ssm_kernel: str = "auto", **_: object) -> LaunchPlan:
    sh = shape(t)
    if lim.target == "gpu":
        if takes_chunked(lim, sh.seq, "GDN_MIN_SEQ", ssm_kernel) and t["dtype"] != "f64":
            return _plan_chunked(t, sh, lim)
        return _plan_lanes(t, sh, lim)
    if sh.seq == 1:
        return _plan_step(t, sh, lim)
    return _plan_walk(t, sh, lim)


def _plan_walk(t: Thunk, sh: Shape, lim: DeviceLimits) -> LaunchPlan:
    """One recurrent launch; with per-channel gates, per block of steps a parallel kernel first writes
    exp(g) to scratch and the state waits there (per row, in the compute type) between blocks."""
    b, s, hv, k, v, dt = sh.batch, sh.seq, sh.value_heads, sh.key_size, sh.value_size, t["dtype"]
    steps = max(1, min(s, GDN_DECAY_MAX // max(1, b * hv * k))) if sh.per_channel else max(1, s)
    blocks = max(1, -(-s // steps))
    at, nbytes = _scratch({"park": sh.rows * hv * k * v if blocks > 1 else 0,
                           "dec": b * steps * hv * k if sh.per_channel else 0,
                           "nrm": 2 * b * s * sh.heads if sh.qk_norm else 0}, dt)
    items = -(-v // lim.tune("GDN_CJ"))
    local = (linear_local(items), 1, 1)
    dec_local = (linear_local(steps * hv * k, 256), 1)
    defines = V2_VARIANT if sh.v2 else ()
    launches = list(_norms(t, sh, lim, at["nrm"]))
    for block in range(blocks):
        t0 = block * steps
        tb = min(steps, s - t0)
        if sh.per_channel:
            launches.append(Launch("gdn", "gdn_decay", dt, grid((tb * hv * k, b), dec_local), dec_local,
                                   (i64(b), i64(s), i64(hv * k), i64(t0), i64(tb), ARENA, i64(t["g"])) + at["dec"],
                                   target=lim.target))
        args = (i64(sh.rows), i64(s), i64(sh.heads), i64(hv), i64(k), i64(v), i64(t0), i64(tb), i32(sh.carry),
                i32(sh.per_channel)) + sh.flags + (real(dt, sh.scale),)
        args += arena_args(t, ("q", "k", "v", "g", "beta")) + _state(t) + at["park"] + arena_args(t, ("dst",))
        args += at["dec"] + _optional(t, "cu_seqlens") + _optional(t, "state_slots") + at["nrm"]
        launches.append(Launch("gdn", "gated_delta_net", dt, grid((items, hv, sh.rows), local), local, args,
                               target=lim.target, defines=defines))
    notes = (f"blocked T={steps}",) if sh.per_channel else ()
    return LaunchPlan(tuple(launches), nbytes, notes)


def _plan_step(t: Thunk, sh: Shape, lim: DeviceLimits) -> LaunchPlan:
    """A decode step (seq 1) at the cpu target: one launch on the state in place, both gate kinds."""
    at, nbytes = _scratch({"nrm": 2 * sh.batch * sh.heads if sh.qk_norm else 0}, t["dtype"])
    args = (i64(sh.rows), i64(sh.heads), i64(sh.value_heads), i64(sh.key_size), i64(sh.value_size), i32(sh.carry),
            i32(sh.per_channel)) + sh.flags + (real(t["dtype"], sh.scale),)
    args += arena_args(t, ("q", "k", "v", "g", "beta")) + _state(t) + arena_args(t, ("dst",))
    args += _optional(t, "cu_seqlens") + _optional(t, "state_slots") + at["nrm"]
    items = -(-sh.value_size // lim.tune("GDN_DJ"))
    local = (linear_local(items), 1, 1)
    step = Launch("gdn", "gated_delta_net_step", t["dtype"], grid((items, sh.value_heads, sh.rows), local), local, args,
                  target=lim.target, defines=V2_VARIANT if sh.v2 else ())
    return LaunchPlan(_norms(t, sh, lim, at["nrm"]) + (step,), nbytes)


def _plan_lanes(t: Thunk, sh: Shape, lim: DeviceLimits) -> LaunchPlan:
    """The whole sequence in one launch, both gate kinds (a per-channel decay is taken in the kernel)."""
    at, nbytes = _scratch({"nrm": 2 * sh.batch * sh.seq * sh.heads if sh.qk_norm else 0}, t["dtype"])
    args = (i64(sh.rows), i64(sh.seq), i64(sh.heads), i64(sh.value_heads), i64(sh.key_size), i64(sh.value_size),
            i32(sh.carry), i32(sh.per_channel)) + sh.flags + (real(t["dtype"], sh.scale),)
    args += arena_args(t, ("q", "k", "v", "g", "beta")) + _state(t) + arena_args(t, ("dst",))
    args += _optional(t, "cu_seqlens") + _optional(t, "state_slots") + at["nrm"]
    defines, glob, local = state_lanes(sh.key_size, sh.value_size, sh.rows * sh.value_heads, lim)
    lanes = Launch("gdn", "gated_delta_net_lanes", t["dtype"], glob, local, args, target="gpu",
                   defines=defines + (V2_VARIANT if sh.v2 else ()))
    return LaunchPlan(_norms(t, sh, lim, at["nrm"]) + (lanes,), nbytes)


def _plan_chunked(t: Thunk, sh: Shape, lim: DeviceLimits) -> LaunchPlan:
    """Three launches over scratch holding, per (value head, chunk), the cumulative log-decays, the q.k
    products P, W, U (U0 until the state pass) and the state entering the chunk (f64 keeps the lanes
    kernel: its tiles would pass CUDA's 48 KiB of static shared memory). Each row has chunks of its own
    (a varlen sequence starts a chunk), so their count is bounded by S / Q + rows with varlen."""
    s, hv, k, v, dt = sh.seq, sh.value_heads, sh.key_size, sh.value_size, t["dtype"]
    q, lanes = lim.tune("GDN_Q"), lim.tune("GDN_LANES")
    chunks = (s + sh.rows * (q - 1)) // q if sh.varlen else sh.batch * -(-s // q)
    slots = hv * chunks
    at, nbytes = _scratch({"gam": slots * q * (k if sh.per_channel else 1), "p": slots * q * q, "w": slots * q * k,
                           "u": slots * q * v, "states": slots * k * v,
                           "nrm": 2 * sh.batch * s * sh.heads if sh.qk_norm else 0}, dt)
    dims = (i64(sh.rows), i64(s), i64(sh.heads), i64(hv), i64(k), i64(v), i64(chunks), i32(sh.per_channel),
            i32(sh.qk_norm), i32(sh.varlen)) + _optional(t, "cu_seqlens")
    arena = {f: (ARENA, i64(t[f])) for f in ("q", "k", "v", "g", "beta", "dst")}
    arena["state"], arena["slots"] = _state(t), _optional(t, "state_slots")

    def args(*names: str) -> tuple:
        return tuple(x for name in names for x in (arena[name] if name in arena else at[name]))

    defines = V2_VARIANT if sh.v2 else ()
    strips = min(lanes // k, lim.tune("GDN_SPMAX"))  # the kernel's GDN_STRIPS
    blocks = -(-v // (strips * lim.tune("GDN_PJ")))
    tiles = -(-v // lim.tune("GDN_OT"))
    prep = Launch("gdn", "gated_delta_net_chunk_prep", dt, (slots * lanes,), (lanes,),
                  dims + args("q", "k", "v", "g", "beta", "nrm", "gam", "p", "w", "u"), target="gpu", defines=defines)
    carry_pass = Launch("gdn", "gated_delta_net_state_pass", dt, (sh.rows * hv * blocks * lanes,), (lanes,),
                        dims + (i32(sh.carry), i32(sh.state_real), i32(sh.slotted))
                        + args("k", "state", "slots", "nrm", "gam", "w", "u", "states"), target="gpu", defines=defines)
    out = Launch("gdn", "gated_delta_net_chunk_out", dt, (slots * tiles * lanes,), (lanes,),
                 dims + (real(dt, sh.scale),) + args("q", "dst", "nrm", "gam", "p", "u", "states"), target="gpu",
                 defines=defines)
    return LaunchPlan(_norms(t, sh, lim, at["nrm"]) + (prep, carry_pass, out), nbytes, (f"chunked Q={q}",))


def unsupported(t: Thunk, lim: DeviceLimits) -> str | None:
    t, most = complete(t), lim.tune("STATE_MAX")
    for field in ("state_size", "value_size"):
        if t[field] > most:
            return f"gated_delta_net keeps a state column of {field}={t[field]} in private memory; the kernel holds at most {most}"
    state_dtype = t["state_dtype"]
    if state_dtype not in (t["dtype"], _COMPUTE[t["dtype"]]):
        return (f"gated_delta_net with state_dtype={state_dtype!r} for a {t['dtype']} thunk: the device kernels carry the "
                f"state in the thunk's compute type ({_COMPUTE[t['dtype']]}); the host runs it at {state_dtype}")
    return None


register("gated_delta_net", _plan, unsupported, v2_fields=V2_FIELDS, family="gdn")
