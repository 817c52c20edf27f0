"""Host kernels for ``lstm``, ``gru`` and ``rnn`` (ABI.md §3, and §8's version-2 fields): multi-layer,
bidirectional, carried state, sequence lengths, clipping, any activations, both GRU forms, LSTM
peepholes, coupled input-forget gates and projections.

How a layer-direction runs, and why (``python benchmarks/rnn.py`` times each choice beside its
alternative and beside torch):

- Feature-major inside: the state is ``h^T [width, batch]`` and a step is ``W_hh · h^T``, the GEMM
  orientation OpenBLAS runs fastest at small batches.
- Time in chunks of about ``rnn_packing._CHUNK_COLUMNS`` columns (a column is one row of the batch at one
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
  peepholes and a batch of at least ``rnn_cell._COMPILED_MIN_BATCH`` runs each step as one compiled kernel
  (``jit``, ``rnn_loops._lstm_compiled_loop``): ``W_hh·h + W_ih·x_t`` in register tiles over the weights packed
  once per call, in vectors as wide as the CPU's (``jit.lanes``: 16 float32 lanes with AVX-512, else 8;
  no projection chunks: the steps read their input columns in place), then the gates,
  clip, the cell and ``o·tanh(c)`` into its slot, where the NumPy loop below runs two OpenBLAS GEMMs
  and ~15 array passes. It runs on one core, so where a direction's GEMMs would get several (one
  direction at a time on a multi-thread BLAS) it takes only the steps it still runs faster
  (``rnn_cell._COMPILED_SHARED_MIN_BATCH``, ``_COMPILED_SHARED_STEP_FLOPS``).
  The NumPy loop is the same recurrence and stays the path everywhere else, and with ``RLX_HOST_JIT=0``.
- A small lstm that the whole-sequence kernels cover (``lstm_sequence``: those gates, no clip, peepholes,
  projection or coupled gates, ``batch·hidden²`` and ``hidden`` within its bounds) runs each layer-direction as
  one compiled call instead, batch-major (``_sequences``), where a call a step and the Python around it
  were most of the time (B=8 S=24 H=32, 2 layers: 0.29 ms to 0.12); a decode call of several rows, whose few
  steps do not repay the kernel's copy of ``W_hh`` (``_SEQUENCE_UNITS_PER_STEP``), keeps the routes below, while
  one of a single row, which copies none, takes the kernel up to ``lstm_sequence.MAX_ROW_HIDDEN``. So does a gru
  (``linear_before_reset``) or rnn that ``rnn_sequence`` covers, of at least ``_SEQUENCE_MIN_BATCH`` rows (or one
  row within the same bound), where NumPy's loop below makes 10-20 array passes a step around its GEMM (gru B32
  S128 I=H=256, 2 layers, bidirectional, one thread: 146 ms to 116).
- Activations are NumPy functions chosen once per layer-direction (``activations.activation``), each writing
  ``out = act(x)`` over whole gate blocks; the loops branch per step on the fields a thunk uses
  (peepholes, clip), never per element.
- Short sequences (decode, ``seq <= rnn_packing._STORED_MAX_SEQ``) in f32/f64 use the weights where they are
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

The parts: ``rnn_packing`` (a thunk's sizes and its packing), ``rnn_cell`` (a layer-direction's weights in its
loop's form), ``rnn_loops`` (a layer-direction's time loop); this module runs a thunk's layers.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from . import gemm, lstm_sequence, rnn_backward, rnn_sequence, threads
from .abi import complete, regions
from .bound import Bound
from .implementations import GIVEN, GIVEN_OUTPUTS, KERNELS, PREPARE, WORKING
from .rnn_loops import _layer_direction
from .rnn_packing import _Dims, _dims, _full_packing, _Packing, _varlen_packing

#: Smallest recurrent GEMM (flops a step) at which two threads pay: below it the threads mostly trade
#: the GIL (lstm B=32 H=64, 1 MFLOP: 14.4 ms in two threads vs 11.7 in one; B=64 H=64, 2 MFLOP:
#: 18 vs 21; rnn B=16 H=256, 2 MFLOP: 13 vs 18).
_PARALLEL_STEP_FLOPS = 2_000_000
#: The whole-sequence lstm kernel (``lstm_sequence``) copies W_hh once a call (4H² values; at a batch of more than one
#: row: ``lstm_sequence.copies_w_hh``), which a short call's
#: steps repay only where H is at most this many units a step of the call. One thread, a Zen 5, µs a call, the
#: per-step route / the kernel: S1 B1 H32 37 / 22, S1 B8 H64 50 / 40, S1 B1 H128 45 / 86, S2 B1 H128 66 / 101,
#: S2 B1 H64 52 / 39, S4 B1 H128 95-117 / 110-131, S4 B2 H128 143 / 119, S8 B1 H128 189 / 135.
_SEQUENCE_UNITS_PER_STEP = 32
#: The fewest rows a gru or rnn runs through the whole-sequence kernels (``rnn_sequence``): a tile takes 8 (or 6)
#: rows at a time, so a smaller batch leaves rows idle. 2 layers, bidirectional, one thread, an Intel Xeon (AVX-512),
#: ms a call, NumPy's loop / the kernels: gru B32 S128 H256 146 / 116, B8 S64 H128 7.8 / 4.2, B4 S64 H128 5.4 / 2.8,
#: B2 S32 H256 5.1 / 5.0, B1 S16 H256 2.1 / 3.3; rnn B32 S128 H256 48 / 41, B4 S64 H128 2.0 / 1.0, B1 S16 H256
#: 0.64 / 1.07.
_SEQUENCE_MIN_BATCH = 4


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


def _sequences(t: Mapping[str, Any], d: _Dims, b: Bound, layers, parallel: bool) -> None:
    """Every layer-direction of an lstm that ``lstm_sequence`` covers, or of a gru or rnn that ``rnn_sequence``
    covers, as one compiled call, batch-major and time-major (``[S, B, features]``): its input projection plus
    bias one GEMM, then the kernel's steps. A layer's directions run in two threads where ``parallel``, else one
    after the other; either way each on a one-thread BLAS (a second BLAS thread would spin beside the kernel: a
    gru's CPU time at B32 S128 H256 was 1.6x its one-thread figure). Stored in f32, the carried states are
    updated where they lie and a batch of one row's top layer is written into dst itself (``_output``), one
    direction's kernel writing its layer's output: a decode step copies none of them."""
    S, B, H, op = d.seq, d.batch, d.hidden, t["op"]
    lens = lstm_sequence.lengths(b.view("seq_lens") if t.get("seq_lens") is not None else None)
    x = b.read("x").transpose(1, 0, 2)
    w_ih = b.read("w_ih")
    states = ("h0", "c0") if op == "lstm" else ("h0",)
    for layer, in_l, spans in layers:
        y, in_dst = _output(d, b, layer == len(layers) - 1)
        rows = np.ascontiguousarray(x).reshape(S * B, in_l)

        def direction(dr: int, layer: int = layer, in_l: int = in_l, spans=spans, y: np.ndarray = y,
                      rows: np.ndarray = rows) -> None:
            lo, hi = spans[dr]
            ld = layer * d.dirs + dr
            u = gemm.times(rows, w_ih[lo:hi].reshape(d.gates * H, in_l).T).reshape(S, B, d.gates * H)
            u += b.read("b_ih" if op == "gru" else "bias", ld)
            carried = [_state(b, f, ld, t["carry"], (B, H)) for f in states]  # (array, whether it is the arena's)
            h, *c = (state for state, _ in carried)
            backwards, out = dr == 1 or bool(t.get("reverse")), y if d.dirs == 1 else np.empty((S, B, H), np.float32)
            if op == "lstm":
                lstm_sequence.forward(u, b.read("w_hh", ld), h, c[0], lens, backwards, out)
            else:
                rnn_sequence.forward(op, u, b.read("w_hh", ld), b.read("b_hh", ld) if op == "gru" else None, h, lens,
                                     backwards, out)
            if d.dirs > 1:
                y[..., dr * H: (dr + 1) * H] = out
            if t["carry"]:  # the final state, in place
                for f, (final, in_arena) in zip(states, carried):
                    if not in_arena:
                        b.store(f, final, ld)
        jobs = [partial(direction, dr) for dr in range(d.dirs)]
        if parallel:
            threads.run_all(jobs)
        else:
            with threads.single_threaded_blas():
                for job in jobs:
                    job()
        x = y
    if not in_dst:
        b.store("dst", x.transpose(1, 0, 2))


def _state(b: Bound, field: str, ld: int, carry: bool, shape: tuple[int, int]) -> tuple[np.ndarray, bool]:
    """Layer-direction ``ld``'s entering state ``field`` as a kernel updating it in place takes it, and whether
    that is the arena's own memory (stored in f32: nothing to store back): zeros without ``carry``, else its
    arena view or, in 16-bit storage, a copy in f32."""
    if not carry:
        return np.zeros(shape, np.float32), False
    held = b.in_place(field, ld)
    return (held, True) if held is not None else (b.load(field, ld), False)


def _output(d: _Dims, b: Bound, top: bool) -> tuple[np.ndarray, bool]:
    """A layer's output ``y [S, B, dirs*H]`` for ``_sequences``, and whether it is dst's own memory: the ``top``
    layer's of a batch of one row stored in f32, where dst ``[B, S, dirs*H]`` read time-major is contiguous."""
    dst = b.in_place("dst") if top and d.batch == 1 else None
    if dst is None:
        return np.empty((d.seq, d.batch, d.dirs * d.hidden), np.float32), False
    return dst.transpose(1, 0, 2), True


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
    if t["reserve"] is not None:  # a training forward (ABI.md §9.1): the backward's recurrences, which keep
        saving = rnn_backward.forward_saving(t)  # what the reserve holds; the caller's arrays taken (GIVEN)
        return lambda arena, given=None, **_: saving(arena, given)
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
    # the whole-sequence kernel repays its copy of W_hh, or (one row) copies none
    sequences = d.hidden <= _SEQUENCE_UNITS_PER_STEP * S or not lstm_sequence.copies_w_hh(B)
    # a gru's or rnn's (``rnn_sequence``): rows enough for the tiles, or one row within the bound of one's
    compiled_steps = (B >= _SEQUENCE_MIN_BATCH or not lstm_sequence.copies_w_hh(B)
                      and d.hidden <= lstm_sequence.MAX_ROW_HIDDEN) and rnn_sequence.applies(t)

    def run(arena: np.ndarray, *, parallel_directions: bool | None = None, given: Any = None) -> bool | None:
        if given is not None:  # only a forward writing a reserve runs on the caller's arrays (GIVEN)
            return False
        if not last or last[0].arena is not arena:
            last[:] = [Bound(t, arena, by_field)]
        b = last[0]
        # not with parallel_directions=True, which asks for the directions in two threads
        if sequences and not parallel_directions and (lstm_sequence.applies(t) or compiled_steps):
            _sequences(t, d, b, layers, d.dirs == 2 and wide and threads.cores() == 2)
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
GIVEN.update(("lstm", "gru", "rnn"))
GIVEN_OUTPUTS.update(("lstm", "gru", "rnn"))  # with a reserve: dst and the reserve written into the caller's arrays
WORKING.add(("lstm", "gru", "rnn"), working_bytes)
