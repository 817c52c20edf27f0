"""A float32 GEMM in the lstm step's register tiles (``jit.kernel`` says what its arguments are; where it runs:
the ``gemm`` module). Imported only through ``jit``.

``out = a · b`` blocked for the caches: a depth block of ``b`` is copied into blocks of a tile's columns
(``[K_BLOCK, 2*lanes]``, contiguous: 32 KiB at 16 lanes, in L1 while every panel of ``a`` passes over it), a
block of ``a``'s rows into panels of a tile's rows (``[M_BLOCK, K_BLOCK]``, 256 KiB: in L2 while every column
block passes over it); a tile keeps its ``rows x 2*lanes`` sums in registers over the depth block. Either
operand may come at any strides (a transposed view is packed as cheaply as a C-contiguous one); ``out``'s
columns must be adjacent. Tiles at an edge of ``out`` (rows past a whole panel, columns past a whole block)
run on a scratch tile whose live part is copied in and out, so nothing past ``out`` is read or written.
"""
from __future__ import annotations

import numba
import numpy as np
from numba import types

from .jit_lstm import _PANEL_8, _PANEL_16, _tile_8x2, _tile_16x2
from .jit_math import _F32, _FLAGS, _transpose8

_ANY = types.Array(types.float32, 2, "A")
#: Depth of the blocks a product is cut into: a column block of ``b`` is ``K_BLOCK x 2*lanes`` float32.
K_BLOCK = 256
#: Rows of ``a`` packed at a time (a multiple of both tiles' rows, 6 and 8).
M_BLOCK = 240


