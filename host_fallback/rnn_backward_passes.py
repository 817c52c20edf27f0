"""The two passes of a recurrent backward thunk (``rnn_backward``) over chunks of steps: the forward bottom up,
then backpropagation through time top down.

A layer-direction's steps are cut into chunks of about ``sqrt(seq)`` consecutive steps (``chunk_steps``,
``time_chunks``), which each pass walks in the direction's order (the reverse pass in the opposite one), so a
layer-direction holds a chunk's gates and their gradients at a time, beside what the forward holds too (a
layer's input) and the input's gradient. Without a saved forward (ABI.md §9.1's ``reserve`` absent) the backward
checkpoints (where every row runs every step, through the plain forward's loops: ``rnn_backward_checkpoints``,
which keeps no chunk's gates): the forward pass keeps every layer's output but the top one's (the next layer's input) and the
state entering each chunk, and drops a chunk's gates once the next chunk has run; the reverse pass runs each
chunk's forward again from its state (``recomputed``; the last one walked is still kept) and backpropagates
through it: ``seq/K`` states and ``K`` steps of gates where every step's were held, at the price of a second
forward of every chunk. With a reserve the reverse pass reads each chunk's steps of it (``read_from``); a
forward writing a reserve runs the whole sequence as one chunk.

A gradient summed over the steps (``d_w_ih``, ``d_w_hh``, the biases, peepholes, ``w_hr``) adds the chunks'
sums in the reverse walk's order, fixed per thunk: a thunk gives the same bytes on every run.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Mapping

import numpy as np

from . import gemm, rnn_reserve
from .abi.rnn import output_width, recurrent_dims
from .arena import COMPUTE
from .rnn_backward_cell import _Cell
from .rnn_backward_setup import Setup, each_direction
from .rnn_backward_steps import _FROM_OUTPUT, _sum_outer, _times

Array = np.ndarray
#: The fewest steps a chunk holds (unless the sequence is shorter): each chunk costs a few GEMM calls of
#: ``K*batch`` rows, which shorter chunks would make too thin to run at the BLAS's speed.
MIN_CHUNK_STEPS = 16


def chunk_steps(seq: int) -> int:
    """K, the steps of a recompute's chunk: ``ceil(sqrt(seq))`` (the ``seq/K`` states and the ``K`` steps of
    gates a layer-direction holds are then about equal), at least ``MIN_CHUNK_STEPS``."""
    return max(MIN_CHUNK_STEPS, math.isqrt(max(seq, 1) - 1) + 1)


#: The fewest rows (steps x batch) of a chunk read from a reserve, which the GEMMs after the steps run over: the
#: whole sequence at B32 S128 I=H=256, as one chunk; a longer sequence takes several, so that the reverse pass
#: holds a chunk's gradients rather than the sequence's (gru B4 S4096 I=H=128, 2 layers, bidirectional: 2.03x
#: the forward's peak as one chunk).
RESERVE_CHUNK_ROWS = 4096


def reserve_chunk_steps(seq: int, batch: int) -> int:
    """The steps of a chunk read from a reserve: ``RESERVE_CHUNK_ROWS`` rows, at least ``chunk_steps``."""
    return max(chunk_steps(seq), -(-RESERVE_CHUNK_ROWS // max(batch, 1)))


#: The most rows (steps x batch) whose every step a backward without a reserve keeps at once, running the forward
#: that writes a reserve into arrays of its own rather than checkpointing: a reserve's worth of memory, as many rows
#: as a reserve's chunk (the whole sequence at B32 S128 I=H=256, 2 layers, bidirectional: the backward's own
#: forward and no rebuilt chunk, no checkpoint pass).
KEPT_WHOLE_ROWS = RESERVE_CHUNK_ROWS


def kept_whole(seq: int, batch: int) -> bool:
    """Whether a backward without a reserve keeps every step of a ``seq`` x ``batch`` thunk (``KEPT_WHOLE_ROWS``)."""
    return seq * batch <= KEPT_WHOLE_ROWS


def time_chunks(seq: int, steps: int) -> list[tuple[int, int]]:
    """``(t0, t1)`` of each chunk of ``steps`` steps in time order, the last one holding what is left."""
    return [(t0, min(t0 + steps, seq)) for t0 in range(0, seq, steps)]


def _walked(count: int, backwards: bool) -> range:
    """Indices of ``count`` chunks (or steps) in a walk's order."""
    return range(count - 1, -1, -1) if backwards else range(count)


