"""The compiled reverse of ``selective_scan`` (``selective_scan_backward_run``): one sequence's every gradient in one
call, where NumPy's chunked reverse makes about forty array passes a chunk over ``[T, R, G, N, W]`` arrays
(``selective_scan_backward``: where it applies and its arguments). Imported only through ``jit``.

Per chunk of ``chunk`` tokens, the tokens' per-channel scalars first (the step ``delta`` after its bias and
softplus, softplus' slope, ``delta x``, the gate's factors), in loops over the contiguous channels; then per
channel, its states through the chunk recomputed from the state entering it (a saved forward's, ABI.md §9.1, or
the checkpoint of a first forward pass) into a ``[chunk + 1, N]`` buffer, keeping each step's decay
``exp(delta a)`` beside them, and the reverse of the chunk walked back from the state's gradient with every sum
over the state in one loop over its ``N`` values. The sums over channels (``d_b``, ``d_c``) and over tokens
(``d_a``, ``d_d``, ``d_delta_bias``) run in a fixed order: the same bytes on every run of one build.
"""
from __future__ import annotations

import numba
import numpy as np
from numba import types

from .jit_math import _F32, _FLAGS, _exp, _exp_subnormal, _softplus
from .jit_ssm_steps import _dot

__all__ = ["selective_scan_backward_run"]  # the kernels ``jit.kernel`` hands out
#: Sums over the state reassociated, so that LLVM runs them in vector lanes (as ``jit_ssm_steps._dot``).
_REDUCING = _FLAGS | {"reassoc"}
#: ABI.md §8's softplus is the identity above this input (``ssm.SOFTPLUS_LINEAR``).
_LINEAR = _F32(20.0)

_T1, _T2, _T3 = (types.Array(types.float32, d, "C") for d in (1, 2, 3))


@numba.njit(fastmath=_FLAGS, inline="always")
def _sigmoid(u):
    return _F32(1.0) / (_F32(1.0) + _exp(-u))


@numba.njit(fastmath=_FLAGS, inline="always")
def _advance(h, t0, span, n, width, a, b, steps, inputs):
    """Every channel's state ``h [H, N]`` through the chunk's ``span`` tokens from ``t0`` (``steps``, ``inputs``:
    ``_chunk_steps``'), ``h = exp(step a) h + (step x) b``."""
    for ch in range(h.shape[0]):
        grp = ch // width
        for i in range(span):
            step, dx = steps[i, ch], inputs[i, ch]
            for k in range(n):
                h[ch, k] = _exp_subnormal(step * a[ch, k]) * h[ch, k] + dx * b[t0 + i, grp, k]


@numba.njit(fastmath=_FLAGS, inline="always")
def _recompute(ch, grp, t0, span, n, x, c, b, a, d, dz, steps, inputs, gates, hs, decays, entering):
    """Channel ``ch``'s (of group ``grp``) states through the chunk's ``span`` tokens from ``t0``, from ``entering``
    into ``hs`` (``hs[i + 1]`` after token ``i``), their decays into ``decays``; with ``z`` (``gates`` has rows),
    ``d_z`` of each token. (Not reassociated: ``_exp_subnormal``'s rounding trick needs its order.)"""
    # the decays first, then the recurrence, each indexing its 2-d arrays in place: a row's view a token (as
    # ``_reverse`` takes them) made this loop 2-4x slower
    for i in range(span):
        step = steps[i, ch]
        for k in range(n):
            decays[i, k] = _exp_subnormal(step * a[ch, k])
    for k in range(n):
        hs[0, k] = entering[k]
    gated = gates.shape[0] > 0
    for i in range(span):
        t, dx = t0 + i, inputs[i, ch]
        for k in range(n):
            hs[i + 1, k] = decays[i, k] * hs[i, k] + dx * b[t, grp, k]
        if gated:  # d_z = dy * y * gate * (1 + z (1 - gate)), y = c . h + d x (the output before z)
            y = _dot(hs[i + 1], c[t, grp], n)
            if d.size > 0:
                y += x[t, ch] * d[ch]
            dz[t, ch] = y * gates[i, ch]


