"""The compiled reverse of ``selective_scan`` (``selective_scan_backward_run``): one sequence's every gradient in one
call, where NumPy's chunked reverse makes about forty array passes a chunk over ``[T, R, G, N, W]`` arrays
(``selective_scan_backward``: where it applies and its arguments). Imported only through ``jit``.

Per chunk of ``chunk`` tokens, the tokens' per-channel scalars first (the step ``delta`` after its bias and
softplus, softplus' slope, ``delta x``, the gate's factors), in loops over the contiguous channels; then per block
of ``BLOCK`` channels, their states through the chunk recomputed from the state entering it (a saved forward's,
ABI.md §9.1, or the checkpoint of a first forward pass) into a ``[chunk + 1, N, BLOCK]`` buffer, keeping each
step's decay ``exp(delta a)`` beside them, and the reverse of the chunk walked back from the state's gradient.
Every loop runs along the block's channels, as NumPy's reverse lays its arrays out: a loop along one channel's
``N = 16`` state values is too short for LLVM to vectorize once it must check the arrays for overlap (that form
ran 2.2x slower). The sums over channels (``d_b``, ``d_c``) and over tokens (``d_a``, ``d_d``, ``d_delta_bias``)
run in a fixed order: the same bytes on every run of one build.
"""
from __future__ import annotations

import numba
import numpy as np
from numba import types

from .jit_math import _F32, _FLAGS, _SOFTPLUS_LINEAR, _exp, _exp_subnormal, _softplus

__all__ = ["selective_scan_backward_run"]  # the kernels ``jit.kernel`` hands out
#: Sums over the state reassociated, so that LLVM runs them in vector lanes (as ``jit_ssm_steps._dot``).
_REDUCING = _FLAGS | {"reassoc"}

#: Channels the reverse takes at once: their states through a chunk, ``[33, N, BLOCK]`` f32 (270 KiB at N=16), and
#: their decays stay in L2.
BLOCK = 128

_T1, _T2, _T3 = (types.Array(types.float32, d, "C") for d in (1, 2, 3))


@numba.njit(fastmath=_FLAGS, inline="always")
def _sigmoid(u):
    return _F32(1.0) / (_F32(1.0) + _exp(-u))


@numba.njit(fastmath=_FLAGS, inline="always")
def _block_states(t0, span, grp, c0, w, x, c, b, a_t, d, dz, steps, inputs, gates, hs, decays, start, y):
    """The states of channels ``c0..c0+w-1`` (of group ``grp``) through the chunk's ``span`` tokens from ``t0``, from
    ``start [H, N]`` (the state entering the chunk), into ``hs [chunk + 1, N, BLOCK]`` (``hs[i + 1]`` after token
    ``i``), their decays into ``decays``; with ``z`` (``gates`` has rows), ``d_z`` of each token. Each loop runs
    along the block's channels (``a_t``: ``a`` transposed, ``[N, H]``). (Not reassociated: ``_exp_subnormal``'s
    rounding trick needs its order.)"""
    n = hs.shape[1]
    for k in range(n):
        first = hs[0, k]
        for j in range(w):
            first[j] = start[c0 + j, k]
    for i in range(span):
        t = t0 + i
        s, dx = steps[i, c0:c0 + w], inputs[i, c0:c0 + w]
        for k in range(n):
            av, dec, prev, h, bk = a_t[k, c0:c0 + w], decays[i, k], hs[i, k], hs[i + 1, k], b[t, grp, k]
            for j in range(w):
                dec[j] = _exp_subnormal(s[j] * av[j])
            for j in range(w):
                h[j] = dec[j] * prev[j] + dx[j] * bk
        if gates.shape[0] > 0:  # d_z = dy * y * gate * (1 + z (1 - gate)), y = c . h + d x (the output before z)
            y[:w] = 0
            for k in range(n):
                h, ck = hs[i + 1, k], c[t, grp, k]
                for j in range(w):
                    y[j] += h[j] * ck
            for j in range(w):
                ch = c0 + j
                out = y[j] + x[t, ch] * d[ch] if d.size > 0 else y[j]
                dz[t, ch] = out * gates[i, ch]


