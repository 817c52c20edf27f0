"""CUDA backend (CuPy): the primitives of ``core.Primitives`` in CUDA calls, plus cuBLAS and CUDA graphs.

Device specs are ``cuda:N``. An arena is one ``cudaMalloc`` allocation; kernels get its base pointer
plus byte offsets (ABI.md §1). Everything runs on one non-blocking stream per session: copies and
memsets are asynchronous on it, ``finish`` synchronizes it. Programs are the portable text compiled by
NVRTC to a cubin for the device's exact ``sm_XY`` with the project's own options (``nvrtc.OPTIONS``:
no ``-ftz``, precise division and square root — CuPy's ``RawModule(code=...)`` would add ``-ftz=true``),
cached in memory and on disk (:mod:`.cubin_cache`) and loaded from bytes.

Beyond the core: ``matmul`` thunks and the recurrent input projections run as cuBLAS
``gemmStridedBatchedEx`` calls on the session's stream (:mod:`.cublas_calls`; 16-bit inputs accumulate
in f32; TF32 only with ``RLX_CUDA_TF32=1``), and a thunk of many launches (the recurrent per-step
loop) is captured once as a CUDA graph and replayed (:mod:`.graph_cache`; ``RLX_CUDA_GRAPHS=0`` turns
that off). Without CuPy, or with CuPy but no usable driver or device, ``probe`` raises
``BackendUnavailable`` with the reason and ``auto`` picks the next backend.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .. import launches
from ..errors import DeviceError, KernelBuildError
from ..launches import ARENA, SCRATCH, DeviceLimits, Launch
from ..schedule.ops import SCAN_OPS
from . import nvrtc
from .base import BackendUnavailable, DeviceInfo
from .core import KernelSession, ScanMemory
from .cublas_calls import GemmCall, NotMappable, matmul_call, ones, with_cublas
from .cubin_cache import CubinCache, cache_dir, nvrtc_version
from .graph_cache import GraphCache, GraphKey, Generations
from .programs import Program

NAME = "cuda"
TF32_ENV = "RLX_CUDA_TF32"  # "1": f32 gemms may round their inputs to TF32 (off by default)
GRAPHS_ENV = "RLX_CUDA_GRAPHS"  # "0": never capture CUDA graphs
CUBLAS_WORKSPACE = 32 << 20  # a fixed workspace keeps cuBLAS from allocating while a graph is captured
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
    return CudaSession(CudaPrimitives(info))


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
    """One CUDA device: its stream, allocations, cubins, cuBLAS handle and CUDA graphs."""

    dialect = NAME
    fp64_feature = "double precision"  # every CUDA device has it

    def __init__(self, info: DeviceInfo):
        cp = self.cp = _cupy()
        self.info = info
        self.index = int(info.spec.split(":")[1])
        self.device = cp.cuda.Device(self.index)
        self.limits = device_limits(info)
        self.arch = "sm_" + info.details["compute_capability"].replace(".", "")
        self.build_options = tuple(nvrtc.OPTIONS)
        self.device_key = (NAME, self.index, self.arch)
        self.max_alloc_bytes = self.global_mem_bytes = info.details["global_mem_bytes"]
        self.cubins = CubinCache(self.arch, self.build_options, nvrtc.compile_cubin, nvrtc_version(), cache_dir())
        self.generations = Generations()
        with self.device:
            self.stream = cp.cuda.Stream(non_blocking=True)
            self.cublas = cp.cuda.cublas.create()
            cp.cuda.cublas.setStream(self.cublas, self.stream.ptr)
            self._workspace = self.allocate(CUBLAS_WORKSPACE)
            set_workspace = getattr(cp.cuda.cublas, "setWorkspace", None)
            if set_workspace is not None:  # without it a graph capture of a gemm may fail: that key then runs eagerly
                set_workspace(self.cublas, self._workspace.ptr, CUBLAS_WORKSPACE)
        self.graphs: GraphCache = GraphCache(_CupyGraphs(self.stream))

    # -- memory -------------------------------------------------------------------------------
    def allocate(self, nbytes: int) -> Allocation:
        with self.device:
            memory = self.cp.cuda.memory.Memory(nbytes)  # a plain cudaMalloc, not CuPy's pool
        return Allocation(self.cp.cuda.memory.MemoryPointer(memory, 0), nbytes, self.generations.new())

    def release(self, buffer: Allocation) -> None:
        self.graphs.forget_generation(buffer.generation)
        # the memory is freed when the last reference (the MemoryPointer) goes; cudaFree waits for the device

    def write(self, buffer: Allocation, offset: int, data: np.ndarray) -> None:
        rt = self.cp.cuda.runtime
        rt.memcpyAsync(buffer.ptr + offset, data.ctypes.data, data.nbytes, rt.memcpyHostToDevice, self.stream.ptr)
        self.stream.synchronize()  # the host array may change once we return

    def read(self, buffer: Allocation, offset: int, out: np.ndarray) -> None:
        rt = self.cp.cuda.runtime
        rt.memcpyAsync(out.ctypes.data, buffer.ptr + offset, out.nbytes, rt.memcpyDeviceToHost, self.stream.ptr)
        self.stream.synchronize()

    def zero(self, buffer: Allocation, offset: int, nbytes: int) -> None:
        self.cp.cuda.runtime.memsetAsync(buffer.ptr + offset, 0, nbytes, self.stream.ptr)

    def finish(self) -> None:
        self.stream.synchronize()

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
        return built.get_function(name)

    def kernel_attributes(self, kernel: Any) -> dict[str, int]:
        """Registers, local (spill/stack) bytes, static shared bytes and the block limit the driver reports."""
        get = self.cp.cuda.driver.funcGetAttribute
        return {name: int(get(attr, kernel.ptr)) for name, attr in _FUNC_ATTRIBUTES.items()}

    def enqueue(self, kernel: Any, launch: Launch, args: tuple[Any, ...]) -> None:
        groups = tuple(launch.groups) + (1,) * (3 - len(launch.groups))
        block = tuple(launch.local_size) + (1,) * (3 - len(launch.local_size))
        kernel(groups, block, tuple(a.pointer if isinstance(a, Allocation) else a for a in args), stream=self.stream)

    # -- cuBLAS -------------------------------------------------------------------------------
    def gemm(self, call: GemmCall, buffers: Mapping[Any, Allocation]) -> None:
        """One ``gemmStridedBatchedEx`` on the stream; operands resolve through ``buffers``."""
        cp = self.cp
        scalar = np.float64 if call.compute == "64F" else np.float32
        alpha, beta = np.array(call.alpha, scalar), np.array(call.beta, scalar)

        def ptr(op) -> int:
            return buffers[op.buf].ptr + op.offset

        with self.stream:  # CuPy's wrapper points the handle at the current stream before every call
            self._gemm(cp, call, alpha, beta, ptr)

    def _gemm(self, cp: Any, call: GemmCall, alpha: np.ndarray, beta: np.ndarray, ptr: Callable[[Any], int]) -> None:
        cp.cuda.cublas.gemmStridedBatchedEx(
            self.cublas, _OPS[call.op_a], _OPS[call.op_b], call.m, call.n, call.k, alpha.ctypes.data,
            ptr(call.a), _DATA_TYPES[call.a.dtype], call.lda, call.stride_a,
            ptr(call.b), _DATA_TYPES[call.b.dtype], call.ldb, call.stride_b, beta.ctypes.data,
            ptr(call.c), _DATA_TYPES[call.c.dtype], call.ldc, call.stride_c,
            call.batch, _COMPUTE_TYPES[call.compute], _GEMM_DEFAULT)


class _CupyGraphs:
    """graph_cache.GraphDriver over CuPy's stream capture."""

    def __init__(self, stream: Any):
        self.stream = stream

    def capture(self, record: Callable[[], None]) -> Any:
        self.stream.begin_capture()
        try:
            record()
        finally:
            graph = self.stream.end_capture()
        return graph

    def replay(self, graph: Any) -> None:
        graph.launch(self.stream)

    def release(self, graph: Any) -> None:
        del graph  # CuPy destroys the executable graph with its last reference


