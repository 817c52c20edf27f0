"""The host's large float32 products (a recurrent layer's input projection, its input and weight gradients):
NumPy's BLAS, or the compiled register tiles (``jit``'s ``gemm``) where that BLAS runs narrower vectors than
the CPU has.

OpenBLAS picks its kernels when it loads: by the CPU, or by ``OPENBLAS_CORETYPE`` where that is set. On an
AVX-512 CPU running its AVX2 kernels (``OPENBLAS_CORETYPE=Haswell``, as on the AMD EPYC Zen 5 machines here, or
a CPU its build does not know) a product runs at half the core's FMA width: one thread, f32, ``[4096, 512] x
[512, 1024]``, a 2-core Zen 5: OpenBLAS's Haswell kernels 127 GFLOP/s, its SkylakeX ones 241, the tiles 220-240
(``[1024, 4096] x [4096, 512]``, a weight gradient: 129 / 218). So the tiles take the products where the CPU has
AVX-512 (``jit.lanes() == 16``) and OpenBLAS says (``openblas_get_corename``) it runs a core without it; NumPy's
BLAS everywhere else, for float64, and for products too small (or of too few rows) to repay packing.
``RLX_HOST_GEMM=compiled`` or ``blas`` forces either (read on every call); the tests run both against float64
products.
"""
from __future__ import annotations

import ctypes
import glob
import os
from functools import cache

import numpy as np

from . import environ, jit

#: The environment variable that forces the products' path: ``compiled`` (the tiles, where Numba is there) or
#: ``blas`` (NumPy's); unset: chosen as the module says.
ENV = "RLX_HOST_GEMM"
#: OpenBLAS's cores whose kernels use AVX-512 (its ``openblas_get_corename`` names, lower case).
AVX512_CORES = frozenset({"skylakex", "cooperlake", "sapphirerapids"})
#: The fewest multiply-adds a product takes the tiles for: below it packing and the call cost more than they save.
MIN_MULTIPLY_ADDS = 1 << 20
#: The fewest rows of the left operand: the right one is packed whole, a cost the rows' products must repay (one
#: thread on the Zen 5, µs, tiles / OpenBLAS's Haswell kernels: ``[m, 256] x [256, 1024]ᵀ`` m=4 46 / 48, 16 60 / 99,
#: 32 97 / 172; ``[m, 1024] x [1024, 256]`` m=16 102 / 91, 32 138 / 164, 64 216 / 299).
MIN_ROWS = 32

_forced = environ.reader(ENV)


@cache
def blas_core() -> str | None:
    """The core whose kernels NumPy's OpenBLAS runs (lower case), None where NumPy's BLAS is not an OpenBLAS this
    can ask (another BLAS, or none bundled)."""
    libs = os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs")
    for path in sorted(glob.glob(os.path.join(libs, "*openblas*"))):
        try:
            lib = ctypes.CDLL(path)  # already loaded by NumPy: the same library
        except OSError:
            continue
        for symbol in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename", "openblas_get_corename64_",
                       "openblas_get_corename"):
            ask = getattr(lib, symbol, None)
            if ask is not None:
                ask.restype = ctypes.c_char_p
                name = ask()
                return name.decode(errors="replace").strip().lower() if name else None
    return None


def compiled() -> bool:
    """Whether the large float32 products take the compiled tiles now (``RLX_HOST_GEMM``, else the rule above)."""
    forced = (_forced() or "").strip().lower()
    if forced not in ("", "compiled", "blas"):
        raise ValueError(f"{ENV}={forced!r}: expected 'compiled' or 'blas', or unset to choose by the CPU and BLAS")
    if forced == "blas" or jit.kernel("gemm") is None:
        return False
    if forced == "compiled":
        return True
    core = blas_core()
    return jit.lanes() == 16 and core is not None and core not in AVX512_CORES


def times(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``a [m, k] · b [k, n]`` (any strides), into ``out`` where given (NumPy's, where its columns are apart or
    its memory may be an operand's: the tiles read the operands while they write)."""
    m, k = a.shape
    n = b.shape[1]
    if (a.dtype != np.float32 or b.dtype != np.float32 or m < MIN_ROWS or m * k * n < MIN_MULTIPLY_ADDS
            or (out is not None and (out.dtype != np.float32 or (n > 1 and out.strides[1] != 4)
                                     or np.may_share_memory(out, a) or np.may_share_memory(out, b)))
            or not compiled()):
        return np.matmul(a, b, out=out)
    if out is None:
        out = np.empty((m, n), np.float32)
    jit.kernel("gemm")(a, b, out, jit.lanes())
    return out
