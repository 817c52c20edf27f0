"""One CUDA device's primitives (``core.Primitives``) through CuPy: its stream, allocations, cubins, cuBLAS
handle, ones buffers and CUDA graphs (``cuda``'s docstring says how they are used)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .. import launches
from ..errors import DeviceError, KernelBuildError
from ..launches import DeviceLimits, Launch
from ..launches.mma import device_mma
from ..units import human_bytes
from . import cublas_lib, nvrtc
from .base import BackendUnavailable, DeviceInfo
from .cublas_calls import GemmCall, ones
from .cubin_cache import CubinCache, cache_dir, nvrtc_version
from .graph_cache import GraphCache, Generations
from .programs import Program

CUBLAS_WORKSPACE = 32 << 20  # the handle's fixed workspace: cuBLAS allocates nothing while a graph is captured
GEMM = "cublasGemmStridedBatchedEx"  # what a bound GemmCall "kernel" is: the call that runs it
# enum values of library_types.h / cublas_api.h (a stable ABI; CuPy's own names moved between releases)
_DATA_TYPES = {"f32": 0, "f64": 1, "f16": 2, "bf16": 14}  # CUDA_R_32F, CUDA_R_64F, CUDA_R_16F, CUDA_R_16BF
_COMPUTE_TYPES = {"32F": 68, "32F_FAST_TF32": 77, "64F": 70}  # CUBLAS_COMPUTE_32F, ..._32F_FAST_TF32, ..._64F
_OPS = {"N": 0, "T": 1}  # CUBLAS_OP_N, CUBLAS_OP_T
_GEMM_DEFAULT = -1  # CUBLAS_GEMM_DEFAULT
#: CUfunction_attribute values (cuda.h) the build report reads back from the driver
_FUNC_ATTRIBUTES = {"max_block": 0, "shared_bytes": 1, "local_bytes": 3, "registers": 4}
_ONE = {"f16": np.float16(1), "bf16": np.uint16(0x3F80), "f32": np.float32(1), "f64": np.float64(1)}


def import_cupy():
    """CuPy, or ``BackendUnavailable`` saying how to install it."""
    try:
        import cupy
    except ImportError as err:
        raise BackendUnavailable(f"cupy is not importable ({err}); in a checkout install it with: "
                                 f'pip install -e ".[cuda13]" (CUDA 13 drivers) or ".[cuda12]"') from err
    return cupy


def device_limits(info: DeviceInfo, tf32: bool = False) -> DeviceLimits:
    """Launch limits of a device: static shared memory stays within the per-block default (the kernels
    declare it statically, so the opt-in maximum does not apply); the tensor-core variants its compute
    capability takes (TF32 only when ``tf32`` asks for it)."""
    d = info.details
    return DeviceLimits(d["max_block"], d["shared_per_block"], True, target=launches.limits.requested_target("gpu"),
                        sub_group=d["warp"], compute_units=d["multiprocessors"], max_grid=d["max_grid"],
                        mma=device_mma(capability(info), tf32))


def capability(info: DeviceInfo) -> tuple[int, int]:
    """The device's compute capability, (major, minor)."""
    major, minor = info.details["compute_capability"].split(".")
    return int(major), int(minor)



@dataclass(frozen=True, eq=False)
class Allocation:
    """One device allocation: CuPy's pointer (passed to kernels as the base) and its generation."""

    pointer: Any  # cupy.cuda.MemoryPointer; owns the cudaMalloc'd memory
    nbytes: int
    generation: int

    @property
    def ptr(self) -> int:
        return int(self.pointer.ptr)


