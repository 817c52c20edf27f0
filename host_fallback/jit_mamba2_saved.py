"""The compiled pass of ``mamba2_backward``'s chunked path with a saved forward (ABI.md §9.1; where it applies and its
arguments: ``mamba2_backward_chunked``, which runs it where Numba is there and the thunk computes in f32). Imported
only through ``jit``.

``mamba2_backward_saved``: all of step 3 for every chunk, one lane (row, head, chunk) at a time, from the last chunk:
its inputs copied and transposed into blocks that stay in L1 (the laid rows lie ``H * P`` values apart), the GEMMs in
``jit_lstm``'s register tiles over operands packed for them (the decays, the causal masks and the states' shares
folded into the packing: three GEMMs, ``[W^T | to_end b]``, ``[dW | exp(cum) gy]``, ``[dW^T | to_end u]``, besides
``dW``'s own), then ``jit_mamba2_backward.mamba2_backward_gradients``' tail; meanwhile the next lane's rows are
prefetched. At B2 S1024 H8 P64 N64, one thread (about 18 ms; parts switched off in a copy of the pass): the three
product GEMMs 6.7 ms (~94 GFLOP/s), packing the operands 3.4 (the causal masks 0.8), the states' gradient 3.2,
writing the lane 1.9, dW's GEMM 1.0, the transposes 0.75, the decays 0.6. Its steps are the inline functions below,
in the order the pass calls them.

Sums run in a fixed order but the dots' (``jit_ssm_steps._dot``): the same bytes on every run of one build. No
fast-math flag but FMA contraction and the sign of zero: NaN and inf propagate as NumPy's.
"""
from __future__ import annotations

import numba
import numpy as np
from numba import types

from .jit_lstm import _PANEL_8, _PANEL_16, _tile_8x2, _tile_16x2
from .jit_mamba2_backward import _chained
from .jit_math import _F32, _FLAGS, _exp_subnormal, _prefetch, _transpose8
from .jit_ssm_steps import _dot

#: the kernels ``jit.kernel`` hands out
__all__ = ["mamba2_backward_saved"]

_T2, _T3, _T4, _T5 = (types.Array(types.float32, d, "C") for d in (2, 3, 4, 5))
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
def _turn(laid, bb, h, t, steps, into, scale, scaled, count, times):
    """``into[:, i] = laid[bb, t + i, h]`` (a lane's rows transposed) for ``i < steps``, times ``times[i]`` where
    ``times`` is given (not empty), 0 for the rest of ``into``'s columns; ``scaled[:, i] = into[:, i] * scale[i]``
    where ``scale`` is given."""
    width, ld = into.shape[1], laid.strides[1] // 4
    whole, across = steps // 8 * 8, count // 8 * 8
    for i in range(0, whole, 8):  # eight rows at a time: 8 x 8 blocks in vector shuffles, then the odd columns
        at = laid[bb, t + i, h].ctypes.data
        for j in range(0, across, 8):
            _transpose8(at + 4 * j, ld, into.ctypes.data + 4 * (j * width + i), width)
        for j in range(across, count):
            for r in range(8):
                into[j, i + r] = laid[bb, t + i + r, h, j]
    for i in range(whole, steps):
        row = laid[bb, t + i, h]
        for j in range(count):
            into[j, i] = row[j]
    for j in range(count):
        line = into[j]
        if len(times):
            for i in range(steps):
                line[i] *= times[i]
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


@numba.njit(fastmath=_FLAGS, inline="always")
def _fetch_rows(laid, bb, t0, steps, h):
    """Prefetches the lines of ``laid[bb, t0 : t0 + steps, h]`` (``laid`` ``[B, S, H, ...]``, C-contiguous)."""
    width = laid.strides[2]
    for t in range(t0, t0 + steps):
        at = laid.ctypes.data + ((bb * laid.shape[1] + t) * laid.shape[2] + h) * width
        for line in range(at - at % 64, at + width, 64):
            _prefetch(line)


