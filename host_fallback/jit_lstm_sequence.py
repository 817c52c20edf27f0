"""An lstm layer-direction's whole sequence in one compiled call, and its backpropagation through time
(``jit.kernel`` says what each argument is; where they apply: the ``lstm_sequence`` module). Imported only
through ``jit``."""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .jit_lstm import _F32_IR, _PANEL_8, _PANEL_16, _counted_loop, _i64, _tile_8x2, _tile_16x2
from .jit_math import _F32, _FLAGS, _ROWS, _exp


# --- an lstm layer-direction's whole sequence, and its backpropagation through time (small sizes) -----
# Batch-major, time-major as ``rnn_backward`` keeps them: ``u [S, B, 4H]`` the input projection plus bias
# in the ABI's gate order i f g o, the states ``[B, H]``. One call runs every step, with no packing of the
# weights beyond a zero-padded copy: a step's ``W_hh·h`` is the tiles above the other way round, the panel a
# group of batch rows (h transposed: each of its values broadcast) and the source ``W_hh^T``'s rows, whose
# vectors run along the gates, so that a batch of 8 fills a 16-lane tile's 8 rows. (Plain Numba loops over
# the same sums, re-reading the gates from memory for each of h's values, ran at a seventh of the speed.)
# A forward of one row (a decode) takes ``W_hh·h`` as dot products of W_hh's rows where they lie instead
# (``_w_hh_times``; the gru's and rnn's kernels too), four rows a pass with their sums in vector registers
# (``_dots``; 16 lanes: one AVX-512 vector, two of AVX2's). B1 S1 H256 (a 2-core Xeon, AVX-512): the lstm kernel
# 17 µs, NumPy's GEMV of the same 1 MiB 14. ``lens [B]`` are the rows' valid steps (empty: all): a row past its
# length takes no step (state unchanged, output 0, no gradient).

@numba.njit(fastmath=_FLAGS, inline="always")
def _tanh(x):
    return _F32(2.0) / (_F32(1.0) + _exp(_F32(-2.0) * x)) - _F32(1.0)


@numba.njit(inline="always")
def _walked(step, seq, backwards):
    return seq - 1 - step if backwards else step


@numba.njit(inline="always")
def _padded(n, lanes):
    return (n + lanes - 1) // lanes * lanes


