"""A CuPy contract double: a stand-in ``cupy`` module of exactly what ``backends/cuda.py`` and
``backends/cuda_primitives.py`` call, and a stand-in cuBLAS library for ``backends/cublas_lib.py``, over NumPy
memory.

It enforces the rules of CuPy 14.2 (read from its source: ``cupy/cuda/function.pyx``,
``cupy/_core/_scalar.pyx``, ``cupy/cuda/memory.pyx``, ``cupy/_core/core.pyx``,
``cupy_backends/cuda/libs/cublas.pyx``), of the CUDA runtime and driver, and of cuBLAS's C API where
they bite:

- kernel arguments are marshalled by type as ``cupy.cuda.function._pointer`` does (a Python int is an
  int64, a float a float64, a NumPy scalar keeps its width, a ``MemoryPointer`` is an 8-byte pointer,
  anything else is ``TypeError``) and checked against the launched kernel's parameter list in the PTX
  NVRTC built beside the cubin; pointers must lie in live allocations of the launching device;
- ``Module.get_function`` of a name the module lacks raises the driver's ``CUDA_ERROR_NOT_FOUND``;
- every stream, module, allocation and cuBLAS handle belongs to the device current when it was made,
  and using it while another device is current is the runtime's invalid-resource-handle error;
- ``memcpyAsync`` checks its kind against where the pointers are; a capturing stream refuses
  synchronization and host copies; CuPy's own cuBLAS wrappers refuse to run while the current stream
  captures (``NotImplementedError``); through the C API a captured gemm needs an attached workspace;
- ``ndarray.__dlpack__`` orders the consumer after CuPy's current stream only: exporting memory that
  another stream still has pending work on is reported as a stale read (:class:`ContractError`).

What it can compute it computes: copies, memsets and GEMMs move real bytes (host memory is read and
written at its real address); kernel launches are recorded (kernel, grid, block, arguments) but not
run, so buffers written by kernels hold whatever was there. CUDA graphs record what a capture enqueued
and replay it, refusing to replay into freed memory. ``Machine.log`` lists, in order, every copy (by
kind), memset and gemm with the stream it was enqueued on, and every synchronization. Breaches that a GPU would not report but would
turn into wrong results raise :class:`ContractError`; failures inside a cuBLAS call (a C callback,
which cannot raise through ctypes) are kept in ``Machine.errors`` and returned as a failing status.
"""
from __future__ import annotations

import bisect
import contextlib
import ctypes
import hashlib
import itertools
import os
import sys
import threading
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import ml_dtypes
import numpy as np

from support import cuda_builds
from rlx_gpu.backends import nvrtc

VERSION = "14.2.0"
DEVICE_BASE = 1 << 52  # device addresses: above any x86-64 user-space host address
LEGACY_STREAM, PER_THREAD_STREAM = 1, 2  # cudaStreamLegacy, cudaStreamPerThread
MEMCPY_KINDS = {"memcpyHostToHost": 0, "memcpyHostToDevice": 1, "memcpyDeviceToHost": 2, "memcpyDeviceToDevice": 3,
                "memcpyDefault": 4}
H200 = {"name": b"NVIDIA H200", "major": 9, "minor": 0, "totalGlobalMem": 150_000_000_000, "multiProcessorCount": 132,
        "maxThreadsPerBlock": 1024, "maxGridSize": (2147483647, 65535, 65535), "sharedMemPerBlock": 49152,
        "sharedMemPerBlockOptin": 232448, "warpSize": 32}
# cuBLAS (cublas_api.h, library_types.h), written here from the headers, apart from the backend's tables
CUBLAS_OK, CUBLAS_INVALID_VALUE, CUBLAS_INTERNAL_ERROR, CUBLAS_NOT_SUPPORTED = 0, 7, 14, 15
BLAS_TYPES = {0: np.dtype(np.float32), 1: np.dtype(np.float64), 2: np.dtype(np.float16), 14: np.dtype(ml_dtypes.bfloat16)}
COMPUTE_32F, COMPUTE_32F_FAST_TF32, COMPUTE_64F = 68, 77, 70
# the PTX beside each cubin of the session's cache, by the cubin's digest, the cubin files already hashed, and the
# size of every cubin file seen (the cache is kept across sessions: thousands of files, each asked its size once)
_PTX_OF_CUBIN: dict[str, str] = {}
_READ_CUBINS: set[Path] = set()
_CUBIN_SIZES: dict[Path, dict[str, int]] = {}


