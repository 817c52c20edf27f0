"""``gated_delta_net`` of ABI.md §4 and §8: the gated delta rule, with per-head or per-channel gates,
grouped value heads, a value width of its own, a scale, q/k L2-norm, packed sequences and state slots.

Two paths. The step path runs the recurrence, vectorized over batch and heads; it serves short
sequences (decode). The chunked path is the WY / UT-transform form: inside a chunk of ``L`` steps
the updates ``u`` solve a unit lower triangular system ``(I + A) u = beta*v - beta*gamma*k S0``
(``A`` the strictly lower ``beta K K^T`` scaled by decay ratios), so a chunk costs a handful of
GEMMs, and a sequential loop over chunks carries the state. Long sequences run blocks of batch
items or key heads on several threads (``threads.run_split``). ``path_for(thunk)`` names the path.

Grouped value heads (``value_heads = G * heads``) never copy q or k per value head: both paths view
the value-head axis as ``[heads, G]`` and let q and k broadcast over ``G``. Packed sequences
(``cu_seqlens``) run where they lie. The step path gives each sequence a batch row of its own (it
serves at most ``STEP_MAX`` tokens, so the padding is short; a padded step has zero inputs and
leaves the state exactly as it was). The chunked path restarts the state inside a chunk: the
cumulative log-decays restart at every sequence start and a same-sequence mask zeroes every
product across a boundary, a sequence that begins inside a chunk enters with its own initial state,
and each sequence's final state is formed at its last token. State slots gather the carried rows
once before the thunk and scatter them once after it.

A forward given a ``reserve`` (ABI.md §9.1, ``abi.gdn.reserve_slots``) runs the chunked path with chunks of
32, whatever the sequence's length, and writes there what its backward reads: each chunk's decayed products,
their inverse, ``u`` and the state leaving it.

16-bit storage computes in f32 (the f16 path is what GPU runtimes without a native kernel fall
back to); a state stored wider (``state_dtype``) is carried at its own precision, and the whole
thunk computes at the wider of the two. ``state`` is read and the final state written back,
rounded once, when ``carry_state``.

The parts: ``gdn_step`` (the step path), ``gdn_chunked`` (the chunked path), ``gdn_grams`` (the per-channel
decayed products both the chunked forward and backward form); this module chooses a path and runs a thunk.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from . import compiled_step, threads
from .abi import complete, regions
from .abi.gdn import RESERVE_CHUNK, gdn_scale, reserve_slots
from .arena import COMPUTE, view
from .bound import Bound
from .chunked import pick_path
from .gdn_chunked import _chunked, packed
from .gdn_grams import LEAF
from .gdn_step import _step
from .implementations import GIVEN, KERNELS, PATHS, PREPARE

Thunk = Mapping[str, Any]

#: Default chunk length of the chunked path (a power of two, at least ``LEAF``).
CHUNK = 32
#: Longest sequence that takes the step path, measured with ``benchmarks/ssm.py --crossover``.
STEP_MAX = 12
#: The ``eps`` of ``qk_l2norm`` (ABI.md §8): ``x / sqrt(sum x^2 + L2_EPS)``.
L2_EPS = 1e-6


def _choose(thunk: Thunk, path: str | None, chunk: int | None) -> tuple[str, int]:
    length = chunk or CHUNK
    if length < LEAF or length & (length - 1):
        raise ValueError(f"gated_delta_net: chunk length must be a power of two >= {LEAF}, got {length}")
    return pick_path("gated_delta_net", path, thunk["seq"], STEP_MAX, "chunked"), length


def _choose_saving(t: Thunk, arena: np.ndarray, path: str | None,
                   chunk: int | None) -> tuple[str, int, dict[str, np.ndarray] | None]:
    """``_choose``'s path and chunk length, and the views of the saved forward the thunk writes (``None``: none);
    one that does runs the chunked form with chunks of ``RESERVE_CHUNK``, whose values it holds."""
    saved = reserve_views(t, arena)
    if saved is None:
        return (*_choose(t, path, chunk), None)
    if chunk not in (None, RESERVE_CHUNK):
        raise ValueError(f"gated_delta_net writes a saved forward (reserve) with chunks of {RESERVE_CHUNK}, "
                         f"got chunk={chunk}")
    return "chunked", RESERVE_CHUNK, saved


def _kept(saved: dict[str, np.ndarray] | None, bs: slice, vs: slice) -> dict[str, Any]:
    """``gdn_chunked._chunked``'s ``keep`` argument for rows ``bs`` and value heads ``vs``: the saved forward's
    views there, none without one."""
    return {} if saved is None else {"keep": {f: x[bs, :, vs] for f, x in saved.items()}}


def _parts(thunk: Thunk, name: str, workers: int | None) -> int:
    # the step path stays on one thread unless forced: its per-step arrays are too small to split
    # (B=2 S=1024 H=8 N=64: 73 ms on one thread, 105 ms on two)
    h, n = thunk["heads"], thunk["state_size"]
    hv, width = thunk.get("value_heads") or h, thunk.get("value_size") or n
    rows = thunk["batch"] if thunk.get("cu_seqlens") is None else (thunk["num_seqs"] if name == "step" else 1)
    work = 0 if name == "step" else thunk["batch"] * thunk["seq"] * hv * n * width
    return threads.parts_for("gated_delta_net", work, rows, h, workers)


def path_for(thunk: Thunk, *, path: str | None = None, chunk: int | None = None, workers: int | None = None) -> str:
    """Name the path ``gated_delta_net`` runs ``thunk`` on: ``step`` or ``chunked L=32``, with
    ``, N threads`` when split across cores."""
    name, length = _choose(thunk, path, chunk)
    parts = _parts(thunk, name, workers)
    return (name if name == "step" else f"{name} L={length}") + (f", {parts} threads" if parts > 1 else "")


def reserve_views(t: Thunk, arena: np.ndarray) -> dict[str, np.ndarray] | None:
    """The saved forward of a completed gated_delta_net thunk (or its backward's) as views by slot name
    (``abi.gdn.reserve_slots``), ``None`` without one."""
    if t.get("reserve") is None:
        return None
    return {s.name: view(arena, t["reserve"] + s.offset, s.dtype, s.shape) for s in reserve_slots(t)}


def _l2norm(x: np.ndarray) -> np.ndarray:
    """``x / sqrt(sum x^2 + L2_EPS)`` over each head vector (the last axis), in a fresh array."""
    return x / np.sqrt(np.einsum("...i,...i->...", x, x)[..., None] + L2_EPS)


class _States:
    """The carried states of a thunk's rows as one array of the work type, and their write-back.

    In place where it can be (the pool is the rows, stored in the work type); else the rows are
    gathered once (``state_slots`` picks pool entries) and scattered once after the thunk, rounded
    into the pool's storage type; entries no slot names are never touched.
    """

    def __init__(self, t: Thunk, bound: Bound, work: np.dtype, rows: int):
        self.bound, self.slots, self.copied = bound, None, False
        if not t["carry_state"]:
            self.rows = np.zeros((rows, t["value_heads"], t["state_size"], t["value_size"]), work)
            return
        pool = bound.view("state")
        if t["state_slots"] is not None:
            self.slots = bound.view("state_slots").astype(np.intp)
            self.rows = pool[self.slots].astype(work)
        else:
            self.rows = pool if pool.dtype == work else pool.astype(work)
        self.copied = self.rows is not pool

    def write_back(self) -> None:
        if not self.copied:
            return
        if self.slots is None:
            self.bound.store("state", self.rows)
        else:
            pool = self.bound.view("state")
            pool[self.slots] = self.rows.astype(pool.dtype)


def _arguments(t: Thunk) -> compiled_step.Arguments:
    """``jit_ssm_steps.gated_delta_net_step``'s arguments from a thunk's arena views (a per-head ``g`` as
    ``[B, S, HV, 1]``)."""
    scale = np.float32(gdn_scale(t))

    def arguments(bound: Bound) -> tuple:
        g = bound.view("g")
        return (*(bound.view(f) for f in ("q", "k", "v")), g if t["gate_per_channel"] else g.reshape(*g.shape, 1),
                bound.view("beta"), compiled_step.view(bound, "state", 4, t["carry_state"]), bound.view("dst"),
                *compiled_step.rows(t, bound), t["cu_seqlens"] is not None, bool(t["qk_l2norm"]), scale)
    return arguments


def _load(bound: Bound, field: str, index: Any, copy: bool, work: np.dtype, normed: bool) -> np.ndarray:
    """``field``'s view at ``index`` in the work type (a copy where ``copy``), q and k L2-normed where ``normed``."""
    x = np.array(bound.view(field)[index], work, copy=copy or None)
    return _l2norm(x) if normed and field in ("q", "k") else x


def _sequence_rows(cu: np.ndarray, states: np.ndarray) -> tuple[np.ndarray | None, np.ndarray, np.ndarray, np.ndarray]:
    """Packed sequences as the step path's batch rows, longest first when their lengths differ: ``(order,
    carried, valid, index)``, ``order`` the rows' order (None: as they lie), ``carried`` the ``states`` in it,
    ``valid [R, longest]`` where a row takes a step and ``index`` each step's packed token."""
    lengths, carried = np.diff(cu), states
    order = np.argsort(-lengths, kind="stable") if lengths.min(initial=0) != lengths.max(initial=0) else None
    if order is not None:
        lengths, carried = lengths[order], states[order]
    pad = np.arange(max(1, int(lengths.max(initial=0))))
    valid = pad[None, :] < lengths[:, None]  # [R, longest]
    index = (cu[:-1] if order is None else cu[:-1][order])[:, None] + pad[None, :]
    return order, carried, valid, index


def _padded(x: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """The packed tokens ``x [T, ...]`` as rows ``[R, longest, ...]``, zero where ``valid`` is not: padded
    steps that change nothing."""
    padded = np.zeros((*valid.shape, *x.shape[1:]), x.dtype)
    padded[valid] = x
    return padded


def prepare(thunk: Thunk) -> Callable[..., None]:
    """The thunk-only setup of ``gated_delta_net``, once (``host_fallback.PREPARE``): where its tensors
    lie, the work type and, for packed sequences, nothing that depends on their (runtime) lengths.

    Returns ``run(arena, *, path, chunk, workers, given)`` (``given``: ``implementations.GIVEN``). Inputs are
    read where they lie when stored in the work type (ABI.md lets no output overlap an input), a carried state
    updated in place when it can be (``_States``) and a step-path output written straight into ``dst``, so a
    decode step adds no copy of the state to the recurrence's own passes.
    """
    t = complete(thunk)
    by_field = {r.field: r for r in regions(t)}
    work = np.result_type(COMPUTE[t["dtype"]], COMPUTE[t["state_dtype"]])
    heads, group = t["heads"], t["value_heads"] // t["heads"]
    scale, normed, varlen = gdn_scale(t), t["qk_l2norm"], t["cu_seqlens"] is not None
    last: list[Bound] = []  # the views of the last arena: a decode runs on one arena call after call
    compiled = compiled_step.CompiledStep.of(t, by_field, "gated_delta_net_step", _arguments(t))

    def bind(arena: np.ndarray) -> Bound:
        if not last or last[0].arena is not arena:
            last[:] = [Bound(t, arena, by_field)]
        return last[0]

    def run(arena: np.ndarray, *, path: str | None = None, chunk: int | None = None,
            workers: int | None = None, given: Any = None) -> bool | None:
        name, length, saved = _choose_saving(t, arena, path, chunk)
        # the step path runs on one thread unless workers are forced (``_parts``)
        taken = (compiled is not None and name == "step" and (workers is None or _parts(t, name, workers) == 1)
                 and compiled.run(arena, given))
        if taken or given is not None:  # arrays given in place of arena views: the compiled step only
            return taken
        bound = bind(arena)
        cu = bound.view("cu_seqlens").astype(np.int64) if varlen else None
        rows = t["num_seqs"] if varlen else t["batch"]
        states = _States(t, bound, work, rows)
        dst = bound.view("dst")
        # inputs read and the output written in place, unless a (malformed) dst overlaps an input
        apart = not any(np.may_share_memory(dst, bound.view(f)) for f in ("q", "k", "v", "g", "beta"))
        direct = apart and dst.dtype == work
        carried = states.rows
        if varlen and name == "step":
            order, carried, valid, index = _sequence_rows(cu, states.rows)
            tokens = index[valid]
        layout = packed(cu, t["seq"], length) if varlen and name == "chunked" else None

        def compute(bs: slice, hs: slice) -> np.ndarray | None:
            vs = slice(hs.start * group, hs.stop * group)
            heads_of = {"q": hs, "k": hs}
            if varlen and name == "step":  # each sequence a batch row, padded with steps that change nothing
                inputs = [_padded(_load(bound, f, (0, tokens, heads_of.get(f, vs)), False, work, normed), valid)[bs]
                          for f in ("q", "k", "v", "g", "beta")]
                out = np.empty((*inputs[2].shape[:3], t["value_size"]), work)
                active = None if order is None else valid[bs].sum(axis=0)
                _step(*inputs, carried[bs, vs], out, scale, active)
                return out
            batch = slice(None) if varlen else bs
            inputs = [_load(bound, f, (batch, slice(None), heads_of.get(f, vs)), not apart, work, normed)
                      for f in ("q", "k", "v", "g", "beta")]
            out = dst[batch, :, vs] if direct else np.empty(dst[batch, :, vs].shape, work)
            if name == "step":
                _step(*inputs, states.rows[bs, vs], out, scale)
            elif varlen:
                _chunked(*inputs, states.rows[:, vs], out, scale, length, layout, t["carry_state"])
            else:
                _chunked(*inputs, states.rows[bs, vs], out, scale, length, **_kept(saved, bs, vs))
            return None if direct else out

        def store(bs: slice, hs: slice, out: np.ndarray | None) -> None:
            vs = slice(hs.start * group, hs.stop * group)
            if varlen and name == "step":
                dst[0, index[bs][valid[bs]], vs] = out[valid[bs]]
            elif out is not None:
                dst[slice(None) if varlen else bs, :, vs] = out

        blocks = 1 if varlen and name == "chunked" else rows
        threads.run_split(compute, store, blocks, heads, _parts(t, name, workers))
        if carried is not states.rows:
            states.rows[order] = carried
        states.write_back()

    return run


def gated_delta_net(thunk: Thunk, arena: np.ndarray, *, path: str | None = None, chunk: int | None = None,
                    workers: int | None = None) -> None:
    """Gated delta rule: ``S = exp(g) S``; ``u = beta (v - S^T k)``; ``S += k u^T``; ``out = scale S^T q``.

    ``path`` (``"step"`` or ``"chunked"``), ``chunk`` (a power-of-two chunk length) and ``workers``
    (threads over the batch x key-head recurrences) override the choice. Any ``state_size`` and
    ``value_size`` are served (memory grows as their product). ``thunk`` holds every field (completed).
    """
    prepare(thunk)(arena, path=path, chunk=chunk, workers=workers)


KERNELS.add("gated_delta_net", gated_delta_net)
PREPARE.add("gated_delta_net", prepare)
GIVEN.add("gated_delta_net")
PATHS.add("gated_delta_net", path_for)