@dataclass
class Direction:
    """Layer-direction ``ld`` (direction ``dr``): its cell, its block ``w [G*hidden, in_l]`` of ``w_ih`` (at
    ``lo:hi`` of the flat field), the input-side bias, the other weights, and whether it walks backwards."""

    ld: int
    dr: int
    cell: _Cell
    w: Array
    lo: int
    hi: int
    bias: Array
    weights: dict[str, Array]
    backwards: bool

    def projection(self, x: Array, into: Array | None = None) -> Array:
        """``x [n, batch, in_l]`` times ``w`` plus the bias: ``[n, batch, G*hidden]``, in ``into`` where given."""
        rows = x.shape[0] * x.shape[1]
        if into is None:
            xp = _times(x, self.w.T)
        else:
            xp = into
            gemm.times(x.reshape(rows, -1), self.w.T, out=xp.reshape(rows, -1))
        xp += self.bias
        return xp


def _direction(s: Setup, w_ih: Array, layer: int, dr: int) -> Direction:
    gates, dirs = recurrent_dims(s.fwd)
    lo, hi, in_l = s.spans[layer][dr]
    ld = layer * dirs + dr
    return Direction(ld, dr, s.cells[dr], w_ih[lo:hi].reshape(gates * s.fwd["hidden"], in_l), lo, hi,
                     s.b.load(s.biases[0], ld), s.weights(ld), s.backwards(dr))


def _layer_input(s: Setup, inputs: list[Array | None], layer: int, t0: int, t1: int) -> Array:
    """Steps ``t0:t1`` of layer ``layer``'s input, time-major in the compute type: ``x`` read from the arena
    for layer 0, the layer below's output (``inputs``) above it."""
    if layer:
        return inputs[layer][t0:t1]
    return np.ascontiguousarray(s.b.view("x")[:, t0:t1].transpose(1, 0, 2), COMPUTE[s.fwd["dtype"]])


def _valid_in(s: Setup, t0: int, t1: int) -> Array | None:
    return None if s.valid is None else s.valid[t0:t1]


def _zero_invalid(valid: Array | None, a: Array) -> Array:
    """``a`` with 0 at the steps past each row's length, in place."""
    if valid is not None:
        np.copyto(a, 0, where=~valid)
    return a


@dataclass
class Forward:
    """What the forward pass leaves: each layer's input and then the top layer's output where asked for
    (``inputs[l]``, time-major; None for layer 0, whose ``x`` is read from the arena, and for the top layer's
    output else), per layer-direction the state ``(h, c)`` entering each chunk (by chunk) and what its last
    chunk kept, and the final states by field."""

    inputs: list[Array | None]
    entries: list[list[tuple[Array, Array | None]]]
    kept: list[dict[str, Array]]
    finals: dict[str, Array]


def forward_pass(s: Setup, forwards: Callable, chunks: list[tuple[int, int]],
                 reserve: tuple[list[dict], list[Array]] | None = None, top: bool = False) -> Forward:
    """The forward, bottom up, chunk by chunk; with a ``reserve`` (``rnn_reserve.slots``, one chunk) the
    arrays kept and the layers' outputs are written in it; ``top``: keep the top layer's output too."""
    fwd = s.fwd
    _, dirs = recurrent_dims(fwd)
    layers, width, dt = len(s.spans), output_width(fwd), COMPUTE[fwd["dtype"]]
    shape = (fwd["seq"], fwd["batch"], dirs * width)
    w_ih = s.b.load("w_ih")
    inputs: list[Array | None] = [None]
    entries: list[list] = [[None] * len(chunks) for _ in range(layers * dirs)]
    kept: list[dict] = [{} for _ in range(layers * dirs)]
    finals = {f: np.empty_like(v) for f, v in s.init.items()} if s.init else {}
    for layer in range(layers):
        if layer + 1 < layers:
            out = reserve[1][layer] if reserve else np.empty(shape, dt)
        else:
            out = np.empty(shape, dt) if top else None

        def forward(dr: int, layer: int = layer, out: Array | None = out) -> None:
            d = _direction(s, w_ih, layer, dr)
            saved = reserve[0][d.ld] if reserve else None
            h, c = s.start(s.init, d.ld, width)
            for k in _walked(len(chunks), d.backwards):
                t0, t1 = chunks[k]
                entries[d.ld][k] = (h.copy(), None if c is None else c.copy())  # private: h may view a kept array
                into = {name: values[t0:t1] for name, values in saved.items()} if saved else None
                xp = d.projection(_layer_input(s, inputs, layer, t0, t1),
                                  into[rnn_reserve.projection_slot(fwd, d.cell)] if into else None)
                y, (h, c), kept[d.ld] = forwards(d.cell, xp, d.weights, h, c, _valid_in(s, t0, t1),
                                                 _walked(t1 - t0, d.backwards), into)
                if out is not None:
                    out[t0:t1, :, dr * width: (dr + 1) * width] = y
            for f, value in zip(finals, (h, c)):
                finals[f][d.ld] = value

        each_direction([partial(forward, dr) for dr in range(dirs)])
        inputs.append(out)
    return Forward(inputs, entries, kept, finals)