def _cubins_of_size(folder: Path, size: int, rescan: bool) -> list[Path]:
    """The cubin files of ``size`` bytes in ``folder`` not hashed yet; the folder is listed on its first call and on a
    ``rescan``, each new file asked its size once."""
    sizes = _CUBIN_SIZES.get(folder)
    if sizes is None or rescan:
        sizes = _CUBIN_SIZES.setdefault(folder, {})
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.name not in sizes and entry.name.endswith(".cubin"):
                    sizes[entry.name] = entry.stat().st_size
    return [path for path in sorted(folder / name for name, n in sizes.items() if n == size) if path not in _READ_CUBINS]


class CUDARuntimeError(RuntimeError):
    """cupy_backends.cuda.api.runtime.CUDARuntimeError."""


class CUDADriverError(RuntimeError):
    """cupy_backends.cuda.api.driver.CUDADriverError."""


class OutOfMemoryError(MemoryError):
    """cupy.cuda.memory.OutOfMemoryError (CuPy's pool; a plain ``Memory`` raises CUDARuntimeError)."""


class ContractError(AssertionError):
    """A call a GPU would accept and then compute garbage from (or read stale data with)."""


def _invalid_handle(what: str) -> CUDARuntimeError:
    return CUDARuntimeError(f"cudaErrorInvalidResourceHandle: invalid resource handle ({what})")


@dataclass(eq=False)
class Block:
    """One cudaMalloc'd allocation."""

    device: int
    ptr: int
    data: np.ndarray
    live: bool = True


@dataclass(eq=False)
class StreamState:
    device: int
    ptr: int
    capture: list | None = None  # the operations a capture recorded, while capturing
    pending: set = field(default_factory=set)  # Blocks written by work not yet synchronized


@dataclass(frozen=True)
class LaunchRecord:
    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    args: tuple[tuple[str, int, Any], ...]  # (kind "i"/"f", bytes, value) as marshalled
    device: int
    stream: int
    replayed: bool


