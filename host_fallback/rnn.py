"""Host kernels for ``lstm``, ``gru`` and ``rnn`` (ABI.md §3): multi-layer, bidirectional, carried state.

How a layer-direction runs, and why (``python benchmarks/rnn.py`` times each choice beside its
alternative and beside torch):

- Feature-major inside: the state is ``h^T [hidden, batch]`` and a step is ``W_hh · h^T``, the GEMM
  orientation OpenBLAS runs fastest at small batches.
- Time in chunks of ``c`` steps, ``c·batch`` ≈ ``_CHUNK_COLUMNS`` columns: a layer's output is
  ``[seq/c, dirs*hidden, c·batch]``, which is also the next layer's input. Each chunk's input
  projection (plus the input-side bias) is one wide GEMM, run just before its ``c`` steps, so the
  per-step add reads it from cache. Layer 0 reads ``x`` through a time-major copy, which is a plain
  copy where the chunked layout would need a transpose; BLAS takes the transposed chunk as it is.
- Sigmoids through exp: the rows of a sigmoid gate (lstm i f o, gru r z) in ``w_ih``, ``w_hh`` and
  the input-side biases are negated once (exact), so ``σ(z) = 1/(1+exp(-z))`` is one ``exp``, one add
  and one division over those rows, which NumPy runs in well under the time of its ``tanh``; the tanh
  gates use ``tanh``. Internally lstm gates are ordered ``i f o g``, so the sigmoid rows are
  contiguous. ``exp(-z)`` overflows to inf for very negative ``z``, which gives ``σ = 0`` as it should:
  the loops run with NumPy's overflow warning off.
- Short sequences (decode, ``seq <= _STORED_MAX_SEQ``) in f32/f64 use the weights where they are
  stored: the reordered, negated copy of ``w_ih`` and ``w_hh`` would cost more than the steps, so
  the loop negates the sigmoid rows of each step's pre-activations itself, in the ABI's gate order.
- With two directions, a two-thread OpenBLAS and steps big enough (``_PARALLEL_STEP_FLOPS``), the
  directions run on two threads (``threads.run_all``), each with a single-threaded BLAS (NumPy
  releases the GIL inside its loops): the elementwise part of one direction overlaps the GEMMs of
  the other. With more BLAS threads one direction at a time keeps every core on each GEMM, so
  anything else runs the directions one after the other (``--directions`` of the benchmark
  compares the two).

16-bit storage is loaded to f32, everything between steps and layers stays f32, and only ``dst``
and ``h0``/``c0`` are rounded (to nearest even) on store; f64 computes in f64.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from . import threads
from .arena import COMPUTE, STORAGE
from .layout import Bound, layer_input_sizes, recurrent_dims, regions

#: Internal gate order (ABI index of each internal gate): sigmoid gates first, tanh gates last.
_ORDER = {"lstm": (0, 1, 3, 2), "gru": (0, 1, 2), "rnn": (0,)}
#: How many leading internal gates are sigmoids.
_SIGMOID = {"lstm": 3, "gru": 2, "rnn": 0}
#: Columns of a time chunk the projection GEMM aims for.
_CHUNK_COLUMNS = 128
#: Smallest recurrent GEMM (flops a step) at which two threads pay: below it the threads mostly trade
#: the GIL (lstm B=32 H=64, 1 MFLOP: 14.4 ms in two threads vs 11.7 in one; B=64 H=64, 2 MFLOP:
#: 18 vs 21; rnn B=16 H=256, 2 MFLOP: 13 vs 18).
_PARALLEL_STEP_FLOPS = 2_000_000
#: Longest sequence that reads f32/f64 weights where they are stored (no per-call reordered copy).
_STORED_MAX_SEQ = 16


@dataclass(frozen=True)
class _Dims:
    op: str
    batch: int
    seq: int
    hidden: int
    layers: int
    gates: int
    dirs: int
    chunk: int  # steps per time chunk; divides seq
    compute: np.dtype
    stored: bool  # weights used in place, ABI gate order, not halved (decode); else the internal copy

    @property
    def chunks(self) -> int:
        return self.seq // self.chunk


def chunk_steps(batch: int, seq: int) -> int:
    """Steps per time chunk: the largest divisor of ``seq`` whose chunk has at most ``_CHUNK_COLUMNS``
    columns (``batch >= 1``, ``seq >= 1``), at least one step."""
    aim = -(-_CHUNK_COLUMNS // batch)
    return max(c for c in range(1, min(aim, seq) + 1) if seq % c == 0)


def _dims(t: Mapping[str, Any]) -> _Dims:
    """Sizes of a thunk with ``batch, seq >= 1``."""
    gates, dirs = recurrent_dims(t)
    batch, seq = t["batch"], t["seq"]
    chunk = chunk_steps(batch, seq)
    compute = COMPUTE[t["dtype"]]
    stored = seq <= _STORED_MAX_SEQ and compute == STORAGE[t["dtype"]]
    return _Dims(t["op"], batch, seq, t["hidden"], t["num_layers"], gates, dirs, chunk, compute, stored)


def _internal(w: np.ndarray, d: _Dims) -> np.ndarray:
    """A ``[gates*hidden, ...]`` block in internal gate order and compute type, sigmoid rows negated.

    With ``d.stored`` a weight matrix is the stored block itself and a bias a private copy, both in
    the ABI's gate order and not negated.
    """
    if d.stored:
        return w.reshape(d.gates * d.hidden, -1) if w.ndim == 2 else w.astype(d.compute).reshape(-1, 1)
    src = w.reshape(d.gates, d.hidden, -1)
    out = np.empty(src.shape, d.compute)
    for k, g in enumerate(_ORDER[d.op]):
        if k < _SIGMOID[d.op]:
            np.negative(src[g], out=out[k], dtype=d.compute)
        else:
            out[k] = src[g]
    return out.reshape(d.gates * d.hidden, -1) if w.ndim == 2 else out.reshape(-1, 1)


# --- one layer-direction's time loop -----------------------------------------------------------------
# Every array is feature-major [features, batch]. ``steps`` yields (x_t, y_t): x_t is W_ih·x_t plus the
# input-side bias, y_t the slot where h_t lands, which then feeds the next step.


def _sigmoid_of_negated(a: np.ndarray) -> None:
    """``a`` holds ``-z``; leaves ``σ(z) = 1/(1+exp(-z))`` in place (exp(-z) = inf gives 0)."""
    np.exp(a, out=a)
    a += 1
    np.divide(1, a, out=a)


def _lstm_loop(w_hh, h_bias, steps, h, c, relu, stored):
    H, B = h.shape
    g = np.empty((4 * H, B), h.dtype)
    tmp = np.empty((H, B), h.dtype)
    if stored:  # ABI order i f g o: two runs of sigmoid rows, negated here every step
        i, f, gg, o = g[:H], g[H: 2 * H], g[2 * H: 3 * H], g[3 * H:]
        sigs = (g[: 2 * H], o)
    else:
        i, f, o, gg = g[:H], g[H: 2 * H], g[2 * H: 3 * H], g[3 * H:]
        sigs = (g[: 3 * H],)
    for xp, y in steps:
        np.matmul(w_hh, h, out=g)
        g += xp
        for sig in sigs:
            if stored:
                np.negative(sig, out=sig)
            _sigmoid_of_negated(sig)
        np.tanh(gg, out=gg)
        c *= f
        np.multiply(i, gg, out=tmp)
        c += tmp
        np.tanh(c, out=tmp)
        np.multiply(o, tmp, out=y)
        h = y
    return h, c


def _gru_loop(w_hh, h_bias, steps, h, c, relu, stored):
    H, B = h.shape
    g = np.empty((3 * H, B), h.dtype)
    tmp = np.empty((H, B), h.dtype)
    rz, r, z, n = g[: 2 * H], g[:H], g[H: 2 * H], g[2 * H:]
    for xp, y in steps:
        np.matmul(w_hh, h, out=g)
        rz += xp[: 2 * H]
        if stored:
            np.negative(rz, out=rz)
        _sigmoid_of_negated(rz)
        n += h_bias  # b_hn sits inside r⊙(W_hn·h + b_hn)
        n *= r
        n += xp[2 * H:]
        np.tanh(n, out=n)
        np.subtract(h, n, out=tmp)  # h' = (1-z)⊙n + z⊙h = n + z⊙(h-n)
        tmp *= z
        np.add(n, tmp, out=y)
        h = y
    return h, c


def _rnn_loop(w_hh, h_bias, steps, h, c, relu, stored):
    g = np.empty_like(h)
    for xp, y in steps:
        np.matmul(w_hh, h, out=g)
        g += xp
        if relu:
            np.maximum(g, 0, out=y)
        else:
            np.tanh(g, out=y)
        h = y
    return h, c


_LOOPS: dict[str, Callable] = {"lstm": _lstm_loop, "gru": _gru_loop, "rnn": _rnn_loop}


def _biases(b: Bound, d: _Dims, ld: int) -> tuple[np.ndarray, np.ndarray | None]:
    """``(input-side bias [G*H, 1], hidden-side bias or None)``; gru keeps b_hn on the hidden side."""
    if d.op != "gru":
        return _internal(b.view("bias")[ld], d), None
    b_ih, b_hh = _internal(b.view("b_ih")[ld], d), _internal(b.view("b_hh")[ld], d)
    two = 2 * d.hidden
    b_ih[:two] += b_hh[:two]
    # added once per step: broadcast from its column for one step (a decode) or one batch row, else
    # spread over the batch once (a contiguous add per step is faster; the spread costs a step's add)
    once = d.batch == 1 or d.seq == 1
    return b_ih, b_hh[two:] if once else np.ascontiguousarray(np.broadcast_to(b_hh[two:], (d.hidden, d.batch)))


def _steps(w_ih, bias, x, out, d: _Dims, reverse: bool) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Project one time chunk at a time, just before its steps, so they read it from cache."""
    B, c = d.batch, d.chunk
    if c * B > 1 and d.chunks > 1:  # spread once, added per chunk (one chunk: the broadcast add is cheaper)
        bias = np.ascontiguousarray(np.broadcast_to(bias, (bias.shape[0], c * B)))
    buf = np.empty((w_ih.shape[0], c * B), d.compute)
    for k in reversed(range(d.chunks)) if reverse else range(d.chunks):
        np.matmul(w_ih, x[k], out=buf)
        buf += bias
        for j in reversed(range(c)) if reverse else range(c):
            yield buf[:, j * B: (j + 1) * B], out[k, :, j]


