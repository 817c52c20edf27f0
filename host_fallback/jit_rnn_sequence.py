"""A gru or rnn layer-direction's whole sequence in one compiled call, keeping what its backward reads, and that
backpropagation through time (``jit.kernel`` says what each argument is; where they apply: the ``rnn_sequence``
module). Imported only through ``jit``.

As the lstm's (``jit_lstm_sequence``, whose tiles and weight blocks they share): batch-major, time-major, a step's
``W_hh·h`` (or ``dz·W_hh``) in register tiles over a group of batch rows, then the step's elementwise math as one
loop over a row's units, where NumPy's steps make 15-25 array passes and a BLAS call that repacks ``W_hh``
(B32 S128 H256, one thread: a gru step forward about 210 µs, back 340). ``lens [B]`` are the rows' valid steps
(empty: all): a row past its length takes no step (state unchanged, output 0, no gradient)."""
from __future__ import annotations

import numba
from numba import types

from .jit_lstm_sequence import _batch_times, _forward_scratch, _product_scratch, _w_hh_times, _walked
from .jit_math import _F32, _FLAGS, _ROWS
from .jit_rnn_chunk import _sigmoid, _tanh

_SEQ = types.Array(types.float32, 3, "C")
_LENS = types.Array(types.int64, 1, "C")
_VECTOR = types.Array(types.float32, 1, "C")


@numba.njit(inline="always")
def _running(lens, t, b):
    return lens.size == 0 or t < lens[b]


@numba.njit(types.void(_SEQ, _ROWS, _VECTOR, _ROWS, _LENS, types.boolean, _SEQ, types.boolean, _SEQ, _SEQ,
                       types.intp), fastmath=_FLAGS, nogil=True, cache=True, error_model="numpy", boundscheck=False)
def gru_sequence(u, w_hh, b_hh, h, lens, backwards, out, keep, h_prev, hn, lanes):
    """Every step of one gru layer-direction (``linear_before_reset``), keeping what its backward reads where
    ``keep`` (``jit.kernel`` says what each argument is)."""
    seq, batch, three = u.shape
    hidden = three // 3
    if (three != 3 * hidden or w_hh.shape[0] != three or w_hh.shape[1] != hidden or b_hh.shape[0] != three
            or h.shape[0] != batch or h.shape[1] != hidden or (lens.size != 0 and lens.size != batch)
            or out.shape[0] != seq or out.shape[1] != batch or out.shape[2] != hidden
            or (keep and (h_prev.shape != out.shape or hn.shape != out.shape))):
        raise ValueError("gru_sequence: the arrays' shapes do not fit together")
    scratch = _forward_scratch(w_hh, batch, lanes)
    g = scratch[2]
    for step in range(seq):
        t = _walked(step, seq, backwards)
        for b in range(batch):
            gb = g[b]
            for j in range(three):
                gb[j] = b_hh[j]
        _w_hh_times(lanes, h, batch, w_hh, scratch)  # g = W_hh·h + b_hh
        for b in range(batch):
            ub, gb, hb, ob = u[t, b], g[b], h[b], out[t, b]
            r, z, n, hn_b = ub[:hidden], ub[hidden: 2 * hidden], ub[2 * hidden:], gb[2 * hidden: three]
            if keep:
                h_prev[t, b] = hb
                hn[t, b] = hn_b
            # loops of one or two arrays and one activation each, which LLVM vectorizes (one loop over the three
            # blocks ran scalar: 72 µs a step of B32 H256, 12 so)
            for k in range(2 * hidden):
                ub[k] = _sigmoid(ub[k] + gb[k])
            for k in range(hidden):
                n[k] += r[k] * hn_b[k]
            for k in range(hidden):
                n[k] = _tanh(n[k])
            if _running(lens, t, b):
                for k in range(hidden):
                    ob[k] = (_F32(1.0) - z[k]) * n[k] + z[k] * hb[k]
                hb[:] = ob
            else:
                ob[:] = 0


@numba.njit(types.void(_SEQ, _SEQ, _SEQ, _ROWS, _SEQ, _ROWS, _LENS, types.boolean, _SEQ, _SEQ, types.intp),
            fastmath=_FLAGS, nogil=True, cache=True, error_model="numpy", boundscheck=False)