class Machine:
    """The GPUs the double simulates: their memory, streams, modules, launches and cuBLAS handles."""

    def __init__(self, devices: int = 1, cubin_dir: Path | None = None, memory_bytes: int = 1 << 34):
        self.props = [dict(H200) for _ in range(devices)]
        self.memory_bytes = memory_bytes
        self.cubin_dir = cubin_dir
        self._local = threading.local()
        self._starts: list[int] = []
        self._blocks: list[Block] = []
        self._next_ptr = DEVICE_BASE
        self.allocated = [0] * devices
        self.streams: dict[int, StreamState] = {}
        self._stream_ids = itertools.count(0x1000, 0x10)
        self.launches: list[LaunchRecord] = []
        self.graph_counts = {"captured": 0, "launched": 0}
        self.log: list[tuple[str, int]] = []  # ("H2D" | "D2H" | "D2D" | "memset" | "gemm" | "sync", stream)
        self.handles: dict[int, dict[str, Any]] = {}
        self.errors: list[BaseException] = []
        for device in range(devices):  # the legacy default stream of each device
            self.streams.setdefault(LEGACY_STREAM, StreamState(device, LEGACY_STREAM))

    # -- the current device and stream (per thread, as in CUDA and CuPy) ---------------------------
    @property
    def device(self) -> int:
        return getattr(self._local, "device", 0)

    @device.setter
    def device(self, index: int) -> None:
        if not 0 <= index < len(self.props):
            raise CUDARuntimeError("cudaErrorInvalidDevice: invalid device ordinal")
        self._local.device = index

    @property
    def current_stream(self) -> int:
        stack = getattr(self._local, "streams", None)
        return stack[-1] if stack else LEGACY_STREAM

    def stream(self, ptr: int) -> StreamState:
        if ptr in (0, LEGACY_STREAM, PER_THREAD_STREAM):
            return StreamState(self.device, LEGACY_STREAM)  # the default stream of the current device
        state = self.streams.get(ptr)
        if state is None:
            raise _invalid_handle(f"no stream 0x{ptr:x}")
        return state

    def own_stream(self, ptr: int, what: str) -> StreamState:
        state = self.stream(ptr)
        if state.device != self.device:
            raise _invalid_handle(f"{what} on a stream of device {state.device} while device {self.device} is current")
        return state

    # -- memory ------------------------------------------------------------------------------------
    def malloc(self, nbytes: int) -> Block:
        device = self.device
        if self.allocated[device] + nbytes > self.memory_bytes:
            raise CUDARuntimeError("cudaErrorMemoryAllocation: out of memory")
        block = Block(device, self._next_ptr, np.full(max(nbytes, 1), 0xAB, np.uint8))  # uninitialised
        self._next_ptr += -(-max(nbytes, 1) // 256) * 256 + 256
        self._starts.append(block.ptr)
        self._blocks.append(block)
        self.allocated[device] += nbytes
        return block

    def free(self, block: Block) -> None:
        if block.live:
            block.live = False
            self.allocated[block.device] -= block.data.size

    def find(self, ptr: int, nbytes: int, what: str) -> tuple[Block, int]:
        """The live allocation holding ``[ptr, ptr + nbytes)`` and the offset of ``ptr`` in it."""
        i = bisect.bisect_right(self._starts, ptr) - 1
        block = self._blocks[i] if i >= 0 else None
        if block is None or ptr + nbytes > block.ptr + block.data.size:
            raise ContractError(f"{what}: {nbytes} bytes at 0x{ptr:x} are outside every allocation")
        if not block.live:
            raise ContractError(f"{what}: 0x{ptr:x} points into freed memory")
        return block, ptr - block.ptr

    def device_bytes(self, ptr: int, nbytes: int, what: str) -> tuple[Block, np.ndarray]:
        block, offset = self.find(ptr, nbytes, what)
        return block, block.data[offset: offset + nbytes]

    @staticmethod
    def is_device(ptr: int) -> bool:
        return ptr >= DEVICE_BASE

    # -- work on a stream: run now, or record while the stream captures ------------------------------
    def submit(self, stream: StreamState, op: Callable[[bool], set]) -> None:
        """``op(replayed)`` does the work and returns the Blocks it wrote."""
        if stream.capture is not None:
            stream.capture.append(op)
        else:
            stream.pending |= op(False)

    def synchronize(self, stream: StreamState) -> None:
        self.log.append(("sync", stream.ptr))
        if stream.capture is not None:
            raise CUDARuntimeError("cudaErrorStreamCaptureUnsupported: operation not permitted when stream is capturing")
        stream.pending.clear()

    # -- cubins and their PTX ------------------------------------------------------------------------
    def ptx_of(self, cubin: bytes) -> str:
        """The PTX NVRTC built with ``cubin``: the ``.ptx`` beside it in the backend's cubin cache."""
        digest = hashlib.sha256(cubin).hexdigest()
        if self.cubin_dir and self.cubin_dir.is_dir():
            # the files listed before, then (a cubin built since) the folder listed again; only those of its size
            for rescan in (False, True):
                if digest in _PTX_OF_CUBIN:
                    break
                for path in _cubins_of_size(self.cubin_dir, len(cubin), rescan):
                    _READ_CUBINS.add(path)
                    _PTX_OF_CUBIN.setdefault(hashlib.sha256(path.read_bytes()).hexdigest(),
                                             path.with_suffix(".ptx").read_text())
        if digest not in _PTX_OF_CUBIN:
            raise ContractError("a cubin the cubin cache did not build was loaded")
        return _PTX_OF_CUBIN[digest]


# ------------------------------------------------------------------------------------------ the module
def cupy_module(machine: Machine) -> types.ModuleType:
    """A ``cupy`` module over ``machine``."""
    m = machine

    class Device:
        def __init__(self, device: int | None = None):
            self.id = m.device if device is None else int(device)

        def __enter__(self):
            self._previous = getattr(self, "_previous", [])
            self._previous.append(m.device)
            m.device = self.id
            return self

        def __exit__(self, *exc):
            m.device = self._previous.pop()

    class Memory:
        def __init__(self, size: int):
            self.size, self.device_id = size, m.device
            self._block = m.malloc(size) if size > 0 else None
            self.ptr = self._block.ptr if self._block else 0

        def __del__(self):
            if getattr(self, "_block", None) is not None:
                m.free(self._block)

    class MemoryPointer:
        def __init__(self, mem: Memory, offset: int):
            assert mem.ptr != 0 or offset == 0
            self.mem, self.ptr, self.device_id = mem, mem.ptr + offset, mem.device_id

        def __int__(self):
            return self.ptr

        def __add__(self, offset: int):
            assert self.ptr != 0 or offset == 0
            return MemoryPointer(self.mem, self.ptr - self.mem.ptr + int(offset))

    class Event:
        pass

    class Stream:
        def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False):
            self.ptr = LEGACY_STREAM if null else next(m._stream_ids)
            self.device_id = m.device
            if not null:
                m.streams[self.ptr] = StreamState(m.device, self.ptr)

        def __enter__(self):
            if not hasattr(m._local, "streams"):
                m._local.streams = []
            m._local.streams.append(self.ptr)
            return self

        def __exit__(self, *exc):
            m._local.streams.pop()

        def synchronize(self):
            m.synchronize(m.own_stream(self.ptr, "cudaStreamSynchronize"))

        def begin_capture(self, mode=None):
            state = m.own_stream(self.ptr, "cudaStreamBeginCapture")
            if state.capture is not None:
                raise CUDARuntimeError("cudaErrorIllegalState: the stream is already capturing")
            state.capture = []

        def end_capture(self):
            state = m.own_stream(self.ptr, "cudaStreamEndCapture")
            ops, state.capture = state.capture, None
            m.graph_counts["captured"] += 1
            return Graph(ops, state.device)

        def is_capturing(self):
            return m.stream(self.ptr).capture is not None

    class ExternalStream(Stream):
        """A stream made elsewhere (torch's), known by its pointer: ``cupy.cuda.ExternalStream(ptr, device_id)``."""

        def __init__(self, ptr: int, device_id: int = -1):
            state = m.stream(ptr)
            if device_id not in (-1, state.device):
                raise _invalid_handle(f"stream 0x{ptr:x} of device {state.device} named as one of device {device_id}")
            self.ptr, self.device_id = ptr, state.device

    class Graph:
        def __init__(self, ops: list, device: int):
            self.ops, self.device = ops, device

        def launch(self, stream: Stream | None = None):
            state = m.own_stream(stream.ptr if stream is not None else m.current_stream, "cudaGraphLaunch")
            if state.device != self.device:
                raise _invalid_handle(f"a graph of device {self.device} launched on device {state.device}")
            m.graph_counts["launched"] += 1
            for op in self.ops:
                m.submit(state, lambda replayed, op=op: op(True))

    def memcpyAsync(dst: int, src: int, size: int, kind: int, stream: int) -> None:
        state = m.own_stream(stream, "cudaMemcpyAsync")
        where = (m.is_device(src), m.is_device(dst))
        expected = {1: (False, True), 2: (True, False), 3: (True, True)}.get(kind)
        if expected is None or where != expected:
            raise CUDARuntimeError(f"cudaErrorInvalidValue: invalid argument (memcpy kind {kind} from a "
                                   f"{'device' if where[0] else 'host'} to a {'device' if where[1] else 'host'} pointer)")
        if state.capture is not None and kind != 3:
            raise CUDARuntimeError("cudaErrorStreamCaptureUnsupported: a copy from or to pageable host memory "
                                   "cannot be captured")
        for ptr in (p for p, on_device in ((src, where[0]), (dst, where[1])) if on_device):
            if m.find(ptr, size, "cudaMemcpyAsync")[0].device != state.device:
                raise ContractError(f"cudaMemcpyAsync: 0x{ptr:x} is memory of another device than the stream's")
        m.log.append(({1: "H2D", 2: "D2H", 3: "D2D"}[kind], state.ptr))

        def copy(replayed: bool) -> set:
            if kind == 1:
                block, into = m.device_bytes(dst, size, "cudaMemcpyAsync")
                into[...] = np.frombuffer(ctypes.string_at(src, size), np.uint8)
                return {block}
            if kind == 2:
                ctypes.memmove(dst, m.device_bytes(src, size, "cudaMemcpyAsync")[1].ctypes.data, size)
                return set()
            block, into = m.device_bytes(dst, size, "cudaMemcpyAsync")
            into[...] = m.device_bytes(src, size, "cudaMemcpyAsync")[1]
            return {block}
        m.submit(state, copy)

    def memsetAsync(ptr: int, value: int, size: int, stream: int) -> None:
        state = m.own_stream(stream, "cudaMemsetAsync")
        if m.find(ptr, size, "cudaMemsetAsync")[0].device != state.device:
            raise ContractError(f"cudaMemsetAsync: 0x{ptr:x} is memory of another device than the stream's")
        m.log.append(("memset", state.ptr))

        def fill(replayed: bool) -> set:
            block, into = m.device_bytes(ptr, size, "cudaMemsetAsync")
            into[...] = value
            return {block}
        m.submit(state, fill)

    def streamIsCapturing(stream: int) -> bool:
        return m.stream(stream).capture is not None

    runtime = types.SimpleNamespace(
        CUDARuntimeError=CUDARuntimeError, getDeviceCount=lambda: len(m.props),
        getDeviceProperties=lambda i: dict(m.props[i]), getDevice=lambda: m.device,
        setDevice=lambda i: setattr(m, "device", i), memcpyAsync=memcpyAsync, memsetAsync=memsetAsync,
        streamIsCapturing=streamIsCapturing, streamLegacy=LEGACY_STREAM, streamPerThread=PER_THREAD_STREAM,
        **MEMCPY_KINDS)

    class Function:
        def __init__(self, module: "Module", name: str, params: tuple[tuple[str, int], ...]):
            self.module, self.name, self.params, self.ptr = module, name, params, id(self)

        def __call__(self, grid: tuple, block: tuple, args, shared_mem: int = 0, stream: Stream | None = None,
                     enable_cooperative_groups: bool = False):
            grid, block = (tuple(grid) + (1, 1))[:3], (tuple(block) + (1, 1))[:3]
            state = m.own_stream(stream.ptr if stream is not None else m.current_stream, "cuLaunchKernel")
            if self.module.device != m.device:
                raise CUDADriverError("CUDA_ERROR_INVALID_HANDLE: invalid resource handle (a kernel of device "
                                      f"{self.module.device} launched while device {m.device} is current)")
            props = m.props[m.device]
            if np.prod(block) > props["maxThreadsPerBlock"] or any(g > cap for g, cap in zip(grid, props["maxGridSize"])):
                raise CUDADriverError(f"CUDA_ERROR_INVALID_VALUE: invalid argument (grid {grid}, block {block})")
            marshalled = tuple(_marshal(a) for a in args)
            got = tuple((kind, size) for kind, size, _ in marshalled)
            if got != self.params:
                raise ContractError(f"{self.name}: the launch packs {got}, the kernel's PTX takes {self.params}")
            for kind, size, value in marshalled:
                if isinstance(value, MemoryPointer):
                    if m.find(value.ptr, 0, f"{self.name}'s pointer argument")[0].device != m.device:
                        raise ContractError(f"{self.name}: a pointer into another device's memory")
            values = tuple((k, s, v.ptr if isinstance(v, MemoryPointer) else v) for k, s, v in marshalled)
            written = {m.find(v.ptr, 0, self.name)[0] for _, _, v in marshalled if isinstance(v, MemoryPointer)}

            def launch(replayed: bool) -> set:
                for _, _, v in marshalled:
                    if isinstance(v, MemoryPointer):
                        m.find(v.ptr, 0, f"{self.name} (replayed)" if replayed else self.name)
                m.launches.append(LaunchRecord(self.name, grid, block, values, state.device, state.ptr, replayed))
                return written
            m.submit(state, launch)

    def _marshal(x: Any) -> tuple[str, int, Any]:
        """(kind, bytes, value) of one kernel argument, by CuPy's rules (``function._pointer``, ``CScalar``)."""
        if x is None:
            return ("i", 8, 0)
        if isinstance(x, ndarray):
            raise ContractError("a cupy.ndarray is passed to a raw kernel as its CArray struct, not as a pointer")
        if isinstance(x, MemoryPointer):
            return ("i", 8, x)
        if isinstance(x, np.ndarray):
            if x.size != 1:
                raise TypeError(f"You are trying to pass a numpy.ndarray of shape {x.shape} as a kernel parameter.")
            x = x.reshape(())[()]
        if type(x) is bool:
            return ("i", 1, x)
        if type(x) is float:
            return ("f", 8, x)
        if type(x) is int:
            return ("i", 8, x)
        if isinstance(x, np.generic):
            return ("f" if x.dtype.kind == "f" else "i", x.dtype.itemsize, x.item())
        raise TypeError(f"Unsupported type {type(x)}")

    class Module:
        def __init__(self):
            self.ptr, self.params = 0, None

        def load(self, cubin: bytes):
            if not cubin.startswith(b"\x7fELF"):
                raise CUDADriverError("CUDA_ERROR_INVALID_IMAGE: device kernel image is invalid")
            self.device, self.ptr = m.device, id(self)
            self.params = nvrtc.parameters(m.ptx_of(cubin))

        def get_function(self, name: str) -> Function:
            if name not in self.params:
                raise CUDADriverError("CUDA_ERROR_NOT_FOUND: named symbol not found")
            return Function(self, name, self.params[name])

    def funcGetAttribute(attribute: int, ptr: int) -> int:
        return {0: m.props[m.device]["maxThreadsPerBlock"]}.get(attribute, 0)

    class ndarray:
        def __init__(self, shape: tuple, dtype: Any = float, memptr: MemoryPointer | None = None):
            self.shape, self.dtype, self.data = tuple(shape), np.dtype(dtype), memptr
            self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
            self.device_id = memptr.device_id

        def __dlpack_device__(self) -> tuple[int, int]:
            return (2, self.device_id)  # kDLCUDA

        def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
            if stream == 0:  # the array API's DLPack rule for CUDA (torch's __dlpack__ asserts it)
                raise ValueError("stream 0 is ambiguous on CUDA: pass 1 for the legacy default stream")
            consumer = LEGACY_STREAM if stream is None else stream
            current = m.current_stream
            block = m.find(self.data.ptr, self.nbytes, "__dlpack__")[0]
            if consumer != -1:  # -1: the consumer asks for no ordering
                stale = [s for s in m.streams.values()
                         if s.device == self.device_id and s.ptr != current and block in s.pending]
                if stale:
                    raise ContractError(f"__dlpack__ orders the consumer after CuPy's current stream (0x{current:x}) "
                                        f"only; stream 0x{stale[0].ptr:x} still has unsynchronized work on this memory")
            return _device_capsule(self, max_version is not None and max_version[0] >= 1)

        def get(self) -> np.ndarray:
            data = m.device_bytes(self.data.ptr, self.nbytes, "ndarray.get")[1]
            return data.view(self.dtype).reshape(self.shape).copy()

    cupy = types.ModuleType("cupy")
    cupy.__version__ = VERSION
    cupy.ndarray = ndarray
    cublas = _cupy_cublas(m)
    cupy.cuda = types.SimpleNamespace(
        Device=Device, Stream=Stream, ExternalStream=ExternalStream, Event=Event, runtime=runtime, cublas=cublas,
        memory=types.SimpleNamespace(Memory=Memory, MemoryPointer=MemoryPointer, OutOfMemoryError=OutOfMemoryError),
        function=types.SimpleNamespace(Module=Module, Function=Function),
        driver=types.SimpleNamespace(CUDADriverError=CUDADriverError, funcGetAttribute=funcGetAttribute),
        graph=types.SimpleNamespace(Graph=Graph), get_current_stream=lambda: m.current_stream)
    return cupy


