"""CUDA backend (CuPy): the primitives of ``core.Primitives`` in CUDA calls (``cuda_primitives``), plus cuBLAS
and CUDA graphs.

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
f32; TF32 only where asked for, which also gives the chunked kernels their TF32 variant: ``launches.mma``;
:func:`tf32_asked`), and a bound plan of many launches (the recurrent per-step
loop) or a scan body's step is captured once as a CUDA graph and replayed (:mod:`.graph_cache`;
``RLX_CUDA_GRAPHS=0`` turns that off). Without CuPy, or with CuPy but no usable driver or device,
``probe`` raises ``BackendUnavailable`` with the reason and ``auto`` picks the next backend.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Mapping

from host_fallback.abi import SCAN_OPS
from host_fallback.scan_data import BeforeThunk

from .. import launches
from ..errors import DeviceError
from . import cublas_lib
from .base import BackendUnavailable, DeviceInfo
from .core import BoundPlan, KernelSession, ScanMemory
from .cublas_calls import GemmCall, lower
from .cuda_primitives import GEMM, CudaPrimitives, device_limits, import_cupy
from .graph_cache import GraphKey

NAME = "cuda"
SPEC_INDICES = ("n",)
PRELUDE = ("kernels_cuda", "prelude.cuh")
DEVICE_ENV = None
TF32_ENV = "RLX_CUDA_TF32"  # "1" / "0": f32 gemms may / may not round their inputs to TF32, over the config
GRAPHS_ENV = "RLX_CUDA_GRAPHS"  # "0": never capture CUDA graphs


def probe() -> list[DeviceInfo]:
    """Every CUDA device CuPy's runtime reports, with its properties."""
    cp = import_cupy()
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


def open(info: DeviceInfo, tf32: bool = False) -> "CudaSession":  # noqa: A001 - the backend surface names it open
    """A session on ``info``; ``tf32``: the config's ``cuda.tf32`` (:func:`tf32_asked`)."""
    return CudaSession(CudaPrimitives(info, cublas_lib.Cublas(cublas_lib.load_library())), tf32_asked(tf32))


def tf32_asked(configured: bool) -> bool:
    """Whether f32 gemms and chunk products may round their operands to TF32: ``RLX_CUDA_TF32`` where set (``1``
    on, ``0`` off), else ``configured`` (the config's ``cuda.tf32``, off by default, as torch's ``allow_tf32``)."""
    value = os.environ.get(TF32_ENV, "").strip()
    if not value:
        return configured
    if value not in ("0", "1"):
        raise DeviceError(f"{TF32_ENV}={value!r}: expected 1 (TF32 on) or 0 (off); unset, the config's cuda.tf32 "
                          f"decides")
    return value == "1"


class CudaSession(KernelSession):
    """The shared kernel session with two CUDA additions: a plan's gemms as cuBLAS calls, and CUDA
    graphs around the core's runs of a bound plan of many launches and around each step of a scan body
    that runs wholly here."""

    prims: CudaPrimitives

    def __init__(self, prims: CudaPrimitives, tf32: bool = False):
        super().__init__(prims)
        self.tf32 = tf32
        if self.tf32:  # the chunked kernels' TF32 variant too (launches/mma.py)
            self.limits = device_limits(prims.info, tf32=True)
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
