"""The Numba kernels behind ``jit`` (imported only through it, where Numba is installed).

``exp`` is written out so that LLVM vectorizes the loops it sits in (a call to libm's ``expf`` would keep
them scalar, four times slower than NumPy's ``exp``): Cody-Waite reduction by ln 2, a degree-6 polynomial,
and the power of two put in by a bit cast. Within an ulp of float32 over its range, ``inf`` above 88.72, 0
below about -87.0 (results under 2.4e-38, which no gate, adding them to 1, tells from 0; NumPy gives them,
denormals included), NaN for NaN: the gates' non-finite classes are NumPy's. The fast-math flags allow FMA
contraction and ignore the sign of zero, nothing more: no NaN or inf is assumed away. Nothing in the loops
branches (clips are clamps, inf for none; ``input_forget`` a select), so LLVM vectorizes them.
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

_F32, _I32 = np.float32, np.int32
_FLAGS = {"nsz", "contract"}
_ROWS = types.Array(types.float32, 2, "C")
_ROW = types.Array(types.float32, 1, "C")


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


#: 1.5 * 2**23: adding it rounds a float32 of magnitude below 2**22 to an integer, which its low bits then hold.
_ROUNDER = _F32(12582912.0)
_ROUNDER_BITS = _I32(np.array(_ROUNDER).view(np.int32))


@numba.njit(fastmath=_FLAGS, inline="always")
def _exp(x):
    # the clamps keep NaN (NaN < lo is false), which then runs through as NaN: no integer is made from
    # a float, only bits reinterpreted, so NaN needs no select of its own
    xc = _F32(-87.3365) if x < _F32(-87.3365) else x  # ln of float32's smallest normal
    xc = _F32(88.7228) if xc > _F32(88.7228) else xc  # ln of its largest
    shifted = xc * _F32(1.4426950408889634) + _ROUNDER  # x / ln2 rounded to the integer r, -126..128
    r = shifted - _ROUNDER
    f = xc - r * _F32(0.693359375)  # ln 2 = 0.693359375 - 2.12194440e-4, the first part exact times r
    f = f + r * _F32(2.12194440e-4)  # |f| <= ln2/2
    p = _F32(0.008374771) + f * _F32(0.0013829421)  # e^f, degree 6, fitted on |f| <= ln2/2: 1.8e-8 relative
    p = _F32(0.04166836) + f * p
    p = _F32(0.16666421) + f * p
    p = _F32(0.4999999) + f * p
    p = _F32(1.0) + f * p
    p = _F32(1.0) + f * p
    # 2**r as 2 * 2**(r-1), so that r = 128 stays finite; r = -126 gives 0 (x below about -87)
    e = (p + p) * _as_float((_as_int(shifted) - _ROUNDER_BITS + _I32(126)) << 23)
    return _F32(np.inf) if x > _F32(88.7228) else e


@numba.njit(fastmath=_FLAGS, inline="always")
def _clipped(z, bound):
    """``np.clip(z, -bound, bound)``, NaN kept (``bound`` inf: no clip)."""
    z = bound if z > bound else z
    return -bound if z < -bound else z


@numba.njit(types.void(_ROWS, _ROWS, types.intp, _ROW, _ROWS, _ROWS, types.intp, types.intp, types.float32,
                       types.float32, types.float32, types.boolean),
            fastmath=_FLAGS, nogil=True, cache=True, error_model="numpy", boundscheck=False)
def lstm_pointwise(g, proj, col, bias, c, out, out_col, n, clip_ifo, clip_g, g_scale, coupled):
    """Everything of an lstm step after its GEMM, for columns ``:n`` (``jit.kernel`` says what each argument is)."""
    hidden, cols, outs = c.shape[0], slice(col, col + n), slice(out_col, out_col + n)
    for r in range(hidden):  # each row's views are slices, indexed from 0: LLVM vectorizes such loops, not x[col + k]
        gi, gf, go, gg = g[r], g[hidden + r], g[2 * hidden + r], g[3 * hidden + r]
        xi, xf = proj[r, cols], proj[hidden + r, cols]
        xo, xg = proj[2 * hidden + r, cols], proj[3 * hidden + r, cols]
        bi, bf, bo, bg = bias[r], bias[hidden + r], bias[2 * hidden + r], bias[3 * hidden + r]
        cr, yr = c[r, :n], out[r, outs]
        for k in range(n):
            i = _F32(1.0) / (_F32(1.0) + _exp(_clipped(gi[k] + xi[k] + bi, clip_ifo)))
            f = _F32(1.0) / (_F32(1.0) + _exp(_clipped(gf[k] + xf[k] + bf, clip_ifo)))
            o = _F32(1.0) / (_F32(1.0) + _exp(_clipped(go[k] + xo[k] + bo, clip_ifo)))
            cand = _F32(2.0) / (_F32(1.0) + _exp(g_scale * _clipped(gg[k] + xg[k] + bg, clip_g))) - _F32(1.0)
            f = _F32(1.0) - i if coupled else f  # input_forget (a select, not a branch: the loop stays vector)
            cell = f * cr[k] + i * cand
            cr[k] = cell
            yr[k] = o * (_F32(2.0) / (_F32(1.0) + _exp(_F32(-2.0) * cell)) - _F32(1.0))