KeepOf = Callable[[Direction, int, Array], Mapping[str, Any]]


def _entering(out: Array, valid: Array | None, h0: Array, t0: int, t1: int, backwards: bool) -> Array:
    """``[t1-t0, batch, W]``: the state entering each step ``t0:t1`` of a direction whose outputs are ``out``
    (``[seq, batch, W]``, 0 past a row's length): the output of the step before it in the walk where that step is
    a valid one, else the initial state ``h0`` (a row's valid steps are a prefix, so this is its walk's first).
    Where every row runs every step and the chunk holds no walk's first step, a view of ``out`` one step over
    (which the reverse pass only reads): no copy of the layer's output (an rnn's recompute, B32 S128 H256:
    7 ms of its 240)."""
    step = 1 if backwards else -1
    if valid is None and 0 <= t0 + step and t1 + step <= out.shape[0]:
        return out[t0 + step: t1 + step]
    before = np.arange(t0, t1) + step
    at = np.clip(before, 0, out.shape[0] - 1)
    ok = ((before >= 0) & (before < out.shape[0]))[:, None, None]
    if valid is not None:
        ok = ok & valid[at]
    entering = out[at]
    np.copyto(entering, h0, where=~ok)
    return entering


def recomputed(s: Setup, forwards: Callable, chunks: list[tuple[int, int]], passed: Forward,
               at_once: Callable | None = None) -> KeepOf:
    """``keep(d, k, x)``: what chunk ``k`` of layer-direction ``d`` keeps (``x``: the chunk's input). The chunk the
    forward pass ran last, which the reverse pass takes first, as that pass kept it; the others run again
    from the state the forward pass saw entering the chunk: with ``at_once`` (``rnn_backward_steps._CHUNK``)
    their gates all at once from every step's entering state, which the layer's output (``passed.inputs``)
    gives (an rnn's read off that output where it can be: ``_FROM_OUTPUT``), else step by step."""
    width, (_, dirs) = output_width(s.fwd), recurrent_dims(s.fwd)

    def keep(d: Direction, k: int, x: Array) -> Mapping[str, Any]:
        if k == _walked(len(chunks), d.backwards)[-1] and passed.kept[d.ld]:
            kept, passed.kept[d.ld] = passed.kept[d.ld], {}
            return kept
        t0, t1 = chunks[k]
        h, c = passed.entries[d.ld][k]
        valid, order = _valid_in(s, t0, t1), _walked(t1 - t0, d.backwards)
        if at_once is None:
            return forwards(d.cell, d.projection(x), d.weights, h, c, valid, order)[2]
        layer, dr = divmod(d.ld, dirs)
        out = passed.inputs[layer + 1][..., dr * width: (dr + 1) * width]
        h_prev = _entering(out, s.valid, s.start(s.init, d.ld, width)[0], t0, t1, d.backwards)
        read_off = _FROM_OUTPUT.get(s.fwd["op"])
        kept = read_off(d.cell, h_prev, out[t0:t1]) if read_off else None
        if kept is not None:
            return kept
        return at_once(d.cell, d.projection(x), d.weights, h_prev, c, valid, order)
    return keep