def _layer_direction(t, b: Bound, d: _Dims, layer: int, dr: int, w_ih: np.ndarray, x: np.ndarray, y: np.ndarray):
    """Run direction ``dr`` of ``layer``: ``w_ih`` its stored ``[G*H, in]`` block, ``x [chunks, in, c*B]``
    the layer's input; write this direction's rows of ``y``, its final state, and at the top ``dst``."""
    H, B, c, ld = d.hidden, d.batch, d.chunk, layer * d.dirs + dr
    w_ih, w_hh = _internal(w_ih, d), _internal(b.view("w_hh")[ld], d)
    x_bias, h_bias = _biases(b, d, ld)
    out = y.reshape(d.chunks, d.dirs * H, c, B)[:, dr * H: dr * H + H]
    carry = t["carry"]

    def state(field: str) -> np.ndarray:  # always a private copy: the loop updates it in place
        return np.array(b.view(field)[ld].T, d.compute, order="C") if carry else np.zeros((H, B), d.compute)

    h, cell = state("h0"), state("c0") if d.op == "lstm" else None
    steps = _steps(w_ih, x_bias, x, out, d, reverse=dr == 1)
    with np.errstate(over="ignore"):  # exp(-z) overflows to inf for z < -88 (f32): σ(z) is then 0
        h, cell = _LOOPS[d.op](w_hh, h_bias, steps, h, cell, t.get("relu", False), d.stored)
    if carry:  # the final state, in place
        b.view("h0")[ld] = h.T
        if cell is not None:
            b.view("c0")[ld] = cell.T
    if layer == d.layers - 1:  # dst [B, S, dirs*H]: this direction's features, one chunk at a time
        dst = b.view("dst").reshape(B, d.chunks, c, d.dirs * H)[..., dr * H: dr * H + H]
        for k in range(d.chunks):
            dst[:, k] = out[k].transpose(2, 1, 0)


