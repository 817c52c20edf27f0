"""Host kernels for ``lstm``, ``gru`` and ``rnn`` (ABI.md §3, and §8's version-2 fields): multi-layer,
bidirectional, carried state, sequence lengths, clipping, any activations, both GRU forms, LSTM
peepholes, coupled input-forget gates and projections.

How a layer-direction runs, and why (``python benchmarks/rnn.py`` times each choice beside its
alternative and beside torch):

- Feature-major inside: the state is ``h^T [width, batch]`` and a step is ``W_hh · h^T``, the GEMM
  orientation OpenBLAS runs fastest at small batches.
- Time in chunks of about ``_CHUNK_COLUMNS`` columns (a column is one row of the batch at one
  step): a layer's output is one ``[dirs*width, columns]`` block per chunk, which is also the next
  layer's input. Each chunk's input projection (plus the input-side bias) is one wide GEMM, run
  just before its steps, so the per-step add reads it from cache. Layer 0 reads ``x`` through a
  time-major copy, which is a plain copy where the chunked layout would need a transpose; BLAS takes
  the transposed chunk as it is.
- Sequence lengths (``seq_lens``) pack the columns as PyTorch's packed sequences do: the rows sorted
  by decreasing length, step ``t`` holds only the ``n_t`` rows still running, so the rows that run
  at a step are a prefix of the batch. Neither the input projection nor the recurrence nor the gates
  touch a finished row: a batch of lengths uniform in ``[1, seq]`` does about half the work of the
  full one. Direction 1 walks the same columns from the end, where a row joins (from its initial
  state) at its last valid step. The rows' final states are kept as they finish.
- Sigmoids and tanhs through exp: the rows of a gate whose activation is ``sigmoid`` (lstm i f o, gru
  r z by default) in ``w_ih``, ``w_hh``, the biases and the peepholes are negated once (exact), and
  those of a ``tanh`` gate (lstm g, gru n) doubled and negated where a step's block is wide
  (``activations.stored_scale``), so ``σ(z) = 1/(1+exp(-z))`` and ``tanh(z) = 2/(1+exp(-2z)) - 1`` are
  one ``exp``, one add and one division (and a subtraction) over those rows; NumPy's ``exp`` costs
  about half its ``tanh``. Clipping is symmetric, so it clips the scaled rows at the bound scaled
  alike. Internally lstm gates are ordered ``i f o g``: the rows of its first activation are
  contiguous, and with the defaults one ``exp`` and one add run over all four gates
  (``activations.sigmoid_then_tanh_of_scaled``); the cell's tanh goes through exp too. ``exp``
  overflows to inf for very negative ``z``, which gives ``σ = 0`` and ``tanh = -1`` as it should: the
  loops run with NumPy's overflow warning off.
- Where Numba is installed (the ``jit`` extra) an f32-inside lstm with the default activations, no
  peepholes and a batch of at least ``_COMPILED_MIN_BATCH`` runs each step as one compiled kernel
  (``jit``, ``_lstm_compiled_loop``): ``W_hh·h + W_ih·x_t`` in register tiles over the weights packed
  once per call, in vectors as wide as the CPU's (``jit.lanes``: 16 float32 lanes with AVX-512, else 8;
  no projection chunks: the steps read their input columns in place), then the gates,
  clip, the cell and ``o·tanh(c)`` into its slot, where the NumPy loop below runs two OpenBLAS GEMMs
  and ~15 array passes. It runs on one core, so where a direction's GEMMs would get several (one
  direction at a time on a multi-thread BLAS) it takes only the steps it still runs faster
  (``_COMPILED_SHARED_MIN_BATCH``, ``_COMPILED_SHARED_STEP_FLOPS``).
  The NumPy loop is the same recurrence and stays the path everywhere else, and with ``RLX_HOST_JIT=0``.
- A small lstm that the whole-sequence kernels cover (``lstm_sequence``: those gates, no clip, peepholes,
  projection or coupled gates, ``batch·hidden²`` and ``hidden`` within its bounds) runs each layer-direction as
  one compiled call instead, batch-major (``_lstm_sequences``), where a call a step and the Python around it
  were most of the time (B=8 S=24 H=32, 2 layers: 0.29 ms to 0.12); a decode call, whose few steps do not
  repay the kernel's copy of ``W_hh`` (``_SEQUENCE_UNITS_PER_STEP``), keeps the routes below.
- Activations are NumPy functions chosen once per layer-direction (``activations.activation``), each writing
  ``out = act(x)`` over whole gate blocks; the loops branch per step on the fields a thunk uses
  (peepholes, clip), never per element.
- Short sequences (decode, ``seq <= _STORED_MAX_SEQ``) in f32/f64 use the weights where they are
  stored: the reordered, scaled copy of ``w_ih`` and ``w_hh`` would cost more than the steps, so
  the sigmoid negates each step's pre-activations itself, in the ABI's gate order.
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
from functools import partial
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import numpy as np

from . import jit, lstm_sequence, threads
from .activations import (Activation, activation, sigmoid_of_negated, sigmoid_then_tanh_of_scaled, stored_scale,
                          tanh_of_scaled)
from .arena import COMPUTE, STORAGE
from .fields import ACTIVATION_SLOTS, complete
from .implementations import KERNELS, PREPARE, WORKING
from .layout import Bound, output_width, regions

#: Internal gate order (ABI index of each internal gate): the gates of the first activation slot first.
_ORDER = {"lstm": (0, 1, 3, 2), "gru": (0, 1, 2), "rnn": (0,)}
#: The activation slot (ABI.md §8: lstm f g h, gru f g, rnn f) that drives each internal gate.
_SLOT = {"lstm": (0, 0, 0, 1), "gru": (0, 0, 1), "rnn": (0,)}
#: Columns of a time chunk the projection GEMM aims for.
_CHUNK_COLUMNS = 128
#: Smallest recurrent GEMM (flops a step) at which two threads pay: below it the threads mostly trade
#: the GIL (lstm B=32 H=64, 1 MFLOP: 14.4 ms in two threads vs 11.7 in one; B=64 H=64, 2 MFLOP:
#: 18 vs 21; rnn B=16 H=256, 2 MFLOP: 13 vs 18).
_PARALLEL_STEP_FLOPS = 2_000_000
#: Longest sequence that reads f32/f64 weights where they are stored (no per-call reordered copy).
_STORED_MAX_SEQ = 16
#: Smallest batch the compiled lstm step runs (``jit``): its narrowest tile is one vector (8 or 16 columns), so
#: below 8 lanes idle (8 lanes, unidirectional H=256, its time over NumPy's step's: B=1 3.3x, B=4 1.26x, B=8
#: 1.12x, B=16 0.95x; 16 lanes take the time of 8 at B=8).
_COMPILED_MIN_BATCH = 8
#: The compiled step runs on one core. Where NumPy's step would run each GEMM on two (one direction at a
#: time on a two-thread BLAS) the compiled one wins from a batch of 12 up to about this many flops a step
#: (B=12 H=256: 12.6 MFLOP, 0.86x NumPy's time; B=32 H=256: 33.6, 0.94x) and loses past it (B=16 H=512: 67,
#: 0.98x; B=64 H=512: 268, 1.20x) or below it (B=8 H=256: 1.12x; B=8 H=512: 1.74x); with more BLAS threads
#: the bound shrinks in proportion.
_COMPILED_SHARED_MIN_BATCH = 12
_COMPILED_SHARED_STEP_FLOPS = 40_000_000
#: The whole-sequence lstm kernel (``lstm_sequence``) copies W_hh once a call (4H² values), which a short call's
#: steps repay only where H is at most this many units a step of the call. One thread, a Zen 5, µs a call, the
#: per-step route / the kernel: S1 B1 H32 37 / 22, S1 B8 H64 50 / 40, S1 B1 H128 45 / 86, S2 B1 H128 66 / 101,
#: S2 B1 H64 52 / 39, S4 B1 H128 95-117 / 110-131, S4 B2 H128 143 / 119, S8 B1 H128 189 / 135.
_SEQUENCE_UNITS_PER_STEP = 32


# --- sizes and packing -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Dims:
    op: str
    batch: int
    seq: int
    hidden: int
    width: int  # of h, dst and the layers above 0: proj_size when the lstm projects, else hidden
    layers: int
    gates: int
    dirs: int
    compute: np.dtype
    stored: bool  # weights used in place, ABI gate order, not scaled (decode); else the internal copy


def _dims(t: Mapping[str, Any]) -> _Dims:
    """Sizes of a thunk with ``batch, seq >= 1``."""
    compute = COMPUTE[t["dtype"]]
    stored = t["seq"] <= _STORED_MAX_SEQ and compute == STORAGE[t["dtype"]]
    return _Dims(t["op"], t["batch"], t["seq"], t["hidden"], output_width(t), t["num_layers"], len(_ORDER[t["op"]]),
                 2 if t["bidirectional"] else 1, compute, stored)


@dataclass(frozen=True)
class _Chunk:
    first: int  # its first column among all
    columns: int
    t0: int  # the time of its first step
    steps: tuple[tuple[int, int], ...]  # (first column inside the chunk, rows) of steps t0, t0+1, ...


@dataclass(frozen=True)
class _Packing:
    """Which rows run at each step, and where each step's columns lie in the time-chunked layout."""

    chunks: tuple[_Chunk, ...]
    columns: int
    widest: int  # columns of the widest chunk
    order: np.ndarray | None  # the rows by decreasing length (None: every row runs every step, in order)
    index: np.ndarray | None  # row*seq + t of every column, with ``order``
    lengths: np.ndarray | None


