"""The compiled lstm step (``jit.kernel`` says what each argument is): its two GEMMs in register tiles
written as LLVM IR, over weights packed once per call (``lstm_panels``, ``lstm_panel_bias``), then the
gates, the cell and ``o·tanh(c)`` in vectorized passes. Imported only through ``jit``."""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .jit_math import _F32, _FLAGS, _ROWS, _clipped, _copy, _exp

_ROW = types.Array(types.float32, 1, "C")
_VIEW = types.Array(types.float32, 2, "A")  # a view at any strides
_PACKED = types.Array(types.float32, 3, "C")
_ORDER = types.Array(types.int64, 1, "C")


# --- the lstm step: its GEMMs in register tiles of LLVM's vector code ------------------------------
# A step's gates are W_hh·h + W_ih·x_t + b: at B=32 H=256 33.5-50 MFLOP, in GEMMs too narrow (32
# columns) for OpenBLAS to amortize packing the weights on every call. Here the weights are packed once
# per call, into panels of a few rows; a tile multiplies a panel (each element broadcast) by one or two
# vectors of adjacent columns of h or x_t in rows x vectors accumulators, which start at the bias (or at
# the previous K block's sums) and stay in registers over the K loop, and W_ih·x_t needs no projection
# block between the steps. The tiles are written as LLVM IR, since LLVM's vectorizers do not keep such a
# block in registers from scalar Numba code (a scalar 6 x 16 version ran at 3.7 GFLOP/s).
#
# The vector width is the CPU's (``jit.lanes``): 8 float32 lanes (AVX2's ymm) or 16 (AVX-512's zmm). A tile
# holds rows x 2 vectors of sums, 2 vectors of a source row and a broadcast weight in registers: 6 rows with
# 8 lanes (15 of AVX2's 16 ymm; 12 sums keep both FMA pipes busy through their 4-cycle latency), 8 with 16
# lanes (19 of AVX-512's 32 zmm: 12 rows ran no faster, and pad H=256 to 264 units). 8-lane tiles on an
# AVX-512 core fill half of each FMA pipe. On an AMD EPYC Zen 5 (AVX-512, 2 cores, B=32 H=256, one thread):
# the 16-lane tiles 245-257 GFLOP/s over 2 MB of weights streamed from L3 (16 FMA lanes x 2 pipes x 2 flops
# a cycle), a whole step 210-230 (the gates' pass about 10 µs of 150 at layer 0); 8 lanes 104-112.
#
# Each step copies h and x_t into blocks of adjacent rows (where they come from, rows lie 512 bytes
# apart at B=32: a K block of them then maps to a quarter of L1's sets and misses, 20-30% slower). Rows
# are packed in groups of units, gate-major inside (i of the group's units, then f, o, g), so a
# group's tiles land as four blocks of rows and everything after the GEMM runs as one loop over
# units x columns elements (Zen 3, AVX2, B=32 H=256, the pass alone: 36-39 µs as one loop over all 8192
# elements, about 75 as 256 loops of 32 columns, the out-of-order core overlapping little of a 32-column loop).

#: The vector widths the tiles come in (float32 lanes) and the rows of W a panel, so a tile, has at each.
_PANEL_8, _PANEL_16 = 6, 8
PANEL_ROWS = {8: _PANEL_8, 16: _PANEL_16}
#: Panels in a group of lstm units: its units are 2 panels' rows (12 with 8 lanes, 16 with 16), a gate's rows
#: two panels.
PANELS = 8
#: Rows of K a group's panels run over together: 16 KB of h or x at 32 columns, which stay in L1 meanwhile.
K_BLOCK = 128
_F32_IR, _I64_IR = ir.FloatType(), ir.IntType(64)


def _i64(value: int) -> ir.Constant:
    """``value`` as an LLVM IR int64 constant (an index or a count)."""
    return ir.Constant(_I64_IR, value)


def _counted_loop(builder, name: str, count, initial: list):
    """A loop in LLVM IR over ``k = 0 .. count-1`` (none where ``count <= 0``) carrying ``initial`` (values) in phis:
    returns ``(k, carried, close)``; the caller emits the body from ``carried`` and calls ``close(values)`` with
    the next iteration's, which ends the loop and returns the carried values after it (``initial`` where it ran
    none), the builder placed after the loop."""
    entry = builder.block
    loop, done = builder.append_basic_block(f"{name}.k"), builder.append_basic_block(f"{name}.done")
    builder.cbranch(builder.icmp_signed(">", count, _i64(0)), loop, done)
    builder.position_at_end(loop)
    k = builder.phi(_I64_IR)
    k.add_incoming(_i64(0), entry)
    carried = [builder.phi(value.type) for value in initial]
    for phi, value in zip(carried, initial):
        phi.add_incoming(value, entry)

    def close(values: list) -> list:
        body, next_k = builder.block, builder.add(k, _i64(1))
        k.add_incoming(next_k, body)
        for phi, value in zip(carried, values):
            phi.add_incoming(value, body)
        builder.cbranch(builder.icmp_signed("<", next_k, count), loop, done)
        builder.position_at_end(done)
        final = [builder.phi(value.type) for value in initial]  # a block's phis come first
        for phi, first, last in zip(final, initial, values):
            phi.add_incoming(first, entry)
            phi.add_incoming(last, body)
        return final
    return k, carried, close


