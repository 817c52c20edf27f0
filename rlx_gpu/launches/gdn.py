"""Launch geometry of gated_delta_net (ABI.md §4 and §8). cpu target: one work-item per GDN_CJ state
columns, or for a decode step per GDN_DJ columns straight on the state; gpu target: each column's key
indices spread across the lanes of a work-group (ssm.state_lanes) for decode and short sequences, from
GDN_MIN_SEQ steps on the chunked WY form. Every target takes every field of §8: the ones that change
what a kernel reads (varlen, state slots, q/k L2-norm, a state kept wider than the thunk) run in the
program variant ``GDN_V2``, so the version-1 program keeps its plain loops. A forward given a saved forward
(ABI.md §9.1's ``reserve``) runs three more kernels before its own launches, which stay as they are: the
``gdn_reserve_*`` kernels fill the reserve in the host's layout (``abi.gdn.reserve_slots``)."""
from __future__ import annotations

from dataclasses import dataclass

from host_fallback.abi import complete, regions
from host_fallback.abi.gdn import RESERVE_CHUNK, gdn_scale, reserve_slots

from .arguments import kernel_launch
from .body import copy_launch
from .core import ARENA, SCRATCH, Launch, LaunchPlan, Thunk, ceil_to, grid, linear_local, real_size
from .limits import GDN_V2 as V2_VARIANT, DeviceLimits
from .mma import MMA_TILE, mma_defines
from .registry import register
from .ssm import state_lanes, takes_chunked

GDN_DECAY_MAX = 1 << 24  # reals of per-channel decays one block of steps may hold in scratch (64 MiB at f32)

#: the §8 fields of gated_delta_net its device kernels implement (launches.unsupported sends a thunk that
#: uses any other to the host)
V2_FIELDS = frozenset({"value_heads", "value_size", "scale", "qk_l2norm", "state_dtype", "cu_seqlens", "num_seqs",
                       "state_slots", "num_slots"})
#: the saved forward's fields (ABI.md §9.1), which gated_delta_net and its backward take beside V2_FIELDS
RESERVE_FIELDS = frozenset({"reserve", "reserve_bytes"})

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
    def flags(self) -> dict[str, bool]:
        """The kernels' runtime flags of the version-2 fields, by their parameter names."""
        return {"state_real": self.state_real, "varlen": self.varlen, "slotted": self.slotted, "qk_norm": self.qk_norm}


def shape(t: Thunk) -> Shape:
    """The geometry and flags of ``t`` (absent version-2 fields take their defaults)."""
    t = complete(t)
    varlen = t["cu_seqlens"] is not None
    return Shape(rows=t["num_seqs"] if varlen else t["batch"], batch=t["batch"], seq=t["seq"], heads=t["heads"],
                 value_heads=t["value_heads"], key_size=t["state_size"], value_size=t["value_size"],
                 scale=gdn_scale(t), carry=bool(t["carry_state"]), per_channel=bool(t["gate_per_channel"]),
                 state_real=t["state_dtype"] != t["dtype"], varlen=varlen, slotted=t["state_slots"] is not None,
                 qk_norm=bool(t["qk_l2norm"]))


#: field (or scratch region) -> the kernels' tensor parameter that takes it (kernels/gdn.cl)
_PARAMS = {"q": "qb", "k": "kb", "v": "vb", "g": "gb", "beta": "beb", "state": "sb", "dst": "db", "cu_seqlens": "cb",
           "state_slots": "slb", "park": "pb", "dec": "eb", "nrm": "nb", "gam": "gmb", "p": "pb", "w": "wb", "u": "ub",
           "states": "hb"}


def _arena(t: Thunk, *fields: str) -> dict[str, tuple]:
    """The arena arguments of ``fields`` of ``t``: an optional int tensor ``t`` lacks at offset 0 (the kernels'
    flag is off), as the state without carry_state."""
    out = {}
    for field in fields:
        offset = (t["state"] if t["carry_state"] else 0) if field == "state" else t.get(field)
        out[_PARAMS[field]] = (ARENA, 0 if offset is None else offset)
    return out