def _chunks(rows: Sequence[int]) -> tuple[_Chunk, ...]:
    """Cut the steps with ``rows[t] > 0`` running rows into chunks of at most ``_CHUNK_COLUMNS`` columns,
    at least one step each."""
    out, t, first = [], 0, 0
    while t < len(rows) and rows[t] > 0:
        t0, steps, width = t, [], 0
        while t < len(rows) and rows[t] > 0 and (not steps or width + rows[t] <= _CHUNK_COLUMNS):
            steps.append((width, rows[t]))
            width += rows[t]
            t += 1
        out.append(_Chunk(first, width, t0, tuple(steps)))
        first += width
    return tuple(out)


def _full_packing(batch: int, seq: int) -> _Packing:
    chunks = _chunks([batch] * seq)
    return _Packing(chunks, batch * seq, max(c.columns for c in chunks), None, None, None)


def _varlen_packing(lengths: np.ndarray, seq: int) -> _Packing:
    """The packing of rows of ``lengths`` (each in ``[0, seq]``, checked before the kernel runs)."""
    order = np.argsort(-lengths, kind="stable")
    running = np.count_nonzero(lengths[order][None, :] > np.arange(seq)[:, None], axis=1)
    chunks = _chunks(running.tolist())
    steps, rows = np.nonzero(np.arange(lengths.size)[None, :] < running[:, None])  # t-major, rows in order
    index = order[rows] * seq + steps
    widest = max((c.columns for c in chunks), default=0)
    return _Packing(chunks, int(index.size), widest, order, index, lengths)