def _tile(lanes: int, vectors: int, rows: int):
    """An intrinsic ``tile(first, bias, panel, src, ld, k, out, ldo)`` (addresses, and strides in
    elements): ``out[rows, lanes*vectors] (+)= panelᵀ · src[k, lanes*vectors]`` for a panel ``[k, rows]`` of
    W, contiguous, and rows of ``src`` and ``out`` at strides ``ld`` and ``ldo``, ``k >= 0``; the sums start
    at ``bias[rows]`` (one per row) where ``first`` is nonzero, else at what ``out`` holds. Multiply-adds
    are contracted to FMA where the CPU has it."""
    vector = ir.VectorType(_F32_IR, lanes)
    broadcast_lanes = ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes)

    @intrinsic
    def tile(typingctx, first, bias, panel, src, ld, k_count, out, ldo):
        def codegen(context, builder, signature, args):
            first, bias, panel, src, ld, k_count, out, ldo = args
            bias, panel, src, out = (builder.inttoptr(a, _F32_IR.as_pointer()) for a in (bias, panel, src, out))
            at = lambda base, offset: builder.gep(base, [offset])  # noqa: E731
            as_vector = lambda ptr: builder.bitcast(ptr, vector.as_pointer())  # noqa: E731

            def broadcast(ptr):
                value = builder.insert_element(ir.Constant(vector, ir.Undefined), builder.load(ptr, align=4),
                                               ir.Constant(ir.IntType(32), 0))
                return builder.shuffle_vector(value, ir.Constant(vector, ir.Undefined), broadcast_lanes)

            out_rows = [at(out, builder.mul(_i64(r), ldo)) for r in range(rows)]
            from_bias = builder.icmp_signed("!=", first, _i64(0))
            start = [[builder.select(from_bias, broadcast(at(bias, _i64(r))),
                                     builder.load(as_vector(at(out_rows[r], _i64(lanes * v))), align=4))
                      for v in range(vectors)] for r in range(rows)]
            k, flat, close = _counted_loop(builder, "tile", k_count, [value for row in start for value in row])
            acc = [flat[r * vectors: (r + 1) * vectors] for r in range(rows)]
            src_row = at(src, builder.mul(k, ld))
            sv = [builder.load(as_vector(at(src_row, _i64(lanes * v))), align=4) for v in range(vectors)]
            w_k = at(panel, builder.mul(k, _i64(rows)))
            summed = []
            for r in range(rows):  # row r's weight at k, broadcast, times each vector of src's row k
                w = broadcast(at(w_k, _i64(r)))
                summed += [builder.fadd(builder.fmul(w, s, flags=("contract",)), a, flags=("contract",))
                           for s, a in zip(sv, acc[r])]
            final = close(summed)
            for r in range(rows):
                for v in range(vectors):
                    builder.store(final[r * vectors + v], as_vector(at(out_rows[r], _i64(lanes * v))), align=4)
            return context.get_dummy_value()
        return types.void(*[types.intp] * 8), codegen
    return tile


_tile_8x2, _tile_8x1 = _tile(8, 2, _PANEL_8), _tile(8, 1, _PANEL_8)
_tile_16x2, _tile_16x1 = _tile(16, 2, _PANEL_16), _tile(16, 1, _PANEL_16)


@numba.njit(inline="always")
def _panel_rows(lanes):
    """``PANEL_ROWS[lanes]``, ValueError for a width the tiles do not come in."""
    if lanes != 8 and lanes != 16:
        raise ValueError("lstm_panels / lstm_panel_bias: lanes must be 8 or 16 (the tiles' widths)")
    return _PANEL_16 if lanes == 16 else _PANEL_8


@numba.njit(inline="always")
def _source_row(group, panel, lane, rows, hidden):
    """The internal row (gate ``i f o g`` times ``hidden`` plus unit) that lane ``lane`` of panel ``panel`` (of
    ``rows`` lanes) of group ``group`` holds: the group's rows are gate-major, ``units = PANELS*rows/4`` a gate;
    -1 past the last unit."""
    units = PANELS * rows // 4
    gate, unit = divmod(panel * rows + lane, units)
    unit += group * units
    return gate * hidden + unit if unit < hidden else -1


