"""A second device backend on the kernel-session core, as a test double: its memory is NumPy and its
"kernels" are a few body kernels written in NumPy (f32 only). It implements ``core.Primitives``
and nothing else, which shows that a backend needs only the primitives."""
from __future__ import annotations

from typing import Any, Callable, Hashable

import numpy as np

from host_fallback.body import UNARY
from rlx_gpu.backends.base import DeviceInfo
from rlx_gpu.backends.core import KernelSession
from rlx_gpu.backends.programs import Program
from rlx_gpu.launches import DeviceLimits, Launch
from rlx_gpu.launches.body import UNARY_FNS


def _f32(buf: np.ndarray, offset: int, n: int) -> np.ndarray:
    return buf[offset: offset + 4 * n].view(np.float32)


def _fill(buf, off, n, value) -> None:
    _f32(buf, int(off), int(n))[...] = value


def _copy_bytes(src, soff, dst, doff, n) -> None:
    dst[int(doff): int(doff) + int(n)] = src[int(soff): int(soff) + int(n)]


def _unary(x, xoff, dst, doff, n, fn) -> None:
    _f32(dst, int(doff), int(n))[...] = UNARY[UNARY_FNS[int(fn)]](_f32(x, int(xoff), int(n)))


KERNELS: dict[str, Callable[..., None]] = {"fill": _fill, "copy_bytes": _copy_bytes, "unary": _unary}


class NumpyPrimitives:
    """``core.Primitives`` over NumPy buffers; counts what the core asks of it."""

    dialect = "opencl"  # program text is only assembled, never compiled
    build_options = ("-numpy",)
    fp64_feature = "the numpy double's fp64"
    shared = False  # a device of its own: every write and read counts as a copy

    def host_view(self, buffer: np.ndarray) -> np.ndarray:
        raise NotImplementedError("the double plays a device with memory of its own")

    def __init__(self, max_alloc_bytes: int = 1 << 20, global_mem_bytes: int = 4 << 20, key: Hashable = None):
        self.info = DeviceInfo("numpy", "numpy:0", "NumPy test double", fp64=False)
        self.device_key = key if key is not None else object()  # sessions with one key share built programs
        self.limits = DeviceLimits(256, 32768, False)
        self.max_alloc_bytes, self.global_mem_bytes = max_alloc_bytes, global_mem_bytes
        self.live: dict[int, np.ndarray] = {}  # id -> buffer not yet released
        self.builds: list[Program] = []
        self.launched: list[str] = []

    def allocate(self, nbytes: int) -> np.ndarray:
        assert 1 <= nbytes <= self.max_alloc_bytes
        buf = np.full(nbytes, 0xAB, np.uint8)  # uninitialised: garbage, not zeros
        self.live[id(buf)] = buf
        return buf

    def release(self, buffer: np.ndarray) -> None:
        del self.live[id(buffer)]

    def write(self, buffer: np.ndarray, offset: int, data: np.ndarray) -> None:
        buffer[offset: offset + data.size] = data

    def read(self, buffer: np.ndarray, offset: int, out: np.ndarray) -> None:
        out[...] = buffer[offset: offset + out.size]

    def zero(self, buffer: np.ndarray, offset: int, nbytes: int) -> None:
        buffer[offset: offset + nbytes] = 0

    def build_program(self, program: Program) -> Program:
        self.builds.append(program)
        return program

    def get_kernel(self, built: Program, name: str) -> Callable[..., None]:
        assert f"KERNEL {name}(" in built.source, f"{built.label} has no kernel {name}"
        return KERNELS[name]

    def enqueue(self, kernel: Callable[..., None], launch: Launch, args: tuple[Any, ...]) -> None:
        assert launch.dtype == "f32", "the double runs f32 only"
        self.launched.append(launch.kernel)
        kernel(*args)

    def finish(self) -> None:
        pass


def open_double(**kwargs: Any) -> KernelSession:
    return KernelSession(NumpyPrimitives(**kwargs))