def chunk_columns(batch: int, seq: int) -> list[int]:
    """Columns of each time chunk of a full batch (``batch``, ``seq >= 1``), in time order."""
    return [c.columns for c in _chunks([batch] * seq)]


# --- weights in the loops' form ----------------------------------------------------------------------


def _internal(w: np.ndarray, d: _Dims, scales: Sequence[float]) -> np.ndarray:
    """A ``[gates*hidden, ...]`` block in internal gate order and compute type, the rows of each
    internal gate times its ``scales`` entry; a 1-D block (a bias) comes back as a column.

    With ``d.stored`` a weight matrix is the stored block itself and a bias a private copy, both in
    the ABI's gate order and not scaled.
    """
    if d.stored:
        return w.reshape(d.gates * d.hidden, -1) if w.ndim == 2 else w.astype(d.compute).reshape(-1, 1)
    src = w.reshape(d.gates, d.hidden, -1)
    out = np.empty(src.shape, d.compute)
    for k, g in enumerate(_ORDER[d.op]):
        if scales[k] != 1:
            np.multiply(src[g], scales[k], out=out[k], dtype=d.compute)
        else:
            out[k] = src[g]
    return out.reshape(d.gates * d.hidden, -1) if w.ndim == 2 else out.reshape(-1, 1)


class _Compiled(NamedTuple):
    """The Numba kernels of the compiled lstm step (``jit``), and the width of its tiles (``jit.lanes``)."""

    lstm_panels: Callable
    lstm_panel_bias: Callable
    lstm_step: Callable
    lanes: int

    def pack(self, w: np.ndarray, scales: Sequence[float]) -> np.ndarray:
        """A stored ``[4H, K]`` weight block packed for the step's tiles: ``_internal``'s reordered, scaled
        rows, read from the stored ones in one pass (16-bit storage converted to f32 first)."""
        return self.lstm_panels(np.require(w, np.float32, ("C", "A")), np.array(_ORDER["lstm"], np.int64),
                                np.array(scales, np.float32), self.lanes)


@dataclass
class _Cell:
    """One layer-direction's weights and the fields its loop reads, in the loop's form."""

    w_hh: np.ndarray
    h_bias: np.ndarray | None  # gru with linear_before_reset: b_hn, spread over the batch or a column
    acts: tuple[Activation, ...]  # one per slot
    clips: tuple[float, ...]  # per internal gate: the clip bound at the scale its rows are stored at; 0: none
    peepholes: tuple[np.ndarray, np.ndarray, np.ndarray] | None  # lstm p_i, p_f, p_o as columns, scaled as their rows
    input_forget: bool
    w_hr: np.ndarray | None
    linear_before_reset: bool
    compiled: _Compiled | None  # lstm: Numba's kernels (``jit``) where they apply; w_hh is then packed for them