def _device_capsule(array: Any, versioned: bool) -> Any:
    """A DLPack capsule of ``array``'s device memory (kDLCUDA), as CuPy's ``_toDlpack`` makes one."""
    from rlx_gpu.runtime import dlpack

    codes = {np.dtype(np.float32): (2, 32), np.dtype(np.float16): (2, 16), np.dtype(np.float64): (2, 64),
             np.dtype(np.int32): (0, 32)}
    ndim = len(array.shape)
    sizes = (ctypes.c_int64 * max(ndim, 1))(*array.shape)
    managed: Any = dlpack.DLManagedTensorVersioned() if versioned else dlpack.DLManagedTensor()
    t = managed.dl_tensor
    t.data, t.byte_offset, t.device, t.ndim = array.data.ptr, 0, dlpack.DLDevice(2, array.device_id), ndim
    t.dtype = dlpack.DLDataType(*codes[array.dtype], 1)
    t.shape = ctypes.cast(sizes, ctypes.POINTER(ctypes.c_int64))
    managed.deleter = dlpack._delete_export
    if versioned:
        managed.version = dlpack.DLPackVersion(1, 0)
    address = ctypes.addressof(managed)
    dlpack._LIVE[address] = (managed, sizes, array)
    return dlpack._capsule_new(address, dlpack._NAME_VERSIONED if versioned else dlpack._NAME, dlpack._destroy_capsule)