@numba.njit(fastmath=_FLAGS, inline="always")
def _fetch_next(bb, h, k, count, length, seq, laid, weights, dlogd, chain, dt, dx, xdu, du):
    """Prefetches what the lane after ``(bb, h, k)`` reads and writes of the laid arrays (``laid``, ``[B, S, H, ...]``:
    ``gy``, ``u`` (``x`` with ``chain``), ``b``, ``c``, ``y``, ``dc``, ``db``; ``dlogd``, and ``dt``, ``dx``, ``xdu``
    with ``chain``, else ``du``) and its ``weights`` (``[B, C, H, L, L]``), to come in while this lane computes: a lane's rows lie
    ``H`` rows apart, which the hardware's prefetchers do not follow (B2 S1024 H8 P64 N64, one thread: the pass
    4-10% faster)."""
    if k == 0:  # the next head's (or batch row's) last chunk
        bb, h, k = (bb, h + 1, count) if h + 1 < weights.shape[2] else (bb + 1, 0, count)
        if bb == weights.shape[0]:
            return
    k -= 1
    t0 = k * length
    steps = min(length, seq - t0)
    for arr in laid:
        _fetch_rows(arr, bb, t0, steps, h)
    _fetch_rows(dlogd, bb, t0, steps, h)
    if chain:
        _fetch_rows(dx, bb, t0, steps, h)
        for arr in (dt, xdu):
            _fetch_rows(arr, bb, t0, steps, h)
    else:
        _fetch_rows(du, bb, t0, steps, h)
    grid = weights[bb, k, h]
    for i in range(length):
        at = grid[i].ctypes.data
        for line in range(at - at % 64, at + 4 * length, 64):
            _prefetch(line)


@numba.njit(fastmath=_FLAGS, inline="always")
def _lane_decays(lane, m, spread, to_end, steps, up, down, grow, te):
    """A lane's decays: ``up = exp(cum - m)``, ``down = exp(m - cum)`` (``m`` the chunk's midpoint's; both 1 where some
    ``|cum - m|`` exceeds ``spread``: the entries are then decayed on their own), ``grow = exp(cum)`` and ``te`` the
    decay to the chunk's end, each 0 from ``steps`` on; returns whether every ``|cum - m|`` is within ``spread``."""
    length = lane.shape[0]
    within = True
    for i in range(length):
        within = within and abs(lane[i] - m) <= spread
    for i in range(length):
        gap = lane[i] - m
        live = i < steps
        up[i] = (_exp_subnormal(gap) if within else _F32(1.0)) if live else _F32(0.0)
        down[i] = (_exp_subnormal(-gap) if within else _F32(1.0)) if live else _F32(0.0)
        grow[i] = _exp_subnormal(lane[i]) if live else _F32(0.0)
        te[i] = to_end[i] if live else _F32(0.0)
    return within


@numba.njit(fastmath=_FLAGS, inline="always")
def _rows_of(laid, bb, h, t0, steps, length, out, width):
    """``out[i, :width] = laid[bb, t0 + i, h]`` for the chunk's rows ``i < steps``, its rows past them to ``length`` 0
    (the padding past ``length`` rows and ``width`` columns stays the zeros it was made with)."""
    for i in range(length):
        line = out[i]
        if i < steps:
            row = laid[bb, t0 + i, h]
            for j in range(width):
                line[j] = row[j]
        else:
            line[:] = 0.0


@numba.njit(fastmath=_FLAGS, inline="always")
def _state_gradient(lanes, rows, decay, d_now, entering, leaving, ds_t, ds, s_in, gy_l, grow, c_l, pan_s, sent, z_at):
    """The state terms of a chunk: ``ds`` and ``ds_t`` (``dS`` and ``dS^T``, ``d_now`` the gradient of the state
    leaving the chunk) and ``s_in`` (the state entering it, where not ``entering`` itself) laid for the tiles; ``d_now`` becomes the gradient of the
    entering state, ``decay dS + (exp(cum) gy)^T c`` (that product in the tiles, through ``pan_s`` into ``sent``);
    returns ``<dS, S_end>``."""
    p, n = d_now.shape
    length, nw = pan_s.shape[1], sent.shape[1]
    at_end = _F32(0.0)
    _turn(d_now.reshape((1, p, 1, n)), 0, 0, 0, p, ds_t, grow[:0], ds_t, n, grow[:0])  # dS^T
    for i in range(p):
        ds[i, :n] = d_now[i]
        if s_in.shape[1] != n:
            s_in[i, :n] = entering[i]
        at_end += _dot(d_now[i], leaving[i], n)
    for block in range(pan_s.shape[0]):  # what the chunk's outputs send to the state entering it
        for i in range(length):
            line, out, scale = gy_l[i], pan_s[block, i], grow[i]
            for r in range(rows):
                out[r] = line[block * rows + r] * scale
        _times(lanes, 1, pan_s[block].ctypes.data, c_l.ctypes.data, nw, length, sent[block * rows].ctypes.data, nw, 0,
               nw, z_at)
    for i in range(p):
        row, more = d_now[i], sent[i]
        for j in range(n):
            row[j] = decay * row[j] + more[j]
    return at_end


