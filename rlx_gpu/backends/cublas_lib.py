"""cuBLAS through its C API (ctypes), so that a CUDA graph can capture a gemm.

CuPy's cuBLAS wrappers point the handle at CuPy's current stream before every call, and that call
refuses to run while the stream captures (``NotImplementedError``), so no sequence holding a gemm could
become a graph. Here a handle is bound once: ``cublasSetStream_v2`` to the session's stream, then
``cublasSetWorkspace_v2`` (setting the stream resets the workspace, so the order matters) with a fixed
workspace, so cuBLAS allocates nothing while a graph is captured, and ``cublasSetMathMode`` with
reduced-precision reductions disallowed (16-bit outputs reduce in f32) and TF32 off. Every later call
is a ``cublasGemmStridedBatchedEx`` on that handle.

The library is the ``libcublas`` of the ``nvidia-cublas`` wheel, a conda environment or the system
toolkit, as ``cuda.pathfinder`` finds it: the one CuPy's own cuBLAS module loads, whose soname the
dynamic loader hands back rather than loading a second copy.
"""
from __future__ import annotations

import ctypes
from typing import Any

from ..errors import DeviceError

# enum values of cublas_api.h (a stable ABI)
DEFAULT_MATH = 0  # CUBLAS_DEFAULT_MATH
DISALLOW_REDUCED_PRECISION_REDUCTION = 16  # CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION
_STATUS = {0: "CUBLAS_STATUS_SUCCESS", 1: "CUBLAS_STATUS_NOT_INITIALIZED", 3: "CUBLAS_STATUS_ALLOC_FAILED",
           7: "CUBLAS_STATUS_INVALID_VALUE", 8: "CUBLAS_STATUS_ARCH_MISMATCH", 11: "CUBLAS_STATUS_MAPPING_ERROR",
           13: "CUBLAS_STATUS_EXECUTION_FAILED", 14: "CUBLAS_STATUS_INTERNAL_ERROR", 15: "CUBLAS_STATUS_NOT_SUPPORTED",
           16: "CUBLAS_STATUS_LICENSE_ERROR"}

_int, _ll, _ptr, _size = ctypes.c_int, ctypes.c_longlong, ctypes.c_void_p, ctypes.c_size_t
#: the functions used, with their C signatures (cublas_api.h); every one returns a cublasStatus_t
PROTOTYPES: dict[str, tuple[Any, ...]] = {
    "cublasCreate_v2": (ctypes.POINTER(_ptr),),
    "cublasDestroy_v2": (_ptr,),
    "cublasSetStream_v2": (_ptr, _ptr),
    "cublasSetWorkspace_v2": (_ptr, _ptr, _size),
    "cublasSetMathMode": (_ptr, _int),
    "cublasGemmStridedBatchedEx": (
        _ptr, _int, _int, _int, _int, _int, _ptr,  # handle, transa, transb, m, n, k, alpha
        _ptr, _int, _int, _ll,  # A, Atype, lda, strideA
        _ptr, _int, _int, _ll,  # B, Btype, ldb, strideB
        _ptr,  # beta
        _ptr, _int, _int, _ll,  # C, Ctype, ldc, strideC
        _int, _int, _int),  # batchCount, computeType, algo
}


class CublasError(DeviceError):
    """A cuBLAS call returned a status other than success."""


def load_library() -> Any:
    """The cuBLAS shared library (a ``ctypes.CDLL``); raises ``DeviceError`` saying how to install it."""
    try:
        from cuda import pathfinder

        return ctypes.CDLL(pathfinder.load_nvidia_dynamic_lib("cublas").abs_path)
    except Exception as err:  # ImportError, DynamicLibNotFoundError, OSError
        raise DeviceError(f"the CUDA backend calls cuBLAS through its C API and cannot load libcublas "
                          f"({type(err).__name__}: {err}); pip install nvidia-cublas (CUDA 13) or "
                          f"nvidia-cublas-cu12 (CUDA 12), or install the CUDA toolkit") from err


class Cublas:
    """The cuBLAS functions the backend calls, typed by :data:`PROTOTYPES` on ``library``."""

    def __init__(self, library: Any):
        self.library = library
        for name, argtypes in PROTOTYPES.items():
            fn = getattr(library, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
            setattr(self, name, fn)

    def check(self, name: str, status: int) -> None:
        if status != 0:
            raise CublasError(f"{name} failed: {_STATUS.get(status, 'status')} ({status})")

    def bound_handle(self, stream: int, workspace: int, workspace_bytes: int) -> int:
        """A new handle (on the current device) bound to ``stream`` with ``workspace`` attached and
        reduced-precision reductions disallowed."""
        handle = ctypes.c_void_p()
        self.check("cublasCreate_v2", self.cublasCreate_v2(ctypes.byref(handle)))
        self.bind_stream(handle, stream, workspace, workspace_bytes)
        self.check("cublasSetMathMode", self.cublasSetMathMode(handle, DEFAULT_MATH | DISALLOW_REDUCED_PRECISION_REDUCTION))
        return int(handle.value)

    def bind_stream(self, handle: Any, stream: int, workspace: int, workspace_bytes: int) -> None:
        """Point ``handle`` at ``stream`` and attach ``workspace`` again (``cublasSetStream`` resets the
        workspace to cuBLAS's own pool, which allocates while a graph is captured)."""
        self.check("cublasSetStream_v2", self.cublasSetStream_v2(handle, stream))
        self.check("cublasSetWorkspace_v2", self.cublasSetWorkspace_v2(handle, workspace, workspace_bytes))

    def destroy(self, handle: int) -> None:
        self.check("cublasDestroy_v2", self.cublasDestroy_v2(handle))

    def gemm_strided_batched(self, handle: int, *args: int) -> None:
        """``cublasGemmStridedBatchedEx(handle, *args)``, arguments in the C order."""
        self.check("cublasGemmStridedBatchedEx", self.cublasGemmStridedBatchedEx(handle, *args))
