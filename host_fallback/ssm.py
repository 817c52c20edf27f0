"""State-space ops of ABI.md §4 and §8: ``selective_scan`` (Mamba-1) and ``mamba2`` (SSD).

Each op has a step path (the recurrence, vectorized over batch, channels/heads and state) for
short sequences, and a fast path for long ones: ``selective_scan`` precomputes the decays and
inputs of a block of steps in bulk and runs a two-operation loop over it; ``mamba2`` uses the
chunked state-space-duality form. Long sequences run blocks of batch items and channels (heads) on
several threads (``threads.run_split``). ``path_for(thunk)`` names the path a thunk gets.

Version 2's fields live in both paths: the ``delta``/``dt`` bias, softplus and limit are applied
to the loaded block as it is read, ``d`` and ``z`` to the block's output before it is stored; the
rows' starting states are gathered once per block and their final states scattered once
(``sequences.StatePool``); packed sequences (``cu_seqlens``) restart the state inside the step
loops and inside a chunk of the SSD form. 16-bit storage computes in f32, widened to
``state_dtype``/``param_dtype`` where they are wider (``compute_type``), and rounds once on store.

The paths: ``ssm_scan`` (selective_scan's), ``ssm_ssd`` (mamba2's); this module chooses one and runs a thunk.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from . import compiled_step, threads
from .abi import Region, complete, regions
from .abi.ssm import RESERVE_CHUNK, RESERVE_SLOTS, SCAN_RESERVE_CHUNK
from .arena import COMPUTE, view
from .bound import Bound
from .chunked import pick_path, scratch
from .implementations import GIVEN, KERNELS, PATHS, PREPARE
from .sequences import Sequences, StatePool
from .ssm_scan import _scan_blocked, _scan_step
from .ssm_ssd import _mamba2_chunked, _mamba2_step

Thunk = Mapping[str, Any]

#: Steps per block of the blocked selective scan (its working set is two ``[T, B, H, N]`` arrays).
SCAN_BLOCK = 32
#: Longest sequence that takes the step path, measured with ``benchmarks/ssm.py --crossover``.
SCAN_STEP_MAX = 16
#: Default chunk length of the SSD form of mamba2.
MAMBA2_CHUNK = 64
#: Longest sequence that takes the mamba2 step path.
MAMBA2_STEP_MAX = 10
#: ABI.md §8's softplus is the identity above this input.
SOFTPLUS_LINEAR = 20.0


_SCAN_PATHS: dict[str, Callable[..., np.ndarray]] = {"step": _scan_step, "blocked": _scan_blocked}
_MAMBA2_PATHS: dict[str, Callable[..., np.ndarray]] = {"step": _mamba2_step, "chunked": _mamba2_chunked}


def _choose(thunk: Thunk, path: str | None, chunk: int | None) -> tuple[str, int]:
    if thunk["op"] == "selective_scan":
        return pick_path("selective_scan", path, thunk["seq"], SCAN_STEP_MAX, "blocked"), chunk or SCAN_BLOCK
    return pick_path("mamba2", path, thunk["seq"], MAMBA2_STEP_MAX, "chunked"), chunk or MAMBA2_CHUNK


#: Weight of one selective_scan state element against a multiply-add in ``threads.SPLIT_MIN_WORK``:
#: each costs an exp and passes over strided bulk arrays (B=2 H=256 N=16, one thread / two: seq 128
#: 2.3 / 2.7 ms, seq 256 4.2 / 3.8 ms).
SCAN_ELEMENT_WORK = 8


def _units(t: Thunk) -> tuple[int, int]:
    """``(units, width)``: the independent blocks a thunk splits into across threads and the channels
    (heads) in each. selective_scan with ``groups`` splits by group, so that a block's channels share
    whole groups of ``b`` and ``c``."""
    if t["op"] == "selective_scan":
        groups = t.get("groups", 1)  # path_for may be asked about a thunk not completed
        return (t["hidden"], 1) if groups == 1 else (groups, t["hidden"] // groups)
    return t["heads"], 1


def _parts(t: Thunk, name: str, workers: int | None) -> int:
    # the step paths stay on one thread unless forced: their per-step arrays are too small to split
    # (B=2 S=1024: selective_scan 27 ms on one thread, 38 on two; mamba2 66 ms, 84)
    b, n = t["batch"], t["state_size"]
    per_channel = n * SCAN_ELEMENT_WORK if t["op"] == "selective_scan" else t["head_dim"] * n
    units, width = _units(t)
    work = 0 if name == "step" else b * t["seq"] * units * width * per_channel
    return threads.parts_for(t["op"], work, b, units, workers)


def path_for(thunk: Thunk, *, path: str | None = None, chunk: int | None = None, workers: int | None = None) -> str:
    """Name the path ``selective_scan``/``mamba2`` runs ``thunk`` on: ``step``, ``blocked T=64``,
    ``chunked L=64``, with ``, N threads`` when split across cores."""
    name, length = _choose(thunk, path, chunk)
    parts = _parts(thunk, name, workers)
    label = name if name == "step" else f"{name} {'T' if name == 'blocked' else 'L'}={length}"
    return label + (f", {parts} threads" if parts > 1 else "")


def compute_type(t: Thunk) -> np.dtype:
    """The type a thunk computes in: its dtype's, widened to its state's and parameters' (ABI.md §8:
    the recurrence is carried at ``state_dtype``'s precision or wider)."""
    return np.result_type(*(COMPUTE[t[f]] for f in ("dtype", "state_dtype", "param_dtype")))