def _scratch(sizes: dict[str, int], dtype: str) -> tuple[dict[str, tuple], int]:
    """Scratch regions of ``sizes`` reals of the compute type, each 256-byte aligned: their arguments and
    the bytes they take. An empty region, which its kernel never reads, points at the arena (a plan
    without scratch has no scratch buffer to point at)."""
    at, offset = {}, 0
    for name, count in sizes.items():
        at[name] = (SCRATCH, offset) if count else (ARENA, 0)
        offset += ceil_to(count * real_size(dtype), 256)
    return at, offset


def _regions(at: dict[str, tuple], *names: str) -> dict[str, tuple]:
    """The scratch regions ``names`` of ``at`` as arguments of their kernel parameters."""
    return {_PARAMS[name]: at[name] for name in names}


def _recurrent(t: Thunk, sh: Shape, nrm: tuple) -> dict[str, object]:
    """The arguments the walk, step and lanes kernels share: the shape, flags, scale and tensors."""
    return dict(R=sh.rows, H=sh.heads, HV=sh.value_heads, K=sh.key_size, V=sh.value_size, carry=sh.carry,
                per_channel=sh.per_channel, **sh.flags, scale=sh.scale, nb=nrm,
                **_arena(t, "q", "k", "v", "g", "beta", "state", "dst", "cu_seqlens", "state_slots"))


def qk_norms(t: Thunk, sh: Shape, lim: DeviceLimits, nrm: tuple) -> tuple[Launch, ...]:
    """With qk_l2norm: the launch that writes 1/|q| and 1/|k| of every (token, key head) to ``nrm``."""
    if not sh.qk_norm:
        return ()
    count = sh.batch * sh.seq * sh.heads
    local = (linear_local(count, 256 if lim.target == "gpu" else 64),)
    return (kernel_launch("gdn", "gdn_qk_norm", t["dtype"], grid((count,), local), local,
                          dict(E=count, K=sh.key_size, **_arena(t, "q", "k"), nb=nrm), target=lim.target,
                          defines=V2_VARIANT),)


def _plan(t: Thunk, lim: DeviceLimits, ssm_kernel: str = "auto", **_: object) -> LaunchPlan:
    sh = shape(t)
    if t.get("reserve") is not None:
        return _plan_saving(t, sh, lim, ssm_kernel)
    if lim.target == "gpu":
        return _plan_gpu(t, sh, lim, ssm_kernel)
    if sh.seq == 1:
        return _plan_step(t, sh, lim)
    return _plan_walk(t, sh, lim)


def _plan_gpu(t: Thunk, sh: Shape, lim: DeviceLimits, ssm_kernel: str) -> LaunchPlan:
    """The gpu target: the chunked form from GDN_MIN_SEQ steps (not at f64), else the lanes kernel."""
    if takes_chunked(lim, sh.seq, "GDN_MIN_SEQ", ssm_kernel) and t["dtype"] != "f64":
        return _plan_chunked(t, sh, lim)
    return _plan_lanes(t, sh, lim)


