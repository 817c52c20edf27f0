"""One ``lstm``/``gru``/``rnn`` layer-direction's time loop: per op the NumPy step loop over its work arrays,
the compiled lstm step's loop, the input projection a time chunk at a time, and the walk over the packed
steps (``_layer_direction`` runs one)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from .activations import sigmoid_of_negated, sigmoid_then_tanh_of_scaled, tanh_of_scaled
from .bound import Bound
from .rnn_cell import _Cell, _cell, _internal, _scales, _specs
from .rnn_packing import _Dims, _Packing


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


def _watched(steps: Iterator[tuple], entering: Callable, c: np.ndarray | None, seq: int,
             backwards: bool) -> Iterator[tuple]:
    """``steps`` (every row running every step), calling ``entering(t, h, c)`` before step ``t`` runs: the state
    entering it, feature-major (``c`` the lstm's cell, updated in place by the loops; else None). Where it
    returns True the walk stops there: that step and the ones after it do not run."""
    for i, step in enumerate(steps):
        if entering(seq - 1 - i if backwards else i, step[1], c):
            return
        yield step


def _layer_direction(t, b: Bound, d: _Dims, layer: int, dr: int, w_ih: np.ndarray, xs, ys, pack: _Packing,
                     blas_cores: int, entering: Callable | None = None):
    """Run direction ``dr`` of ``layer``: ``w_ih`` its stored ``[G*H, in]`` block, ``xs`` the layer's input
    chunks ``[in, columns]``; write this direction's rows of the output chunks ``ys`` and its final state.
    ``blas_cores``: the threads each GEMM runs on (1 where the directions run in two threads). ``entering``
    (a recompute backward's checkpoint pass, every row running every step: ``_watched``) sees the state entering
    each step and may stop the walk, and the final state is not stored."""
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
        else:
            steps = _steps(xs.__getitem__, out, pack, backwards, h)  # the step reads x_t in place
        if entering is not None:
            steps = _watched(steps, entering, c, d.seq, backwards)
        if cell.compiled is None:
            loop(cell, steps, make_spaces(cell, d, c))
        else:
            _lstm_compiled_loop(cell, w_ih, steps, d, x_bias.ravel(), c)
    if carry and entering is None:  # the final state, in place
        for field, final in (("h0", h), ("c0", c)):
            if final is not None:
                if pack.order is None:
                    b.view(field)[ld] = final.T
                else:
                    b.view(field)[ld][pack.order] = final.T