# ------------------------------------------------------------------------------------------ cuBLAS
def _gemm(m: Machine, handle: dict, transa: int, transb: int, rows: int, cols: int, depth: int, alpha: int,
          a: int, a_type: int, lda: int, stride_a: int, b: int, b_type: int, ldb: int, stride_b: int, beta: int,
          c: int, c_type: int, ldc: int, stride_c: int, batch: int, compute: int, algo: int) -> int:
    """``cublasGemmStridedBatchedEx`` (BLAS semantics, column-major) on the device memory; a status."""
    if m.device != handle["device"]:
        raise ContractError(f"a cuBLAS handle of device {handle['device']} used while device {m.device} is current")
    types_ = (a_type, b_type, c_type)
    if any(t not in BLAS_TYPES for t in types_) or a_type != b_type:
        return CUBLAS_NOT_SUPPORTED
    if compute == COMPUTE_64F:
        if types_ != (1, 1, 1):
            return CUBLAS_NOT_SUPPORTED
    elif compute in (COMPUTE_32F, COMPUTE_32F_FAST_TF32):
        if a_type == 1 or c_type not in (0, a_type) or (compute == COMPUTE_32F_FAST_TF32 and a_type != 0):
            return CUBLAS_NOT_SUPPORTED
    else:
        return CUBLAS_NOT_SUPPORTED
    shape_a = (rows, depth) if transa == 0 else (depth, rows)
    shape_b = (depth, cols) if transb == 0 else (cols, depth)
    if min(rows, cols, depth, batch) < 0 or transa not in (0, 1) or transb not in (0, 1) or \
            lda < max(1, shape_a[0]) or ldb < max(1, shape_b[0]) or ldc < max(1, rows):
        return CUBLAS_INVALID_VALUE
    scalar = ctypes.c_double if compute == COMPUTE_64F else ctypes.c_float
    alpha_v, beta_v = scalar.from_address(alpha).value, scalar.from_address(beta).value  # host pointer mode
    stream = m.stream(handle["stream"])
    if stream.device != m.device:
        raise ContractError("a cuBLAS handle bound to a stream of another device")
    if stream.capture is not None and handle["workspace"] is None:
        return CUBLAS_NOT_SUPPORTED  # it would allocate its workspace while the graph is captured

    def matrix(ptr: int, type_code: int, z: int, stride: int, shape: tuple[int, int], ld: int) -> tuple[Block, np.ndarray, np.ndarray]:
        itemsize = BLAS_TYPES[type_code].itemsize
        start = ptr + z * stride * itemsize
        span = (shape[0] - 1 + ld * (shape[1] - 1) + 1) * itemsize if min(shape) > 0 else 0
        block, data = m.device_bytes(start, span, "cublasGemmStridedBatchedEx")
        elems = data.view(BLAS_TYPES[type_code]) if span else np.empty(0, BLAS_TYPES[type_code])
        idx = np.arange(shape[0])[:, None] + ld * np.arange(shape[1])[None, :]
        return block, elems, idx

    def run(replayed: bool) -> set:
        written = set()
        for z in range(batch):
            _, ea, ia = matrix(a, a_type, z, stride_a, shape_a, lda)
            _, eb, ib = matrix(b, b_type, z, stride_b, shape_b, ldb)
            block, ec, ic = matrix(c, c_type, z, stride_c, (rows, cols), ldc)
            op_a = ea[ia].astype(np.float64) if transa == 0 else ea[ia].astype(np.float64).T
            op_b = eb[ib].astype(np.float64) if transb == 0 else eb[ib].astype(np.float64).T
            out = alpha_v * (op_a @ op_b)
            if beta_v:
                out = out + beta_v * ec[ic].astype(np.float64)
            if rows and cols:
                ec[ic] = out.astype(BLAS_TYPES[c_type])
            written.add(block)
        return written
    m.submit(stream, run)
    m.log.append(("gemm", stream.ptr))
    handle["gemms"] += 1
    return CUBLAS_OK


