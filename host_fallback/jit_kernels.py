"""The Numba kernels behind ``jit`` (imported only through it, where Numba is installed): the lstm step,
and the step paths of selective_scan, mamba2 and gated_delta_net.

``exp`` is written out so that LLVM vectorizes the loops it sits in (a call to libm's ``expf`` would keep
them scalar, four times slower than NumPy's ``exp``): Cody-Waite reduction by ln 2, a degree-6 polynomial,
and the power of two put in by a bit cast. Within an ulp of float32 over its range, ``inf`` above 88.72, NaN
for NaN. The lstm's gates take ``_exp``, 0 below about -87.0 (results under 2.4e-38, which no gate, adding
them to 1, tells from 0; NumPy gives them, denormals included); the state-space steps take
``_exp_subnormal``, which gives the subnormals as NumPy does (a decay multiplies a state: an infinite state
times 0 is NaN, times a subnormal inf), at one more multiply. ``_log`` (for softplus) is written out the
same way. The non-finite classes are NumPy's. The fast-math flags allow FMA contraction and ignore the sign
of zero, nothing more: no NaN or inf is assumed away. Nothing in the loops branches (clips are clamps, inf
for none; ``input_forget`` a select), so LLVM vectorizes them.
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_F32, _I32 = np.float32, np.int32
_FLAGS = {"nsz", "contract"}
_ROWS = types.Array(types.float32, 2, "C")
_ROW = types.Array(types.float32, 1, "C")
_VIEW = types.Array(types.float32, 2, "A")  # a view at any strides
_PACKED = types.Array(types.float32, 3, "C")
_ORDER = types.Array(types.int64, 1, "C")


@intrinsic
def _as_float(typingctx, bits):
    """The float32 whose bits are the int32 ``bits``."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