def softplus(u: np.ndarray) -> np.ndarray:
    """ABI.md §8's softplus: ``u`` where ``u > 20``, else ``log1p(exp(u))``."""
    # log1p(e) as log(w) * e / (w - 1), w = 1 + e, exact to a few ulps (Goldberg's rewrite): NumPy's
    # f32 log1p has no vector loop and costs 15x an exp (2x1024x256: 23 ms against 1.5)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        e = np.exp(u)
        w = e + 1
        soft = np.log(w)
        w -= 1
        soft *= np.divide(e, w, out=w)
    np.copyto(soft, e, where=e + 1 == 1)  # e below half an ulp of 1: log1p(e) is e
    np.copyto(soft, u, where=u > SOFTPLUS_LINEAR)
    return soft


def _gate(y: np.ndarray, x: np.ndarray, d: np.ndarray | None, z: np.ndarray | None) -> None:
    """ABI.md §8's skip and gate, in place: ``y += d * x``, then ``y *= silu(z) = z / (1 + exp(-z))``.

    The terms go through one reused scratch array: a fresh one per call would page-fault on first touch."""
    if d is None and z is None:
        return
    term = scratch("ssm.gate", y.shape, y.dtype)
    if d is not None:
        y += np.multiply(x, d, out=term)
    if z is not None:
        with np.errstate(over="ignore"):
            np.exp(np.negative(z, out=term), out=term)
        term += 1
        y *= np.divide(z, term, out=term)


def _read(bound: Bound, field: str, index: Any, dtype: np.dtype) -> np.ndarray:
    """A block of ``field`` in ``dtype``: a view of the arena where it is stored so (the kernels only read
    their inputs), else a converted copy."""
    block = bound.view(field)[index]
    return block if block.dtype == dtype else block.astype(dtype)


def _inputs(t: Thunk, bound: Bound, rows: tuple, hs: slice, ctype: np.dtype, step: str) -> tuple[np.ndarray, np.ndarray]:
    """A block's ``x`` and step sizes (``step``: ``delta`` or ``dt``), the step sizes plus ``{step}_bias``
    and softplus-ed with ``{step}_softplus`` where the thunk asks."""
    x, steps = (_read(bound, f, rows, ctype) for f in ("x", step))
    if t[f"{step}_bias"] is not None:
        steps = steps + _read(bound, f"{step}_bias", hs, ctype)
    if t[f"{step}_softplus"]:
        steps = softplus(steps)
    return x, steps


def _run(t: Thunk, arena: np.ndarray, name: str, state_shape: tuple[int, ...],
         compute: Callable[[Bound, slice, slice, StatePool], np.ndarray], workers: int | None,
         by_field: Mapping[str, Region] | None) -> None:
    """Run ``compute(bound, batch_rows, channels, pool) -> y`` over blocks of batch rows x channels
    (heads) on threads (``threads.run_split``); each block's starting states come from ``pool`` and
    its ``y`` and final states are stored after every block has computed."""
    bound = Bound(t, arena, by_field)
    pool = StatePool(t, bound, compute_type(t), state_shape)
    units, width = _units(t)
    channels = lambda us: slice(us.start * width, us.stop * width)  # noqa: E731
    states: dict[tuple[int, int], np.ndarray] = {}

    def block(bs: slice, us: slice) -> np.ndarray:
        hs = channels(us)
        state = states[bs.start, us.start] = pool.initial(bs, hs)
        return compute(bound, bs, hs, state)

    def store(bs: slice, us: slice, y: np.ndarray) -> None:
        hs = channels(us)
        target = bound.view("dst")[bs, :, hs]
        if y.dtype == target.dtype:  # one copy, where a store's reshape and astype would copy twice more
            np.copyto(target, y)
        else:
            bound.store("dst", y, (bs, slice(None), hs))
        pool.store(bs, hs, states[bs.start, us.start])

    threads.run_split(block, store, t["batch"], units, _parts(t, name, workers))