@numba.njit(fastmath=_REDUCING, nogil=True, error_model="numpy", boundscheck=False)
def _block_reverse(t0, span, grp, c0, w, x, c, b, a_t, d, dx_out, ddelta_out, db, dc, steps, inputs, slopes, grads,
                   hs, decays, g_t, da_t, gb, pa, p, sums):
    """The reverse of channels ``c0..c0+w-1`` (of group ``grp``) through the chunk's ``span`` tokens from ``t0``, over
    the states and decays ``_block_states`` kept, back from ``g_t [N, H]`` (the gradient of the state leaving the
    chunk, left as the one entering it); ``da_t [N, H]`` (``d_a`` transposed) and ``sums [H, 2]`` (each channel's
    ``d_d`` and ``d_delta_bias`` terms) added to; ``gb``, ``pa``, ``p``: ``[BLOCK]`` scratch. Each loop runs along
    the block's channels, a few arrays each (LLVM checks those for overlap before it vectorizes a loop), the
    sums over channels (``d_b``, ``d_c``) reassociated."""
    n = hs.shape[1]
    for i in range(span - 1, -1, -1):
        t = t0 + i
        e, s, dx = grads[i, c0:c0 + w], steps[i, c0:c0 + w], inputs[i, c0:c0 + w]
        gb[:w] = 0
        pa[:w] = 0
        for k in range(n):
            g, dec, prev, h = g_t[k, c0:c0 + w], decays[i, k], hs[i, k], hs[i + 1, k]
            ck, bk = c[t, grp, k], b[t, grp, k]
            for j in range(w):  # g += c dy: the state's gradient after token i
                g[j] += ck * e[j]
            to_c, to_b = _F32(0.0), _F32(0.0)
            for j in range(w):
                to_c += h[j] * e[j]
            for j in range(w):
                to_b += g[j] * dx[j]
            dc[t, grp, k] += to_c
            db[t, grp, k] += to_b
            for j in range(w):
                gb[j] += g[j] * bk
            for j in range(w):  # the gradient of (delta a)[k]
                p[j] = g[j] * dec[j] * prev[j]
            av, da = a_t[k, c0:c0 + w], da_t[k, c0:c0 + w]
            for j in range(w):
                pa[j] += p[j] * av[j]
            for j in range(w):
                da[j] += p[j] * s[j]
            for j in range(w):  # back through the decay
                g[j] *= dec[j]
        for j in range(w):
            ch = c0 + j
            xv = x[t, ch]
            dx_out[t, ch] = s[j] * gb[j] + e[j] * d[ch] if d.size > 0 else s[j] * gb[j]
            grad_step = (pa[j] + xv * gb[j]) * slopes[i, ch]
            ddelta_out[t, ch] = grad_step
            sums[ch, 0] += e[j] * xv
            sums[ch, 1] += grad_step


@numba.njit(fastmath=_FLAGS, inline="always")
def _take(dst, src):
    for k in range(dst.size):
        dst[k] = src[k]


@numba.njit(fastmath=_FLAGS, inline="always")
def _chunk_steps(t0, span, x, delta, z, dy, delta_bias, softplus, steps, inputs, slopes, grads, gates):
    """The chunk's per-token, per-channel scalars, ``[i, ch]`` for token ``t0 + i``: ``steps`` (``delta`` after its
    bias and softplus), ``slopes`` (softplus' derivative, 1 without), ``inputs = steps x``, ``grads`` (the
    gradient reaching ``c . h + d x``: ``dy``, times ``z sigmoid(z)`` with ``z``) and, with ``z``, ``gates``: the
    factor ``dy sigmoid(z) (1 + z (1 - sigmoid(z)))`` that turns ``c . h + d x`` into ``d_z``."""
    gated, has_bias = z.size > 0, delta_bias.size > 0
    for i in range(span):  # loops over a token's contiguous channels, one operation each, which LLVM vectorizes
        t = t0 + i
        u, slope, dx, e, xs = steps[i], slopes[i], inputs[i], grads[i], x[t]
        _take(u, delta[t])
        if has_bias:
            for ch in range(u.size):
                u[ch] += delta_bias[ch]
        if softplus:
            for ch in range(u.size):
                v = u[ch]
                slope[ch] = _F32(1.0) if v > _SOFTPLUS_LINEAR else _sigmoid(v)
            for ch in range(u.size):
                u[ch] = _softplus(u[ch])
        else:
            slope[:] = _F32(1.0)
        for ch in range(u.size):
            dx[ch] = u[ch] * xs[ch]
        _take(e, dy[t])
        if gated:
            zs, gate = z[t], gates[i]
            for ch in range(u.size):
                zv = zs[ch]
                sig = _sigmoid(zv)
                gate[ch] = e[ch] * sig * (_F32(1.0) + zv * (_F32(1.0) - sig))
            for ch in range(u.size):
                zv = zs[ch]
                e[ch] = e[ch] * (zv * _sigmoid(zv))


