"""The host kernel of ``causal_conv1d`` (ABI.md §10) on NumPy arrays: the depthwise causal convolution of
every Mamba / Gated DeltaNet layer, with §8's packed sequences, carried state and state slots.

Per sequence and channel ``d`` the inputs are extended on the left by ``width-1`` values (the carried state,
oldest first, or zeros): ``e``; then ``y[t] = bias + sum_w weight[d,w] * e[t+w]``, then the activation, and
with a carried state the last ``width-1`` values of ``e`` go back to the row's pool entry.

The arrays are in the compute type (ABI.md §1: 16-bit storage computes in f32; the caller converts); the
pool ``state`` may be stored in any float type (``state_dtype``) and is updated in place. The work is
``width`` shifted multiply-adds over ``[tokens, channels]`` slabs of :func:`block_tokens` tokens (each slab a
few hundred KiB, so the passes over it stay in cache), vectorised over the full width of channels; the
threads (``threads.run_all``) take disjoint runs of slabs (token ranges, each slab contiguous in memory), and
every value is the same formula whichever thread computes it, so every thread count gives the same bytes. A
decode step (every row one token, carried state) is one compiled call over a run of rows where Numba is
installed (``jit``: one pass a row, the GIL released), else a handful of array operations over all rows at
once; the threads take disjoint runs of rows, only for a step large enough to pay for their wake
(``DECODE_SPLIT_WORK``). ``conv_backward`` holds the gradients.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping

import numpy as np

from . import compiled_step, jit, threads
from .abi import Region, complete, regions
from .bound import Bound
from .implementations import GIVEN, KERNELS, PREPARE

ACTIVATIONS = ("none", "silu")
#: the widths ABI.md §10 allows
WIDTHS = range(2, 9)
#: the bytes of one [tokens, channels] slab of the blocked passes (several live at once: within L2)
SLAB_BYTES = 1 << 18

#: the compiled decode step's bias where there is none
NO_BIAS = np.empty(0, np.float32)

Row = tuple[int, int, int, int]  # (batch row, state row, first token, one past the last)


def rows(batch: int, seq: int, cu_seqlens: np.ndarray | None) -> list[Row]:
    """Every sequence as ``(batch row, state row, lo, hi)``: each batch row, or each packed sequence of
    ``cu_seqlens`` (batch 1), empty ones included."""
    if cu_seqlens is None:
        return [(b, b, 0, seq) for b in range(batch)]
    cu = [int(v) for v in cu_seqlens]
    return [(0, r, lo, hi) for r, (lo, hi) in enumerate(zip(cu, cu[1:]))]


def block_tokens(dim: int, itemsize: int) -> int:
    """Tokens per slab: a power of two filling :data:`SLAB_BYTES` at ``dim`` channels, at least 16 (more than
    ``width - 1``: a sequence's first slab holds every token its initial state meets). A function of the full
    channel count only: the threads' channel ranges change no summation order."""
    tokens = 16
    while tokens * 2 * dim * itemsize <= SLAB_BYTES:
        tokens *= 2
    return tokens


def entry_of(row: int, slots: np.ndarray | None) -> int:
    """The pool entry of state row ``row``: ``slots[row]`` with state slots, else the row itself."""
    return row if slots is None else int(slots[row])


def initial_window(pool: np.ndarray | None, entry: int, cs: slice, width: int, dtype: np.dtype) -> np.ndarray:
    """The ``width-1`` values a sequence's inputs are extended by, ``[width-1, channels cs]`` in ``dtype``:
    the pool entry's (transposed) with a carried state, zeros without."""
    if pool is None:
        return np.zeros((width - 1, cs.stop - cs.start), dtype)
    return pool[entry, cs].T.astype(dtype)


class Slabs:
    """The extended inputs of one sequence, a slab of tokens at a time: ``source(lo, n)`` is ``e`` over the
    tokens ``lo - (width-1) .. lo + n - 1`` (``[n + width-1, channels]``), a view of ``x`` past the first
    ``width-1`` tokens, else the carried values and the first tokens copied into a buffer."""

    def __init__(self, xs: np.ndarray, head: np.ndarray):
        self.xs, self.head = xs, head
        self.buffer: np.ndarray | None = None

    def source(self, lo: int, n: int) -> np.ndarray:
        back = len(self.head)
        if lo >= back:
            return self.xs[lo - back:lo + n]
        if self.buffer is None or len(self.buffer) < back + n:
            self.buffer = np.empty((back + n, self.xs.shape[1]), self.xs.dtype)
        out = self.buffer[:back + n]
        out[:back - lo] = self.head[lo:]
        out[back - lo:] = self.xs[:lo + n]
        return out


def convolve(src: np.ndarray, taps: np.ndarray, bias: np.ndarray | None, out: np.ndarray,
             scratch: np.ndarray) -> None:
    """``out = bias + sum_w taps[w] * src[w : w+n]`` (``taps [width, channels]``, ``n = len(out)``): the
    pre-activation of ``n`` tokens from their extended inputs. ``scratch`` is at least ``out``'s shape."""
    n, width = len(out), len(taps)
    term = scratch[:n]
    np.multiply(src[width - 1:width - 1 + n], taps[width - 1], out=out)
    for w in range(width - 1):
        out += np.multiply(src[w:w + n], taps[w], out=term)
    if bias is not None:
        out += bias


def silu_(values: np.ndarray, scratch: np.ndarray) -> None:
    """``values = values * sigmoid(values)`` in place, as ``values / (1 + exp(-values))``."""
    term = scratch[:len(values)]
    with np.errstate(over="ignore", invalid="ignore"):
        np.exp(np.negative(values, out=term), out=term)
        term += 1
        np.divide(values, term, out=values)


def check(x: np.ndarray, weight: np.ndarray, activation: str, state: np.ndarray | None) -> None:
    """The shapes and choices a caller must get right (the validator's, repeated for direct callers)."""
    if x.ndim != 3 or weight.ndim != 2 or weight.shape[0] != x.shape[2] or weight.shape[1] not in WIDTHS:
        raise ValueError(f"causal_conv1d: x {x.shape} and weight {weight.shape}: expected x [B,S,D] and "
                         f"weight [D,W] with 2 <= W <= 8")
    if activation not in ACTIVATIONS:
        raise ValueError(f"causal_conv1d: activation={activation!r}: expected one of {ACTIVATIONS}")
    if state is not None and state.shape[1:] != (x.shape[2], weight.shape[1] - 1):
        raise ValueError(f"causal_conv1d: state {state.shape}: expected [entries, {x.shape[2]}, "
                         f"{weight.shape[1] - 1}]")


def causal_conv1d(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None, activation: str = "none",
                  state: np.ndarray | None = None, cu_seqlens: np.ndarray | None = None,
                  state_slots: np.ndarray | None = None, *, out: np.ndarray | None = None,
                  workers: int | None = None) -> np.ndarray:
    """``y = act(bias + causal depthwise convolution of x by weight)``, ABI.md §10.

    ``x [B,S,D]`` and ``out`` (default: a new array) in the compute type; ``weight [D,W]``, ``bias [D]``;
    ``state``: the carried state's pool ``[entries, D, W-1]`` (``carry_state``; absent: every sequence starts
    from zeros), row ``r`` reading and writing entry ``state_slots[r]`` (else ``r``), updated in place;
    ``cu_seqlens``: packed sequences of the one batch row. Rows are independent; the values are trusted
    (the runtime checks them, ABI.md §8).
    """
    check(x, weight, activation, state)
    ct = x.dtype
    taps = np.ascontiguousarray(weight.T, ct)
    bias = None if bias is None else np.asarray(bias, ct)
    out = np.empty(x.shape, ct) if out is None else out
    slots = None if state_slots is None else np.asarray(state_slots, np.intp)
    sequences = rows(x.shape[0], x.shape[1], cu_seqlens)
    if state is not None and sequences and all(hi - lo == 1 for _, _, lo, hi in sequences):
        _decode(x, taps, bias, activation, state, sequences, slots, cu_seqlens is not None, out, workers)
        return out
    _prefill(x, taps, bias, activation, state, sequences, slots, out, workers)
    return out


def _prefill(x, taps, bias, activation, pool, sequences, slots, out, workers) -> None:
    """Every sequence a slab of tokens at a time, full width: the threads take disjoint runs of slabs (token
    ranges, contiguous in memory), and every output is the same formula whichever thread computes it. The
    initial windows are read before any slab runs and the final states written after all have: a sequence's
    first and last slabs may fall to different threads."""
    dim, ct, back = x.shape[2], x.dtype, len(taps) - 1
    tokens = block_tokens(dim, ct.itemsize)
    zeros = np.zeros((back, dim), ct)
    heads = [zeros if pool is None or hi == lo else initial_window(pool, entry_of(r, slots), slice(0, dim), back + 1, ct)
             for _, r, lo, hi in sequences]
    work = [(i, lo, n) for i, (_, _, first, end) in enumerate(sequences) for lo, n in iter_slabs(end - first, tokens)]

    def job(part: list[tuple[int, int, int]]) -> None:
        scratch = np.empty((tokens, dim), ct)
        for i, lo, n in part:
            b, _, first, end = sequences[i]
            ys = out[b, first + lo:first + lo + n]
            convolve(Slabs(x[b, first:end], heads[i]).source(lo, n), taps, bias, ys, scratch)
            if activation == "silu":
                silu_(ys, scratch)

    over_slabs(work, x.size * len(taps), workers, job)
    if pool is not None:
        for (b, r, lo, hi) in sequences:
            if hi > lo:
                store_final(pool, entry_of(r, slots), slice(0, dim), x[b, lo:hi])


def over_slabs(work: list[Any], size: int, workers: int | None, job: Callable[[list[Any]], None]) -> None:
    """``job(run)`` over disjoint contiguous runs of the slabs ``work``, on ``workers`` threads (default: every
    core once ``size`` multiply-adds are enough, ``threads.parts_for``)."""
    parts = threads.parts_for("causal_conv1d", size, 1, max(1, len(work)), workers)
    edges = [len(work) * i // parts for i in range(parts + 1)]
    threads.run_all([lambda run=work[lo:hi]: job(run) for lo, hi in zip(edges, edges[1:])])


def store_final(pool: np.ndarray, entry: int, cs: slice, xs: np.ndarray) -> None:
    """Entry ``entry``'s channels ``cs`` become the last ``W-1`` values of the extended inputs: the sequence's
    last tokens, after the carried values still in the window where it is shorter than ``W-1`` (those kept
    at the pool's own precision)."""
    back = pool.shape[2]
    kept = pool[entry, cs, len(xs):]  # [channels, back - len] carried values that stay (empty when len >= back)
    newest = xs[max(0, len(xs) - back):].T.astype(pool.dtype)
    pool[entry, cs] = np.concatenate([kept, newest], axis=1)


#: The smallest decode step (rows x channels x width multiply-adds) split across cores, by path: below it a
#: thread's wake (~85 µs on a 2-core Intel Xeon VM) costs more than half the step saves. Two workers against one
#: there, W4 D4096 (``python benchmarks/causal_conv1d.py --split``; its decode case B16 is 2^18): compiled 2.0x at
#: 2^18, 1.4x at 2^19, 1.07x at 2^20, 0.82x at 2^21; NumPy's (its threads trading the GIL between ~20 array calls)
#: 1.4x at 2^18, 0.9x at 2^19, 0.65x at 2^20.
DECODE_SPLIT_WORK = {"compiled": 1 << 21, "numpy": 1 << 19}


def _decode(x, taps, bias, activation, pool, sequences, slots, varlen, out, workers) -> None:
    """Every row one token with a carried state, all rows at once: the threads take disjoint runs of rows (their
    pool entries, tokens and outputs whole rows of ``D`` values apart: no line shared), each in one compiled call
    (``_compiled_decode``) where it applies, else ``_decode_rows``. ``workers`` caps the threads: a step smaller
    than its path's ``DECODE_SPLIT_WORK`` runs on one, whatever it allows."""
    count, work = len(sequences), len(sequences) * x.shape[2] * len(taps)
    step = _compiled_decode(x, taps, bias, activation, pool, sequences, slots, out)
    big = work >= DECODE_SPLIT_WORK["numpy" if step is None else "compiled"]
    if step is None:
        tokens = np.array([lo for _, _, lo, _ in sequences], np.intp)
        step = lambda rows_: _decode_rows(x, taps, bias, activation, pool, rows_, tokens, slots, varlen, out)  # noqa: E731
    allowed = threads.parts_for("causal_conv1d", work, count, 1,  # checks workers, whatever the size
                                workers if workers is not None else threads.cores() if big else 1)
    parts = allowed if big else 1
    edges = [count * i // parts for i in range(parts + 1)]
    threads.run_all([lambda rows_=slice(lo, hi): step(rows_) for lo, hi in zip(edges, edges[1:])])


def _compiled_decode(x, taps, bias, activation, pool, sequences, slots, out) -> Callable[[slice], None] | None:
    """The decode step of a run of rows as one GIL-free call of ``jit``'s ``causal_conv1d_decode`` (the window,
    taps, bias, silu and pool shift in one pass a row), or ``None`` where it does not apply: no Numba (or
    ``RLX_HOST_JIT=0``), anything but float32 (a pool in another type than the activations included), a pool or
    output that is not C-contiguous, aligned and writeable, or one overlapping another array. The inputs are
    taken as they are where the kernel can (else a contiguous copy: a decode step's are small)."""
    kernel = jit.kernel("causal_conv1d_decode")
    if (kernel is None or any(a.dtype != np.float32 for a in (x, pool, out))
            or not all(a.flags.c_contiguous and a.flags.aligned and a.flags.writeable for a in (pool, out))
            or any(np.may_share_memory(a, b) for a, b in ((out, x), (pool, x), (pool, out)))):
        return None
    batch_seq, dim = x.shape[0] * x.shape[1], x.shape[2]
    positions = np.array([b * x.shape[1] + lo for b, _, lo, _ in sequences], np.intp)  # rows of x as [B*S, D]
    entries = np.arange(len(sequences), dtype=np.intp) if slots is None else _as_taken(slots, np.intp)
    x, taps, bias = (NO_BIAS if a is None else _as_taken(a, np.float32) for a in (x, taps, bias))
    flat_x, flat_out, silu = x.reshape(batch_seq, dim), out.reshape(batch_seq, dim), activation == "silu"
    return lambda rows_: kernel(flat_x, positions, entries, taps, bias, silu, pool, flat_out, rows_.start, rows_.stop)


def _as_taken(a: np.ndarray, dtype: type) -> np.ndarray:
    """``a`` where a compiled kernel takes it as it is (``dtype``, C-contiguous, aligned, writeable), else a copy
    that it takes (``np.require``'s check, at a sixth of its cost)."""
    flags = a.flags
    usable = a.dtype == dtype and flags.c_contiguous and flags.aligned and flags.writeable
    return a if usable else np.array(a, dtype)


def _decode_rows(x, taps, bias, activation, pool, rows_, tokens, slots, varlen, out) -> None:
    """The decode step of the rows ``rows_``: their windows and tokens side by side in a channel-contiguous
    buffer ``e [rows, W, D]`` (the pool's ``[D, W-1]`` entries transposed once, at the pool's precision or the
    compute type's, the wider), ``y = bias + sum_w taps[w] * e[:, w]`` in contiguous passes (the prefill's
    order), then ``e[:, 1:]`` back to the entries, straight on the pool (a column of the entries at a time: 3.5x
    faster than one transposed assignment, whose inner loop numpy takes across the rows of ``e``)."""
    width = len(taps)
    entries = rows_ if slots is None else slots[rows_]
    tokens = tokens[rows_]
    e = np.empty((len(tokens), width, x.shape[2]), np.result_type(x.dtype, pool.dtype))
    e[:, :width - 1] = pool[entries].transpose(0, 2, 1)
    e[:, width - 1] = x[0, tokens] if varlen else x[rows_, 0]
    y = np.multiply(e[:, width - 1], taps[width - 1])
    term = np.empty_like(y)
    for w in range(width - 1):
        y += np.multiply(e[:, w], taps[w], out=term)
    if bias is not None:
        y += bias
    if activation == "silu":
        silu_(y, term)
    if varlen:
        out[0, tokens] = y
    else:
        out[rows_, 0] = y
    for k in range(width - 1):
        pool[entries, :, k] = e[:, k + 1]


def iter_slabs(length: int, tokens: int, reverse: bool = False) -> Iterator[tuple[int, int]]:
    """``(lo, n)`` of the slabs of ``tokens`` over ``length`` tokens, last first with ``reverse``."""
    starts = range(0, length, tokens)
    for lo in (reversed(starts) if reverse else starts):
        yield lo, min(tokens, length - lo)


def pool_of(bound: Bound, field: str) -> tuple[np.ndarray, bool]:
    """A carried-state pool (``state`` / ``d_state``) to update in place: the arena's view when it is stored in
    its compute type, else a loaded copy; and whether that copy must be stored back (16-bit storage)."""
    view = bound.in_place(field)
    return (view, False) if view is not None else (bound.load(field), True)


def optional_inputs(t: Mapping[str, Any], bound: Bound) -> dict[str, Any]:
    """The optional §10 inputs of thunk ``t`` (completed) as the host cores take them (``state`` aside)."""
    out: dict[str, Any] = {"activation": t["activation"], "bias": None if t["bias"] is None else bound.load("bias")}
    out.update({f: None if t[f] is None else bound.view(f) for f in ("cu_seqlens", "state_slots")})
    return out


def kernel(t: Mapping[str, Any], arena: np.ndarray, *, workers: int | None = None) -> None:
    """``causal_conv1d`` on a host arena: 16-bit storage computes in f32, the pool is updated in place."""
    _arrays(t, arena, None, workers)


def _arrays(t: Mapping[str, Any], arena: np.ndarray, by_field: Mapping[str, Region] | None,
            workers: int | None) -> None:
    """``kernel`` on the thunk's regions ``by_field`` where the caller laid them out (None: laid out here)."""
    bound = Bound(t, arena, by_field)
    pool, copied = pool_of(bound, "state") if t["carry_state"] else (None, False)
    out = bound.in_place("dst")
    y = causal_conv1d(bound.load("x"), bound.load("weight"), state=pool, out=out, workers=workers,
                      **optional_inputs(t, bound))
    if out is None:
        bound.store("dst", y)
    if copied:
        bound.store("state", pool)


def prepare(thunk: Mapping[str, Any]) -> Callable[..., bool | None]:
    """The thunk-only setup of ``causal_conv1d``, once (``host_fallback.PREPARE``): the thunk completed and its
    regions laid out, and, for a decode step (every batch row one token, a carried state, every tensor f32, no
    output overlapping another tensor, too small a step to split), ``jit``'s ``causal_conv1d_decode`` bound to
    each arena's views once: a call then transposes the weight and makes one compiled call, where ``kernel``
    lays out the regions, loads each input and picks its path again (B1 D1536 W4: about 30 µs of Python).
    Returns ``run(arena, *, workers, given)`` (``given``: ``implementations.GIVEN``; the decode step only)."""
    t = complete(thunk)
    by_field = {r.field: r for r in regions(t)}
    step = jit.kernel("causal_conv1d_decode")
    batch, dim, width = t["batch"], t["dim"], t["width"]
    decode = (step is not None and t["carry_state"] and t["seq"] == 1 and t["cu_seqlens"] is None
              and all(r.dtype in ("f32", "i32") for r in by_field.values()) and compiled_step.apart(by_field)
              and batch * dim * width < DECODE_SPLIT_WORK["compiled"])
    positions = np.arange(batch, dtype=np.intp)  # row b's token is row b of x as [B, D]
    last: list[Any] = []  # (arena, its views): a decode runs on one arena call after call

    def views_of(arena: np.ndarray) -> dict[str, np.ndarray] | None:
        if not last or last[0] is not arena:
            bound = Bound(t, arena, by_field)
            views = {f: bound.view(f) for f in ("x", "weight", "state", "dst", "bias", "state_slots")
                     if t.get(f) is not None or f in ("x", "weight", "state", "dst")}
            usable = all(a.flags.aligned and a.flags.writeable for a in views.values())  # as Numba takes them
            last[:] = [arena, views if usable else None]
        return last[1]

    def run(arena: np.ndarray, *, workers: int | None = None, given: Any = None) -> bool | None:
        views = None
        if decode:
            threads.parts_for("causal_conv1d", 0, batch, 1, workers)  # checks workers, as ``_decode`` does
            views = views_of(arena)
            if views is not None and given:
                views = _given_views(views, by_field, given)
        if views is not None:
            slots = views.get("state_slots")
            step(views["x"].reshape(batch, dim), positions, positions if slots is None else slots.astype(np.intp),
                 np.ascontiguousarray(views["weight"].T), views.get("bias", NO_BIAS), t["activation"] == "silu",
                 views["state"], views["dst"].reshape(batch, dim), 0, batch)
            return None if given is None else True
        if given is not None:  # arrays given in place of arena views: the decode step only
            return False
        _arrays(t, arena, by_field, workers)
        return None
    return run


def _given_views(views: dict[str, np.ndarray], by_field: Mapping[str, Region],
                 given: Mapping[int, np.ndarray]) -> dict[str, np.ndarray] | None:
    """``views`` with each array of ``given`` (a field's arena offset -> an array) in place of its field's view
    where they fit (``compiled_step.fitting``: the step writes the pool and ``dst``); None where one does not (the
    caller copies them through the arena)."""
    at = {by_field[f].offset: by_field[f] for f in views}
    fitted = compiled_step.fitting(given, {offset: (r.nbytes, r.shape, r.field in ("state", "dst"))
                                           for offset, r in at.items()})
    return None if fitted is None else {**views, **{at[offset].field: a for offset, a in fitted.items()}}


KERNELS.add("causal_conv1d", kernel)
PREPARE.add("causal_conv1d", prepare)
GIVEN.add("causal_conv1d")
