"""CUDA backend (CuPy): the primitives of ``core.Primitives`` in CUDA calls, plus cuBLAS and CUDA graphs.

Device specs are ``cuda:N``. An arena is one ``cudaMalloc`` allocation; kernels get its base pointer
plus byte offsets (ABI.md §1). Everything runs on one non-blocking stream per session, with the
session's device current around every call (CuPy's current device is 0 otherwise): copies and memsets
are asynchronous on it, ``finish`` synchronizes it. ``CudaSession.on_stream(ptr)`` sends the work to a
caller's stream instead (torch's current stream), device-to-device copies there not waited for and no
graph of the session's own captured, so the caller can capture a whole call in a CUDA graph of its own. Programs are the portable text compiled by NVRTC
to a cubin for the device's exact ``sm_XY`` with the project's own options (``nvrtc.OPTIONS``: no
``-ftz``, precise division and square root — CuPy's ``RawModule(code=...)`` would add ``-ftz=true``),
cached in memory and on disk with their PTX (:mod:`.cubin_cache`) and loaded from bytes.

Beyond the core: the gemms of a plan (``matmul`` thunks, the recurrent input projections) run as
cuBLAS ``cublasGemmStridedBatchedEx`` calls through the C API on a handle bound once to the session's
stream and workspace (:mod:`.cublas_lib`, :mod:`.cublas_calls`; 16-bit inputs accumulate and reduce in
f32; TF32 only with ``RLX_CUDA_TF32=1``), and a bound plan of many launches (the recurrent per-step
loop) or a scan body's step is captured once as a CUDA graph and replayed (:mod:`.graph_cache`;
``RLX_CUDA_GRAPHS=0`` turns that off). Without CuPy, or with CuPy but no usable driver or device,
``probe`` raises ``BackendUnavailable`` with the reason and ``auto`` picks the next backend.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np
from host_fallback.abi import SCAN_OPS
from host_fallback.scan_data import BeforeThunk

from .. import launches
from ..errors import DeviceError, KernelBuildError
from ..launches import DeviceLimits, Launch
from ..units import human_bytes
from . import cublas_lib, nvrtc
from .base import BackendUnavailable, DeviceInfo
from .core import BoundPlan, KernelSession, ScanMemory
from .cublas_calls import GemmCall, lower, ones
from .cubin_cache import CubinCache, cache_dir, nvrtc_version
from .graph_cache import GraphCache, GraphKey, Generations
from .programs import Program

NAME = "cuda"
SPEC_INDICES = ("n",)
PRELUDE = ("kernels_cuda", "prelude.cuh")
DEVICE_ENV = None
TF32_ENV = "RLX_CUDA_TF32"  # "1": f32 gemms may round their inputs to TF32 (off by default)
GRAPHS_ENV = "RLX_CUDA_GRAPHS"  # "0": never capture CUDA graphs
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


def _cupy():
    try:
        import cupy
    except ImportError as err:
        raise BackendUnavailable(f"cupy is not importable ({err}); in a checkout install it with: "
                                 f'pip install -e ".[cuda13]" (CUDA 13 drivers) or ".[cuda12]"') from err
    return cupy


def probe() -> list[DeviceInfo]:
    """Every CUDA device CuPy's runtime reports, with its properties."""
    cp = _cupy()
    try:
        count = cp.cuda.runtime.getDeviceCount()
        props = [cp.cuda.runtime.getDeviceProperties(i) for i in range(count)]
    except Exception as err:  # CUDARuntimeError, or a missing libcudart / driver library
        raise BackendUnavailable(f"CuPy {getattr(cp, '__version__', '?')} is installed but CUDA cannot be used "
                                 f"({type(err).__name__}: {err}); is an NVIDIA driver installed and a GPU visible?") from err
    if not props:
        raise BackendUnavailable("the CUDA driver reports no device")
    return [device_info(i, p) for i, p in enumerate(props)]