def prepare(t: Mapping[str, Any]) -> Callable[..., None]:
    """Do the work that depends only on the thunk once (sizes, regions, the layer split); returns
    ``run(arena, *, parallel_directions=None)`` for any arena. A decode step (lstm B=1 H=256) spends
    more time on this setup than on its math, so a runtime that runs a thunk many times keeps ``run``.

    ``parallel_directions``: ``None`` lets the kernel choose (see the module docstring),
    ``True``/``False`` forces two threads or one."""
    if 0 in (t["batch"], t["seq"], t["hidden"]):
        return lambda arena, **_: None  # nothing to compute; a carried state is its own final state
    t = dict(t)  # the kernel reads its fields dozens of times a call; a plain dict is the fastest mapping
    d = _dims(t)
    by_field = {r.field: r for r in regions(t)}
    B, c = d.batch, d.chunk
    layers, offset = [], 0
    for layer, in_l in enumerate(layer_input_sizes(t)):
        size = d.gates * d.hidden * in_l
        layers.append((layer, in_l, [(offset + k * size, offset + (k + 1) * size) for k in range(d.dirs)]))
        offset += d.dirs * size
    wide = 2 * d.gates * d.hidden ** 2 * d.batch >= _PARALLEL_STEP_FLOPS
    last: list[Bound] = []  # the last arena's views, reused while runs come on the same arena

    def run(arena: np.ndarray, *, parallel_directions: bool | None = None) -> None:
        if not last or last[0].arena is not arena:
            last[:] = [Bound(t, arena, by_field)]
        b = last[0]
        # Layer 0's input, time-major; chunk k is the transposed view x_tm[k*c:(k+1)*c].reshape(c*B, I).T
        x = np.empty((d.seq, B, t["input_size"]), d.compute)
        x[...] = b.view("x").transpose(1, 0, 2)
        x = x.reshape(d.chunks, c * B, -1).transpose(0, 2, 1)
        w_ih = b.view("w_ih")
        parallel = d.dirs == 2 and (parallel_directions if parallel_directions is not None else
                                     wide and threads.cores() == 2)
        for layer, in_l, spans in layers:
            blocks = [w_ih[lo:hi].reshape(-1, in_l) for lo, hi in spans]
            y = np.empty((d.chunks, d.dirs * d.hidden, c * B), d.compute)
            jobs = [lambda dr=dr: _layer_direction(t, b, d, layer, dr, blocks[dr], x, y) for dr in range(d.dirs)]
            if parallel:
                threads.run_all(jobs)
            else:
                for job in jobs:
                    job()
            x = y
    return run


def _run(t: Mapping[str, Any], arena: np.ndarray, *, parallel_directions: bool | None = None) -> None:
    """Run one lstm/gru/rnn thunk in place (``prepare`` says what ``parallel_directions`` does)."""
    prepare(t)(arena, parallel_directions=parallel_directions)


KERNELS = {"lstm": _run, "gru": _run, "rnn": _run}
PREPARE = {"lstm": prepare, "gru": prepare, "rnn": prepare}