@numba.njit(fastmath=_FLAGS, inline="always")
def _operands(rows, weights, grid, within, lane, b_t, gy_t, u_t, te, grow, pan_u, pan_b, pan_c):
    """The left operands of a chunk's three GEMMs packed for the tiles, block of rows by block: ``[W^T | to_end b]``
    (``pan_u``), ``[dW | exp(cum) gy]`` (``pan_c``) and ``[dW^T | to_end u]`` (``pan_b``), each block reading only its
    causal part (``weights`` the saved scores, ``grid`` dW; ``lane`` the cumulative log-decays, by which each entry
    is decayed on its own where not ``within``)."""
    length = lane.shape[0]
    n, p = b_t.shape[0], gy_t.shape[0]
    for block in range(pan_u.shape[0]):
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


@numba.njit(fastmath=_FLAGS, inline="always")
def _lane_products(lanes, rows, pan_u, pan_c, pan_b, gy_l, ds_t, b_l, s_in, c_l, ds, o_u, at_c, at_b, ld, nw, z_at):
    """A chunk's ``du = [W^T | to_end b] [gy; dS^T]``, ``dc = [dW | exp(cum) gy] [b; S_0]`` and ``db = [dW^T | to_end
    u] [c; dS]`` into ``o_u`` and at the addresses ``at_c``, ``at_b`` (rows ``ld`` apart, ``nw`` wide), block of
    rows by block, each over its causal rows only."""
    length = pan_u.shape[1] - ds_t.shape[0]
    n, p = ds_t.shape[0], s_in.shape[0]
    pw, pg, nl = o_u.shape[1], gy_l.shape[1], b_l.shape[1]
    for block in range(pan_u.shape[0]):
        i0 = block * rows
        hi = min(i0 + rows, length)
        at_u, to_c, to_b = o_u[i0].ctypes.data, at_c + 4 * i0 * ld, at_b + 4 * i0 * ld
        _times(lanes, 1, pan_u[block, i0].ctypes.data, gy_l[i0].ctypes.data, pg, length - i0, at_u, pw, 0, pw, z_at)
        _times(lanes, 0, pan_u[block, length].ctypes.data, ds_t.ctypes.data, pw, n, at_u, pw, 0, pw, z_at)
        _times(lanes, 1, pan_c[block].ctypes.data, b_l.ctypes.data, nl, hi, to_c, ld, 0, nw, z_at)
        _times(lanes, 0, pan_c[block, length].ctypes.data, s_in.ctypes.data, nl, p, to_c, ld, 0, nw, z_at)
        _times(lanes, 1, pan_b[block, i0].ctypes.data, c_l[i0].ctypes.data, nl, length - i0, to_b, ld, 0, nw, z_at)
        _times(lanes, 0, pan_b[block, length].ctypes.data, ds.ctypes.data, nl, p, to_b, ld, 0, nw, z_at)


@numba.njit(fastmath={"reassoc", "nsz", "contract"}, nogil=True, error_model="numpy", boundscheck=False)
def _unfinite(o_c, o_b, bb, t0, h, steps, n):
    """0, or NaN where ``o_c[bb, t0 : t0 + steps, h, :n]`` or ``o_b``'s holds an inf or a NaN: one call a lane, its sums
    reassociated (only here) so that LLVM runs them in vector lanes (where a dot a step cost about 1 ms of the pass's
    18 at B2 S1024 H8 P64 N64)."""
    total = _F32(0.0)
    for i in range(steps):
        row_c, row_b = o_c[bb, t0 + i, h], o_b[bb, t0 + i, h]
        for j in range(n):
            total += row_c[j] * _F32(0.0) + row_b[j] * _F32(0.0)
    return total