@numba.njit(_PACKED(_ROWS, _ORDER, _ROW, types.intp), nogil=True, cache=True, error_model="numpy",
            boundscheck=False)
def lstm_panels(w, order, scales, lanes):
    """An lstm weight ``[4H, K]`` (``w_hh`` or ``w_ih``) packed as ``lstm_step`` reads it with tiles of
    ``lanes`` (8 or 16) float32 lanes, internal gate ``g`` (``i f o g``) taken from gate ``order[g]`` of
    ``w`` times ``scales[g]`` (so the stored weights are read once, not reordered and scaled first):
    ``[groups, K*PANELS, rows]``, ``rows = PANEL_ROWS[lanes]``, ``groups = ceil(H/units)``,
    ``units = PANELS*rows/4``: a group's K in blocks of ``K_BLOCK`` rows, each block its panels ``[block,
    rows]`` one after the other, so that the step reads every group front to back (zeros for the units
    past ``H``)."""
    rows = _panel_rows(lanes)
    if order.size != 4 or scales.size != 4 or w.shape[0] % 4 != 0:
        raise ValueError("lstm_panels: w must be [4H, K], order and scales one entry per gate")
    units, panels = PANELS * rows // 4, PANELS
    hidden, width = w.shape[0] // 4, w.shape[1]
    out = np.zeros(((hidden + units - 1) // units, width * panels, rows), _F32)
    for group in range(out.shape[0]):  # in the order written: each panel's block stays in L1 meanwhile
        dst = out[group]
        for k0 in range(0, width, K_BLOCK):
            block = min(K_BLOCK, width - k0)
            for p in range(panels):
                panel = dst[k0 * panels + p * block: k0 * panels + (p + 1) * block]
                for lane in range(rows):
                    row = _source_row(group, p, lane, rows, hidden)
                    if row >= 0:
                        gate = row // hidden
                        src, scale = w[order[gate] * hidden + row % hidden, k0: k0 + block], scales[gate]
                        for k in range(block):
                            panel[k, lane] = src[k] * scale
    return out


@numba.njit(_ROWS(_ROW, types.intp), nogil=True, cache=True, error_model="numpy", boundscheck=False)
def lstm_panel_bias(bias, lanes):
    """An lstm bias ``[4H]`` (internal gate order) in the panels' row order for tiles of ``lanes``:
    ``[panels of all groups, PANEL_ROWS[lanes]]``."""
    rows = _panel_rows(lanes)
    units, panels = PANELS * rows // 4, PANELS
    hidden = bias.size // 4
    out = np.zeros((panels * ((hidden + units - 1) // units), rows), _F32)
    for panel in range(out.shape[0]):
        for lane in range(rows):
            row = _source_row(panel // panels, panel % panels, lane, rows, hidden)
            if row >= 0:
                out[panel, lane] = bias[row]
    return out


@numba.njit(fastmath=_FLAGS, inline="always")
def _cells(gi, gf, go, gg, c, y, clip_ifo, clip_g, g_scale, coupled):
    """The gates, the cell and ``o·tanh(c)`` over a block of units' columns, flat: two loops LLVM vectorizes,
    the cell's tanh in the second, so that no iteration waits on two exps one after the other (one loop
    does, and runs about 10% slower)."""
    for k in range(c.size):
        i = _F32(1.0) / (_F32(1.0) + _exp(_clipped(gi[k], clip_ifo)))
        f = _F32(1.0) / (_F32(1.0) + _exp(_clipped(gf[k], clip_ifo)))
        cand = _F32(2.0) / (_F32(1.0) + _exp(g_scale * _clipped(gg[k], clip_g))) - _F32(1.0)
        f = _F32(1.0) - i if coupled else f  # input_forget (a select, not a branch: the loop stays vector)
        c[k] = f * c[k] + i * cand
    for k in range(c.size):
        o = _F32(1.0) / (_F32(1.0) + _exp(_clipped(go[k], clip_ifo)))
        y[k] = o * (_F32(2.0) / (_F32(1.0) + _exp(_F32(-2.0) * c[k])) - _F32(1.0))


@numba.njit(types.void(_PACKED, _VIEW, _PACKED, _VIEW, _ROWS, _ROWS, _ROWS, types.intp, types.float32,
                       types.float32, types.float32, types.boolean),
            fastmath=_FLAGS, nogil=True, cache=True, error_model="numpy", boundscheck=False)
def lstm_step(w_hh, h, w_ih, x, bias, c, out, out_col, clip_ifo, clip_g, g_scale, coupled):
    """One lstm step for the ``n = h.shape[1]`` running columns (``jit.kernel`` says what each argument is)."""
    hidden, (width, n), inputs = c.shape[0], h.shape, x.shape[0]
    rows = bias.shape[1]
    if rows != _PANEL_8 and rows != _PANEL_16:
        raise ValueError("lstm_step: the packed bias's rows are not a tile's (lstm_panel_bias with 8 or 16 lanes)")
    lanes, units, panels = 16 if rows == _PANEL_16 else 8, PANELS * rows // 4, PANELS
    groups = (hidden + units - 1) // units
    if (w_hh.shape[0] != groups or w_hh.shape[1] != width * panels or w_hh.shape[2] != rows
            or w_ih.shape[0] != groups or w_ih.shape[1] != inputs * panels or w_ih.shape[2] != rows
            or bias.shape[0] != groups * panels or x.shape[1] != n or c.shape[1] < n or out.shape[0] < hidden
            or out_col < 0 or out_col + n > out.shape[1] or width < 1):
        raise ValueError("lstm_step: the arrays' shapes do not fit together")
    if n == 0:
        return
    # h and x copied into blocks of adjacent rows, their columns padded with zeros to ``cols``, a whole
    # number of vectors: what the tiles read, K_BLOCK rows at a time. (As they come, rows of h and x lie
    # 512 bytes apart at B=32 and 128-column chunks: the 16 KB of a K block then fall into 16 of L1's 64
    # sets, and miss.) The gates are computed over all of ``cols``; only the n columns go to c and out.
    cols = (n + lanes - 1) // lanes * lanes
    wide = cols - cols % (2 * lanes)  # columns in two-vector tiles, then one one-vector tile if a vector is left
    gates = np.empty((4 * units, cols), _F32)  # one group's gates, gate-major: i, f, o, g of its units
    cells, ys = np.zeros((units, cols), _F32), np.empty((units, cols), _F32)
    h_block, x_block = np.empty((width, cols), _F32), np.empty((inputs, cols), _F32)
    for src, dst in ((h, h_block), (x, x_block)):
        for k in range(src.shape[0]):
            row, out_row = src[k], dst[k]
            if src.strides[1] == 4:  # adjacent columns (x of layer 0 comes transposed: a gather)
                _copy(out_row.ctypes.data, row.ctypes.data, n)
            else:
                for j in range(n):
                    out_row[j] = row[j]
            for j in range(n, cols):
                out_row[j] = 0
    gates_at = gates.ctypes.data
    operands = ((w_hh.ctypes.data, h_block.ctypes.data, width), (w_ih.ctypes.data, x_block.ctypes.data, inputs))
    block = units * cols
    for group in range(groups):
        first = 1
        for weights, src, depth in operands:
            group_at = weights + group * depth * panels * rows * 4
            for k0 in range(0, depth, K_BLOCK):
                k = min(K_BLOCK, depth - k0)
                at = src + k0 * cols * 4
                for p in range(panels):
                    w = group_at + (k0 * panels + p * k) * rows * 4
                    b = bias.ctypes.data + (group * panels + p) * rows * 4
                    rows_at = gates_at + p * rows * cols * 4
                    if lanes == 16:
                        for j in range(0, wide, 32):
                            _tile_16x2(first, b, w, at + j * 4, cols, k, rows_at + j * 4, cols)
                        if cols > wide:
                            _tile_16x1(first, b, w, at + wide * 4, cols, k, rows_at + wide * 4, cols)
                    else:
                        for j in range(0, wide, 16):
                            _tile_8x2(first, b, w, at + j * 4, cols, k, rows_at + j * 4, cols)
                        if cols > wide:
                            _tile_8x1(first, b, w, at + wide * 4, cols, k, rows_at + wide * 4, cols)
                first = 0
        running = min(units, hidden - group * units)
        c_at, cells_at = c.ctypes.data + group * units * c.shape[1] * 4, cells.ctypes.data
        for u in range(running):  # copies, not slice assignments (which would check for overlap, and copy)
            _copy(cells_at + u * cols * 4, c_at + u * c.shape[1] * 4, n)
        flat = gates.ravel()
        _cells(flat[:block], flat[block: 2 * block], flat[2 * block: 3 * block], flat[3 * block:], cells.ravel(),
               ys.ravel(), clip_ifo, clip_g, g_scale, coupled)
        out_at = out.ctypes.data + (group * units * out.shape[1] + out_col) * 4
        for u in range(running):
            _copy(c_at + u * c.shape[1] * 4, cells_at + u * cols * 4, n)
            _copy(out_at + u * out.shape[1] * 4, ys.ctypes.data + u * cols * 4, n)


__all__ = ["lstm_panels", "lstm_panel_bias", "lstm_step"]  # the kernels ``jit.kernel`` hands out
