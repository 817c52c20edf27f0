"""The float32 primitives the Numba kernels share (``jit_lstm``, ``jit_lstm_sequence``, ``jit_ssm_steps``;
imported only through ``jit``, where Numba is installed): bit casts, a memcpy, a prefetch, an 8 x 8 transpose (and
a whole matrix's, ``_transposed``, any float type), ``exp`` and ``log``.

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
from numba.extending import intrinsic, overload

__all__: list[str] = []  # primitives of the other kernels: ``jit.kernel`` hands out none of them
_F32, _I32 = np.float32, np.int32
_FLAGS = {"nsz", "contract"}
_ROWS = types.Array(types.float32, 2, "C")


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


@intrinsic
def _prefetch(typingctx, address):
    """Prefetch the cache line at ``address`` into L2 (``llvm.prefetch``: a read, locality 2; x86's prefetcht1),
    for a pass to read it some microseconds later (a prefetch does not fault, whatever the address)."""
    def codegen(context, builder, signature, args):
        i32, ptr = ir.IntType(32), ir.IntType(8).as_pointer()
        fetch = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [ptr, i32, i32, i32]),
                                               "llvm.prefetch.p0")
        builder.call(fetch, [builder.inttoptr(args[0], ptr), *(ir.Constant(i32, v) for v in (0, 2, 1))])
        return context.get_dummy_value()
    return types.void(types.intp), codegen


@intrinsic
def _transpose8(typingctx, src, lds, dst, ldd):
    """``dst[c, r] = src[r, c]`` for an 8 x 8 block of float32 (addresses, and row strides in elements): eight
    vector loads, three rounds of eight shuffles, eight vector stores (where a scalar loop moves one value at a
    time)."""
    def codegen(context, builder, signature, args):
        vector, f32p = ir.VectorType(ir.FloatType(), 8), ir.FloatType().as_pointer()
        src, lds, dst, ldd = args
        src, dst = builder.inttoptr(src, f32p), builder.inttoptr(dst, f32p)

        def at(base, stride, k):
            return builder.bitcast(builder.gep(base, [builder.mul(stride, ir.Constant(stride.type, k))]),
                                   vector.as_pointer())

        def mix(a, b, mask):
            return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(ir.IntType(32), 8), mask))

        rows = [builder.load(at(src, lds, r), align=4) for r in range(8)]
        # rows 2k and 2k + 1 interleaved: columns (0, 1, 4, 5), then (2, 3, 6, 7), two values each
        low, high = [0, 8, 1, 9, 4, 12, 5, 13], [2, 10, 3, 11, 6, 14, 7, 15]
        pairs = [mix(rows[r], rows[r + 1], m) for r in range(0, 8, 2) for m in (low, high)]
        # four rows (0-3, then 4-7) of columns (0, 4), (1, 5), (2, 6), (3, 7)
        low, high = [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15]
        quads = [mix(pairs[q + k], pairs[q + k + 2], m) for q in (0, 4) for k in (0, 1) for m in (low, high)]
        low, high = [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]
        for c in range(4):  # each column whole: its rows 0-3 from quads[c], 4-7 from quads[c + 4]
            builder.store(mix(quads[c], quads[c + 4], low), at(dst, ldd, c), align=4)
            builder.store(mix(quads[c], quads[c + 4], high), at(dst, ldd, c + 4), align=4)
        return context.get_dummy_value()
    return types.void(types.intp, types.intp, types.intp, types.intp), codegen


def _transposed(dst, col, src):
    """``dst[v, col + i] = src[i, v]`` for every element of ``src`` (2-D arrays): ``_transpose8``'s 8 x 8 blocks
    (the edges one value at a time) where both are float32 and C-contiguous by type, else one value at a time."""


@overload(_transposed)
def _transposed_typed(dst, col, src):
    if not all(x.dtype == types.float32 and x.layout == "C" for x in (dst, src)):
        return _transposed_values

    def blocks(dst, col, src):
        rows, cols = src.shape
        whole_rows, whole_cols = rows - rows % 8, cols - cols % 8
        lds, ldd = src.strides[0] // 4, dst.strides[0] // 4
        for i in range(0, whole_rows, 8):
            for v in range(0, whole_cols, 8):
                _transpose8(src.ctypes.data + 4 * (i * lds + v), lds, dst.ctypes.data + 4 * (v * ldd + col + i), ldd)
        for i in range(rows):
            for v in range(whole_cols if i < whole_rows else 0, cols):
                dst[v, col + i] = src[i, v]
    return blocks


def _transposed_values(dst, col, src):
    """``_transposed`` one value at a time."""
    for v in range(src.shape[1]):
        line = dst[v]
        for i in range(src.shape[0]):
            line[col + i] = src[i, v]


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


#: ABI.md §8's softplus is the identity above this input (``ssm.SOFTPLUS_LINEAR``).
_SOFTPLUS_LINEAR = _F32(20.0)


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