def _cell(t: Mapping[str, Any], b: Bound, d: _Dims, ld: int, dr: int, inputs: int,
          blas_cores: int) -> tuple[_Cell, np.ndarray]:
    """The loop's form of layer-direction ``ld`` (direction ``dr``, ``inputs`` features in), and its input-side
    bias column; ``blas_cores``: the threads a GEMM of NumPy's step would run on."""
    specs = _specs(t, d, dr)
    scales = _scales(specs, d)
    slot_scale = dict(zip(_SLOT[d.op], scales))  # lstm's h (slot 2) reads the cell itself, never scaled
    acts = tuple(activation(spec, slot_scale.get(s, 1.0), _block(d)) for s, spec in enumerate(specs))
    clips = tuple(abs(k) * float(t["clip"]) for k in scales)
    h_bias, lbr = None, bool(t.get("linear_before_reset", True))
    if d.op == "gru":
        b_ih, b_hh = _internal(b.view("b_ih")[ld], d, scales), _internal(b.view("b_hh")[ld], d, scales)
        two = 2 * d.hidden
        if lbr:  # b_hn sits inside r⊙(W_hn·h + b_hn)
            b_ih[:two] += b_hh[:two]
            # added once per step: broadcast from its column for one step (a decode) or one batch row,
            # else spread over the batch once (a contiguous add per step is faster; the spread costs a step's add)
            once = d.batch == 1 or d.seq == 1
            h_bias = b_hh[two:] if once else np.ascontiguousarray(np.broadcast_to(b_hh[two:], (d.hidden, d.batch)))
        else:
            b_ih += b_hh
        x_bias = b_ih
    else:
        x_bias = _internal(b.view("bias")[ld], d, scales)
    peepholes = None
    if t.get("peepholes") is not None:
        p = b.view("peepholes")[ld].astype(d.compute).reshape(3, d.hidden, 1)  # ONNX order i, o, f
        k = scales[0]  # i f o: the rows of slot f
        peepholes = (k * p[0], k * p[2], k * p[1])
    w_hr = None
    if t.get("w_hr") is not None:
        w_hr = b.view("w_hr")[ld]
        w_hr = w_hr if w_hr.dtype == d.compute else w_hr.astype(d.compute)
    compiled = None
    step_flops = 2 * d.gates * d.hidden * (d.width + inputs) * d.batch
    if (d.op == "lstm" and not d.stored and d.compute == np.float32 and d.batch >= _COMPILED_MIN_BATCH
            and (blas_cores == 1 or (d.batch >= _COMPILED_SHARED_MIN_BATCH
                                     and step_flops * blas_cores <= 2 * _COMPILED_SHARED_STEP_FLOPS))
            and peepholes is None and [spec[0] for spec in specs] == ["sigmoid", "tanh", "tanh"]):
        kernels = [jit.kernel(name) for name in _Compiled._fields[:-1]]  # all but lanes
        compiled = None if None in kernels else _Compiled(*kernels, jit.lanes())
    w_hh = b.view("w_hh")[ld]
    w_hh = _internal(w_hh, d, scales) if compiled is None else compiled.pack(w_hh, scales)
    return _Cell(w_hh, h_bias, acts, clips, peepholes, bool(t.get("input_forget", False)), w_hr,
                 lbr, compiled), x_bias


# --- one layer-direction's time loop -----------------------------------------------------------------
# Every array is feature-major [features, columns]. ``steps`` yields (xp, h, y, n, at): xp is W_ih·x_t plus
# the input-side bias for the n running rows (for the compiled lstm step, x_t itself), h their state, y the
# slot where h_t lands; ``at`` is where y lies, (the output chunk, the step's first column in it): what the
# compiled step writes through, since it vectorizes over rows of a C-contiguous array.


class _Spaces(dict):
    """Per-step work arrays by running rows ``n``: views of shared flat buffers, made once per ``n``."""

    def __init__(self, make: Callable[[int], Any]):
        super().__init__()
        self._make = make

    def __missing__(self, n: int) -> Any:
        made = self[n] = self._make(n)
        return made


def _blocks(flat: np.ndarray, n: int, rows: int) -> np.ndarray:
    return flat[: rows * n].reshape(rows, n)


@dataclass
class _LstmSpace:
    g: np.ndarray
    i: np.ndarray
    f: np.ndarray
    o: np.ndarray
    gg: np.ndarray
    early: list  # (rows, scratch) activated by slot f before the cell update
    late: bool  # o activated after the cell update (it peeks at the new cell)
    fused: bool  # i f o hold -z and g -2z, all activated before the cell update: one exp pass for the four
    clip_early: list  # (rows, bound) clipped before the activations
    c: np.ndarray
    tmp: np.ndarray
    scratch: np.ndarray
    o_scratch: np.ndarray
    g_scratch: np.ndarray


def _lstm_spaces(cell: _Cell, d: _Dims, c: np.ndarray) -> _Spaces:
    H, B = d.hidden, d.batch
    g_flat, s_flat = np.empty(4 * H * B, d.compute), np.empty(4 * H * B, d.compute)
    tmp_flat = np.empty(H * B, d.compute)
    late = cell.peepholes is not None
    fused = not late and cell.acts[0] is sigmoid_of_negated and cell.acts[1] is tanh_of_scaled
    clip_f, clip_g = cell.clips[0], cell.clips[-1]  # slot f's gates, slot g's (internal order; all alike when stored)

    def make(n: int) -> _LstmSpace:
        g, scratch = _blocks(g_flat, n, 4 * H), _blocks(s_flat, n, 4 * H)
        if d.stored:  # ABI order i f g o
            i, f, gg, o = g[:H], g[H: 2 * H], g[2 * H: 3 * H], g[3 * H:]
            early = [(g[: 2 * H], scratch[: 2 * H])] + ([] if late else [(o, scratch[3 * H:])])
        else:
            i, f, o, gg = g[:H], g[H: 2 * H], g[2 * H: 3 * H], g[3 * H:]
            early = [(g[: 2 * H], scratch[: 2 * H])] if late else [(g[: 3 * H], scratch[: 3 * H])]
        if late:
            clip_early = [(g[: 2 * H], clip_f), (gg, clip_g)]
        else:
            clip_early = [(g, clip_f)] if clip_f == clip_g else [(g[: 3 * H], clip_f), (gg, clip_g)]
        return _LstmSpace(g, i, f, o, gg, early, late, fused, clip_early, c[:, :n], _blocks(tmp_flat, n, H),
                          scratch[:H], scratch[H: 2 * H], scratch[2 * H: 3 * H])
    return _Spaces(make)