@numba.njit(types.void(_T2, _T2, _T3, _T3, _T2, _T1, _T1, _T2, _T2, _T2, _T3, _T2, _T2, _T2, _T2, _T3, _T3, _T2,
                       _T1, _T1, types.intp, types.boolean, types.boolean), fastmath=_FLAGS, nogil=True, cache=True,
            error_model="numpy", boundscheck=False)
def selective_scan_backward_run(x, delta, b, c, a, delta_bias, d, z, dy, entering, keep, d_state, dx_out,
                                ddelta_out, dz_out, db_out, dc_out, da, dd, dbias, chunk, softplus, saved):
    """The gradients of one sequence of ``selective_scan`` (ABI.md §9), float32, every array C-contiguous.

    In: ``x, delta, z, dy [T, H]`` (``dy`` the output's gradient), ``b, c [T, G, N]``, ``a [H, N]``, ``delta_bias, d
    [H]``, ``entering [H, N]`` the state before the first token, ``keep [C, H, N]`` the state leaving each chunk of
    ``chunk`` tokens (``C = ceil(T / chunk)``): read where ``saved`` (a saved forward's), else a forward pass
    writes them there (the caller's array, so that its memory is the caller's to see), ``d_state [H, N]`` the final
    state's gradient, updated in place to the entering state's. Optional inputs (``delta_bias``, ``d``, ``z``) are
    empty where the thunk has none, and so is ``dz_out`` without ``z``. Out: ``dx_out, ddelta_out, dz_out [T,
    H]`` and ``db_out, dc_out [T, G, N]`` written; ``da [H, N]``, ``dd, dbias [H]`` added to (``dd``, ``dbias``
    empty where the thunk has no ``d`` / ``delta_bias``)."""
    seq, hidden = x.shape
    groups, n = b.shape[1], a.shape[1]
    width = hidden // groups
    count = (seq + chunk - 1) // chunk
    if keep.shape[0] != count:
        raise ValueError("selective_scan_backward_run: keep holds one state a chunk")
    steps, inputs = np.empty((chunk, hidden), _F32), np.empty((chunk, hidden), _F32)
    slopes, grads = np.empty((chunk, hidden), _F32), np.empty((chunk, hidden), _F32)
    gates = np.empty((chunk if z.size > 0 else 0, hidden), _F32)
    block = min(BLOCK, width)
    hs, decays = np.empty((chunk + 1, n, block), _F32), np.empty((chunk, n, block), _F32)
    gb, pa, p, y = np.empty(block, _F32), np.empty(block, _F32), np.empty(block, _F32), np.empty(block, _F32)
    a_t, g_t, da_t = np.ascontiguousarray(a.T), np.ascontiguousarray(d_state.T), np.zeros((n, hidden), _F32)
    if not saved:  # the forward pass: the state leaving each chunk (the last's is recomputed in the reverse anyway)
        ungated = gates[:0]
        for k in range(count - 1):
            t0, span = k * chunk, min(chunk, seq - k * chunk)
            _chunk_steps(t0, span, x, delta, z, dy, delta_bias, softplus, steps, inputs, slopes, grads, gates)
            start = entering if k == 0 else keep[k - 1]
            for grp in range(groups):
                for c0 in range(grp * width, (grp + 1) * width, block):
                    w = min(block, (grp + 1) * width - c0)
                    _block_states(t0, span, grp, c0, w, x, c, b, a_t, d, dz_out, steps, inputs, ungated, hs, decays,
                                  start, y)
                    for j in range(w):
                        for m in range(n):
                            keep[k, c0 + j, m] = hs[span, m, j]
    sums = np.zeros((hidden, 2), _F32)
    for k in range(count - 1, -1, -1):
        t0, span = k * chunk, min(chunk, seq - k * chunk)
        _chunk_steps(t0, span, x, delta, z, dy, delta_bias, softplus, steps, inputs, slopes, grads, gates)
        db_out[t0:t0 + span] = 0
        dc_out[t0:t0 + span] = 0
        start = entering if k == 0 else keep[k - 1]
        for grp in range(groups):
            for c0 in range(grp * width, (grp + 1) * width, block):
                w = min(block, (grp + 1) * width - c0)
                _block_states(t0, span, grp, c0, w, x, c, b, a_t, d, dz_out, steps, inputs, gates, hs, decays, start,
                              y)
                _block_reverse(t0, span, grp, c0, w, x, c, b, a_t, d, dx_out, ddelta_out, db_out, dc_out, steps,
                               inputs, slopes, grads, hs, decays, g_t, da_t, gb, pa, p, sums)
    d_state[:] = g_t.T
    da += da_t.T
    for ch in range(dd.size):
        dd[ch] += sums[ch, 0]
    for ch in range(dbias.size):
        dbias[ch] += sums[ch, 1]