def cublas_library(m: Machine) -> types.SimpleNamespace:
    """The cuBLAS C API over ``m``: each function a real C function pointer (a ctypes callback) with
    the header's signature, so the caller's argument types go through the C ABI."""
    c_int, c_ll, c_ptr, c_size = ctypes.c_int, ctypes.c_longlong, ctypes.c_void_p, ctypes.c_size_t

    def create(out: int) -> int:
        handle = len(m.handles) + 0x100
        m.handles[handle] = {"device": m.device, "stream": LEGACY_STREAM, "workspace": None, "math": 0, "gemms": 0}
        ctypes.c_void_p.from_address(out).value = handle
        return CUBLAS_OK

    def set_stream(handle: int, stream: int | None) -> int:
        h = m.handles[handle]
        h["stream"], h["workspace"] = stream or LEGACY_STREAM, None  # setting the stream resets the workspace
        return CUBLAS_OK

    def set_workspace(handle: int, workspace: int | None, nbytes: int) -> int:
        block, _ = m.device_bytes(workspace or 0, nbytes, "cublasSetWorkspace_v2")
        if block.device != m.handles[handle]["device"]:
            raise ContractError("a workspace on another device than the handle's")
        m.handles[handle]["workspace"] = (workspace, nbytes)
        return CUBLAS_OK

    def set_math_mode(handle: int, mode: int) -> int:
        m.handles[handle]["math"] = mode
        return CUBLAS_OK

    def destroy(handle: int) -> int:
        del m.handles[handle]
        return CUBLAS_OK

    def gemm(handle: int, *args: Any) -> int:
        return _gemm(m, m.handles[handle], *(0 if a is None else a for a in args))

    header = {  # name: (implementation, C parameter types), from cublas_api.h
        "cublasCreate_v2": (create, (c_ptr,)),
        "cublasDestroy_v2": (destroy, (c_ptr,)),
        "cublasSetStream_v2": (set_stream, (c_ptr, c_ptr)),
        "cublasSetWorkspace_v2": (set_workspace, (c_ptr, c_ptr, c_size)),
        "cublasSetMathMode": (set_math_mode, (c_ptr, c_int)),
        "cublasGemmStridedBatchedEx": (gemm, (c_ptr, c_int, c_int, c_int, c_int, c_int, c_ptr, c_ptr, c_int, c_int, c_ll,
                                              c_ptr, c_int, c_int, c_ll, c_ptr, c_ptr, c_int, c_int, c_ll, c_int, c_int, c_int)),
    }
    library = types.SimpleNamespace()
    for name, (impl, params) in header.items():
        def guarded(*args: Any, impl: Callable = impl) -> int:
            try:
                return impl(*args)
            except BaseException as err:  # noqa: BLE001 - nothing may raise through a C callback
                m.errors.append(err)
                return CUBLAS_INTERNAL_ERROR
        setattr(library, name, ctypes.CFUNCTYPE(c_int, *params)(guarded))
    return library