@numba.njit(fastmath=_FLAGS, inline="always")
def _write_lane(bb, h, t0, length, steps, at_end, o_u, o_c, o_b, direct, gy_l, ys, u, du, dc, db, dlogd, chain, x,
                dt, dx, xdu):
    """A chunk's ``du`` (or, with ``chain``, ``dx`` and ``xdu``), ``dc`` and ``db`` (unless ``direct``: the tiles wrote
    them) written to its ``length`` steps (the arrays are padded as long), and the log-decay's gradient summed from the
    chunk's end (``at_end`` the state term of its last step); returns 0, or NaN where a gradient of the lane is not
    finite."""
    p, n = u.shape[3], dc.shape[3]
    acc = at_end
    if direct:
        flag = _unfinite(dc, db, bb, t0, h, steps, n)
    else:
        flag = _unfinite(o_c.reshape((1, o_c.shape[0], 1, o_c.shape[1])), o_b.reshape((1, o_b.shape[0], 1,
                         o_b.shape[1])), 0, 0, 0, steps, n)
    for i in range(length - 1, -1, -1):
        t = t0 + i
        got, got_c, got_b = o_u[i], o_c[i], o_b[i]
        out_u, out_c, out_b = du[bb, t, h], dc[bb, t, h], db[bb, t, h]
        if not chain:  # (with it, dx and xdu carry du)
            for j in range(p):
                out_u[j] = got[j]
        if not direct:
            for j in range(n):
                out_c[j] = got_c[j]
            for j in range(n):
                out_b[j] = got_b[j]
        d_cum = _F32(0.0)
        if i < steps:
            if chain:  # u . du = dt (x . du)
                share = xdu[bb, t, h] = _chained(got, dt[bb, t, h], x[bb, t, h], dx[bb, t, h], p)
                d_cum = _dot(gy_l[i], ys[bb, t, h], p) - dt[bb, t, h] * share
            else:
                d_cum = _dot(gy_l[i], ys[bb, t, h], p) - _dot(u[bb, t, h], got, p)
        acc += d_cum
        dlogd[bb, t, h] = acc
    return flag + (acc - acc)


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
    or 16: ``jit.lanes()``), each block of rows reading only its causal part (a whole chunk's ``dc`` and ``db`` written
    where they lie); then the log-decay's reverse sum, the
    chain rule and the check for non-finite values. With ``chain``, ``u`` is not read (``u = dt x``
    is formed lane by lane from ``x`` and ``dt``, as NumPy rounds it) and ``du`` not written (``dx`` and ``xdu`` are)."""
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
    up, down, grow, te, step = np.zeros(lw, np.float32), np.zeros(lw, np.float32), np.zeros(lw, np.float32), \
        np.zeros(lw, np.float32), np.zeros(lw, np.float32)
    middle, z_at = (length - 1) // 2, zeros.ctypes.data
    for bb in range(bsz):
        for h in range(heads):
            d_now[:, :] = d_state[bb, h]
            for k in range(count - 1, -1, -1):
                lane, t0 = cum[k, bb, h], k * length
                steps = min(length, seq - t0)
                _fetch_next(bb, h, k, count, length, seq, (gy, x if chain else u, b, c, ys, dc, db), scores, dlogd,
                            chain, dt, dx, xdu, du)
                within = _lane_decays(lane, lane[middle], spread, to_end[k, bb, h], steps, up, down, grow, te)
                _turn(gy, bb, h, t0, steps, gy_t, up[:0], gy_t, p, up[:0])
                if chain:  # u = dt x, formed here
                    for i in range(steps):
                        step[i] = dt[bb, t0 + i, h]
                _turn(x if chain else u, bb, h, t0, steps, u_t, down, u_down, p, step[:steps] if chain else step[:0])
                _turn(b, bb, h, t0, steps, b_t, up[:0], b_t, n, up[:0])
                _rows_of(gy, bb, h, t0, steps, length, gy_l, p)
                _rows_of(b, bb, h, t0, steps, length, b_l, n)
                _rows_of(c, bb, h, t0, steps, length, c_l, n)
                entering, leaving = s0[bb, h] if k == 0 else ends[bb, k - 1, h], ends[bb, k, h]
                at_end = _state_gradient(lanes, rows, through[k, bb, h], d_now, entering, leaving, ds_t, ds, s_in,
                                         gy_l, grow, c_l, pan_s, sent, z_at)
                for block in range(blocks):  # dW's rows to the diagonal
                    i0 = block * rows
                    _pack(gy_t, 0, p, block, rows, up, pan_g[block], 0)
                    _times(lanes, 1, pan_g[block].ctypes.data, u_down.ctypes.data, lw, p, grid[i0].ctypes.data, lw,
                           0, -(-(i0 + rows) // wide) * wide, z_at)
                _operands(rows, scores[bb, k, h], grid, within, lane, b_t, gy_t, u_t, te, grow, pan_u, pan_b, pan_c)
                direct = steps == length and blocks * rows == length and nw == n  # the tiles write dc, db in place
                at_c, at_b, ld = (dc[bb, t0, h].ctypes.data, db[bb, t0, h].ctypes.data, dc.strides[1] // 4) if direct \
                    else (o_c.ctypes.data, o_b.ctypes.data, nw)
                _lane_products(lanes, rows, pan_u, pan_c, pan_b, gy_l, ds_t, b_l, entering if nw == n else s_in, c_l,
                               ds, o_u, at_c, at_b, ld, nw, z_at)
                nonfinite[bb, h] += _write_lane(bb, h, t0, length, steps, at_end, o_u, o_c, o_b, direct, gy_l, ys, u,
                                                du, dc, db, dlogd, chain, x, dt, dx, xdu)
            d_state[bb, h] = d_now