def _lstm_loop(cell: _Cell, steps, spaces: _Spaces) -> None:
    act_f, act_g, act_h = cell.acts
    w_hh, clip, peep, w_hr, coupled = cell.w_hh, cell.clips[0], cell.peepholes, cell.w_hr, cell.input_forget
    H = w_hh.shape[0] // 4
    for xp, h, y, n, _ in steps:
        s = spaces[n]
        c, tmp = s.c, s.tmp
        np.matmul(w_hh, h, out=s.g)
        s.g += xp
        if peep is not None:  # i and f peek at the previous cell
            np.multiply(c, peep[0], out=tmp)
            s.i += tmp
            if not coupled:
                np.multiply(c, peep[1], out=tmp)
                s.f += tmp
        if clip:
            for rows, bound in s.clip_early:
                np.clip(rows, -bound, bound, out=rows)
        if s.fused:
            sigmoid_then_tanh_of_scaled(s.g, 3 * H)
        else:
            for rows, scratch in s.early:
                act_f(rows, rows, scratch)
            act_g(s.gg, s.gg, s.g_scratch)
        if coupled:  # f = 1 - i: c' = c + i⊙(g - c)
            np.subtract(s.gg, c, out=tmp)
            tmp *= s.i
            c += tmp
        else:
            c *= s.f
            np.multiply(s.i, s.gg, out=tmp)
            c += tmp
        if s.late:  # o peeks at the new cell
            np.multiply(c, peep[2], out=tmp)
            s.o += tmp
            if clip:
                np.clip(s.o, -clip, clip, out=s.o)
            act_f(s.o, s.o, s.o_scratch)
        act_h(c, tmp, s.scratch)
        if w_hr is None:
            np.multiply(s.o, tmp, out=y)
        else:
            tmp *= s.o
            np.matmul(w_hr, tmp, out=y)


def _lstm_compiled_loop(cell: _Cell, w_ih: np.ndarray, steps, d: _Dims, bias: np.ndarray, c: np.ndarray) -> None:
    """``_lstm_loop`` as one Numba kernel a step (``jit``): ``W_hh·h + W_ih·x_t + bias`` over the weights packed
    once for the call (``cell.w_hh`` and ``w_ih``, by ``_Compiled.pack``), and everything after it. ``steps``
    yield ``x_t`` itself (not its projection), ``bias [4H]`` is the input-side bias, ``c [H, batch]`` the cell."""
    kernels, w_hh, w_hr = cell.compiled, cell.w_hh, cell.w_hr
    step, bias = kernels.lstm_step, kernels.lstm_panel_bias(bias, kernels.lanes)
    tmp_flat = np.empty(d.hidden * d.batch, d.compute)  # o·tanh(c) before w_hr
    clip_ifo, clip_g = (np.float32(bound or np.inf) for bound in (cell.clips[0], cell.clips[-1]))  # inf: no clip
    g_scale = np.float32(1.0 if cell.acts[1] is tanh_of_scaled else -2.0)  # g's rows at -2z, or at z (narrow blocks)
    coupled = cell.input_forget
    for x, h, y, n, (out, col) in steps:
        if w_hr is None:
            step(w_hh, h, w_ih, x, bias, c, out, col, clip_ifo, clip_g, g_scale, coupled)
        else:
            tmp = _blocks(tmp_flat, n, d.hidden)
            step(w_hh, h, w_ih, x, bias, c, tmp, 0, clip_ifo, clip_g, g_scale, coupled)
            np.matmul(w_hr, tmp, out=y)


@dataclass
class _GruSpace:
    g: np.ndarray
    rz: np.ndarray
    r: np.ndarray
    z: np.ndarray
    n: np.ndarray
    h_bias: np.ndarray | None
    tmp: np.ndarray
    rz_scratch: np.ndarray
    n_scratch: np.ndarray


def _gru_spaces(cell: _Cell, d: _Dims, c: None) -> _Spaces:
    H, B = d.hidden, d.batch
    g_flat, s_flat, tmp_flat = np.empty(3 * H * B, d.compute), np.empty(3 * H * B, d.compute), np.empty(H * B, d.compute)

    def make(n: int) -> _GruSpace:
        g, scratch = _blocks(g_flat, n, 3 * H), _blocks(s_flat, n, 3 * H)
        hb = cell.h_bias
        if hb is not None and hb.shape[1] > 1:
            hb = hb[:, :n]
        return _GruSpace(g, g[: 2 * H], g[:H], g[H: 2 * H], g[2 * H:], hb, _blocks(tmp_flat, n, H),
                         scratch[: 2 * H], scratch[2 * H:])
    return _Spaces(make)