@numba.njit(fastmath=_REDUCING, nogil=True, error_model="numpy", boundscheck=False)
def _reverse(ch, grp, t0, span, n, x, c, b, a, d, dx_out, ddelta_out, db, dc, steps, inputs, slopes, grads, hs,
             decays, g, da, sums):
    """The reverse of channel ``ch`` (of group ``grp``) through the chunk's ``span`` tokens from ``t0``, over the
    states and decays ``_recompute`` kept, back from ``g`` (the gradient of the state leaving the chunk, left as
    the one entering it). ``sums``: the channel's ``d_d`` and ``d_delta_bias`` terms, added to; ``da``: its
    ``d_a`` row, added to. Its sums over the state reassociated, so that LLVM runs them in vector lanes."""
    av = a[ch]
    skip = d[ch] if d.size > 0 else _F32(0.0)
    acc_d, acc_bias = _F32(0.0), _F32(0.0)
    for i in range(span - 1, -1, -1):
        t = t0 + i
        e, step, dx, xv = grads[i, ch], steps[i, ch], inputs[i, ch], x[t, ch]
        bs, cs, dbs, dcs = b[t, grp], c[t, grp], db[t, grp], dc[t, grp]
        prev, h, dec = hs[i], hs[i + 1], decays[i]
        # in four loops over the state, each touching few arrays, so that LLVM vectorizes every one (one loop
        # writing four arrays and reading six it leaves mostly scalar: too many pairs to check for overlap)
        for k in range(n):  # g += c dy: the state's gradient after token i
            g[k] += cs[k] * e
        for k in range(n):
            dcs[k] += h[k] * e
        gb = _F32(0.0)
        for k in range(n):
            gk = g[k]
            dbs[k] += gk * dx
            gb += gk * bs[k]
        pa = _F32(0.0)
        for k in range(n):  # back through the decay; p is the gradient of (delta a)[k]
            gk, dk = g[k], dec[k]
            p = gk * dk * prev[k]
            da[k] += p * step
            pa += p * av[k]
            g[k] = dk * gk
        dx_out[t, ch] = step * gb + e * skip
        grad_step = (pa + xv * gb) * slopes[i, ch]
        ddelta_out[t, ch] = grad_step
        acc_d += e * xv
        acc_bias += grad_step
    sums[0] += acc_d
    sums[1] += acc_bias


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
                slope[ch] = _F32(1.0) if v > _LINEAR else _sigmoid(v)
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
    hs, decays = np.empty((chunk + 1, n), _F32), np.empty((chunk, n), _F32)
    sums = np.zeros((hidden, 2), _F32)
    if not saved:  # the forward pass: the state leaving each chunk
        h = entering.copy()
        for k in range(count - 1):  # (the last chunk's states are recomputed in the reverse anyway)
            t0, span = k * chunk, min(chunk, seq - k * chunk)
            _chunk_steps(t0, span, x, delta, z, dy, delta_bias, softplus, steps, inputs, slopes, grads, gates)
            if n == 16:  # Mamba's d_state: a trip count LLVM knows, one 16-lane vector
                _advance(h, t0, span, 16, width, a, b, steps, inputs)
            else:
                _advance(h, t0, span, n, width, a, b, steps, inputs)
            keep[k] = h
    for k in range(count - 1, -1, -1):
        t0, span = k * chunk, min(chunk, seq - k * chunk)
        _chunk_steps(t0, span, x, delta, z, dy, delta_bias, softplus, steps, inputs, slopes, grads, gates)
        db_out[t0:t0 + span] = 0
        dc_out[t0:t0 + span] = 0
        for ch in range(hidden):
            start, grp = entering[ch] if k == 0 else keep[k - 1, ch], ch // width
            if n == 16:  # Mamba's d_state: a trip count LLVM knows, one 16-lane vector
                _recompute(ch, grp, t0, span, 16, x, c, b, a, d, dz_out, steps, inputs, gates, hs, decays, start)
            else:
                _recompute(ch, grp, t0, span, n, x, c, b, a, d, dz_out, steps, inputs, gates, hs, decays, start)
            if n == 16:  # (a constant LLVM propagates into the call it inlines: the reverse 3x faster)
                _reverse(ch, grp, t0, span, 16, x, c, b, a, d, dx_out, ddelta_out, db_out, dc_out, steps, inputs,
                         slopes, grads, hs, decays, d_state[ch], da[ch], sums[ch])
            else:
                _reverse(ch, grp, t0, span, n, x, c, b, a, d, dx_out, ddelta_out, db_out, dc_out, steps, inputs,
                         slopes, grads, hs, decays, d_state[ch], da[ch], sums[ch])
    for ch in range(dd.size):
        dd[ch] += sums[ch, 0]
    for ch in range(dbias.size):
        dbias[ch] += sums[ch, 1]