def read_from(kept: list[Mapping[str, Array | None]], chunks: list[tuple[int, int]]) -> KeepOf:
    """``keep(d, k, x)``: chunk ``k``'s steps of what the whole sequence's forward ``kept`` (a reserve's views)."""
    def keep(d: Direction, k: int, x: Array) -> Mapping[str, Any]:
        t0, t1 = chunks[k]
        return {name: None if values is None else values[t0:t1] for name, values in kept[d.ld].items()}
    return keep


def _add(sums: dict[str, Array], chunk: Mapping[str, Array]) -> None:
    """Add a chunk's gradient sums into ``sums`` (the first chunk's are taken as they are)."""
    for f, g in chunk.items():
        if f in sums:
            sums[f] += g
        else:
            sums[f] = g


class _Sum:
    """The gradient of a layer's input ``[seq, batch, in_l]``, which both directions add into a chunk at a time
    (in whichever order their threads come: ``a + b`` rounds like ``b + a``, so the bytes are the same)."""

    def __init__(self, shape: tuple[int, ...], dtype, chunks: int):
        self.total = np.empty(shape, dtype)
        self._added = [False] * chunks
        self._lock = threading.Lock()

    def add(self, k: int, t0: int, t1: int, part: Array) -> None:
        with self._lock:
            if self._added[k]:
                self.total[t0:t1] += part
            else:
                self.total[t0:t1] = part
                self._added[k] = True


def reverse_pass(s: Setup, inputs: list[Array | None], chunks: list[tuple[int, int]], keep_of: KeepOf,
                 reverses: Callable) -> None:
    """The reverse, top down, chunk by chunk from each direction's last step, storing every gradient:
    ``inputs`` as ``Forward.inputs``, ``keep_of`` gives what a chunk's forward kept. ``d_y`` is the gradient of a
    layer's output, then of its input (the top layer's read from ``d_dst`` a chunk at a time)."""
    fwd, b = s.fwd, s.b
    _, dirs = recurrent_dims(fwd)
    S, B, width, dt = fwd["seq"], fwd["batch"], output_width(fwd), COMPUTE[fwd["dtype"]]
    w_ih = b.load("w_ih")
    d_w_ih = np.zeros_like(w_ih)
    grads = {f: np.zeros(b.regions[f].shape, dt) for f in ("w_hh", *s.biases, *s.optional)}
    d_final = {f: b.load(f"d_{f}") for f in s.init} if s.init else None
    d_init = {f: np.zeros_like(v) for f, v in s.init.items()} if s.init else {}
    d_y = None
    for layer in reversed(range(len(s.spans))):
        d_in = _Sum((S, B, s.spans[layer][0][2]), dt, len(chunks))

        def reverse(dr: int, layer: int = layer, d_y: Array | None = d_y, d_in: _Sum = d_in) -> None:
            d = _direction(s, w_ih, layer, dr)
            cols = slice(dr * width, (dr + 1) * width)
            dh, dc = s.start(d_final, d.ld, width)
            sums: dict[str, Array] = {}
            for k in _walked(len(chunks), not d.backwards):
                t0, t1 = chunks[k]
                x, valid = _layer_input(s, inputs, layer, t0, t1), _valid_in(s, t0, t1)
                dy = (d_y[t0:t1, :, cols] if d_y is not None else
                      _zero_invalid(valid, b.view("d_dst")[:, t0:t1, cols].transpose(1, 0, 2).astype(dt)))
                d_pre, d_bias, d_w, (dh, dc) = reverses(d.cell, keep_of(d, k, x), d.weights, dy, dh, dc, valid,
                                                        _walked(t1 - t0, not d.backwards))
                _add(sums, {"w_ih": _sum_outer(d_pre, x), **d_bias, **d_w})
                d_in.add(k, t0, t1, _times(d_pre, d.w))
            if sums:  # none without steps
                d_w_ih[d.lo:d.hi] = sums.pop("w_ih").reshape(-1)
            for f, g in sums.items():
                grads[f][d.ld] = g
            for f, value in zip(d_init, (dh, dc)):
                d_init[f][d.ld] = value

        each_direction([partial(reverse, dr) for dr in range(dirs)])
        inputs[layer + 1] = None  # the layer's output is no longer needed (a reserve's view: nothing freed)
        d_y = _zero_invalid(s.valid, d_in.total) if layer else d_in.total
    b.store("d_x", d_y.transpose(1, 0, 2))
    b.store("d_w_ih", d_w_ih)
    for f, g in {**grads, **d_init}.items():
        b.store(f"d_{f}", g)