def _gru_loop(cell: _Cell, steps, spaces: _Spaces) -> None:
    act_f, act_g = cell.acts
    H = cell.w_hh.shape[0] // 3
    w_hh, w_rz, w_n = cell.w_hh, cell.w_hh[: 2 * H], cell.w_hh[2 * H:]
    clip, clip_n = cell.clips[0], cell.clips[2]
    lbr = cell.linear_before_reset
    for xp, h, y, n, _ in steps:
        s = spaces[n]
        rz, cand, tmp = s.rz, s.n, s.tmp
        np.matmul(w_hh if lbr else w_rz, h, out=s.g if lbr else rz)
        rz += xp[: 2 * H]
        if clip:
            np.clip(rz, -clip, clip, out=rz)
        act_f(rz, rz, s.rz_scratch)
        if lbr:  # n = g(W_in·x + b_in + r⊙(W_hn·h + b_hn))
            cand += s.h_bias
            cand *= s.r
        else:  # n = g(W_in·x + b_in + W_hn·(r⊙h) + b_hn), b_hn among the input-side biases
            np.multiply(s.r, h, out=tmp)
            np.matmul(w_n, tmp, out=cand)
        cand += xp[2 * H:]
        if clip:
            np.clip(cand, -clip_n, clip_n, out=cand)
        act_g(cand, cand, s.n_scratch)
        np.subtract(h, cand, out=tmp)  # h' = (1-z)⊙n + z⊙h = n + z⊙(h-n)
        tmp *= s.z
        np.add(cand, tmp, out=y)


@dataclass
class _RnnSpace:
    g: np.ndarray
    scratch: np.ndarray


def _rnn_spaces(cell: _Cell, d: _Dims, c: None) -> _Spaces:
    H, B = d.hidden, d.batch
    g_flat, s_flat = np.empty(H * B, d.compute), np.empty(H * B, d.compute)
    return _Spaces(lambda n: _RnnSpace(_blocks(g_flat, n, H), _blocks(s_flat, n, H)))


def _rnn_loop(cell: _Cell, steps, spaces: _Spaces) -> None:
    (act,) = cell.acts
    w_hh, clip = cell.w_hh, cell.clips[0]
    for xp, h, y, n, _ in steps:
        s = spaces[n]
        np.matmul(w_hh, h, out=s.g)
        s.g += xp
        if clip:
            np.clip(s.g, -clip, clip, out=s.g)
        act(s.g, y, s.scratch)


_LOOPS: dict[str, tuple[Callable, Callable]] = {"lstm": (_lstm_spaces, _lstm_loop), "gru": (_gru_spaces, _gru_loop),
                                                "rnn": (_rnn_spaces, _rnn_loop)}


def _projection(w_ih: np.ndarray, bias: np.ndarray, xs: Sequence[np.ndarray], pack: _Packing,
                d: _Dims) -> Callable[[int], np.ndarray]:
    """``source(k)``: chunk ``k``'s input projection plus ``bias``, into a buffer the chunks share."""
    # spread once, added per chunk (one chunk: the broadcast add is cheaper)
    if pack.widest > 1 and len(pack.chunks) > 1:
        bias = np.ascontiguousarray(np.broadcast_to(bias, (bias.shape[0], pack.widest)))
    buf = np.empty(w_ih.shape[0] * pack.widest, d.compute)

    def source(k: int) -> np.ndarray:
        proj = _blocks(buf, pack.chunks[k].columns, w_ih.shape[0])
        np.matmul(w_ih, xs[k], out=proj)
        proj += bias if bias.shape[1] == 1 else bias[:, : proj.shape[1]]
        return proj
    return source


def _steps(source: Callable[[int], np.ndarray], out: Sequence[np.ndarray], pack: _Packing, backwards: bool,
           state: np.ndarray) -> Iterator[tuple]:
    """Take each time chunk's per-step block from ``source`` (its input projection, or its input) just before
    its steps, so they read it from cache; hand each step the state of its running rows.

    A step's state is the previous step's output while no row joins (its first ``n`` columns: the
    rows still running are a prefix); ``state`` ``[width, batch]`` holds the initial state of the rows
    that have not run yet, receives each row's state as it stops, and ends as every row's final state.
    """
    prev, prev_n = None, 0
    for k in reversed(range(len(pack.chunks))) if backwards else range(len(pack.chunks)):
        block, chunk = source(k), pack.chunks[k]
        for first, n in reversed(chunk.steps) if backwards else chunk.steps:
            if prev is None:
                h = state[:, :n]
            elif n <= prev_n:
                if n < prev_n:  # rows n.. stopped at the previous step
                    state[:, n:prev_n] = prev[:, n:]
                h = prev[:, :n]
            else:  # rows prev_n.. join from their initial state
                state[:, :prev_n] = prev
                h = state[:, :n]
            y = out[k][:, first: first + n]
            yield block[:, first: first + n], h, y, n, (out[k], first)
            prev, prev_n = y, n
    if prev is not None:
        state[:, :prev_n] = prev


