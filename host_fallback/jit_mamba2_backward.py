"""The compiled passes of ``mamba2_backward``'s chunked path (where they apply and their arguments:
``mamba2_backward_chunked``, which runs them where Numba is there and the thunk computes in f32). Imported only
through ``jit``.

Without a saved forward the GEMMs stay NumPy's (OpenBLAS, near the core's peak at these 64-wide squares); the passes
between them are compiled, where NumPy made an array pass for each step of each, its inner loops 64 values long:

- ``mamba2_backward_operands``: a slab's decayed products' operands, ``gy exp(cum - m)`` and ``u exp(m - cum)``
  (written transposed, so that the GEMM takes both as laid), with the check of each chunk's spread;
- ``mamba2_backward_state_gradients``: the loop back over the chunks that makes the gradients of the states leaving
  each, in both layouts, and ``<dS, S>`` at each chunk's end;
- ``mamba2_backward_gradients``: what follows each slab's GEMMs, one lane (chunk, batch row, head) in one pass from
  the chunk's last step to its first: the leaving state's shares of ``du`` and ``db`` scaled by each step's decay to
  the chunk's end and added, the entering state's share of ``dc`` added, the dots ``u_i . du_i`` and the sum from
  the chunk's end of the log-decay's gradient (its ``gy . y`` terms too), written in the ``[B, S, H, ...]`` layout
  the op returns (with mamba2's chain rule through ``u = dt x``: ``du dt`` and ``du . x``), and a value per lane that
  is finite exactly when the lane's gradients are (a non-finite ``du_i`` reaches the log-decay's sum
  through ``u_i . du_i``; ``dc`` and ``db`` are checked on their own), where NumPy made about ten passes a slab;
- with a saved forward, ``jit_mamba2_saved``'s one pass (its module docstring).

Loops run along the contiguous ``P`` or ``N`` values (LLVM vectorizes them); the dots' sums are reassociated
(``jit_ssm_steps._dot``), every other sum runs in a fixed order: the same bytes on every run of one build. No
fast-math flag but FMA contraction and the sign of zero: NaN and inf propagate as NumPy's.
"""
from __future__ import annotations

import numba
import numpy as np
from numba import types

from .jit_math import _F32, _FLAGS, _exp_subnormal
from .jit_ssm_steps import _dot

#: the kernels ``jit.kernel`` hands out
__all__ = ["mamba2_backward_gradients", "mamba2_backward_operands", "mamba2_backward_state_gradients"]

_T1, _T2, _T3, _T4, _T5 = (types.Array(types.float32, d, "C") for d in (1, 2, 3, 4, 5))


@numba.njit(fastmath=_FLAGS, inline="always")
def _chained(du, step, x, dx, p):
    """mamba2's chain rule through ``u = dt x`` at one step: ``dx = du dt`` written, ``du . x`` (dt's share)
    returned."""
    for j in range(p):
        dx[j] = du[j] * step
    return _dot(x, du, p)


@numba.njit(fastmath=_FLAGS, inline="always")
def _unfinite(dc, db, zeros, n):
    """0, or NaN where ``dc`` or ``db`` (a step's) holds an inf or a NaN."""
    return _dot(dc, zeros, n) + _dot(db, zeros, n)


@numba.njit(types.void(types.int64, types.int64, _T5, _T5, _T5, _T4, _T4, types.int64, _T4, _T4, types.boolean,
                       _T3, _T4, _T4, _T4, _T4, _T3, _T2, types.boolean, _T4, _T3, _T4, _T3),
            fastmath=_FLAGS, nogil=True, error_model="numpy", boundscheck=False, cache=True)
def mamba2_backward_gradients(first, seq, to_state, entering, leaving_b, to_end, ys, y_first, gy, c, entered,
                              end_dot, u, du, dc, db, dlogd, nonfinite, chain, x, dt, dx, xdu):
    """The gradients of a slab of chunks ``first, first + 1, ...`` (``[K, B, H, L, ...]`` its products, one chunk
    ``K`` to an index), float32, C-contiguous:

    ``du, dc, db`` (``[B, S', H, ...]``, ``S'`` the padded length) hold ``W^T gy``, ``(gy u^T * M) b`` and ``(gy u^T
    * M)^T c`` at the slab's steps, and get the states' shares added in place: ``du += to_end * to_state`` (``b
    dS^T``, ``[K, B, H, L, P]``), ``dc += entering`` (``(exp(cum) gy) S_0``), ``db += to_end * leaving_b`` (``u dS``,
    ``[K, B, H, L, N]``), ``S_0`` the state entering the chunk and ``dS`` the gradient of the one leaving it;
    ``to_end [C, B, H, L]`` is each step's decay to its chunk's end and ``end_dot [C, B, H]`` ``<dS, S_end>``, for
    every chunk. The log-decay gradient's terms before ``- u_i . du_i`` are ``gy_i . y_i``: ``ys [B, S'', H, P]``
    holds ``y`` from step ``y_first`` on (a saved forward's), or with ``entered`` the intra-chunk part ``W u`` of it,
    the entering state's share then ``c_i . entering_i``; ``gy, u [B, seq, H, P]`` and ``c [B, seq, H, N]``.
    Writes ``dlogd [B, S', H]``, the sum from the chunk's end of ``gy . y - u . du`` (``end_dot`` at its last step;
    padded steps, ``t >= seq``, have no inputs), and adds to ``nonfinite [B, H]`` a value that is finite exactly when
    the lane's values are (steps before ``seq``). With ``chain`` (mamba2's ``u = dt x``: ``x [B, seq, H, P]``, ``dt
    [B, seq, H]``) also the chain rule's ``dx = du dt`` and ``xdu = du . x`` (``[B, seq, H, ...]``) at those steps."""
    chunks, bsz, heads, length, p = to_state.shape
    n = entering.shape[4]
    zeros = np.zeros(max(p, n), np.float32)
    for kk in range(chunks):
        k = first + kk
        for b in range(bsz):
            for h in range(heads):
                acc = end_dot[k, b, h]
                flag = _F32(0.0)
                for i in range(length - 1, -1, -1):
                    t = k * length + i
                    e = to_end[k, b, h, i]
                    got, share = du[b, t, h], to_state[kk, b, h, i]
                    for j in range(p):
                        got[j] += e * share[j]
                    got_c, share_c = dc[b, t, h], entering[kk, b, h, i]
                    for j in range(n):
                        got_c[j] += share_c[j]
                    got_b, share_b = db[b, t, h], leaving_b[kk, b, h, i]
                    for j in range(n):
                        got_b[j] += e * share_b[j]
                    d_cum = _F32(0.0)
                    if t < seq:
                        d_cum = _dot(gy[b, t, h], ys[b, t - y_first, h], p)
                        if entered:
                            d_cum += _dot(c[b, t, h], share_c, n)
                        d_cum -= _dot(u[b, t, h], got, p)
                        if chain:
                            xdu[b, t, h] = _chained(got, dt[b, t, h], x[b, t, h], dx[b, t, h], p)
                        flag += _unfinite(got_c, got_b, zeros, n)
                    acc += d_cum
                    dlogd[b, t, h] = acc
                nonfinite[b, h] += flag + (acc - acc)  # acc: every d_cum summed, so every du too