def _plan_walk(t: Thunk, sh: Shape, lim: DeviceLimits, saved: dict[str, tuple] | None = None) -> LaunchPlan:
    """One recurrent launch; with per-channel gates, per block of steps a parallel kernel first writes
    exp(g) to scratch and the state waits there (per row, in the compute type) between blocks. ``saved``
    (the reserve's states and u as arguments ``hb``, ``ub``): the walk records them too (``GDN_RESERVE``)."""
    b, s, hv, k, v, dt = sh.batch, sh.seq, sh.value_heads, sh.key_size, sh.value_size, t["dtype"]
    steps = max(1, min(s, GDN_DECAY_MAX // max(1, b * hv * k))) if sh.per_channel else max(1, s)
    blocks = max(1, -(-s // steps))
    at, nbytes = _scratch({"park": sh.rows * hv * k * v if blocks > 1 else 0,
                           "dec": b * steps * hv * k if sh.per_channel else 0,
                           "nrm": 2 * b * s * sh.heads if sh.qk_norm else 0}, dt)
    launches = list(qk_norms(t, sh, lim, at["nrm"]))
    for block in range(blocks):
        t0 = block * steps
        tb = min(steps, s - t0)
        if sh.per_channel:
            launches.append(_decay_launch(t, sh, lim, t0, tb, steps, at["dec"]))
        launches.append(_walk_launch(t, sh, lim, dict(t0=t0, T=tb, **_regions(at, "park", "dec")), at["nrm"], saved))
    notes = (f"blocked T={steps}",) if sh.per_channel else ()
    return LaunchPlan(tuple(launches), nbytes, notes)


def _decay_launch(t: Thunk, sh: Shape, lim: DeviceLimits, t0: int, tb: int, steps: int, dec: tuple) -> Launch:
    """``gdn_decay``: exp(g) of the ``tb`` steps from ``t0`` (of blocks of ``steps``) into ``dec`` (per-channel
    gates, the cpu walk's decays)."""
    local = (linear_local(steps * sh.value_heads * sh.key_size, 256), 1)
    return kernel_launch("gdn", "gdn_decay", t["dtype"], grid((tb * sh.value_heads * sh.key_size, sh.batch), local),
                         local, dict(B=sh.batch, S=sh.seq, W=sh.value_heads * sh.key_size, t0=t0, T=tb,
                                     **_arena(t, "g"), eb=dec), target=lim.target)


def _walk_launch(t: Thunk, sh: Shape, lim: DeviceLimits, block: dict[str, object], nrm: tuple,
                 saved: dict[str, tuple] | None, moved: dict[str, tuple] | None = None) -> Launch:
    """One launch of the cpu walk: ``block`` its steps (t0, T) and scratch regions (park, dec), ``nrm`` where 1/|q|,
    1/|k| are; ``saved`` (hb, ub) it records (GDN_RESERVE); ``moved``: its output (db) and state (sb) elsewhere
    than the thunk's."""
    items = -(-sh.value_size // lim.tune("GDN_CJ"))
    local = (linear_local(items), 1, 1)
    defines = (V2_VARIANT if sh.v2 else ()) + ((("GDN_RESERVE", 1),) if saved else ())
    args = dict(_recurrent(t, sh, nrm), S=sh.seq, **block, **(saved or dict(hb=(ARENA, 0), ub=(ARENA, 0))))
    args.update(moved or {})
    return kernel_launch("gdn", "gated_delta_net", t["dtype"], grid((items, sh.value_heads, sh.rows), local), local,
                         args, target=lim.target, defines=defines)


def _plan_step(t: Thunk, sh: Shape, lim: DeviceLimits) -> LaunchPlan:
    """A decode step (seq 1) at the cpu target: one launch on the state in place, both gate kinds."""
    at, nbytes = _scratch({"nrm": 2 * sh.batch * sh.heads if sh.qk_norm else 0}, t["dtype"])
    items = -(-sh.value_size // lim.tune("GDN_DJ"))
    local = (linear_local(items), 1, 1)
    step = kernel_launch("gdn", "gated_delta_net_step", t["dtype"], grid((items, sh.value_heads, sh.rows), local),
                         local, _recurrent(t, sh, at["nrm"]), target=lim.target, defines=V2_VARIANT if sh.v2 else ())
    return LaunchPlan(qk_norms(t, sh, lim, at["nrm"]) + (step,), nbytes)


def _plan_lanes(t: Thunk, sh: Shape, lim: DeviceLimits) -> LaunchPlan:
    """The whole sequence in one launch, both gate kinds (a per-channel decay is taken in the kernel)."""
    at, nbytes = _scratch({"nrm": 2 * sh.batch * sh.seq * sh.heads if sh.qk_norm else 0}, t["dtype"])
    defines, glob, local = state_lanes(sh.key_size, sh.value_size, sh.rows * sh.value_heads, lim)
    lanes = kernel_launch("gdn", "gated_delta_net_lanes", t["dtype"], glob, local,
                          dict(_recurrent(t, sh, at["nrm"]), S=sh.seq), target="gpu",
                          defines=defines + (V2_VARIANT if sh.v2 else ()))
    return LaunchPlan(qk_norms(t, sh, lim, at["nrm"]) + (lanes,), nbytes)


def _plan_chunked(t: Thunk, sh: Shape, lim: DeviceLimits) -> LaunchPlan:
    """Three launches over scratch holding, per (value head, chunk), the cumulative log-decays, the q.k
    products P, W, U (U0 until the state pass) and the state entering the chunk (f64 keeps the lanes
    kernel: its tiles would pass CUDA's 48 KiB of static shared memory). Each row has chunks of its own
    (a varlen sequence starts a chunk), so their count is bounded by S / Q + rows with varlen. On a device with
    tensor cores the three take the MMA variant of the chunk products (``mma``: W, U0 and the outputs)."""
    s, hv, k, v, dt = sh.seq, sh.value_heads, sh.key_size, sh.value_size, t["dtype"]
    q, lanes = lim.tune("GDN_Q"), lim.tune("GDN_LANES")
    chunks = (s + sh.rows * (q - 1)) // q if sh.varlen else sh.batch * -(-s // q)
    slots = hv * chunks
    at, nbytes = _scratch({"gam": slots * q * (k if sh.per_channel else 1), "p": slots * q * q, "w": slots * q * k,
                           "u": slots * q * v, "states": slots * k * v,
                           "nrm": 2 * sh.batch * s * sh.heads if sh.qk_norm else 0}, dt)
    dims = dict(R=sh.rows, S=s, H=sh.heads, HV=hv, K=k, V=v, NC=chunks, per_channel=sh.per_channel,
                qk_norm=sh.qk_norm, varlen=sh.varlen, **_arena(t, "cu_seqlens"))

    def launch(kernel: str, size: tuple, args: dict[str, object], *regions: str) -> Launch:
        return kernel_launch("gdn", kernel, dt, size, (lanes,), {**dims, **args, **_regions(at, *regions)},
                             target="gpu", defines=(V2_VARIANT if sh.v2 else ()) + mma_defines(lim, dt))

    strips = min(lanes // k, lim.tune("GDN_SPMAX"))  # the kernel's GDN_STRIPS
    blocks = -(-v // (MMA_TILE if mma_defines(lim, dt) else strips * lim.tune("GDN_PJ")))  # columns per state group
    tiles = -(-v // lim.tune("GDN_OT"))
    prep = launch("gated_delta_net_chunk_prep", (slots * lanes,), _arena(t, "q", "k", "v", "g", "beta"),
                  "nrm", "gam", "p", "w", "u")
    carry_pass = launch("gated_delta_net_state_pass", (sh.rows * hv * blocks * lanes,),
                        dict(carry=sh.carry, state_real=sh.state_real, slotted=sh.slotted,
                             **_arena(t, "k", "state", "state_slots")), "nrm", "gam", "w", "u", "states")
    out = launch("gated_delta_net_chunk_out", (slots * tiles * lanes,), dict(scale=sh.scale, **_arena(t, "q", "dst")),
                 "nrm", "gam", "p", "u", "states")
    return LaunchPlan(qk_norms(t, sh, lim, at["nrm"]) + (prep, carry_pass, out), nbytes, (f"chunked Q={q}",))


def _plan_saving(t: Thunk, sh: Shape, lim: DeviceLimits, ssm_kernel: str) -> LaunchPlan:
    """A forward writing the saved forward: the states leaving each chunk and each token's u recorded by the cpu
    walk as it runs (a decode step too), at the gpu target walked before the forward by ``gdn_reserve_walk``
    (the forward may replace the initial state); then ``gdn_reserve_grams`` (the decayed
    products) and ``gdn_reserve_inverse``, with 1/|q|, 1/|k| of their own past the plan's scratch."""
    at = {s.name: (ARENA, t["reserve"] + s.offset) for s in reserve_slots(complete(t))}
    if lim.target == "cpu":
        plan = _plan_walk(t, sh, lim, dict(hb=at["states"], ub=at["u"]))
    else:
        plan = _plan_gpu(t, sh, lim, ssm_kernel)
    nrm_at = ceil_to(plan.scratch_bytes, 256)
    nrm = (SCRATCH, nrm_at) if sh.qk_norm else (ARENA, 0)
    nbytes = nrm_at + 2 * sh.batch * sh.seq * sh.heads * real_size(t["dtype"]) if sh.qk_norm else plan.scratch_bytes
    saving = () if lim.target == "cpu" else (_reserve_walk(t, sh, lim, at, nrm),)
    return LaunchPlan(qk_norms(t, sh, lim, nrm) + saving + _reserve_products(t, sh, lim, at, nrm) + plan.launches,
                      nbytes, plan.notes + ("saved forward",))


def recompute_saved(t: Thunk, lim: DeviceLimits, at: dict[str, tuple], nrm: tuple, out: tuple,
                    state: tuple, dec: tuple) -> tuple[Launch, ...]:
    """The launches that write the saved forward of ``t`` (batch rows) at ``at`` (slot name -> argument) from
    1/|q|, 1/|k| at ``nrm`` (written before, with qk_l2norm): at the cpu target the walk recording it (its output at
    ``out``; with carry_state walking a copy of the state at ``state``, which it replaces; per-channel gates reading
    the whole sequence's exp(g) at ``dec``, ``decay_reals``), at the gpu target ``gdn_reserve_walk``; then the
    decayed products and the inverses. A backward without a reserve recomputes its forward so
    (launches/gdn_backward.py)."""
    sh = shape(t)
    if lim.target == "gpu":
        return (_reserve_walk(t, sh, lim, at, nrm),) + _reserve_products(t, sh, lim, at, nrm)
    copy = (copy_launch(lim, state_bytes(t), (ARENA, t["state"]), state, t["dtype"]),) if sh.carry else ()
    decay = (_decay_launch(t, sh, lim, 0, sh.seq, sh.seq, dec),) if sh.per_channel else ()
    walk = _walk_launch(t, sh, lim, dict(t0=0, T=sh.seq, pb=(ARENA, 0), eb=dec if sh.per_channel else (ARENA, 0)),
                        nrm, dict(hb=at["states"], ub=at["u"]), dict(db=out, sb=state))
    return copy + decay + (walk,) + _reserve_products(t, sh, lim, at, nrm)


def decay_reals(t: Thunk) -> int:
    """The reals of ``recompute_saved``'s ``dec`` for ``t`` (completed) at the cpu target: exp(g) of every token
    with per-channel gates, else none."""
    return t["batch"] * t["seq"] * t["value_heads"] * t["state_size"] if t["gate_per_channel"] else 0


def state_bytes(t: Thunk) -> int:
    """The bytes of the state tensor of ``t`` (with carry_state; else 0)."""
    return next((r.nbytes for r in regions(t) if r.field == "state"), 0)


def _saving_launch(t: Thunk, sh: Shape, lim: DeviceLimits, kernel: str, items: int, args: dict[str, object],
                   local: tuple[int, ...] | None = None) -> Launch:
    """A launch of one of the ``gdn_reserve_*`` kernels over ``items`` work-items (in groups of ``local``)."""
    local = local or (linear_local(items),)
    return kernel_launch("gdn", kernel, t["dtype"], grid((items,), local), local, args, target=lim.target,
                         defines=V2_VARIANT if sh.v2 else ())


def _reserve_walk(t: Thunk, sh: Shape, lim: DeviceLimits, at: dict[str, tuple], nrm: tuple) -> Launch:
    """``gdn_reserve_walk`` (the gpu target): the states leaving each chunk and each token's u into ``at``."""
    return _saving_launch(t, sh, lim, "gdn_reserve_walk", sh.batch * sh.value_heads * sh.value_size, dict(
        B=sh.batch, S=sh.seq, HV=sh.value_heads, H=sh.heads, K=sh.key_size, V=sh.value_size, carry=sh.carry,
        per_channel=sh.per_channel, state_real=sh.state_real, slotted=sh.slotted, qk_norm=sh.qk_norm, nb=nrm,
        hb=at["states"], ub=at["u"], **_arena(t, "q", "k", "v", "g", "beta", "state", "state_slots")))


def _reserve_products(t: Thunk, sh: Shape, lim: DeviceLimits, at: dict[str, tuple], nrm: tuple) -> tuple[Launch, ...]:
    """``gdn_reserve_grams`` (the decayed products qk, kk; a work-group per chunk) and ``gdn_reserve_inverse``
    into ``at``."""
    dims = dict(B=sh.batch, S=sh.seq, HV=sh.value_heads)
    rows = sh.batch * -(-sh.seq // RESERVE_CHUNK) * sh.value_heads * RESERVE_CHUNK  # (row, chunk, head, token)
    grams = _saving_launch(t, sh, lim, "gdn_reserve_grams", rows, dict(
        dims, H=sh.heads, K=sh.key_size, per_channel=sh.per_channel, qk_norm=sh.qk_norm, nb=nrm, pb=at["qk"],
        mb=at["kk"], **_arena(t, "q", "k", "g")), local=(RESERVE_CHUNK,))
    inverse = _saving_launch(t, sh, lim, "gdn_reserve_inverse", rows, dict(dims, mb=at["kk"], tb=at["inverse"],
                                                                           **_arena(t, "beta")))
    return grams, inverse


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


register("gated_delta_net", _plan, unsupported, v2_fields=V2_FIELDS | RESERVE_FIELDS, family="gdn")