@numba.njit(inline="always")
def _blocks(src, width):
    """``src [depth, cols]`` (any strides) as ``[ceil(cols/width), depth, width]`` blocks of adjacent columns,
    zero-padded: what a tile reads over its whole depth, contiguous (``src``'s own rows, 1-4 KiB apart, map a
    tile's ``depth`` loads to a few of L1's sets, which then miss: B32 H256, the step's W_hh·h 122 -> 83 µs)."""
    depth, cols = src.shape
    blocks = np.zeros(((cols + width - 1) // width, depth, width), _F32)
    for j0 in range(0, cols, 16):  # in 16 x 16 squares: whichever way src runs, a row at a time would touch a
        for k0 in range(0, depth, 16):  # page a value
            for j in range(j0, min(j0 + 16, cols)):
                block, lane = blocks[j // width], j % width
                for k in range(k0, min(k0 + 16, depth)):
                    block[k, lane] = src[k, j]
    return blocks


@numba.njit(inline="always")
def _batch_times(lanes, rows_of, n, panels, blocks, sums):
    """``sums[:n] += rows_of[:n] · W`` for ``rows_of [n, depth]`` (any row stride) and ``W [depth, cols]`` as
    ``_blocks`` of ``2*lanes`` columns, ``sums [>= n, >= blocks*2*lanes]``: ``rows_of`` transposed into ``panels``
    (``[>= ceil(n/rows), depth, rows]``, rows past ``n`` zero), then a block's tiles over every panel, while the
    block is in cache."""
    rows, depth, width = panels.shape[2], blocks.shape[1], blocks.shape[2]
    filled = (n + rows - 1) // rows
    for p in range(filled):
        panel = panels[p]
        for r in range(rows):
            b = p * rows + r
            if b < n:
                src = rows_of[b]
                for k in range(depth):
                    panel[k, r] = src[k]
            else:
                for k in range(depth):
                    panel[k, r] = 0
    zeros = panels.ctypes.data  # any readable address: the tiles start from what sums holds
    ldo = sums.shape[1]
    for j in range(blocks.shape[0]):
        block = blocks[j].ctypes.data
        for p in range(filled):
            out = sums.ctypes.data + (p * rows * ldo + j * width) * 4
            if lanes == 16:
                _tile_16x2(0, zeros, panels[p].ctypes.data, block, width, depth, out, ldo)
            else:
                _tile_8x2(0, zeros, panels[p].ctypes.data, block, width, depth, out, ldo)


def _dots(lanes: int, rows: int):
    """An intrinsic ``dots(w, ld, src, steps, out)`` (addresses; ``ld`` in elements): ``out[r, :lanes]`` the sums,
    lane by lane, of ``w[r*ld + k] * src[k]`` over ``k < steps*lanes`` for each of ``rows`` rows, in vector
    registers across the loop (the lanes' total is the row's dot product)."""
    vector = ir.VectorType(_F32_IR, lanes)

    @intrinsic
    def dots(typingctx, w, ld, src, steps, out):
        def codegen(context, builder, signature, args):
            w, ld, src, steps, out = args
            w, src, out = (builder.inttoptr(a, _F32_IR.as_pointer()) for a in (w, src, out))
            load = lambda ptr: builder.load(builder.bitcast(ptr, vector.as_pointer()), align=4)  # noqa: E731
            rows_at = [builder.gep(w, [builder.mul(_i64(r), ld)]) for r in range(rows)]
            zero = ir.Constant(vector, [0.0] * lanes)
            k, acc, close = _counted_loop(builder, "dots", steps, [zero] * rows)
            at = builder.mul(k, _i64(lanes))
            s = load(builder.gep(src, [at]))
            final = close([builder.fadd(builder.fmul(load(builder.gep(row, [at])), s, flags=("contract",)), a,
                                        flags=("contract",)) for row, a in zip(rows_at, acc)])
            for r, value in enumerate(final):
                builder.store(value, builder.bitcast(builder.gep(out, [_i64(r * lanes)]), vector.as_pointer()),
                              align=4)
            return context.get_dummy_value()
        return types.void(*[types.intp] * 5), codegen
    return dots


#: Rows of ``W_hh`` a pass of ``_row_dots`` takes, and the lanes of each one's partial sums.
_DOT_ROWS, _DOT_LANES = 4, 16
_dots_4x16, _dots_1x16 = _dots(_DOT_LANES, _DOT_ROWS), _dots(_DOT_LANES, 1)


@numba.njit(fastmath=_FLAGS, inline="always")
def _dot_total(lanes, q, row, src, whole):
    """Row ``q``'s dot product from its partial sums ``lanes[q]`` (``_dots``) and the depth past ``whole``."""
    total = _F32(0.0)
    for j in range(_DOT_LANES):
        total += lanes[q, j]
    for k in range(whole, row.size):
        total += row[k] * src[k]
    return total


@numba.njit(fastmath=_FLAGS, inline="always")
def _row_dots(src, w, out, lanes):
    """``out += W · src`` for ``W [rows, depth]`` as stored (C-contiguous): ``_DOT_ROWS`` of its rows a pass over
    ``src``, then one at a time, summed in vector registers (``_dots``) into ``lanes`` (``[_DOT_ROWS,
    _DOT_LANES]``), then across them (the depth past a whole number of lanes, one by one)."""
    rows, depth = w.shape
    whole, grouped = depth - depth % _DOT_LANES, rows - rows % _DOT_ROWS
    for r in range(0, grouped, _DOT_ROWS):
        _dots_4x16(w[r].ctypes.data, depth, src.ctypes.data, whole // _DOT_LANES, lanes.ctypes.data)
        for q in range(_DOT_ROWS):
            out[r + q] += _dot_total(lanes, q, w[r + q], src, whole)
    for r in range(grouped, rows):
        _dots_1x16(w[r].ctypes.data, depth, src.ctypes.data, whole // _DOT_LANES, lanes.ctypes.data)
        out[r] += _dot_total(lanes, 0, w[r], src, whole)


@numba.njit(inline="always")
def _forward_scratch(w_hh, batch, lanes):
    """What a forward kernel's ``W_hh·h`` works in (``_w_hh_times``): at a batch of one row the sums ``[1, rows]``
    and ``_row_dots``' lanes, nothing of ``W_hh`` copied; else ``_product_scratch`` of ``W_hh^T`` (its blocks, the
    panels and the sums, their columns padded to a tile's)."""
    if batch == 1:
        nothing = np.empty((0, 0, 0), _F32)
        return nothing, nothing, np.zeros((1, w_hh.shape[0]), _F32), np.empty((_DOT_ROWS, _DOT_LANES), _F32)
    w_t, panels, g = _product_scratch(w_hh.T, batch, lanes)
    return w_t, panels, g, np.empty((0, 0), _F32)


@numba.njit(inline="always")
def _w_hh_times(lanes, h, batch, w_hh, scratch):
    """``g[:batch] += h[:batch] · W_hh^T`` in ``scratch = (w_t, panels, g, dot_lanes)`` (``_forward_scratch``): a
    batch of one row (a decode) would fill one of a panel's rows and pay for the copy of ``W_hh^T`` every call, so
    it takes dot products of ``W_hh``'s rows where they lie (``_row_dots``); more take the tiles (``_batch_times``)."""
    w_t, panels, g, dot_lanes = scratch
    if batch == 1:
        _row_dots(h[0], w_hh, g[0], dot_lanes)
    else:
        _batch_times(lanes, h, batch, panels, w_t, g)


@numba.njit(inline="always")
def _tile_rows(lanes):
    if lanes != 8 and lanes != 16:
        raise ValueError("lstm_sequence / lstm_sequence_backward: lanes must be 8 or 16 (the tiles' widths)")
    return _PANEL_16 if lanes == 16 else _PANEL_8


@numba.njit(inline="always")
def _product_scratch(src, batch, lanes):
    """What ``_batch_times`` works in for the product of ``batch`` rows of depth ``src.shape[0]`` with ``src``
    (``[depth, width]``: W_hh^T forward, W_hh back): ``src`` in blocks of a tile's columns (``_blocks``), the
    panels of a tile's rows the batch is packed into, and the sums, a row per panel row and ``width`` padded to
    a tile's columns (zeros: a padded column is computed, never read)."""
    rows, tile = _tile_rows(lanes), 2 * lanes
    panels = np.empty(((batch + rows - 1) // rows, src.shape[0], rows), _F32)
    return _blocks(src, tile), panels, np.zeros((panels.shape[0] * rows, _padded(src.shape[1], tile)), _F32)


_SEQ = types.Array(types.float32, 3, "C")
_LENS = types.Array(types.int64, 1, "C")


@numba.njit(types.void(_SEQ, _ROWS, _ROWS, _ROWS, _LENS, types.boolean, _SEQ, types.boolean, _SEQ, _SEQ, _SEQ,
                       types.intp), fastmath=_FLAGS, nogil=True, cache=True, error_model="numpy", boundscheck=False)
def lstm_sequence(u, w_hh, h, c, lens, backwards, out, keep, h_prev, c_prev, hc, lanes):
    """Every step of one lstm layer-direction (``jit.kernel`` says what each argument is)."""
    seq, batch, four = u.shape
    hidden = four // 4
    if (four != 4 * hidden or w_hh.shape[0] != four or w_hh.shape[1] != hidden or h.shape[0] != batch
            or h.shape[1] != hidden or c.shape[0] != batch or c.shape[1] != hidden
            or (lens.size != 0 and lens.size != batch) or out.shape[0] != seq or out.shape[1] != batch
            or out.shape[2] != hidden):
        raise ValueError("lstm_sequence: the arrays' shapes do not fit together")
    if keep and (h_prev.shape != out.shape or c_prev.shape != out.shape or hc.shape != out.shape):
        raise ValueError("lstm_sequence: the kept arrays' shapes are not out's")
    scratch = _forward_scratch(w_hh, batch, lanes)
    g = scratch[2]
    cols = g.shape[1]
    tcs = np.empty(hidden, _F32)  # a row's tanh(c)
    # each gate column's activation as scale / (1 + exp(slope z)) - shift: σ for i f o, tanh for g (three loops
    # over the gates' blocks, of H columns each, ran scalar: about 7x slower at H=32)
    slope, scale, shift = np.full(cols, _F32(-1.0)), np.ones(cols, _F32), np.zeros(cols, _F32)
    for j in range(2 * hidden, 3 * hidden):
        slope[j], scale[j], shift[j] = _F32(-2.0), _F32(2.0), _F32(1.0)
    for step in range(seq):
        t = _walked(step, seq, backwards)
        for b in range(batch):
            gb, ub = g[b], u[t, b]
            for j in range(four):
                gb[j] = ub[j]
        _w_hh_times(lanes, h, batch, w_hh, scratch)
        for b in range(batch):
            gb, hb, cb, ob = g[b], h[b], c[b], out[t, b]
            for j in range(cols):  # σ(z) or tanh(z) = 2σ(2z) - 1 by the column's gate: one loop LLVM vectorizes
                gb[j] = scale[j] / (_F32(1.0) + _exp(slope[j] * gb[j])) - shift[j]
            if keep:
                ub, hp, cp = u[t, b], h_prev[t, b], c_prev[t, b]
                for j in range(four):
                    ub[j] = gb[j]
                for k in range(hidden):
                    hp[k] = hb[k]
                    cp[k] = cb[k]
            if lens.size != 0 and t >= lens[b]:
                for k in range(hidden):
                    ob[k] = 0
                continue
            for k in range(hidden):
                cn = gb[hidden + k] * cb[k] + gb[k] * gb[2 * hidden + k]
                cb[k] = cn
                tc = _tanh(cn)
                tcs[k] = tc
                hk = gb[3 * hidden + k] * tc
                hb[k] = hk
                ob[k] = hk
            if keep:
                hcb = hc[t, b]
                for k in range(hidden):
                    hcb[k] = tcs[k]


@numba.njit(types.void(_SEQ, _SEQ, _SEQ, _ROWS, _SEQ, _ROWS, _ROWS, _LENS, types.boolean, _SEQ, types.intp),
            fastmath=_FLAGS, nogil=True, cache=True, error_model="numpy", boundscheck=False)
def lstm_sequence_backward(y, hc, c_prev, w_hh, dy, dh, dc, lens, backwards, dz, lanes):
    """Backpropagation through the steps ``lstm_sequence`` kept (``jit.kernel`` says what each argument is)."""
    seq, batch, four = y.shape
    hidden = four // 4
    if (four != 4 * hidden or hc.shape[0] != seq or hc.shape[1] != batch or hc.shape[2] != hidden
            or c_prev.shape != hc.shape or dy.shape != hc.shape or w_hh.shape[0] != four or w_hh.shape[1] != hidden
            or dh.shape[0] != batch or dh.shape[1] != hidden or dc.shape[0] != batch or dc.shape[1] != hidden
            or (lens.size != 0 and lens.size != batch) or dz.shape != y.shape):
        raise ValueError("lstm_sequence_backward: the arrays' shapes do not fit together")
    w, panels, sums = _product_scratch(w_hh, batch, lanes)
    dhin = np.empty(hidden, _F32)  # a row's dh + dy
    for step in range(seq):
        t = _walked(step, seq, not backwards)  # the forward's walk, from its end
        for b in range(batch):
            zb = dz[t, b]
            if lens.size != 0 and t >= lens[b]:
                for j in range(four):
                    zb[j] = 0
                continue
            yb, hcb, cpb, dyb, dhb, dcb = y[t, b], hc[t, b], c_prev[t, b], dy[t, b], dh[b], dc[b]
            i, f, g, o = yb[:hidden], yb[hidden: 2 * hidden], yb[2 * hidden: 3 * hidden], yb[3 * hidden: four]
            zi, zf, zg, zo = zb[:hidden], zb[hidden: 2 * hidden], zb[2 * hidden: 3 * hidden], zb[3 * hidden: four]
            for k in range(hidden):  # loops of a few arrays each, as the forward's
                dhin[k] = dhb[k] + dyb[k]
            for k in range(hidden):
                zo[k] = dhin[k] * hcb[k] * (o[k] * (_F32(1.0) - o[k]))
            for k in range(hidden):  # the new cell's gradient
                dcb[k] = dhin[k] * o[k] * (_F32(1.0) - hcb[k] * hcb[k]) + dcb[k]
            for k in range(hidden):
                zi[k] = dcb[k] * g[k] * (i[k] * (_F32(1.0) - i[k]))
            for k in range(hidden):
                zf[k] = dcb[k] * cpb[k] * (f[k] * (_F32(1.0) - f[k]))
            for k in range(hidden):
                zg[k] = dcb[k] * i[k] * (_F32(1.0) - g[k] * g[k])
            for k in range(hidden):
                dcb[k] *= f[k]
        sums[:] = 0
        _batch_times(lanes, dz[t], batch, panels, w, sums)  # dh = dz · W_hh
        for b in range(batch):
            if lens.size == 0 or t < lens[b]:
                dhb, sb = dh[b], sums[b]
                for k in range(hidden):
                    dhb[k] = sb[k]


__all__ = ["lstm_sequence", "lstm_sequence_backward"]  # the kernels ``jit.kernel`` hands out