def gru_sequence_backward(y, h_prev, hn, w_hh, dy, dh, lens, backwards, d_in, d_hid, lanes):
    """Backpropagation through the steps ``gru_sequence`` kept (``jit.kernel`` says what each argument is)."""
    seq, batch, three = y.shape
    hidden = three // 3
    if (three != 3 * hidden or h_prev.shape[0] != seq or h_prev.shape[1] != batch or h_prev.shape[2] != hidden
            or hn.shape != h_prev.shape or dy.shape != h_prev.shape or w_hh.shape[0] != three
            or w_hh.shape[1] != hidden or dh.shape[0] != batch or dh.shape[1] != hidden
            or (lens.size != 0 and lens.size != batch) or d_in.shape != y.shape or d_hid.shape != y.shape):
        raise ValueError("gru_sequence_backward: the arrays' shapes do not fit together")
    w, panels, sums = _product_scratch(w_hh, batch, lanes)
    for step in range(seq):
        t = _walked(step, seq, not backwards)  # the forward's walk, from its end
        for b in range(batch):
            ab, cb = d_in[t, b], d_hid[t, b]
            if not _running(lens, t, b):
                for j in range(three):
                    ab[j] = 0
                    cb[j] = 0
                continue
            yb, hpb, hnb, dyb, dhb, dhin = y[t, b], h_prev[t, b], hn[t, b], dy[t, b], dh[b], sums[b]
            r, z, n = yb[:hidden], yb[hidden: 2 * hidden], yb[2 * hidden:]
            dr, dz, dn = ab[:hidden], ab[hidden: 2 * hidden], ab[2 * hidden:]
            for k in range(hidden):  # loops of a few arrays each, as the forward's
                dhin[k] = dhb[k] + dyb[k]
            for k in range(hidden):
                dn[k] = dhin[k] * (_F32(1.0) - z[k]) * (_F32(1.0) - n[k] * n[k])
            for k in range(hidden):
                dr[k] = dn[k] * hnb[k] * (r[k] * (_F32(1.0) - r[k]))
            for k in range(hidden):
                dz[k] = dhin[k] * (hpb[k] - n[k]) * (z[k] * (_F32(1.0) - z[k]))
            cb[: 2 * hidden] = ab[: 2 * hidden]
            for k in range(hidden):
                cb[2 * hidden + k] = dn[k] * r[k]
            for k in range(hidden):
                dhin[k] *= z[k]  # dh_in⊙z, which the GEMM adds to
        _batch_times(lanes, d_hid[t], batch, panels, w, sums)  # dh = dh_in⊙z + d_hid · W_hh
        for b in range(batch):
            if _running(lens, t, b):
                dhb, sb = dh[b], sums[b]
                for k in range(hidden):
                    dhb[k] = sb[k]


@numba.njit(types.void(_SEQ, _ROWS, _ROWS, _LENS, types.boolean, _SEQ, types.boolean, _SEQ, types.intp),
            fastmath=_FLAGS, nogil=True, cache=True, error_model="numpy", boundscheck=False)
def rnn_sequence(u, w_hh, h, lens, backwards, out, keep, h_prev, lanes):
    """Every step of one tanh rnn layer-direction, keeping what its backward reads where ``keep`` (``jit.kernel``
    says what each argument is)."""
    seq, batch, hidden = u.shape
    if (w_hh.shape[0] != hidden or w_hh.shape[1] != hidden or h.shape[0] != batch or h.shape[1] != hidden
            or (lens.size != 0 and lens.size != batch) or out.shape != u.shape or (keep and h_prev.shape != u.shape)):
        raise ValueError("rnn_sequence: the arrays' shapes do not fit together")
    scratch = _forward_scratch(w_hh, batch, lanes)
    g = scratch[2]
    for step in range(seq):
        t = _walked(step, seq, backwards)
        for b in range(batch):
            gb, ub = g[b], u[t, b]
            for k in range(hidden):
                gb[k] = ub[k]
        _w_hh_times(lanes, h, batch, w_hh, scratch)  # g = W_ih·x + b + W_hh·h
        for b in range(batch):
            ub, gb, hb, ob = u[t, b], g[b], h[b], out[t, b]
            if keep:
                h_prev[t, b] = hb
            for k in range(hidden):
                ub[k] = _tanh(gb[k])
            if _running(lens, t, b):
                for k in range(hidden):
                    hb[k] = ub[k]
                    ob[k] = ub[k]
            else:
                for k in range(hidden):
                    ob[k] = 0


@numba.njit(types.void(_SEQ, _ROWS, _SEQ, _ROWS, _LENS, types.boolean, _SEQ, types.intp),
            fastmath=_FLAGS, nogil=True, cache=True, error_model="numpy", boundscheck=False)
def rnn_sequence_backward(y, w_hh, dy, dh, lens, backwards, dz, lanes):
    """Backpropagation through the steps ``rnn_sequence`` kept (``jit.kernel`` says what each argument is)."""
    seq, batch, hidden = y.shape
    if (w_hh.shape[0] != hidden or w_hh.shape[1] != hidden or dy.shape != y.shape or dh.shape[0] != batch
            or dh.shape[1] != hidden or (lens.size != 0 and lens.size != batch) or dz.shape != y.shape):
        raise ValueError("rnn_sequence_backward: the arrays' shapes do not fit together")
    w, panels, sums = _product_scratch(w_hh, batch, lanes)
    for step in range(seq):
        t = _walked(step, seq, not backwards)  # the forward's walk, from its end
        for b in range(batch):
            zb = dz[t, b]
            if not _running(lens, t, b):
                for k in range(hidden):
                    zb[k] = 0
                continue
            yb, dyb, dhb = y[t, b], dy[t, b], dh[b]
            for k in range(hidden):
                zb[k] = (dhb[k] + dyb[k]) * (_F32(1.0) - yb[k] * yb[k])
        sums[:] = 0
        _batch_times(lanes, dz[t], batch, panels, w, sums)  # dh = dz · W_hh
        for b in range(batch):
            if _running(lens, t, b):
                dhb, sb = dh[b], sums[b]
                for k in range(hidden):
                    dhb[k] = sb[k]


__all__ = ["gru_sequence", "gru_sequence_backward", "rnn_sequence", "rnn_sequence_backward"]  # ``jit.kernel``'s