@numba.njit(inline="always")
def _pack_rows(a, m0, count, k0, depth, rows, panels):
    """``panels[p, k, r] = a[m0 + p*rows + r, k0 + k]`` for ``count`` rows of ``a`` from ``m0`` and ``depth`` of
    its columns from ``k0``; zeros for the rows past ``count`` in the last panel. Reads run along whichever axis
    of ``a`` is adjacent in memory; a whole panel of 8 rows whose columns lie together moves in 8 x 8 vector
    transposes (``jit_math._transpose8``)."""
    filled = (count + rows - 1) // rows
    across = depth // 8 * 8 if rows == 8 and a.strides[1] == 4 else 0
    for p in range(filled):
        panel = panels[p]
        live = min(rows, count - p * rows)
        if a.strides[0] == 4:  # a is a transposed view: a panel's row of ``rows`` values lies together
            for k in range(depth):
                for r in range(live):
                    panel[k, r] = a[m0 + p * rows + r, k0 + k]
                for r in range(live, rows):
                    panel[k, r] = 0
            continue
        done = across if live == rows else 0
        at = a.ctypes.data + (m0 + p * rows) * a.strides[0] + k0 * 4
        for k in range(0, done, 8):
            _transpose8(at + 4 * k, a.strides[0] // 4, panel.ctypes.data + 4 * k * rows, rows)
        for r in range(live):
            src = a[m0 + p * rows + r]
            for k in range(done, depth):
                panel[k, r] = src[k0 + k]
        for r in range(live, rows):
            for k in range(depth):
                panel[k, r] = 0


@numba.njit(inline="always")
def _pack_columns(b, k0, depth, width, blocks):
    """``blocks[j, k, c] = b[k0 + k, j*width + c]`` for ``depth`` rows of ``b`` from ``k0``; zeros past its last
    column. Reads run along whichever axis of ``b`` is adjacent in memory; in a transposed view, eight whole
    columns at a time move in 8 x 8 vector transposes."""
    cols = b.shape[1]
    if b.strides[0] == 4 and cols > 1:  # b is a transposed view: its columns lie together
        across = depth // 8 * 8
        for j in range(blocks.shape[0]):
            block = blocks[j]
            for c8 in range(0, width, 8):
                col = j * width + c8
                done = across if col + 8 <= cols else 0
                at = b.ctypes.data + k0 * 4 + col * b.strides[1]
                for k in range(0, done, 8):
                    _transpose8(at + 4 * k, b.strides[1] // 4, block.ctypes.data + 4 * (k * width + c8), width)
                for c in range(c8, c8 + 8):
                    if j * width + c < cols:
                        for k in range(done, depth):
                            block[k, c] = b[k0 + k, j * width + c]
                    else:
                        for k in range(depth):
                            block[k, c] = 0
    else:
        whole = cols // width  # blocks copied as they lie, then the last one's columns and zeros
        for k in range(depth):
            src = b[k0 + k]
            for j in range(whole):
                row = blocks[j, k]
                for c in range(width):
                    row[c] = src[j * width + c]
            if whole < blocks.shape[0]:
                row = blocks[whole, k]
                for c in range(width):
                    row[c] = src[whole * width + c] if whole * width + c < cols else 0


@numba.njit(inline="always")
def _tile(lanes, first, zeros, panel, src, width, depth, out, ldo):
    if lanes == 16:
        _tile_16x2(first, zeros, panel, src, width, depth, out, ldo)
    else:
        _tile_8x2(first, zeros, panel, src, width, depth, out, ldo)


@numba.njit(inline="always")
def _edge_tile(lanes, first, zeros, panel, src, width, depth, out, r0, c0, edge):
    """A tile over the live part of ``out`` from ``(r0, c0)`` (fewer rows or columns than a tile's), through
    ``edge``: the live sums copied in (zeros where ``first``), the tile, the live part copied back."""
    live_rows, live_cols = min(edge.shape[0], out.shape[0] - r0), min(width, out.shape[1] - c0)
    for r in range(edge.shape[0]):
        for c in range(width):
            edge[r, c] = out[r0 + r, c0 + c] if (not first and r < live_rows and c < live_cols) else 0
    _tile(lanes, 0, zeros, panel, src, width, depth, edge.ctypes.data, width)
    for r in range(live_rows):
        for c in range(live_cols):
            out[r0 + r, c0 + c] = edge[r, c]


@numba.njit(types.void(_ANY, _ANY, _ANY, types.intp), fastmath=_FLAGS, nogil=True, cache=True, error_model="numpy",
            boundscheck=False)
def gemm(a, b, out, lanes):
    """``out [m, n] = a [m, k] · b [k, n]`` in float32 over tiles of ``lanes`` (8 or 16,
    ``jit.lanes()``) float32 lanes; ``a`` and ``b`` at any strides, ``out``'s columns adjacent. Raises ValueError
    for shapes that do not fit together, before anything is written."""
    m, depth = a.shape
    n = b.shape[1]
    if lanes != 8 and lanes != 16:
        raise ValueError("gemm: lanes must be 8 or 16 (the tiles' widths)")
    if b.shape[0] != depth or out.shape[0] != m or out.shape[1] != n:
        raise ValueError("gemm: the arrays' shapes do not fit together")
    if n > 1 and out.strides[1] != 4:
        raise ValueError("gemm: out's columns must be adjacent in memory")
    if m == 0 or n == 0:
        return
    if depth == 0:
        out[...] = 0
        return
    rows, width = (_PANEL_16 if lanes == 16 else _PANEL_8), 2 * lanes
    ldo = out.strides[0] // 4
    column_blocks = (n + width - 1) // width
    blocks = np.empty((column_blocks, min(K_BLOCK, depth), width), _F32)
    panels = np.empty(((min(M_BLOCK, m) + rows - 1) // rows, min(K_BLOCK, depth), rows), _F32)
    edge, zeros = np.empty((rows, width), _F32), np.zeros(rows, _F32)
    for k0 in range(0, depth, K_BLOCK):
        kc = min(K_BLOCK, depth - k0)
        first = 1 if k0 == 0 else 0  # the sums start at 0, then at the depth blocks' before
        _pack_columns(b, k0, kc, width, blocks)
        for m0 in range(0, m, M_BLOCK):
            mc = min(M_BLOCK, m - m0)
            _pack_rows(a, m0, mc, k0, kc, rows, panels)
            for j in range(column_blocks):
                src, c0 = blocks[j].ctypes.data, j * width
                for p in range((mc + rows - 1) // rows):
                    r0 = m0 + p * rows
                    if r0 + rows <= m and c0 + width <= n:
                        _tile(lanes, first, zeros.ctypes.data, panels[p].ctypes.data, src, width, kc,
                              out.ctypes.data + (r0 * ldo + c0) * 4, ldo)
                    else:
                        _edge_tile(lanes, first, zeros.ctypes.data, panels[p].ctypes.data, src, width, kc, out,
                                   r0, c0, edge)


__all__ = ["gemm"]  # the kernel ``jit.kernel`` hands out