@numba.njit(types.void(types.int64, types.int64, _T4, _T4, _T4, _T5, _T5, _T3, types.float32),
            fastmath=_FLAGS, nogil=True, error_model="numpy", boundscheck=False, cache=True)
def mamba2_backward_operands(first, seq, left, right, cum, lhs, rhs_t, fits, spread):
    """The operands of a slab's decayed products ``(left right^T) * M`` (``mamba2_backward_chunked._decayed``),
    float32, C-contiguous, for the chunks ``first, first + 1, ...`` of ``lhs [K, B, H, L, X]``: ``lhs = left
    exp(cum - m)`` and ``rhs_t [K, B, H, X, L]``, ``right exp(m - cum)`` transposed, from ``left, right [B, seq, H,
    X]`` (0 at padded steps, ``t >= seq``) and ``cum [C, B, H, L]`` (``m``: the cumulative log-decay of step ``(L -
    1) // 2``); ``fits [K, B, H]`` 1 where every ``|cum - m|`` is at most ``spread``, else 0 (NaN included)."""
    chunks, bsz, heads, length, x = lhs.shape
    middle = (length - 1) // 2
    up, down = np.empty(length, np.float32), np.empty(length, np.float32)
    for kk in range(chunks):
        k = first + kk
        for b in range(bsz):
            for h in range(heads):
                lane, m = cum[k, b, h], cum[k, b, h, middle]
                within = True
                for i in range(length):
                    gap = lane[i] - m
                    up[i], down[i] = _exp_subnormal(gap), _exp_subnormal(-gap)
                    within = within and abs(gap) <= spread
                fits[kk, b, h] = 1.0 if within else 0.0
                turned = rhs_t[kk, b, h]
                for i in range(length):
                    t = k * length + i
                    row = lhs[kk, b, h, i]
                    if t < seq:
                        src, e, other, f = left[b, t, h], up[i], right[b, t, h], down[i]
                        for j in range(x):
                            row[j] = src[j] * e
                        for j in range(x):
                            turned[j, i] = other[j] * f
                    else:
                        for j in range(x):
                            row[j] = 0.0
                            turned[j, i] = 0.0


@numba.njit(types.void(_T3, _T5, _T5, _T5, _T4, _T3),
            fastmath=_FLAGS, nogil=True, error_model="numpy", boundscheck=False, cache=True)
def mamba2_backward_state_gradients(through, leaving, leaving_t, ends, d, end_dot):
    """The gradients of the states leaving each chunk, float32, C-contiguous: ``leaving [C, B, H, P, N]`` holds what
    each chunk's outputs send to the state entering it and is overwritten by the gradient of the state leaving it,
    ``leaving_t [C, B, H, N, P]`` the same transposed; ``d [B, H, P, N]``, the final state's gradient, ends as the
    initial state's (each chunk's ``d = through d + sent``, ``through [C, B, H]`` its decay); ``end_dot [C, B, H]``
    gets ``<d, S>`` at each chunk's end (``S``: the state leaving it, ``ends [B, C, H, P, N]``)."""
    count, bsz, heads, p, n = leaving.shape
    for b in range(bsz):
        for h in range(heads):
            grad = d[b, h]
            for k in range(count - 1, -1, -1):
                state = ends[b, k, h]
                sent, turned, decay = leaving[k, b, h], leaving_t[k, b, h], through[k, b, h]
                total = _F32(0.0)
                for i in range(p):
                    row, out = grad[i], sent[i]
                    total += _dot(row, state[i], n)
                    for j in range(n):
                        turned[j, i] = row[j]
                    for j in range(n):
                        kept = out[j]
                        out[j] = row[j]
                        row[j] = decay * row[j] + kept
                end_dot[k, b, h] = total