def _cupy_cublas(m: Machine) -> types.SimpleNamespace:
    """``cupy.cuda.cublas`` (CuPy 14.2's wrappers): each call first points the handle at CuPy's current
    stream, which refuses while that stream captures."""
    lib = cublas_library(m)

    def create() -> int:
        out = ctypes.c_void_p()
        lib.cublasCreate_v2(ctypes.addressof(out))
        return int(out.value)

    def setStream(handle: int, stream: int) -> None:
        if m.stream(stream).capture is not None:
            raise NotImplementedError("calling cuBLAS API during stream capture is currently unsupported")
        lib.cublasSetStream_v2(handle, stream)

    def gemmStridedBatchedEx(handle: int, *args: int) -> None:
        setStream(handle, m.current_stream)
        status = lib.cublasGemmStridedBatchedEx(handle, *args)
        if status:
            raise RuntimeError(f"CUBLAS_STATUS {status}")

    return types.SimpleNamespace(create=create, setStream=setStream, gemmStridedBatchedEx=gemmStridedBatchedEx)


# ------------------------------------------------------------------------------------------ fixtures
@contextlib.contextmanager
def installed(monkeypatch: Any, devices: int = 1, memory_bytes: int = 1 << 34):
    """The double in place of CuPy and cuBLAS, the backend's cubin cache on the session's (``cuda_builds``)
    and fresh registry and program caches; yields the :class:`Machine`. Fails if a cuBLAS call failed inside."""
    from rlx_gpu.backends import core, cublas_lib
    from rlx_gpu.runtime import registry

    directory = cuda_builds.directory()
    machine = Machine(devices, directory, memory_bytes)
    monkeypatch.setitem(sys.modules, "cupy", cupy_module(machine))
    monkeypatch.setattr(cublas_lib, "load_library", lambda: cublas_library(machine))
    monkeypatch.setenv("RLX_CACHE_DIR", str(directory))
    monkeypatch.setattr(core, "_PROGRAMS", {})  # modules loaded on another machine are not this one's
    caches = (registry.status, registry.backend_module, registry.sessions)
    for cache in caches:
        cache.cache_clear()
    try:
        yield machine
    finally:
        for cache in caches:
            cache.cache_clear()
    assert not machine.errors, f"failures inside cuBLAS calls: {machine.errors!r}"