def _layer_direction(t, b: Bound, d: _Dims, layer: int, dr: int, w_ih: np.ndarray, xs, ys, pack: _Packing,
                     blas_cores: int):
    """Run direction ``dr`` of ``layer``: ``w_ih`` its stored ``[G*H, in]`` block, ``xs`` the layer's input
    chunks ``[in, columns]``; write this direction's rows of the output chunks ``ys`` and its final state.
    ``blas_cores``: the threads each GEMM runs on (1 where the directions run in two threads)."""
    ld, W = layer * d.dirs + dr, d.width
    cell, x_bias = _cell(t, b, d, ld, dr, w_ih.shape[1], blas_cores)
    scales = _scales(_specs(t, d, dr), d)
    w_ih = _internal(w_ih, d, scales) if cell.compiled is None else cell.compiled.pack(w_ih, scales)
    out = [y[dr * W: dr * W + W] for y in ys]
    carry = t["carry"]

    def state(field: str, rows: int) -> np.ndarray:  # always a private copy: the loop updates it in place
        if not carry:
            return np.zeros((rows, d.batch), d.compute)
        held = b.view(field)[ld]
        return np.array((held if pack.order is None else held[pack.order]).T, d.compute, order="C")

    h, c = state("h0", W), state("c0", d.hidden) if d.op == "lstm" else None
    make_spaces, loop = _LOOPS[d.op]
    backwards = dr == 1 or bool(t.get("reverse"))
    with np.errstate(over="ignore"):  # exp(-z) overflows to inf for z < -88 (f32): σ(z) is then 0
        if cell.compiled is None:
            steps = _steps(_projection(w_ih, x_bias, xs, pack, d), out, pack, backwards, h)
            loop(cell, steps, make_spaces(cell, d, c))
        else:
            steps = _steps(xs.__getitem__, out, pack, backwards, h)  # the step reads x_t in place
            _lstm_compiled_loop(cell, w_ih, steps, d, x_bias.ravel(), c)
    if carry:  # the final state, in place
        for field, final in (("h0", h), ("c0", c)):
            if final is not None:
                if pack.order is None:
                    b.view(field)[ld] = final.T
                else:
                    b.view(field)[ld][pack.order] = final.T


def _specs(t: Mapping[str, Any], d: _Dims, dr: int) -> Sequence[Sequence[Any]]:
    """The ``[name, alpha, beta]`` of each activation slot of direction ``dr``."""
    slots = ACTIVATION_SLOTS[d.op]
    return t["activations"][dr * slots: (dr + 1) * slots]


def _block(d: _Dims) -> int:
    """Elements of a step's activation block as the exp route counts them (``activations.stored_scale``).
    An rnn's activation writes straight into the layer's output slot, strided, where NumPy's one
    ``tanh`` pass beats the route's four (rnn B=32 H=256: 8% slower through exp), so there it is 0."""
    return 0 if d.op == "rnn" else d.hidden * d.batch


def _scales(specs: Sequence[Sequence[Any]], d: _Dims) -> list[float]:
    """The factor each internal gate's rows are stored at (``activations.stored_scale``; 1 in decode)."""
    return [1.0 if d.stored else stored_scale(specs[s][0], _block(d)) for s in _SLOT[d.op]]


def _zero_padding(b: Bound, pack: _Packing) -> None:
    """dst is 0 where a row has no step (past its length)."""
    if pack.order is not None:
        dst = b.view("dst")
        for row, length in enumerate(pack.lengths.tolist()):
            dst[row, length:] = 0


def _store_dst(b: Bound, d: _Dims, pack: _Packing, ys: Sequence[np.ndarray], dr: int) -> None:
    """Direction ``dr``'s features of dst ``[B, S, dirs*width]`` from the top layer's chunks (each direction's
    thread stores its own as it finishes: the transposing copy takes ~2% of a B=32 H=256 lstm)."""
    dst, rows = b.view("dst"), slice(dr * d.width, (dr + 1) * d.width)
    if pack.order is None:
        for chunk, y in zip(pack.chunks, ys):
            steps = len(chunk.steps)
            dst[:, chunk.t0: chunk.t0 + steps, rows] = y[rows].reshape(-1, steps, d.batch).transpose(2, 1, 0)
        return
    flat = dst.reshape(d.batch * d.seq, -1)
    for chunk, y in zip(pack.chunks, ys):
        flat[pack.index[chunk.first: chunk.first + chunk.columns], rows] = y[rows].T


def _lstm_sequences(t: Mapping[str, Any], d: _Dims, b: Bound, layers) -> None:
    """Every layer-direction of an lstm that ``lstm_sequence`` covers as one compiled call, batch-major and
    time-major (``[S, B, features]``): its input projection plus bias one GEMM, then the kernel's steps."""
    S, B, H = d.seq, d.batch, d.hidden
    lens = lstm_sequence.lengths(b.view("seq_lens") if t.get("seq_lens") is not None else None)
    x = b.load("x").transpose(1, 0, 2)
    w_ih = b.load("w_ih")
    out = np.empty((S, B, H), np.float32)
    for layer, in_l, spans in layers:
        y = np.empty((S, B, d.dirs * H), np.float32)
        rows = np.ascontiguousarray(x).reshape(S * B, in_l)
        for dr, (lo, hi) in enumerate(spans):
            ld = layer * d.dirs + dr
            u = (rows @ w_ih[lo:hi].reshape(4 * H, in_l).T).reshape(S, B, 4 * H)
            u += b.load("bias", ld)
            h, c = (b.load(f, ld) if t["carry"] else np.zeros((B, H), np.float32) for f in ("h0", "c0"))
            lstm_sequence.forward(u, b.load("w_hh", ld), h, c, lens, dr == 1 or bool(t.get("reverse")), out)
            y[..., dr * H: (dr + 1) * H] = out
            if t["carry"]:  # the final state, in place
                b.store("h0", h, ld)
                b.store("c0", c, ld)
        x = y
    b.store("dst", x.transpose(1, 0, 2))


