"""The gates of a recomputed chunk of lstm or gru steps in one compiled pass each (where they apply and what they
replace: ``rnn_backward_gates``; ``jit.kernel`` says what each argument is). Imported only through ``jit``.

The chunk's GEMMs are NumPy's (BLAS, over every step of the chunk at once): what is left is elementwise, which
NumPy runs as a dozen array passes over ``[steps, batch, G*hidden]`` (sigmoid alone four), and these run as one
pass a row, the activations through ``jit_math._exp`` as the whole-sequence lstm's (``jit_lstm_sequence``)."""
from __future__ import annotations

import numba
import numpy as np
from numba import types

from .jit_math import _F32, _FLAGS, _ROWS, _exp

_SEQ = types.Array(types.float32, 3, "C")
_LENS = types.Array(types.int64, 1, "C")
_VECTOR = types.Array(types.float32, 1, "C")


@numba.njit(fastmath=_FLAGS, inline="always")
def _sigmoid(x):
    return _F32(1.0) / (_F32(1.0) + _exp(-x))


@numba.njit(fastmath=_FLAGS, inline="always")
def _tanh(x):
    return _F32(2.0) / (_F32(1.0) + _exp(_F32(-2.0) * x)) - _F32(1.0)


@numba.njit(types.void(_SEQ, _ROWS, _LENS, types.boolean, _SEQ, _SEQ, _SEQ), fastmath=_FLAGS, nogil=True, cache=True,
            error_model="numpy", boundscheck=False)
def lstm_chunk_gates(u, c, lens, backwards, c_prev, c_new, hc):
    """An lstm chunk's gates from their pre-activations, then its cell step by step (``jit.kernel`` says what
    each argument is)."""
    steps, batch, four = u.shape
    hidden = four // 4
    if (four != 4 * hidden or c.shape[0] != batch or c.shape[1] != hidden or (lens.size != 0 and lens.size != batch)
            or c_prev.shape[0] != steps or c_prev.shape[1] != batch or c_prev.shape[2] != hidden
            or c_new.shape != c_prev.shape or hc.shape != c_prev.shape):
        raise ValueError("lstm_chunk_gates: the arrays' shapes do not fit together")
    # each gate column's activation as scale / (1 + exp(slope z)) - shift: σ for i f o, tanh for g (one loop
    # that LLVM vectorizes, as jit_lstm_sequence's)
    slope, scale, shift = np.full(four, _F32(-1.0)), np.ones(four, _F32), np.zeros(four, _F32)
    for j in range(2 * hidden, 3 * hidden):
        slope[j], scale[j], shift[j] = _F32(-2.0), _F32(2.0), _F32(1.0)
    for b in range(batch):
        cb = c[b]
        for step in range(steps):
            t = steps - 1 - step if backwards else step
            ub = u[t, b]
            for j in range(four):
                ub[j] = scale[j] / (_F32(1.0) + _exp(slope[j] * ub[j])) - shift[j]
            cp, cn, hcb = c_prev[t, b], c_new[t, b], hc[t, b]
            valid = lens.size == 0 or t < lens[b]
            for k in range(hidden):
                cp[k] = cb[k]
                new = ub[hidden + k] * cb[k] + ub[k] * ub[2 * hidden + k]
                cn[k] = new
                hcb[k] = _tanh(new)
            if valid:  # a row past its length takes no step: its cell passes through
                for k in range(hidden):
                    cb[k] = cn[k]


@numba.njit(types.void(_SEQ, _SEQ, _VECTOR), fastmath=_FLAGS, nogil=True, cache=True, error_model="numpy",
            boundscheck=False)
def gru_chunk_gates(u, hidden, b_hh):
    """A gru chunk's gates (``linear_before_reset``) from the input and hidden sides (``jit.kernel`` says what
    each argument is)."""
    steps, batch, three = u.shape
    size = three // 3
    if three != 3 * size or hidden.shape != u.shape or b_hh.shape[0] != three:
        raise ValueError("gru_chunk_gates: the arrays' shapes do not fit together")
    for t in range(steps):
        for b in range(batch):
            ub, hb = u[t, b], hidden[t, b]
            r, z, n = ub[:size], ub[size: 2 * size], ub[2 * size:]
            hr, hz, hn = hb[:size], hb[size: 2 * size], hb[2 * size:]
            br, bz, bn = b_hh[:size], b_hh[size: 2 * size], b_hh[2 * size:]
            for k in range(size):  # one loop over the three blocks: LLVM vectorizes it (a loop a block ran 2x slower)
                rk = _sigmoid(r[k] + (hr[k] + br[k]))
                z[k] = _sigmoid(z[k] + (hz[k] + bz[k]))
                hnk = hn[k] + bn[k]
                hn[k] = hnk  # W_hn·h + b_hn, kept: the reverse pass reads it
                r[k] = rk
                n[k] = _tanh(n[k] + rk * hnk)

__all__ = ["lstm_chunk_gates", "gru_chunk_gates"]  # the kernels ``jit.kernel`` hands out