class CudaPrimitives:
    """One CUDA device: its stream, allocations, cubins, cuBLAS handle, ones buffers and CUDA graphs."""

    dialect = "cuda"  # the backend's NAME
    fp64_feature = "double precision"  # every CUDA device has it
    shared = False

    def host_view(self, buffer: Any) -> np.ndarray:
        raise NotImplementedError("CUDA device memory has no host view; read it")

    def __init__(self, info: DeviceInfo, cublas: cublas_lib.Cublas):
        cp = self.cp = import_cupy()
        self.info = info
        self.index = int(info.spec.split(":")[1])
        self.device = cp.cuda.Device(self.index)
        self.limits = device_limits(info)
        self.arch = "sm_" + info.details["compute_capability"].replace(".", "")
        self.build_options = tuple(nvrtc.OPTIONS)
        self.device_key = (self.dialect, self.index, self.arch)
        self.max_alloc_bytes = self.global_mem_bytes = info.details["global_mem_bytes"]
        self.cubins = CubinCache(self.arch, self.build_options, nvrtc.build, nvrtc_version(), cache_dir())
        self.generations = Generations()
        self.ones: dict[str, Allocation] = {}  # per dtype, the second operand of the bias gemms
        self.cublas = cublas
        with self.device:
            self.stream = self.own_stream = cp.cuda.Stream(non_blocking=True)
            self._workspace = self.allocate(CUBLAS_WORKSPACE, "the cuBLAS workspace")
            self.handle = cublas.bound_handle(self.stream.ptr, self._workspace.ptr, CUBLAS_WORKSPACE)
        self.graphs: GraphCache = GraphCache(_CupyGraphs(self.own_stream, self.device))

    # -- streams ------------------------------------------------------------------------------
    @property
    def external(self) -> bool:
        """Whether the work is enqueued on a caller's stream (:meth:`on_stream`), not the session's own."""
        return self.stream is not self.own_stream

    @contextlib.contextmanager
    def on_stream(self, ptr: int):
        """Enqueue every copy, memset, launch and gemm on the caller's CUDA stream ``ptr`` (torch's
        ``current_stream().cuda_stream``) until the block ends; the session's own stream afterwards.

        The cuBLAS handle is pointed at that stream and its workspace attached again (``cublasSetStream``
        drops the workspace, and a gemm captured without one would allocate). Nothing here waits for the
        device: both calls are host-side settings, allowed while the stream captures.
        """
        if ptr == self.own_stream.ptr:
            yield
            return
        with self.device:
            self._bind_stream(self.cp.cuda.ExternalStream(ptr, self.index))
        try:
            yield
        finally:
            with self.device:
                self._bind_stream(self.own_stream)

    def _bind_stream(self, stream: Any) -> None:
        self.cublas.bind_stream(self.handle, stream.ptr, self._workspace.ptr, CUBLAS_WORKSPACE)
        self.stream = stream

    def stream_is_capturing(self) -> bool:
        """Whether the stream the work goes to is being captured into a CUDA graph (by its owner)."""
        with self.device:
            return bool(self.cp.cuda.runtime.streamIsCapturing(self.stream.ptr))

    # -- memory -------------------------------------------------------------------------------
    def allocate(self, nbytes: int, what: str = "a device buffer") -> Allocation:
        """A plain ``cudaMalloc`` (not CuPy's pool) of ``nbytes``; ``DeviceError`` naming ``what`` when it fails."""
        memory = self.cp.cuda.memory
        try:
            with self.device:
                block = memory.Memory(nbytes)
        except (memory.OutOfMemoryError, self.cp.cuda.runtime.CUDARuntimeError) as err:
            raise DeviceError(f"allocating {what} of {nbytes} bytes ({human_bytes(nbytes)}) on {self.info.name} "
                              f"({self.info.spec}) failed: {type(err).__name__}: {err}; free other arenas, shrink the "
                              f"schedule, or run it on a device with more free memory") from err
        return Allocation(memory.MemoryPointer(block, 0), nbytes, self.generations.new())

    def release(self, buffer: Allocation) -> None:
        self.graphs.forget_generation(buffer.generation)
        # the memory is freed when the last reference (the MemoryPointer) goes; cudaFree waits for the device

    def write(self, buffer: Allocation, offset: int, data: np.ndarray) -> None:
        rt = self.cp.cuda.runtime
        with self.device:
            rt.memcpyAsync(buffer.ptr + offset, data.ctypes.data, data.nbytes, rt.memcpyHostToDevice, self.stream.ptr)
            self.stream.synchronize()  # the host array may change once we return

    def read(self, buffer: Allocation, offset: int, out: np.ndarray) -> None:
        rt = self.cp.cuda.runtime
        with self.device:
            rt.memcpyAsync(out.ctypes.data, buffer.ptr + offset, out.nbytes, rt.memcpyDeviceToHost, self.stream.ptr)
            self.stream.synchronize()

    def zero(self, buffer: Allocation, offset: int, nbytes: int) -> None:
        with self.device:
            self.cp.cuda.runtime.memsetAsync(buffer.ptr + offset, 0, nbytes, self.stream.ptr)

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """Device-to-device ``nbytes`` from pointer ``src`` to ``dst`` on the stream; waited for on the
        session's own stream (its producer may free the memory as soon as we return), not on a caller's
        (:meth:`on_stream`), whose allocator reuses memory in that stream's order, after the copy."""
        rt = self.cp.cuda.runtime
        with self.device:
            rt.memcpyAsync(dst, src, nbytes, rt.memcpyDeviceToDevice, self.stream.ptr)
            if not self.external:
                self.stream.synchronize()

    def finish(self) -> None:
        with self.device:
            self.stream.synchronize()

    def ones_buffer(self, dtype: str, count: int) -> Allocation:
        """At least ``count`` ones in ``dtype``; call it before any capture (an allocation cannot be captured)."""
        have = self.ones.get(dtype)
        if have is None or have.nbytes < count * _ONE[dtype].itemsize:
            if have is not None:
                self.release(have)
            data = np.full(max(count, 1024), _ONE[dtype]).view(np.uint8)
            have = self.ones[dtype] = self.allocate(data.size, f"the {dtype} ones of the bias gemms")
            self.write(have, 0, data)
        return have

    # -- programs -----------------------------------------------------------------------------
    def build_program(self, program: Program) -> Any:
        cubin = self.cubins.get(program)  # raises KernelBuildError with NVRTC's log
        module = self.cp.cuda.function.Module()
        try:
            with self.device:
                module.load(cubin)
        except Exception as err:
            raise KernelBuildError(f"loading the {self.arch} cubin of the {program.label} on {self.info.name} "
                                   f"({self.info.spec}) failed", f"{type(err).__name__}: {err}",
                                   [f"--gpu-architecture={self.arch}", *self.build_options], program.source) from err
        return module

    def get_kernel(self, built: Any, name: str) -> Any:
        with self.device:
            return built.get_function(name)

    def kernel_attributes(self, kernel: Any) -> dict[str, int]:
        """Registers, local (spill/stack) bytes, static shared bytes and the block limit the driver reports."""
        get = self.cp.cuda.driver.funcGetAttribute
        with self.device:
            return {name: int(get(attr, kernel.ptr)) for name, attr in _FUNC_ATTRIBUTES.items()}

    def enqueue(self, kernel: Any, launch: Launch | GemmCall, args: tuple[Any, ...]) -> None:
        """Launch ``kernel``, or run the cuBLAS call ``launch`` (``kernel`` is then :data:`GEMM` and ``args``
        its operands' buffers, ``GemmCall.args``)."""
        if isinstance(launch, GemmCall):
            self.gemm(launch, args)
            return
        groups = tuple(launch.groups) + (1,) * (3 - len(launch.groups))
        block = tuple(launch.local_size) + (1,) * (3 - len(launch.local_size))
        with self.device:
            kernel(groups, block, tuple(a.pointer if isinstance(a, Allocation) else a for a in args), stream=self.stream)

    # -- cuBLAS -------------------------------------------------------------------------------
    def gemm(self, call: GemmCall, buffers: tuple[Any, Any, Any]) -> None:
        """One ``cublasGemmStridedBatchedEx`` on the bound handle; ``buffers`` hold A, B and C (an
        allocation, or the ``ones`` Buf of a bias call)."""
        scalar = np.float64 if call.compute == "64F" else np.float32
        alpha, beta = np.array(call.alpha, scalar), np.array(call.beta, scalar)
        a, b, c = (self.ones[op.dtype] if buf == ones(op.dtype) else buf for buf, op in zip(buffers, (call.a, call.b, call.c)))
        with self.device:
            self.cublas.gemm_strided_batched(
                self.handle, _OPS[call.op_a], _OPS[call.op_b], call.m, call.n, call.k, alpha.ctypes.data,
                a.ptr + call.a.offset, _DATA_TYPES[call.a.dtype], call.lda, call.stride_a,
                b.ptr + call.b.offset, _DATA_TYPES[call.b.dtype], call.ldb, call.stride_b, beta.ctypes.data,
                c.ptr + call.c.offset, _DATA_TYPES[call.c.dtype], call.ldc, call.stride_c,
                call.batch, _COMPUTE_TYPES[call.compute], _GEMM_DEFAULT)


class _CupyGraphs:
    """graph_cache.GraphDriver over CuPy's stream capture, with the stream's device current."""

    def __init__(self, stream: Any, device: Any):
        self.stream, self.device = stream, device

    def capture(self, record: Callable[[], None]) -> Any:
        with self.device:
            self.stream.begin_capture()
            try:
                record()
            finally:
                graph = self.stream.end_capture()
        return graph

    def replay(self, graph: Any) -> None:
        with self.device:
            graph.launch(self.stream)

    def release(self, graph: Any) -> None:
        del graph  # CuPy destroys the executable graph with its last reference