def device_info(index: int, props: Mapping[str, Any]) -> DeviceInfo:
    """A DeviceInfo from one ``cudaGetDeviceProperties`` record (as CuPy returns it)."""
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    details = {
        "compute_capability": f"{props['major']}.{props['minor']}",
        "global_mem_bytes": int(props["totalGlobalMem"]),
        "multiprocessors": int(props["multiProcessorCount"]),
        "max_block": int(props["maxThreadsPerBlock"]),
        "max_grid": tuple(int(g) for g in props["maxGridSize"]),
        "shared_per_block": int(props["sharedMemPerBlock"]),
        "shared_per_block_optin": int(props.get("sharedMemPerBlockOptin", props["sharedMemPerBlock"])),
        "warp": int(props.get("warpSize", 32)),
    }
    return DeviceInfo(NAME, f"cuda:{index}", f"{name} (sm_{props['major']}{props['minor']})", True, details)


def device_limits(info: DeviceInfo) -> DeviceLimits:
    """Launch limits of a device: static shared memory stays within the per-block default (the kernels
    declare it statically, so the opt-in maximum does not apply)."""
    d = info.details
    return DeviceLimits(d["max_block"], d["shared_per_block"], True, target=launches.limits.requested_target("gpu"),
                        sub_group=d["warp"], compute_units=d["multiprocessors"], max_grid=d["max_grid"])


def open(info: DeviceInfo) -> "CudaSession":  # noqa: A001 - the backend surface names it open
    return CudaSession(CudaPrimitives(info, cublas_lib.Cublas(cublas_lib.load_library())))


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

    dialect = NAME
    fp64_feature = "double precision"  # every CUDA device has it
    shared = False

    def host_view(self, buffer: Any) -> np.ndarray:
        raise NotImplementedError("CUDA device memory has no host view; read it")

    def __init__(self, info: DeviceInfo, cublas: cublas_lib.Cublas):
        cp = self.cp = _cupy()
        self.info = info
        self.index = int(info.spec.split(":")[1])
        self.device = cp.cuda.Device(self.index)
        self.limits = device_limits(info)
        self.arch = "sm_" + info.details["compute_capability"].replace(".", "")
        self.build_options = tuple(nvrtc.OPTIONS)
        self.device_key = (NAME, self.index, self.arch)
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


