"""The checkpoint pass of a recurrent backward without a saved forward (``rnn_backward_passes``), through the
plain forward's loops (``rnn_loops``: feature-major, gates through ``exp``, the compiled lstm step where it
applies) rather than the backward's own per-step recurrences, which keep every step's gates and cost about as
much as the reverse pass (lstm B32 S128 I=H=256, 2 layers, bidirectional: 320 ms where the forward takes 170).

It keeps what the reverse pass reads from a forward pass (``Forward``): each layer's output (the next layer's
input; the top layer's where asked for), time-major, and the state entering each chunk of steps. It writes
neither ``dst`` nor the final states. The loops keep no gates, so the reverse pass would recompute every chunk;
given a ``keeping`` recurrence (``rnn_backward_steps``' forward), each layer-direction's walk stops before its
last chunk, which that recurrence runs keeping what the reverse pass reads, and which the reverse pass then
takes first as it is: one chunk a layer-direction not run twice (B32 S128: an eighth of the chunks; where
``rnn_backward`` hands one over says where that pays). Every row runs every step (no ``seq_lens``:
``applies``), so a step's index is its place in the walk.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Mapping

import numpy as np

from .rnn_backward_passes import Forward, _direction, _walked
from .rnn_backward_setup import Setup, each_direction
from .rnn_loops import _layer_direction
from .rnn_packing import _dims, _full_packing

Array = np.ndarray


def applies(fwd: Mapping[str, Any]) -> bool:
    """Whether ``checkpoint_pass`` runs the forward thunk ``fwd``: every row runs every step."""
    return fwd.get("seq_lens") is None and fwd["batch"] > 0 and fwd["seq"] > 0


def checkpoint_pass(s: Setup, chunks: list[tuple[int, int]], top: bool = False,
                    keeping: Callable | None = None) -> Forward:
    """The forward bottom up through the plain forward's loops, keeping each layer's output (the top one's too
    where ``top``) and the state ``(h, c)`` entering each of ``chunks`` in each layer-direction's walk; with
    ``keeping``, each walk's last chunk through that recurrence instead, and what it keeps."""
    fwd, d = s.fwd, _dims(s.fwd)
    S, B, rows = d.seq, d.batch, d.dirs * d.width
    pack = _full_packing(B, S)
    x = np.empty((S, B, fwd["input_size"]), d.compute)  # layer 0's input time-major: column t*B + b
    x[...] = s.b.view("x").transpose(1, 0, 2)
    w_ih = s.b.view("w_ih")
    w_compute = s.b.load("w_ih") if keeping is not None else None  # for the last chunks' projections
    inputs: list[Array | None] = [None]
    entries: list[list] = [[None] * len(chunks) for _ in range(len(s.spans) * d.dirs)]
    kept: list[dict] = [{} for _ in entries]
    for layer, spans in enumerate(s.spans):
        # a layer's input chunks [in, columns] are views of the time-major input (BLAS and the compiled step take
        # them transposed); its output chunks are arrays of their own, each freed once copied time-major
        xs = [x.reshape(S * B, -1)[c.first: c.first + c.columns].T for c in pack.chunks]
        ys = [np.empty((rows, c.columns), d.compute) for c in pack.chunks]
        tails: list[tuple[int, Array] | None] = [None] * d.dirs  # each direction's last chunk: (t0, its output)

        def direction(dr: int, layer: int = layer, x: Array = x, xs: list = xs, ys: list = ys) -> None:
            lo, hi, in_l = spans[dr]
            ld = layer * d.dirs + dr
            first = {(t1 - 1 if s.backwards(dr) else t0): k for k, (t0, t1) in enumerate(chunks)}
            last = _walked(len(chunks), s.backwards(dr))[-1] if keeping is not None else None

            def entering(t: int, h: Array, c: Array | None) -> bool:
                k = first.get(t)
                if k is not None:  # the loops update h's and c's buffers in place: copies
                    entries[ld][k] = (h.T.copy(), None if c is None else c.T.copy())
                return k is not None and k == last  # the last chunk: run by ``keeping``
            _layer_direction(fwd, s.b, d, layer, dr, w_ih[lo:hi].reshape(-1, in_l), xs, ys, pack, 1, entering)
            if last is not None:
                t0, t1 = chunks[last]
                r = _direction(s, w_compute, layer, dr)
                h, c = entries[ld][last]
                y, _, kept[ld] = keeping(r.cell, r.projection(x[t0:t1]), r.weights, h, c, None,
                                         _walked(t1 - t0, r.backwards))
                tails[dr] = (t0, y)

        each_direction([partial(direction, dr) for dr in range(d.dirs)])
        del xs
        x = _time_major(ys, S, B) if top or layer + 1 < len(s.spans) else None
        for dr, tail in enumerate(tails):
            if tail is not None and x is not None:  # the steps the loops did not run
                x[tail[0]: tail[0] + tail[1].shape[0], :, dr * d.width: (dr + 1) * d.width] = tail[1]
        inputs.append(x)
    return Forward(inputs, entries, kept, {})


def _time_major(ys: list[Array], seq: int, batch: int) -> Array:
    """A layer's output ``[seq, batch, rows]`` from its chunks ``[rows, columns]`` (column ``t*batch + b``), each
    chunk dropped from ``ys`` once copied."""
    out = np.empty((seq, batch, ys[0].shape[0]), ys[0].dtype)
    t0 = 0
    while ys:
        y = ys.pop(0)
        steps = y.shape[1] // batch
        out[t0: t0 + steps] = y.T.reshape(steps, batch, -1)
        t0 += steps
    return out