def working_bytes(t: Mapping[str, Any]) -> int:
    """A lower bound of the bytes a run of ``t`` allocates besides the arena: with every row running
    every step, layer 0's time-major input and two layers' outputs (one for a single layer). The
    packing ``prepare`` builds first takes time and memory in proportion to ``seq``, so a runtime
    compares this with the machine's memory before preparing. 0 with ``seq_lens`` (rows may not run)."""
    t = complete(t)
    if t.get("seq_lens") is not None or 0 in (t["batch"], t["seq"], t["hidden"]):
        return 0
    d = _dims(t)
    per_column = t["input_size"] + min(d.layers, 2) * d.dirs * d.width
    return d.batch * d.seq * per_column * np.dtype(d.compute).itemsize


def prepare(t: Mapping[str, Any]) -> Callable[..., None]:
    """Do the work that depends only on the thunk once (sizes, regions, the layer split); returns
    ``run(arena, *, parallel_directions=None)`` for any arena. A decode step (lstm B=1 H=256) spends
    more time on this setup than on its math, so a runtime that runs a thunk many times keeps ``run``.

    A raw thunk is completed here (version-2 fields absent: their defaults). ``parallel_directions``: ``None`` lets
    the kernel choose (see the module docstring), ``True``/``False`` forces two threads or one."""
    if 0 in (t["batch"], t["seq"], t["hidden"]):
        return lambda arena, **_: None  # nothing to compute; a carried state is its own final state
    t = complete(t)  # a plain dict (read dozens of times a call: the fastest mapping) with every field
    d = _dims(t)
    by_field = {r.field: r for r in regions(t)}
    B, S = d.batch, d.seq
    layers, offset = [], 0
    for layer in range(d.layers):
        in_l = t["input_size"] if layer == 0 else d.dirs * d.width
        size = d.gates * d.hidden * in_l
        layers.append((layer, in_l, [(offset + k * size, offset + (k + 1) * size) for k in range(d.dirs)]))
        offset += d.dirs * size
    wide = 2 * d.gates * d.hidden * d.width * d.batch >= _PARALLEL_STEP_FLOPS
    full = _full_packing(B, S) if t.get("seq_lens") is None else None
    last: list[Bound] = []  # the last arena's views, reused while runs come on the same arena
    sequences = d.hidden <= _SEQUENCE_UNITS_PER_STEP * S  # the whole-sequence kernel repays its copy of W_hh

    def run(arena: np.ndarray, *, parallel_directions: bool | None = None) -> None:
        if not last or last[0].arena is not arena:
            last[:] = [Bound(t, arena, by_field)]
        b = last[0]
        # not with parallel_directions=True, which asks for the directions in two threads
        if sequences and not parallel_directions and lstm_sequence.applies(t):
            _lstm_sequences(t, d, b, layers)
            return
        pack = full or _varlen_packing(b.view("seq_lens").astype(np.int64), S)
        if pack.order is None:  # layer 0's input, time-major: chunk k is rows first..first+columns, transposed
            x = np.empty((S, B, t["input_size"]), d.compute)
            x[...] = b.view("x").transpose(1, 0, 2)
            x = x.reshape(S * B, -1)
        else:
            x = b.view("x").reshape(B * S, -1)[pack.index].astype(d.compute, copy=False)
        xs = [x[c.first: c.first + c.columns].T for c in pack.chunks]
        w_ih = b.view("w_ih")
        blas_cores = threads.cores()
        parallel = d.dirs == 2 and (parallel_directions if parallel_directions is not None else
                                     wide and blas_cores == 2)
        rows = d.dirs * d.width
        _zero_padding(b, pack)
        for layer, in_l, spans in layers:
            blocks = [w_ih[lo:hi].reshape(-1, in_l) for lo, hi in spans]
            y = np.empty(rows * pack.columns, d.compute)
            ys = [y[rows * c.first: rows * (c.first + c.columns)].reshape(rows, c.columns) for c in pack.chunks]

            def direction(dr: int, layer=layer, blocks=blocks, xs=xs, ys=ys) -> None:
                _layer_direction(t, b, d, layer, dr, blocks[dr], xs, ys, pack, 1 if parallel else blas_cores)
                if layer == d.layers - 1:  # dst overlaps no other range (ABI.md §1): stored as each direction ends
                    _store_dst(b, d, pack, ys, dr)
            jobs = [partial(direction, dr) for dr in range(d.dirs)]
            if parallel:
                threads.run_all(jobs)
            else:
                for job in jobs:
                    job()
            xs = ys
    return run


def _run(t: Mapping[str, Any], arena: np.ndarray, *, parallel_directions: bool | None = None) -> None:
    """Run one lstm/gru/rnn thunk in place (``prepare`` says what ``parallel_directions`` does)."""
    prepare(t)(arena, parallel_directions=parallel_directions)


KERNELS.add(("lstm", "gru", "rnn"), _run)
PREPARE.add(("lstm", "gru", "rnn"), prepare)
WORKING.add(("lstm", "gru", "rnn"), working_bytes)