class CudaSession(KernelSession):
    """The shared kernel session with two CUDA additions: a plan's gemms as cuBLAS calls, and CUDA
    graphs around the core's runs of a bound plan of many launches and around each step of a scan body
    that runs wholly here."""

    prims: CudaPrimitives

    def __init__(self, prims: CudaPrimitives):
        super().__init__(prims)
        self.tf32 = os.environ.get(TF32_ENV) == "1"
        self.use_graphs = os.environ.get(GRAPHS_ENV, "1") != "0"
        self._scratch_generation = 0
        self.capturing = False  # a scan body's step is being captured: what runs inside only records

    def _buffer(self, nbytes: int, what: str) -> Any:
        self.check_fits(nbytes, what)
        return self.prims.allocate(max(nbytes, 1), what)

    def scratch(self, nbytes: int) -> Any:
        buffer = super().scratch(nbytes)
        self._scratch_generation = buffer.generation
        return buffer

    def scan_memory(self, options, on_host):  # type: ignore[override]
        return GraphedScanMemory(self, options, on_host)

    def kernel(self, launch):  # type: ignore[override]
        return GEMM if isinstance(launch, GemmCall) else super().kernel(launch)

    def bind(self, plan: launches.LaunchPlan) -> BoundPlan:
        """The core's binding of ``plan`` with its gemms as cuBLAS calls, their ones buffers made now
        (before any capture)."""
        lowered = lower(plan, self.tf32)
        for call in lowered.launches:
            if isinstance(call, GemmCall) and call.ones_needed:
                self.prims.ones_buffer(call.b.dtype, call.ones_needed)
        return super().bind(lowered)

    def run_bound(self, bound: BoundPlan, arena: Any) -> int:
        """The core's run of ``bound``, through a CUDA graph once the same launches on the same
        allocations repeat (``graph_cache``)."""
        steps, scratch = self.resolve(bound, arena)
        if not self.own_graphs:
            self.enqueue_bound(steps, arena, scratch)
            return 0
        gens = (arena.buffer.generation, scratch.generation if scratch is not None else 0,
                *(b.generation for b in self.prims.ones.values()))
        self.prims.graphs.run(GraphKey((bound, steps is bound.steady), gens),
                              lambda: self.enqueue_bound(steps, arena, scratch), len(steps))
        return 0

    @property
    def own_graphs(self) -> bool:
        """Whether a run may capture and replay graphs of its own: not with ``RLX_CUDA_GRAPHS=0``, not inside
        a capture of its own, and not on a caller's stream (:meth:`on_stream`), where the caller captures
        the whole step if it wants a graph (a session graph is captured and replayed on its own stream)."""
        return self.use_graphs and not self.capturing and not self.prims.external

    @contextlib.contextmanager
    def on_stream(self, ptr: int):
        """Hold the session (its lock) with every copy, launch and gemm enqueued on the caller's CUDA stream
        ``ptr`` (``CudaPrimitives.on_stream``), and a plan's scratch kept with its resident arena
        (``pinned_scratch``: a graph the caller captures keeps pointing at that scratch, whereas the
        shared one is freed when it grows). What waits for the device on that path: nothing but a host
        read (``read``, ``write``), which the call plan's stream path does only for an eager data check."""
        with self.lock, self.prims.on_stream(ptr):
            self.pinned_scratch = True
            try:
                yield self
            finally:
                self.pinned_scratch = False

    def generations(self, arena: Any) -> tuple[int, ...]:
        """The allocations a launch on ``arena`` may point into: the arena, the scratch, the ones buffers."""
        return (arena.buffer.generation, self._scratch_generation, *(b.generation for b in self.prims.ones.values()))

    # -- CUDA tensors in and out of a device arena, never through the host (the call plan's stream path) ---
    def import_device(self, arena: Any, offset: int, tensor: Any) -> None:
        """Copy a CUDA tensor taken by ``runtime.dlpack.import_tensor`` (a ``DeviceTensor``) into ``arena``
        at byte ``offset``, device to device on the session's stream (waited for: ``CudaPrimitives.copy``) or the caller's (:meth:`on_stream`: not waited for)."""
        self._check_device_range(arena, offset, tensor, "into")
        self.prims.copy(arena.buffer.ptr + offset, tensor.pointer, tensor.nbytes)
        self.touched(arena, offset, tensor.nbytes)

    def export_device(self, arena: Any, offset: int, tensor: Any) -> None:
        """Copy ``tensor.nbytes`` of ``arena`` at byte ``offset`` into the memory of the CUDA tensor
        ``tensor`` (a ``DeviceTensor``: the caller's output), device to device, as :meth:`import_device`."""
        self._check_device_range(arena, offset, tensor, "out of")
        self.prims.copy(tensor.pointer, arena.buffer.ptr + offset, tensor.nbytes)

    def _check_device_range(self, arena: Any, offset: int, tensor: Any, way: str) -> None:
        if tensor.device != "cuda" or tensor.device_id != self.prims.index:
            raise DeviceError(f"a {tensor.device}:{tensor.device_id} tensor cannot be copied {way} an arena on "
                              f"{self.info.spec}; move it to cuda:{self.prims.index} first")
        if offset < 0 or offset + tensor.nbytes > arena.nbytes:
            raise DeviceError(f"{tensor.nbytes} bytes at offset {offset} lie outside the arena of {arena.nbytes} bytes")


class GraphedScanMemory(ScanMemory):
    """The scan driver's device memory, replaying one CUDA graph per step of a body that runs wholly on
    the device (no body thunk placed on the host, no nested scan). The first step runs eagerly (it plans
    the body thunks, builds their kernels and grows the scratch), the second is captured, the rest replay;
    the body arena is allocated per scan execution, so its graph lives as long as that arena. Every step
    is worth a graph, one launch or many: a replay also skips the driver's host work for the body. A body
    whose run-time data must be read between its thunks (``before.reads``) runs eagerly."""

    def run(self, schedule: Mapping[str, Any], arena: Any, before: BeforeThunk) -> None:
        session: CudaSession = self.session  # type: ignore[assignment]
        thunks = schedule["thunks"]
        if not session.own_graphs or before.reads or any(
                id(t) in self.on_host or t["op"] in SCAN_OPS for t in thunks):
            super().run(schedule, arena, before)
            return
        self._ready(arena)  # the body arena's pristine bytes reach the device before any capture

        def record() -> None:
            session.capturing = True
            try:
                super(GraphedScanMemory, self).run(schedule, arena, before)
            finally:
                session.capturing = False

        key = GraphKey(("scan body", id(schedule)), session.generations(arena))
        session.prims.graphs.run(key, record, len(thunks), min_launches=1)