@intrinsic
def _as_int(typingctx, value):
    """The int32 whose bits are the float32 ``value``."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.int32(types.float32), codegen


@intrinsic
def _copy(typingctx, dst, src, count):
    """Copy ``count`` float32 from address ``src`` to address ``dst`` (ranges apart) with LLVM's memcpy: a
    row of 32 columns in a few vector moves, where a loop over them, its length unknown to LLVM, runs scalar
    below its unrolled vector width (Zen 5, B=32 H=256: the step 2% faster)."""
    def codegen(context, builder, signature, args):
        dst, src, count = (builder.inttoptr(a, ir.IntType(8).as_pointer()) if k < 2 else a
                           for k, a in enumerate(args))
        cgutils.raw_memcpy(builder, dst, src, count, 4, align=4)
        return context.get_dummy_value()
    return types.void(types.intp, types.intp, types.intp), codegen


#: 1.5 * 2**23: adding it rounds a float32 of magnitude below 2**22 to an integer, which its low bits then hold.
_ROUNDER = _F32(12582912.0)
_ROUNDER_BITS = _I32(np.array(_ROUNDER).view(np.int32))


@numba.njit(fastmath=_FLAGS, inline="always")
def _exp_parts(x, low):
    """``e^x = m * 2**k`` for ``x`` clamped to ``[low, 88.7228]``: ``(m, k)``, ``m`` in ``[1.41, 2.83]``."""
    # the clamps keep NaN (NaN < lo is false), which then runs through as NaN: no integer is made from
    # a float, only bits reinterpreted, so NaN needs no select of its own
    xc = low if x < low else x
    xc = _F32(88.7228) if xc > _F32(88.7228) else xc  # ln of float32's largest
    shifted = xc * _F32(1.4426950408889634) + _ROUNDER  # x / ln2 rounded to the integer r, -151..128
    r = shifted - _ROUNDER
    f = xc - r * _F32(0.693359375)  # ln 2 = 0.693359375 - 2.12194440e-4, the first part exact times r
    f = f + r * _F32(2.12194440e-4)  # |f| <= ln2/2
    p = _F32(0.008374771) + f * _F32(0.0013829421)  # e^f, degree 6, fitted on |f| <= ln2/2: 1.8e-8 relative
    p = _F32(0.04166836) + f * p
    p = _F32(0.16666421) + f * p
    p = _F32(0.4999999) + f * p
    p = _F32(1.0) + f * p
    p = _F32(1.0) + f * p
    # 2**r as 2 * 2**(r-1), so that r = 128 stays finite
    return p + p, _as_int(shifted) - _ROUNDER_BITS - _I32(1)


@numba.njit(fastmath=_FLAGS, inline="always")
def _exp(x):
    """e^x, 0 below about -87.0 (where e^x is no normal float32): for gates, which add it to 1."""
    m, k = _exp_parts(x, _F32(-87.3365))  # ln of float32's smallest normal: k >= -127, 2**k normal
    e = m * _as_float((k + _I32(127)) << 23)
    return _F32(np.inf) if x > _F32(88.7228) else e


@numba.njit(fastmath=_FLAGS, inline="always")
def _exp_subnormal(x):
    """e^x down to float32's subnormals (0 below about -103.97), as NumPy's: for decays that multiply a
    state, where 0 and a subnormal differ (an infinite state times either: NaN or inf)."""
    m, k = _exp_parts(x, _F32(-104.0))
    k = _I32(k)
    normal = _I32(k if k > _I32(-126) else _I32(-126))  # 2**k as 2**normal * 2**(k - normal), both normal:
    e = m * _as_float(_I32(normal + _I32(127)) << _I32(23))  # exact, then one rounding into the subnormals
    e = e * _as_float(_I32(_I32(k - normal) + _I32(127)) << _I32(23))
    return _F32(np.inf) if x > _F32(88.7228) else e


@numba.njit(fastmath=_FLAGS, inline="always")
def _clipped(z, bound):
    """``np.clip(z, -bound, bound)``, NaN kept (``bound`` inf: no clip)."""
    z = bound if z > bound else z
    return -bound if z < -bound else z


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


def _tile(lanes: int, vectors: int, rows: int):
    """An intrinsic ``tile(first, bias, panel, src, ld, k, out, ldo)`` (addresses, and strides in
    elements): ``out[rows, lanes*vectors] (+)= panelᵀ · src[k, lanes*vectors]`` for a panel ``[k, rows]`` of
    W, contiguous, and rows of ``src`` and ``out`` at strides ``ld`` and ``ldo``, ``k >= 0``; the sums start
    at ``bias[rows]`` (one per row) where ``first`` is nonzero, else at what ``out`` holds. Multiply-adds
    are contracted to FMA where the CPU has it."""
    vector = ir.VectorType(_F32_IR, lanes)
    broadcast_lanes = ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes)
    const = lambda v: ir.Constant(_I64_IR, v)  # noqa: E731

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

            out_rows = [at(out, builder.mul(const(r), ldo)) for r in range(rows)]
            from_bias = builder.icmp_signed("!=", first, const(0))
            start = [[builder.select(from_bias, broadcast(at(bias, const(r))),
                                     builder.load(as_vector(at(out_rows[r], const(lanes * v))), align=4))
                      for v in range(vectors)] for r in range(rows)]
            entry = builder.block
            loop, done = builder.append_basic_block("tile.k"), builder.append_basic_block("tile.done")
            builder.cbranch(builder.icmp_signed(">", k_count, const(0)), loop, done)
            builder.position_at_end(loop)
            k = builder.phi(_I64_IR)
            k.add_incoming(const(0), entry)
            acc = [[builder.phi(vector) for _ in row] for row in start]
            for row, values in zip(acc, start):
                for phi, value in zip(row, values):
                    phi.add_incoming(value, entry)
            src_row = at(src, builder.mul(k, ld))
            sv = [builder.load(as_vector(at(src_row, const(lanes * v))), align=4) for v in range(vectors)]
            w_k = at(panel, builder.mul(k, const(rows)))
            summed = []
            for r in range(rows):  # row r's weight at k, broadcast, times each vector of src's row k
                w = broadcast(at(w_k, const(r)))
                summed.append([builder.fadd(builder.fmul(w, s, flags=("contract",)), a, flags=("contract",))
                               for s, a in zip(sv, acc[r])])
            next_k = builder.add(k, const(1))
            k.add_incoming(next_k, loop)
            for row, new in zip(acc, summed):
                for phi, value in zip(row, new):
                    phi.add_incoming(value, loop)
            builder.cbranch(builder.icmp_signed("<", next_k, k_count), loop, done)
            builder.position_at_end(done)
            final = [[builder.phi(vector) for _ in row] for row in start]  # a block's phis come first
            for r, row in enumerate(final):
                for v, value in enumerate(row):
                    value.add_incoming(start[r][v], entry)
                    value.add_incoming(summed[r][v], loop)
            for r, row in enumerate(final):
                for v, value in enumerate(row):
                    builder.store(value, as_vector(at(out_rows[r], const(lanes * v))), align=4)
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



# --- an lstm layer-direction's whole sequence, and its backpropagation through time (small sizes) -----
# Batch-major, time-major as ``rnn_backward`` keeps them: ``u [S, B, 4H]`` the input projection plus bias
# in the ABI's gate order i f g o, the states ``[B, H]``. One call runs every step, with no packing of the
# weights beyond a zero-padded copy: a step's ``W_hh·h`` is the tiles above the other way round, the panel a
# group of batch rows (h transposed: each of its values broadcast) and the source ``W_hh^T``'s rows, whose
# vectors run along the gates, so that a batch of 8 fills a 16-lane tile's 8 rows. (Plain Numba loops over
# the same sums, re-reading the gates from memory for each of h's values, ran at a seventh of the speed.)
# ``lens [B]`` are the rows' valid steps (empty: all): a row past its length takes no step (state unchanged,
# output 0, no gradient).

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
def _panel_times(lanes, zeros, panel, src, ld, depth, cols, out, ldo):
    """``out[rows, :cols] += panelᵀ · src[depth, :cols]`` (addresses; ``cols`` a multiple of ``lanes``, the
    panel ``[depth, rows]`` contiguous, ``rows`` = ``PANEL_ROWS[lanes]``; ``zeros`` a readable address the
    tiles load and ignore)."""
    wide = cols - cols % (2 * lanes)
    if lanes == 16:
        for j in range(0, wide, 32):
            _tile_16x2(0, zeros, panel, src + j * 4, ld, depth, out + j * 4, ldo)
        if cols > wide:
            _tile_16x1(0, zeros, panel, src + wide * 4, ld, depth, out + wide * 4, ldo)
    else:
        for j in range(0, wide, 16):
            _tile_8x2(0, zeros, panel, src + j * 4, ld, depth, out + j * 4, ldo)
        if cols > wide:
            _tile_8x1(0, zeros, panel, src + wide * 4, ld, depth, out + wide * 4, ldo)


@numba.njit(inline="always")
def _batch_times(lanes, rows_of, n, panels, weights, sums):
    """``sums[:n] += rows_of[:n] · weights`` for ``rows_of [n, depth]`` (any row stride), ``weights [depth,
    cols]`` zero-padded to whole vectors and ``sums [>= n, cols]``: ``rows_of`` transposed into ``panels``
    (``[>= ceil(n/rows), depth, rows]``, rows past ``n`` zero), then each panel's tiles."""
    rows, depth, cols = panels.shape[2], weights.shape[0], weights.shape[1]
    zeros = panels.ctypes.data  # any readable address: the tiles start from what sums holds
    for p in range((n + rows - 1) // rows):
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
        _panel_times(lanes, zeros, panel.ctypes.data, weights.ctypes.data, cols, depth, cols,
                     sums.ctypes.data + p * rows * sums.shape[1] * 4, sums.shape[1])


@numba.njit(inline="always")
def _tile_rows(lanes):
    if lanes != 8 and lanes != 16:
        raise ValueError("lstm_sequence / lstm_sequence_backward: lanes must be 8 or 16 (the tiles' widths)")
    return _PANEL_16 if lanes == 16 else _PANEL_8


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
    rows, cols = _tile_rows(lanes), _padded(four, lanes)
    w_t = np.zeros((hidden, cols), _F32)  # W_hh^T, its rows padded to whole vectors
    for j0 in range(0, four, 16):  # in 16 x 16 blocks: a column of w_t at a time would touch a page a value
        for k0 in range(0, hidden, 16):
            for j in range(j0, min(j0 + 16, four)):
                for k in range(k0, min(k0 + 16, hidden)):
                    w_t[k, j] = w_hh[j, k]
    panels = np.empty(((batch + rows - 1) // rows, hidden, rows), _F32)
    g = np.zeros((panels.shape[0] * rows, cols), _F32)
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
        _batch_times(lanes, h, batch, panels, w_t, g)
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
    rows, cols = _tile_rows(lanes), _padded(hidden, lanes)
    w = np.zeros((four, cols), _F32)  # W_hh, its rows padded to whole vectors
    for j in range(four):
        for k in range(hidden):
            w[j, k] = w_hh[j, k]
    panels = np.empty(((batch + rows - 1) // rows, four, rows), _F32)
    sums = np.empty((panels.shape[0] * rows, cols), _F32)
    for step in range(seq):
        t = _walked(step, seq, not backwards)  # the forward's walk, from its end
        for b in range(batch):
            zb = dz[t, b]
            if lens.size != 0 and t >= lens[b]:
                for j in range(four):
                    zb[j] = 0
                continue
            yb, hcb, cpb, dyb, dhb, dcb = y[t, b], hc[t, b], c_prev[t, b], dy[t, b], dh[b], dc[b]
            for k in range(hidden):
                dhk = dhb[k] + dyb[k]
                i, f, g, o, tc = yb[k], yb[hidden + k], yb[2 * hidden + k], yb[3 * hidden + k], hcb[k]
                zb[3 * hidden + k] = dhk * tc * (o * (_F32(1.0) - o))
                dcn = dhk * o * (_F32(1.0) - tc * tc) + dcb[k]
                zb[k] = dcn * g * (i * (_F32(1.0) - i))
                zb[hidden + k] = dcn * cpb[k] * (f * (_F32(1.0) - f))
                zb[2 * hidden + k] = dcn * i * (_F32(1.0) - g * g)
                dcb[k] = dcn * f
        sums[:] = 0
        _batch_times(lanes, dz[t], batch, panels, w, sums)  # dh = dz · W_hh
        for b in range(batch):
            if lens.size == 0 or t < lens[b]:
                dhb, sb = dh[b], sums[b]
                for k in range(hidden):
                    dhb[k] = sb[k]


# --- the state-space decode steps: selective_scan, mamba2, gated_delta_net -----------------------------
# One call runs a thunk's step path whole: every row (batch row, or packed sequence), channel or head,
# token, with the v2 fields, the state updated where it lies in the arena. Rows are the step path's: row
# r is batch row r over all tokens, or with ``varlen`` sequence r (tokens cu[r]..cu[r+1]-1 of batch row 0);
# its state is pool entry ``slots[r]`` (``r`` where ``slots`` is empty), or, where the pool is empty (no
# ``carry_state``), a zeroed work state that is not kept. Optional inputs (biases, d, z) are empty arrays
# where the thunk has none. The arithmetic is ABI.md §4/§8's in its order, so non-finite values land where
# NumPy's step path puts them; only the dot products' sums are reassociated (``_dot``), as a BLAS's are.
# Loops run over a state's rows as views, the inner loop over a row's contiguous N (or V) values, which LLVM
# vectorizes (indexing flat arrays at computed offsets instead left it scalar, 6x slower).

_T1, _T2 = types.Array(types.float32, 1, "C"), types.Array(types.float32, 2, "C")
_T3, _T4 = types.Array(types.float32, 3, "C"), types.Array(types.float32, 4, "C")
_INDEX = types.Array(types.int32, 1, "C")
#: ABI.md §8's softplus is the identity above this input (``ssm.SOFTPLUS_LINEAR``).
_SOFTPLUS_LINEAR = _F32(20.0)
_L2_EPS = _F32(1e-6)  # gdn.L2_EPS


@numba.njit(fastmath=_FLAGS, inline="always")
def _log(w):
    """ln w for a positive normal float32 (NaN for NaN), within about two ulps: ``w = m * 2**e`` with ``m``
    in ``[sqrt(1/2), sqrt(2))``, ``ln m = 2 atanh(s)``, ``s = (m-1)/(m+1)`` (|s| <= 0.172), whose series
    ``2s (1 + s²/3 + s⁴/5 + ...)`` is cut where its terms fall below 2**-28."""
    bits = _as_int(w)
    e = (bits >> 23) - _I32(127)
    m = _as_float((bits & _I32(0x007FFFFF)) | _I32(0x3F800000))  # [1, 2)
    high = m > _F32(1.4142135)
    m = m * _F32(0.5) if high else m
    e = e + _I32(1) if high else e
    f = m - _F32(1.0)  # exact
    s = f / (f + _F32(2.0))
    s2 = s * s
    p = _F32(1.0 / 9.0) + s2 * (_F32(1.0 / 11.0))
    p = _F32(1.0 / 7.0) + s2 * p
    p = _F32(1.0 / 5.0) + s2 * p
    p = _F32(1.0 / 3.0) + s2 * p
    ln_m = (s + s) + (s + s) * (s2 * p)
    k = _F32(e)
    return k * _F32(0.693359375) + (ln_m - k * _F32(2.12194440e-4))


@numba.njit(fastmath=_FLAGS, inline="always")
def _softplus(u):
    """ABI.md §8's softplus, as ``ssm.softplus`` forms it: ``log1p(e^u)`` as ``ln(w) * e / (w - 1)``,
    ``w = 1 + e^u`` (exact to a few ulps), ``e^u`` where ``w`` rounds to 1, ``u`` above 20."""
    e = _exp_subnormal(u)
    w = e + _F32(1.0)
    soft = _log(w) * (e / (w - _F32(1.0)))
    soft = e if w == _F32(1.0) else soft
    return u if u > _SOFTPLUS_LINEAR else soft


@numba.njit(fastmath=_FLAGS, inline="always")
def _silu(z):
    return z / (_F32(1.0) + _exp(-z))


@numba.njit(fastmath={"reassoc", "nsz", "contract"}, nogil=True, error_model="numpy", boundscheck=False)
def _dot(a, b, n):
    """``sum(a[:n] * b[:n])``, its sum reassociated (only here) so that LLVM runs it in vector lanes."""
    total = _F32(0.0)
    for i in range(n):
        total += a[i] * b[i]
    return total


@numba.njit(inline="always")
def _span(r, varlen, cu, seq):
    """Row ``r``'s batch row and tokens ``lo..hi-1``."""
    if varlen:
        return 0, cu[r], cu[r + 1]
    return r, 0, seq


@numba.njit(inline="always")
def _rows(varlen, cu, batch):
    return cu.size - 1 if varlen else batch


@numba.njit(inline="always")
def _state(pool, work, slots, r):
    """Row ``r``'s state: pool entry ``slots[r]`` (``r`` without slots), updated in place, or where the pool is
    empty (no ``carry_state``) the zeroed ``work``, an entry's shape."""
    if pool.shape[0] > 0:
        return pool[slots[r] if slots.size > 0 else r]
    work[:] = 0
    return work


@numba.njit(fastmath=_FLAGS, inline="always")
def _gated(y, z, gated, out):
    """``out = y * silu(z)`` where ``gated`` (ABI.md §8's ``z``), else ``y``."""
    if gated:
        for i in range(y.size):
            out[i] = y[i] * _silu(z[i])
    else:
        for i in range(y.size):
            out[i] = y[i]


@numba.njit(fastmath=_FLAGS, inline="always")
def _decay_row(h, a, b, step, dx, n):
    """One channel's ``h = exp(delta a) h + (delta x) b`` over its ``n`` state values."""
    for k in range(n):
        h[k] = _exp_subnormal(step * a[k]) * h[k] + dx * b[k]


@numba.njit(types.void(_T3, _T3, _T2, _T4, _T4, _T1, _T1, _T3, _T3, _T3, _INDEX, _INDEX, types.boolean,
                       types.boolean), fastmath=_FLAGS, nogil=True, cache=True, error_model="numpy",
            boundscheck=False)
def selective_scan_step(x, delta, a, b, c, delta_bias, d, z, state, dst, cu, slots, varlen, softplus):
    """``selective_scan``'s step path (ABI.md §4, §8): ``x, delta, z, dst [B, S, H]``, ``a [H, N]``, ``b, c
    [B, S, G, N]``, ``delta_bias, d [H]``, ``state [E, H, N]``."""
    bsz, seq, hidden = x.shape
    n, width = a.shape[1], hidden // b.shape[2]
    work = np.empty((0 if state.size else hidden, n), _F32)  # the state where no pool keeps it
    steps, inputs, y = np.empty(hidden, _F32), np.empty(hidden, _F32), np.empty(hidden, _F32)
    for r in range(_rows(varlen, cu, bsz)):
        row, lo, hi = _span(r, varlen, cu, seq)
        h = _state(state, work, slots, r)
        for t in range(lo, hi):
            for ch in range(hidden):
                steps[ch] = delta[row, t, ch]
            if delta_bias.size > 0:
                for ch in range(hidden):
                    steps[ch] += delta_bias[ch]
            if softplus:
                for ch in range(hidden):
                    steps[ch] = _softplus(steps[ch])
            for ch in range(hidden):
                inputs[ch] = steps[ch] * x[row, t, ch]
            for group in range(b.shape[2]):  # its channels read its b and c
                bs, cs = b[row, t, group], c[row, t, group]
                for i in range(width):  # h = exp(delta a) h + (delta x) b
                    # unsigned, so that no negative index's wraparound is left to select (B1 H1536 N16: 4 of 16 µs)
                    ch = np.uintp(group * width + i)
                    if n == 16:  # Mamba's d_state: a trip count LLVM knows, one 16-lane vector (8% faster)
                        _decay_row(h[ch], a[ch], bs, steps[ch], inputs[ch], 16)
                    else:
                        _decay_row(h[ch], a[ch], bs, steps[ch], inputs[ch], n)
                for i in range(width):
                    ch = np.uintp(group * width + i)
                    y[ch] = _dot(h[ch], cs, n)
            if d.size > 0:
                for ch in range(hidden):
                    y[ch] += x[row, t, ch] * d[ch]
            gated = z.size > 0
            _gated(y, z[row, t] if gated else y, gated, dst[row, t])


@numba.njit(types.void(_T4, _T3, _T1, _T4, _T4, _T1, _T1, _T4, _T4, _T4, _INDEX, _INDEX, types.boolean,
                       types.boolean, types.float32, types.float32), fastmath=_FLAGS, nogil=True, cache=True,
            error_model="numpy", boundscheck=False)
def mamba2_step(x, dt, a, b, c, dt_bias, d, z, state, dst, cu, slots, varlen, softplus, low, high):
    """``mamba2``'s step path (ABI.md §4, §8): ``x, z, dst [B, S, H, P]``, ``dt [B, S, H]``, ``a, dt_bias, d
    [H]``, ``b, c [B, S, G, N]``, ``state [E, H, P, N]``; ``dt`` clamped to ``[low, high]`` (-inf and inf
    where the thunk has no ``dt_limit``, so NaN stays NaN)."""
    bsz, seq, heads, p = x.shape
    n, per_group = b.shape[3], heads // b.shape[2]
    work = np.empty((0 if state.size else heads, p, n), _F32)
    y = np.empty(p, _F32)
    for r in range(_rows(varlen, cu, bsz)):
        row, lo, hi = _span(r, varlen, cu, seq)
        states = _state(state, work, slots, r)
        for hd in range(heads):
            s = states[hd]
            for t in range(lo, hi):
                step = dt[row, t, hd]
                if dt_bias.size > 0:
                    step += dt_bias[hd]
                if softplus:
                    step = _softplus(step)
                step = low if step < low else step
                step = high if step > high else step
                decay = _exp_subnormal(step * a[hd])
                xs, bs, cs = x[row, t, hd], b[row, t, hd // per_group], c[row, t, hd // per_group]
                for i in range(p):  # S = exp(dt a) S + (dt x) (x) b, a row of N at a time; y = S c
                    si, xi = s[i], step * xs[i]
                    for k in range(n):
                        si[k] = si[k] * decay + xi * bs[k]
                    y[i] = _dot(si, cs, n)
                if d.size > 0:
                    skip = d[hd]
                    for i in range(p):
                        y[i] += xs[i] * skip
                gated = z.size > 0
                _gated(y, z[row, t, hd] if gated else y, gated, dst[row, t, hd])


@numba.njit(types.void(_T4, _T4, _T4, _T4, _T3, _T4, _T4, _INDEX, _INDEX, types.boolean, types.boolean,
                       types.float32), fastmath=_FLAGS, nogil=True, cache=True, error_model="numpy",
            boundscheck=False)
def gated_delta_net_step(q, k, v, g, beta, state, dst, cu, slots, varlen, l2norm, scale):
    """``gated_delta_net``'s step path (ABI.md §4, §8): ``q, k [B, S, H, K]``, ``v, dst [B, S, HV, V]``, ``g [B,
    S, HV, K]`` per channel or ``[B, S, HV, 1]`` per head, ``beta [B, S, HV]``, ``state [E, HV, K, V]``.

    Per step, two passes over the state's rows (S[i, :], the values of key i): the first decays them and
    sums ``k^T S``, the second adds ``k u^T`` and sums ``q^T S`` of the updated state (step 4's order, so
    its NaN and each signed inf land where the ABI puts them)."""
    bsz, seq, heads, n = q.shape
    value_heads, width = v.shape[2], v.shape[3]
    group, per_channel = value_heads // heads, g.shape[3] > 1
    work = np.empty((0 if state.size else value_heads, n, width), _F32)
    qn, kn, decay = np.empty(n, _F32), np.empty(n, _F32), np.empty(n, _F32)
    ks, u, out = np.empty(width, _F32), np.empty(width, _F32), np.empty(width, _F32)
    for r in range(_rows(varlen, cu, bsz)):
        row, lo, hi = _span(r, varlen, cu, seq)
        states = _state(state, work, slots, r)
        for j in range(value_heads):
            s = states[j]
            for t in range(lo, hi):
                qs, kk = q[row, t, j // group], k[row, t, j // group]
                if l2norm:  # x / sqrt(sum x^2 + eps), per head vector
                    qnorm = np.sqrt(_dot(qs, qs, n) + _L2_EPS)
                    knorm = np.sqrt(_dot(kk, kk, n) + _L2_EPS)
                    for i in range(n):
                        qn[i] = qs[i] / qnorm
                        kn[i] = kk[i] / knorm
                    qs, kk = qn, kn
                gs = g[row, t, j]
                if per_channel:
                    for i in range(n):
                        decay[i] = _exp_subnormal(gs[i])
                else:
                    whole = _exp_subnormal(gs[0])
                    for i in range(n):
                        decay[i] = whole
                ks[:] = 0
                for i in range(n):  # S *= exp(g); ks = k^T S
                    si, di, ki = s[i], decay[i], kk[i]
                    for col in range(width):
                        value = si[col] * di
                        si[col] = value
                        ks[col] += ki * value
                vs, bt = v[row, t, j], beta[row, t, j]
                for col in range(width):
                    u[col] = (vs[col] - ks[col]) * bt
                out[:] = 0
                for i in range(n):  # S += k u^T; out = q^T S
                    si, ki, qi = s[i], kk[i], qs[i]
                    for col in range(width):
                        value = si[col] + ki * u[col]
                        si[col] = value
                        out[col] += qi * value
                o = dst[row, t, j]
                for col in range(width):
                    o[col] = scale * out[col]
