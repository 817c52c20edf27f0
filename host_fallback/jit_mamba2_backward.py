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
- ``mamba2_backward_saved``: with a saved forward, all of step 3 for every chunk, one lane (row, head, chunk) at a
  time: its inputs copied and transposed into blocks that stay in L1 (the laid rows lie ``H * P`` values apart),
  the GEMMs in ``jit_lstm``'s register tiles over operands packed for them (the decays, the causal masks and the
  states' shares folded into the packing: three GEMMs, ``[W^T | to_end b]``, ``[dW | exp(cum) gy]``, ``[dW^T |
  to_end u]``, besides ``dW``'s own), then ``mamba2_backward_gradients``' tail. At B2 S1024 H8 P64 N64, one
  thread: the GEMMs about 40% of the pass, the transposes and packing 40%, writing the results the rest.

Loops run along the contiguous ``P`` or ``N`` values (LLVM vectorizes them); the dots' sums are reassociated
(``jit_ssm_steps._dot``), every other sum runs in a fixed order: the same bytes on every run of one build. No
fast-math flag but FMA contraction and the sign of zero: NaN and inf propagate as NumPy's.
"""
from __future__ import annotations

import numba
import numpy as np
from numba import types

from .jit_lstm import _PANEL_8, _PANEL_16, _tile_8x2, _tile_16x2
from .jit_math import _F32, _FLAGS, _exp_subnormal
from .jit_ssm_steps import _dot

#: the kernels ``jit.kernel`` hands out
__all__ = ["mamba2_backward_gradients", "mamba2_backward_operands", "mamba2_backward_saved",
           "mamba2_backward_state_gradients"]

_T1, _T2, _T3, _T4, _T5 = (types.Array(types.float32, d, "C") for d in (1, 2, 3, 4, 5))


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
                            step, out_x = dt[b, t, h], dx[b, t, h]
                            for j in range(p):
                                out_x[j] = got[j] * step
                            xdu[b, t, h] = _dot(x[b, t, h], got, p)
                        flag += _dot(got_c, zeros, n) + _dot(got_b, zeros, n)  # 0, or NaN for an inf or NaN
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


# --- a chunk with a saved forward, in one pass: its GEMMs in jit_lstm's register tiles ---------------------------
_A5 = types.Array(types.float32, 5, "A")


@numba.njit(fastmath=_FLAGS, inline="always")
def _times(lanes, first, panel, src, ld, k, out, ldo, lo, hi, zeros):
    """``out[rows, lo:hi] (+)= panelᵀ · src[k, lo:hi]`` (addresses; ``rows`` a tile's, ``PANEL_ROWS[lanes]``) in
    tiles of ``2 * lanes`` columns (``lo``, ``hi`` multiples of it): from 0 where ``first``, else adding to ``out``."""
    for j in range(lo, hi, 2 * lanes):
        if lanes == 16:
            _tile_16x2(first, zeros, panel, src + j * 4, ld, k, out + j * 4, ldo)
        else:
            _tile_8x2(first, zeros, panel, src + j * 4, ld, k, out + j * 4, ldo)


@numba.njit(fastmath=_FLAGS, inline="always")
def _turn(laid, bb, h, t, steps, into, scale, scaled, count):
    """``into[:, i] = laid[bb, t + i, h]`` (a lane's rows transposed) for ``i < steps``, 0 for the rest of ``into``'s
    columns; ``scaled[:, i] = into[:, i] * scale[i]`` where ``scale`` is given (not empty)."""
    width = into.shape[1]
    whole = steps // 8 * 8
    for i in range(0, whole, 8):  # eight rows at a time: a vector of eight stored per column
        r0, r1, r2, r3 = laid[bb, t + i, h], laid[bb, t + i + 1, h], laid[bb, t + i + 2, h], laid[bb, t + i + 3, h]
        r4, r5, r6, r7 = laid[bb, t + i + 4, h], laid[bb, t + i + 5, h], laid[bb, t + i + 6, h], laid[bb, t + i + 7, h]
        for j in range(count):
            line = into[j]
            line[i], line[i + 1], line[i + 2], line[i + 3] = r0[j], r1[j], r2[j], r3[j]
            line[i + 4], line[i + 5], line[i + 6], line[i + 7] = r4[j], r5[j], r6[j], r7[j]
    for i in range(whole, steps):
        row = laid[bb, t + i, h]
        for j in range(count):
            into[j, i] = row[j]
    for j in range(count):
        line = into[j]
        for i in range(steps, width):
            line[i] = 0.0
        if len(scale):
            out = scaled[j]
            for i in range(width):
                out[i] = line[i] * scale[i]


@numba.njit(fastmath=_FLAGS, inline="always")
def _pack(source, lo, hi, block, rows, factor, panel, at):
    """``panel[at + j - lo, r] = source[j, block * rows + r] * factor[block * rows + r]`` for ``lo <= j < hi``: rows
    ``lo..hi`` of ``source``, a tile's columns, scaled by ``factor`` (``source`` as wide as the padded chunk)."""
    i0 = block * rows
    for j in range(lo, hi):
        line, out = source[j], panel[at + j - lo]
        for r in range(rows):
            out[r] = line[i0 + r] * factor[i0 + r]


@numba.njit(types.void(types.int64, types.int64, types.float32, _T4, _T4, _T3, _T4, _T4, _T4, _T4, _T4, _A5, _T4,
                       _T5, _T4, _T4, _T4, _T4, _T3, _T2, types.boolean, _T4, _T3, _T4, _T3),
            fastmath=_FLAGS, nogil=True, error_model="numpy", boundscheck=False, cache=True)
def mamba2_backward_saved(lanes, seq, spread, cum, to_end, through, u, b, c, gy, ys, scores, s0, ends, d_state, du,
                          dc, db, dlogd, nonfinite, chain, x, dt, dx, xdu):
    """Every chunk's gradients with a saved forward (``ys [B, seq, H, P]``, ``scores [B, C, H, L, L]`` zero above
    their diagonals, ``ends [B, C, H, P, N]``), float32, C-contiguous but ``scores``: ``mamba2_backward_gradients``'
    results (same arguments; ``s0 [B, H, P, N]`` the initial state, ``through [C, B, H]`` each chunk's decay), one lane
    (batch row, head, chunk) at a time, the chunks from the last: the gradient ``dS`` of the state leaving the chunk
    (``d_state [B, H, P, N]``, the final state's, ends as the initial state's: ``dS = through dS + (exp(cum) gy)^T
    c`` a chunk, that product in the tiles too), ``<dS, S_end>``; ``gy``, ``u``, ``b`` transposed and
    ``gy``, ``b``, ``c`` copied into blocks zero past ``seq`` and out to whole tiles; ``dW = (gy u^T) * M`` by a GEMM
    of ``gy exp(cum - m)`` by ``u exp(m - cum)`` (unscaled, each entry then decayed on its own,
    where some ``|cum - m|`` exceeds ``spread``); then ``du = [W^T | to_end b] [gy; dS^T]``, ``dc = [dW | exp(cum)
    gy] [b; S_0]`` and ``db = [dW^T | to_end u] [c; dS]`` as GEMMs over operands packed for the tiles (``lanes`` 8
    or 16: ``jit.lanes()``), each block of rows reading only its causal part; then the log-decay's reverse sum, the
    chain rule and the check for non-finite values. With ``chain``, ``du`` is not written (``dx`` and ``xdu`` are)."""
    count, bsz, heads, length = cum.shape
    p, n = u.shape[3], b.shape[3]
    rows = _PANEL_16 if lanes == 16 else _PANEL_8
    wide = 2 * lanes
    blocks = -(-length // rows)
    lw = -(-max(blocks * rows, length) // wide) * wide  # the padded chunk: whole blocks of rows, whole tiles
    pw, nw = -(-p // wide) * wide, -(-n // wide) * wide
    pblocks = -(-p // rows)
    pg = max(pw, pblocks * rows)
    pan_s, sent = np.zeros((pblocks, length, rows), np.float32), np.zeros((pblocks * rows, nw), np.float32)
    d_now = np.zeros((p, n), np.float32)
    gy_t, u_t, b_t = np.zeros((p, lw), np.float32), np.zeros((p, lw), np.float32), np.zeros((n, lw), np.float32)
    u_down = np.zeros((p, lw), np.float32)  # decayed from the midpoint
    grid = np.zeros((lw, lw), np.float32)  # dW
    gy_l, b_l, c_l = np.zeros((lw, pg), np.float32), np.zeros((lw, nw), np.float32), np.zeros((lw, nw), np.float32)
    ds_t, ds, s_in = np.zeros((n, pw), np.float32), np.zeros((p, nw), np.float32), np.zeros((p, nw), np.float32)
    pan_g = np.zeros((blocks, p, rows), np.float32)
    pan_u = np.zeros((blocks, length + n, rows), np.float32)
    pan_c, pan_b = np.zeros((blocks, length + p, rows), np.float32), np.zeros((blocks, length + p, rows), np.float32)
    o_u, o_c, o_b = np.zeros((lw, pw), np.float32), np.zeros((lw, nw), np.float32), np.zeros((lw, nw), np.float32)
    zeros = np.zeros(max(rows, pw, nw), np.float32)
    up, down, grow, te = np.zeros(lw, np.float32), np.zeros(lw, np.float32), np.zeros(lw, np.float32), \
        np.zeros(lw, np.float32)
    middle, z_at = (length - 1) // 2, zeros.ctypes.data
    for bb in range(bsz):
        for h in range(heads):
            d_now[:, :] = d_state[bb, h]
            for k in range(count - 1, -1, -1):
                lane, m = cum[k, bb, h], cum[k, bb, h, middle]
                within = True
                for i in range(length):
                    within = within and abs(lane[i] - m) <= spread
                steps = min(length, seq - k * length)
                for i in range(length):
                    gap = lane[i] - m
                    live = i < steps
                    up[i] = (_exp_subnormal(gap) if within else _F32(1.0)) if live else _F32(0.0)
                    down[i] = (_exp_subnormal(-gap) if within else _F32(1.0)) if live else _F32(0.0)
                    grow[i] = _exp_subnormal(lane[i]) if live else _F32(0.0)
                    te[i] = to_end[k, bb, h, i] if live else _F32(0.0)
                t0 = k * length
                _turn(gy, bb, h, t0, steps, gy_t, up[:0], gy_t, p)
                _turn(u, bb, h, t0, steps, u_t, down, u_down, p)
                _turn(b, bb, h, t0, steps, b_t, up[:0], b_t, n)
                for i in range(length):
                    g_out, b_out, c_out = gy_l[i], b_l[i], c_l[i]
                    if i < steps:
                        g_in, b_in, c_in = gy[bb, t0 + i, h], b[bb, t0 + i, h], c[bb, t0 + i, h]
                        for j in range(p):
                            g_out[j] = g_in[j]
                        for j in range(n):
                            b_out[j] = b_in[j]
                        for j in range(n):
                            c_out[j] = c_in[j]
                    else:
                        g_out[:] = 0.0
                        b_out[:] = 0.0
                        c_out[:] = 0.0
                entering, leaving = s0[bb, h] if k == 0 else ends[bb, k - 1, h], ends[bb, k, h]
                at_end = _F32(0.0)
                for i in range(p):
                    for j in range(n):
                        ds_t[j, i] = d_now[i, j]
                    ds[i, :n] = d_now[i]
                    s_in[i, :n] = entering[i]
                    at_end += _dot(d_now[i], leaving[i], n)
                for block in range(pblocks):  # what the chunk's outputs send to the state entering it
                    for i in range(length):
                        line, out, scale = gy_l[i], pan_s[block, i], grow[i]
                        for r in range(rows):
                            out[r] = line[block * rows + r] * scale
                    _times(lanes, 1, pan_s[block].ctypes.data, c_l.ctypes.data, nw, length,
                           sent[block * rows].ctypes.data, nw, 0, nw, z_at)
                decay = through[k, bb, h]
                for i in range(p):
                    row, more = d_now[i], sent[i]
                    for j in range(n):
                        row[j] = decay * row[j] + more[j]
                for block in range(blocks):  # dW's rows to the diagonal
                    i0 = block * rows
                    _pack(gy_t, 0, p, block, rows, up, pan_g[block], 0)
                    _times(lanes, 1, pan_g[block].ctypes.data, u_down.ctypes.data, lw, p, grid[i0].ctypes.data, lw,
                           0, -(-(i0 + rows) // wide) * wide, z_at)
                weights = scores[bb, k, h]
                for block in range(blocks):  # the operands packed for the tiles
                    i0 = block * rows
                    for j in range(i0, length):  # W^T's and dW^T's upper parts
                        w_row, g_row, out_u, out_b = weights[j], grid[j], pan_u[block, j], pan_b[block, j]
                        if i0 + rows <= length:
                            for r in range(rows):
                                out_u[r] = w_row[i0 + r] if j >= i0 + r else _F32(0.0)
                                out_b[r] = g_row[i0 + r] if j >= i0 + r else _F32(0.0)
                        else:
                            for r in range(rows):
                                keep = i0 + r < length and j >= i0 + r
                                out_u[r] = w_row[min(i0 + r, length - 1)] if keep else _F32(0.0)
                                out_b[r] = g_row[i0 + r] if keep else _F32(0.0)
                    for r in range(rows):  # dW's lower part (0 past the diagonal)
                        g_row, out_c = grid[i0 + r], pan_c[block]
                        for j in range(min(i0 + rows, length)):
                            out_c[j, r] = g_row[j] if j <= i0 + r else _F32(0.0)
                    if not within:  # each entry decayed on its own
                        for j in range(i0, length):
                            for r in range(min(rows, length - i0)):
                                pan_b[block, j, r] *= _exp_subnormal(lane[j] - lane[i0 + r])
                        for j in range(min(i0 + rows, length)):
                            for r in range(min(rows, length - i0)):
                                pan_c[block, j, r] *= _exp_subnormal(lane[i0 + r] - lane[j])
                    _pack(b_t, 0, n, block, rows, te, pan_u[block], length)
                    _pack(gy_t, 0, p, block, rows, grow, pan_c[block], length)
                    _pack(u_t, 0, p, block, rows, te, pan_b[block], length)
                for block in range(blocks):
                    i0 = block * rows
                    hi = min(i0 + rows, length)
                    at_u, at_c, at_b = o_u[i0].ctypes.data, o_c[i0].ctypes.data, o_b[i0].ctypes.data
                    _times(lanes, 1, pan_u[block, i0].ctypes.data, gy_l[i0].ctypes.data, pg, length - i0, at_u, pw,
                           0, pw, z_at)
                    _times(lanes, 0, pan_u[block, length].ctypes.data, ds_t.ctypes.data, pw, n, at_u, pw, 0, pw,
                           z_at)
                    _times(lanes, 1, pan_c[block].ctypes.data, b_l.ctypes.data, nw, hi, at_c, nw, 0, nw, z_at)
                    _times(lanes, 0, pan_c[block, length].ctypes.data, s_in.ctypes.data, nw, p, at_c, nw, 0, nw,
                           z_at)
                    _times(lanes, 1, pan_b[block, i0].ctypes.data, c_l[i0].ctypes.data, nw, length - i0, at_b, nw,
                           0, nw, z_at)
                    _times(lanes, 0, pan_b[block, length].ctypes.data, ds.ctypes.data, nw, p, at_b, nw, 0, nw, z_at)
                acc, flag = at_end, _F32(0.0)
                for i in range(length - 1, -1, -1):
                    t = t0 + i
                    got, got_c, got_b = o_u[i], o_c[i], o_b[i]
                    out_u, out_c, out_b = du[bb, t, h], dc[bb, t, h], db[bb, t, h]
                    if not chain:  # (with it, dx and xdu carry du)
                        for j in range(p):
                            out_u[j] = got[j]
                    for j in range(n):
                        out_c[j] = got_c[j]
                    for j in range(n):
                        out_b[j] = got_b[j]
                    d_cum = _F32(0.0)
                    if i < steps:
                        d_cum = _dot(gy_l[i], ys[bb, t, h], p) - _dot(u[bb, t, h], got, p)
                        if chain:
                            step, out_x = dt[bb, t, h], dx[bb, t, h]
                            for j in range(p):
                                out_x[j] = got[j] * step
                            xdu[bb, t, h] = _dot(x[bb, t, h], got, p)
                        flag += _dot(got_c, zeros, n) + _dot(got_b, zeros, n)  # 0, or NaN for an inf or NaN
                    acc += d_cum
                    dlogd[bb, t, h] = acc
                nonfinite[bb, h] += flag + (acc - acc)
            d_state[bb, h] = d_now