def selective_scan(thunk: Thunk, arena: np.ndarray, *, path: str | None = None, chunk: int | None = None,
                   workers: int | None = None) -> None:
    """Mamba-1 (ABI.md §4, §8): per channel, ``delta`` biased and softplus-ed where asked,
    ``h = exp(delta*a)*h + delta*b*x`` and ``y = c . h`` from the row's starting state, then
    ``y = (y + d*x) * silu(z)``.

    ``path`` (``"step"`` or ``"blocked"``), ``chunk`` (steps per block) and ``workers`` (threads
    over the batch x channel recurrences) override the choice.
    """
    prepare(thunk)(arena, path=path, chunk=chunk, workers=workers)


def _selective_scan(t: Thunk, arena: np.ndarray, path: str | None, chunk: int | None, workers: int | None,
                    by_field: Mapping[str, Region] | None) -> None:
    name, length = _choose(t, path, chunk)
    ctype, grouped, n = compute_type(t), t["groups"] > 1, t["state_size"]
    saved = reserve_views(t, arena)
    if saved is not None:  # a saved forward holds the blocked form's states, blocks of 32
        if chunk not in (None, SCAN_RESERVE_CHUNK):
            raise ValueError(f"selective_scan writes a saved forward (reserve) with blocks of {SCAN_RESERVE_CHUNK}, "
                             f"got chunk={chunk}")
        name, length = "blocked", SCAN_RESERVE_CHUNK

    def compute(bound: Bound, bs: slice, hs: slice, state: np.ndarray) -> np.ndarray:
        rows = (bs, slice(None), hs)
        x, delta = _inputs(t, bound, rows, hs, ctype, "delta")
        width = t["hidden"] // t["groups"]
        gs = (bs, slice(None), slice(hs.start // width, hs.stop // width)) if grouped else bs
        b, c = (_read(bound, f, gs, ctype).reshape(*x.shape[:2], -1, n) for f in "bc")
        keep = () if saved is None else (saved["states"][bs, :, hs],)  # (blocked)
        y = _SCAN_PATHS[name](x, delta, _read(bound, "a", hs, ctype), b, c, state, Sequences.of(t, bound), length,
                              *keep)
        _gate(y, x, None if t["d"] is None else _read(bound, "d", hs, ctype),
              None if t["z"] is None else _read(bound, "z", rows, ctype))
        return y

    _run(t, arena, name, (n,), compute, workers, by_field)


def mamba2(thunk: Thunk, arena: np.ndarray, *, path: str | None = None, chunk: int | None = None,
           workers: int | None = None) -> None:
    """Mamba-2 (SSD, ABI.md §4, §8): per head, ``dt`` biased, softplus-ed and clamped to ``dt_limit``
    where asked, ``S = exp(dt*a)*S + (dt*x) (x) b`` and ``y = S c`` from the row's starting state, then
    ``y = (y + d*x) * silu(z)``.

    ``path`` (``"step"`` or ``"chunked"``), ``chunk`` (chunk length) and ``workers`` (threads over
    the batch x heads recurrences) override the choice.
    """
    prepare(thunk)(arena, path=path, chunk=chunk, workers=workers)


def reserve_views(t: Thunk, arena: np.ndarray) -> dict[str, np.ndarray] | None:
    """The saved forward of a completed selective_scan or mamba2 thunk (or their backward's) as views by slot
    name (``abi.ssm.RESERVE_SLOTS``), ``None`` without one."""
    if t.get("reserve") is None:
        return None
    slots = RESERVE_SLOTS[t["op"].removesuffix("_backward")](t)
    return {s.name: view(arena, t["reserve"] + s.offset, s.dtype, s.shape) for s in slots}


def _mamba2(t: Thunk, arena: np.ndarray, path: str | None, chunk: int | None, workers: int | None,
            by_field: Mapping[str, Region] | None) -> None:
    name, length = _choose(t, path, chunk)
    ctype, heads, groups = compute_type(t), t["heads"], t["groups"]
    saved = reserve_views(t, arena)
    if saved is not None:  # a saved forward holds the chunked form's values, chunks of 64
        if chunk not in (None, RESERVE_CHUNK):
            raise ValueError(f"mamba2 writes a saved forward (reserve) with chunks of {RESERVE_CHUNK}, got chunk={chunk}")
        name, length = "chunked", RESERVE_CHUNK
    group_of = np.arange(heads) // (heads // groups)

    def compute(bound: Bound, bs: slice, hs: slice, state: np.ndarray) -> np.ndarray:
        rows = (bs, slice(None), hs)
        x, dt = _inputs(t, bound, rows, hs, ctype, "dt")
        if t["dt_limit"] is not None:
            low, high = t["dt_limit"]
            dt = np.maximum(dt, low)
            if high is not None:
                np.minimum(dt, high, out=dt)
        gs = rows if groups == heads else (bs, slice(None), group_of[hs])
        b, c = (_read(bound, f, gs, ctype) for f in "bc")
        keep = () if saved is None else ({f: saved[f][bs, :, hs] for f in ("states", "scores")},)  # (chunked)
        y = _MAMBA2_PATHS[name](x, dt, _read(bound, "a", hs, ctype), b, c, state, Sequences.of(t, bound), length,
                                *keep)
        if saved is not None:
            np.copyto(saved["y"][bs, :, hs], y)
        _gate(y, x, None if t["d"] is None else _read(bound, "d", hs, ctype)[:, None],
              None if t["z"] is None else _read(bound, "z", rows, ctype))
        return y

    _run(t, arena, name, (t["head_dim"], t["state_size"]), compute, workers, by_field)


def _scan_arguments(t: Thunk) -> compiled_step.Arguments:
    """``jit_ssm_steps.selective_scan_step``'s arguments from a thunk's arena views."""
    def arguments(bound: Bound) -> tuple:
        b, c = bound.view("b"), bound.view("c")
        if t["groups"] == 1:  # [B, S, N]: one group
            b, c = (v.reshape(*v.shape[:2], 1, -1) for v in (b, c))
        optional = [compiled_step.view(bound, f, rank, t[f] is not None) for f, rank in
                    (("delta_bias", 1), ("d", 1), ("z", 3))]
        return (bound.view("x"), bound.view("delta"), bound.view("a"), b, c, *optional,
                compiled_step.view(bound, "state", 3, t["carry_state"]), bound.view("dst"),
                *compiled_step.rows(t, bound), t["cu_seqlens"] is not None, bool(t["delta_softplus"]))
    return arguments


def _mamba2_arguments(t: Thunk) -> compiled_step.Arguments:
    """``jit_ssm_steps.mamba2_step``'s arguments from a thunk's arena views."""
    low, high = t["dt_limit"] if t["dt_limit"] is not None else (-np.inf, np.inf)
    limit = (np.float32(low), np.float32(np.inf if high is None else high))

    def arguments(bound: Bound) -> tuple:
        optional = [compiled_step.view(bound, f, rank, t[f] is not None) for f, rank in
                    (("dt_bias", 1), ("d", 1), ("z", 4))]
        return (*(bound.view(f) for f in ("x", "dt", "a", "b", "c")), *optional,
                compiled_step.view(bound, "state", 4, t["carry_state"]), bound.view("dst"),
                *compiled_step.rows(t, bound), t["cu_seqlens"] is not None, bool(t["dt_softplus"]), *limit)
    return arguments


#: op -> its NumPy body, and its compiled step's kernel and arguments.
_BODIES = {"selective_scan": _selective_scan, "mamba2": _mamba2}
_STEPS = {"selective_scan": ("selective_scan_step", _scan_arguments), "mamba2": ("mamba2_step", _mamba2_arguments)}


def prepare(thunk: Thunk) -> Callable[..., None]:
    """The thunk-only setup of ``selective_scan``/``mamba2``, once (``host_fallback.PREPARE``): the thunk
    completed and its regions laid out, which cost about as much as a decode step's arithmetic
    (B1 H1536 N16: ~60 of ~230 µs), and its compiled step bound (``compiled_step``), which runs the step
    path on one thread where it applies. Returns ``run(arena, *, path, chunk, workers, given)`` (``given``:
    ``implementations.GIVEN``)."""
    t = complete(thunk)
    by_field = {r.field: r for r in regions(t)}
    body = _BODIES[t["op"]]
    kernel, arguments = _STEPS[t["op"]]
    # a saved forward (reserve) is written by the NumPy paths only
    compiled = None if t.get("reserve") is not None else compiled_step.CompiledStep.of(t, by_field, kernel,
                                                                                       arguments(t))

    def run(arena: np.ndarray, *, path: str | None = None, chunk: int | None = None,
            workers: int | None = None, given: Any = None) -> bool | None:
        # the step path runs on one thread unless workers are forced (``_parts``)
        taken = (compiled is not None and _choose(t, path, chunk)[0] == "step"
                 and (workers is None or _parts(t, "step", workers) == 1) and compiled.run(arena, given))
        if taken or given is not None:  # arrays given in place of arena views: the compiled step only
            return taken
        body(t, arena, path, chunk, workers, by_field)
        return None
    return run


KERNELS.add("selective_scan", selective_scan)
KERNELS.add("mamba2", mamba2)
PREPARE.add(("selective_scan", "mamba2"), prepare)
GIVEN.update(("selective_scan", "mamba2"))
PATHS.add(("selective_scan", "mamba2"), path_for)