Step = tuple[Any, Launch] | GemmCall  # a bound kernel launch, or a cuBLAS call


class LaunchSequence:
    """What a thunk enqueues (launches with their arguments, cuBLAS calls) as a graph-cache key whose
    hash is computed once: the same runner finds its graph by identity, an equal new one by value."""

    __slots__ = ("items", "_hash")

    def __init__(self, items: tuple):
        self.items, self._hash = items, hash(items)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, LaunchSequence) and self._hash == other._hash
                                 and self.items == other.items)


class CudaSession(KernelSession):
    """The shared kernel session with two CUDA additions: cuBLAS gemms, and CUDA graphs for a thunk of
    many launches and for each step of a scan body that runs wholly here."""

    prims: CudaPrimitives

    def __init__(self, prims: CudaPrimitives):
        super().__init__(prims)
        self.tf32 = os.environ.get(TF32_ENV) == "1"
        self.use_graphs = os.environ.get(GRAPHS_ENV, "1") != "0"
        self._ones: dict[str, Allocation] = {}
        self._scratch_generation = 0
        self.capturing = False  # a scan body's step is being captured: what runs inside only records

    def scratch(self, nbytes: int) -> Any:
        buffer = super().scratch(nbytes)
        self._scratch_generation = buffer.generation
        return buffer

    def scan_memory(self, options, on_host):  # type: ignore[override]
        return GraphedScanMemory(self, options, on_host)

    def runner(self, thunk, options, on_host=()):  # type: ignore[override]
        if thunk["op"] in SCAN_OPS:
            return super().runner(thunk, options, on_host)
        if thunk["op"] == "matmul":
            if thunk["batch"] == 0:
                return lambda arena: 0
            try:
                steps: Sequence[Step] = [matmul_call(thunk, self.tf32)]
                scratch_bytes = 0
            except NotMappable:
                return super().runner(thunk, options, on_host)
        else:
            plan = launches.plan(thunk, self.limits, **options.planner_keywords)
            self.check_fits(plan.scratch_bytes, f"the launch scratch of thunk {getattr(thunk, 'index', '?')} ({thunk['op']})")
            steps = [s if isinstance(s, GemmCall) else (self.kernel(s), s)
                     for s in with_cublas(plan.launches, self.tf32) if isinstance(s, GemmCall) or not s.empty]
            scratch_bytes = plan.scratch_bytes
        for call in steps:
            if isinstance(call, GemmCall) and call.ones_needed:
                self._ones_buffer(call.b.dtype, call.ones_needed)  # before any capture: allocations cannot be captured
        sequence = LaunchSequence(tuple(s if isinstance(s, GemmCall) else s[1] for s in steps))
        return lambda arena: self._run_steps(sequence, steps, scratch_bytes, arena)

    def _run_steps(self, sequence: LaunchSequence, steps: Sequence[Step], scratch_bytes: int, arena: Any) -> int:
        scratch = self.scratch(scratch_bytes) if scratch_bytes else None
        buffers = {ARENA: arena.buffer, SCRATCH: scratch, **{ones(dt): buf for dt, buf in self._ones.items()}}

        def record() -> None:
            for step in steps:
                if isinstance(step, GemmCall):
                    self.prims.gemm(step, buffers)
                else:
                    kernel, item = step
                    self.prims.enqueue(kernel, item, tuple(buffers.get(a, a) if isinstance(a, launches.Buf) else a
                                                           for a in item.args))

        if not self.use_graphs or self.capturing:
            record()
            return 0
        gens = tuple(b.generation for b in buffers.values() if b is not None)
        self.prims.graphs.run(GraphKey(sequence, gens), record, len(steps))
        return 0

    def generations(self, arena: Any) -> tuple[int, ...]:
        """The allocations a launch on ``arena`` may point into: the arena, the scratch, the ones buffers."""
        return (arena.buffer.generation, self._scratch_generation, *(b.generation for b in self._ones.values()))

    def _ones_buffer(self, dtype: str, count: int) -> Allocation:
        have = self._ones.get(dtype)
        if have is None or have.nbytes < count * _ONE[dtype].itemsize:
            if have is not None:
                self.prims.release(have)
            data = np.full(max(count, 1024), _ONE[dtype]).view(np.uint8)
            have = self._ones[dtype] = self.prims.allocate(data.size)
            self.prims.write(have, 0, data)
        return have

    # -- DLPack: CUDA tensors in and arena views out, never through the host -------------------
    def import_device(self, arena: Any, offset: int, tensor: Any) -> None:
        """Copy a CUDA tensor taken by ``runtime.dlpack.import_tensor(obj, stream=session.stream_ptr)``
        (a ``DeviceTensor``) into ``arena`` at byte ``offset``, device to device on the session's stream."""
        if tensor.device != "cuda" or tensor.device_id != self.prims.index:
            raise DeviceError(f"a {tensor.device}:{tensor.device_id} tensor cannot be copied into an arena on "
                              f"{self.info.spec}; move it to cuda:{self.prims.index} first")
        if offset < 0 or offset + tensor.nbytes > arena.nbytes:
            raise DeviceError(f"{tensor.nbytes} bytes at offset {offset} lie outside the arena of {arena.nbytes} bytes")
        rt = self.prims.cp.cuda.runtime
        rt.memcpyAsync(arena.buffer.ptr + offset, tensor.pointer, tensor.nbytes, rt.memcpyDeviceToDevice,
                       self.prims.stream.ptr)
        self.prims.stream.synchronize()  # the producer may free its memory once ``tensor`` is gone

    @property
    def stream_ptr(self) -> int:
        """The session's stream, for DLPack producers (``__dlpack__(stream=...)``) to order their work before."""
        return int(self.prims.stream.ptr)

    def export_view(self, arena: Any, offset: int, dtype: str, shape: tuple[int, ...]) -> Any:
        """A CuPy array sharing ``shape`` elements of ``dtype`` at ``offset`` of a device arena (no copy);
        ``torch.from_dlpack`` takes it as is. CuPy has no bfloat16, so bf16 comes out as its uint16 bits:
        ``torch.from_dlpack(view).view(torch.bfloat16)``."""
        cp = self.prims.cp
        np_dtype = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16, "f64": np.float64}[dtype]
        count = int(np.prod(shape, dtype=np.int64))
        if offset < 0 or offset % np.dtype(np_dtype).itemsize or offset + count * np.dtype(np_dtype).itemsize > arena.nbytes:
            raise DeviceError(f"{dtype} {list(shape)} at byte {offset} does not lie aligned inside the arena of "
                              f"{arena.nbytes} bytes")
        pointer = arena.buffer.pointer + offset  # MemoryPointer arithmetic keeps the allocation alive
        return cp.ndarray(tuple(shape), np_dtype, memptr=pointer)


class GraphedScanMemory(ScanMemory):
    """The scan driver's device memory, replaying one CUDA graph per step of a body that runs wholly on
    the device (no body thunk placed on the host, no nested scan). The first step runs eagerly (it plans
    the body thunks, builds their kernels and grows the scratch), the second is captured, the rest replay;
    the body arena is allocated per scan execution, so its graph lives as long as that arena."""

    def run(self, schedule: Mapping[str, Any], arena: Any) -> None:
        session: CudaSession = self.session  # type: ignore[assignment]
        thunks = schedule["thunks"]
        if not session.use_graphs or session.capturing or any(
                id(t) in self.on_host or t["op"] in SCAN_OPS for t in thunks):
            super().run(schedule, arena)
            return
        self._ready(arena)  # the body arena's pristine bytes reach the device before any capture

        def record() -> None:
            session.capturing = True
            try:
                super(GraphedScanMemory, self).run(schedule, arena)
            finally:
                session.capturing = False

        key = GraphKey(("scan body", id(schedule)), session.generations(arena))
        session.prims.graphs.run(key, record, launches=2 * len(thunks))
