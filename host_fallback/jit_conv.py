"""The compiled decode step of ``causal_conv1d`` (``causal_conv1d_decode``): every row's window, taps, bias,
activation and pool shift in one pass over its pool entry, where NumPy's step (``conv._decode_rows``) makes about
twenty array passes and releases the GIL between them. Imported only through ``jit``."""
from __future__ import annotations

import numba
from numba import literal_unroll, types

from .jit_math import _FLAGS
from .jit_ssm_steps import _silu

_C1, _C2, _C3 = (types.Array(types.float32, d, "C") for d in (1, 2, 3))
_INDEX = types.Array(types.intp, 1, "C")

__all__ = ["causal_conv1d_decode"]
#: the pool's last axis, ``width - 1``, for ABI.md §10's widths 2..8
_BACKS = (1, 2, 3, 4, 5, 6, 7)


@numba.njit(inline="always")
def _convolve_row(xs, state, taps, bias, ys, back):
    """One row: ``ys = xs * taps[back] + sum_w state[:, w] * taps[w] (+ bias)`` in NumPy's order, and the
    entry ``state [D, back]`` shifted one place, ``xs`` its newest column. Inlined with ``back`` a constant, so
    that LLVM unrolls the taps and runs the channels in vector lanes (a run-time ``back`` leaves them scalar,
    2.5x slower). Every input value of a channel is read before its output is written (``ys`` may be ``xs``)."""
    for d in range(xs.size):
        value = xs[d]
        total = value * taps[back, d]
        for w in range(back):
            total += state[d, w] * taps[w, d]
        if bias.size > 0:
            total += bias[d]
        for w in range(back - 1):
            state[d, w] = state[d, w + 1]
        state[d, back - 1] = value
        ys[d] = total


@numba.njit(fastmath=_FLAGS, error_model="numpy", boundscheck=False)
def _silu_row(values):
    """``values / (1 + exp(-values))`` in place (``conv.silu_``'s formula). A function of its own, so that its
    fast-math flags (``exp``'s contractions) stay out of the convolution, whose sums round as NumPy's; compiled
    with it (lazily: nothing to compile where its code comes from Numba's cache)."""
    for d in range(values.size):
        values[d] = _silu(values[d])


@numba.njit(types.void(_C2, _INDEX, _INDEX, _C2, _C1, types.boolean, _C3, _C2, types.intp, types.intp),
            nogil=True, cache=True, error_model="numpy", boundscheck=False)
def causal_conv1d_decode(x, tokens, entries, taps, bias, silu, pool, out, lo, hi):
    """The decode step (ABI.md §10, one token a row, carried state) of rows ``lo .. hi-1``, float32: row ``r``'s
    token is ``x[tokens[r]]`` (``x, out [N, D]``), its output goes to ``out[tokens[r]]``, its window is pool entry
    ``entries[r]`` (``pool [E, D, W-1]``), shifted in place; ``taps [W, D]`` (the weight transposed), ``bias [D]``
    or empty, ``silu`` the activation. No product or sum is contracted or reassociated: without ``silu`` the
    output has NumPy's bytes; silu's ``exp`` is ``jit_math``'s (silu within 4 ulp of NumPy's). ``out`` may be ``x``;
    no other overlap is allowed, and the caller checks the shapes and indices (none is checked here)."""
    back = pool.shape[2]
    if back < 1 or back > 7:
        raise ValueError("causal_conv1d_decode: the pool's last axis (width - 1) must be 1..7")
    for r in range(lo, hi):
        xs, state, ys = x[tokens[r]], pool[entries[r]], out[tokens[r]]
        for each in literal_unroll(_BACKS):  # one inlined copy per width, ``each`` a constant in it
            if back == each:
                _convolve_row(xs, state, taps, bias, ys, each)
        if silu:
            _silu_row(ys)
