"""OpenCL backend (pyopencl): one ``cl.Buffer`` per arena, kernels from the portable text in ``kernels/``.

Device specs are ``opencl:PLATFORM:DEVICE`` indices. Programs are built once per (context, source
hash, options) and memoized; launch geometry comes from :mod:`rlx_gpu.launches`. The scan family
runs the shared driver of ``host_fallback.scan`` over :class:`DeviceMemory`, so body thunks launch
here and body arenas stay on the device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from .. import launches
from ..errors import KernelBuildError
from ..launches import ARENA, SCRATCH, Buf, Launch
from ..schedule.ops import SCAN_OPS
from . import programs
from .base import BackendUnavailable, DeviceInfo

NAME = "opencl"
BUILD_OPTIONS = ("-cl-std=CL1.2",)  # the text must stay within OpenCL C 1.2 (Oclgrind, older drivers)
SIMULATORS = ("Oclgrind",)

_PROGRAMS: dict[tuple, Any] = {}  # cache_key -> cl.Program, shared by every session of a context


def _cl():
    try:
        import pyopencl as cl
    except ImportError as err:
        raise BackendUnavailable(f"pyopencl is not importable ({err}); install it with: pip install 'pyopencl[pocl]'") from err
    return cl


def probe() -> list[DeviceInfo]:
    """Every OpenCL device, real ones first (simulators such as Oclgrind last)."""
    cl = _cl()
    try:
        platforms = cl.get_platforms()
    except cl.Error as err:
        raise BackendUnavailable(f"no OpenCL platform found ({err}); install an ICD, e.g. pip install 'pyopencl[pocl]'") from err
    infos = []
    for pi, platform in enumerate(platforms):
        for di, dev in enumerate(platform.get_devices()):
            details = {
                "platform": platform.name,
                "version": dev.version,
                "max_work_group": dev.max_work_group_size,
                "local_mem_bytes": dev.local_mem_size,
                "global_mem_bytes": dev.global_mem_size,
                "simulator": platform.name in SIMULATORS,
            }
            fp64 = "cl_khr_fp64" in dev.extensions.split()
            infos.append(DeviceInfo(NAME, f"opencl:{pi}:{di}", f"{dev.name.strip()} ({platform.name})", fp64, details))
    if not infos:
        raise BackendUnavailable("OpenCL platforms exist but report no device")
    return sorted(infos, key=lambda info: bool(info.details["simulator"]))


def open(info: DeviceInfo) -> "OpenCLSession":  # noqa: A001 - the backend surface names it open
    return OpenCLSession(info)


@dataclass(eq=False)
class DeviceArena:
    """A device arena: one buffer of ``nbytes`` (OpenCL refuses empty buffers, so at least 1 byte)."""

    buf: Any
    nbytes: int
    pending: np.ndarray | None = None  # DeviceMemory: the host image not yet uploaded (see there)


class OpenCLSession:
    """One opened OpenCL device: arenas, program cache, launches."""

    def __init__(self, info: DeviceInfo):
        cl = _cl()
        _, pi, di = info.spec.split(":")
        self.cl = cl
        self.info = info
        self.device = cl.get_platforms()[int(pi)].get_devices()[int(di)]
        self.context = cl.Context([self.device])
        self.queue = cl.CommandQueue(self.context)
        self.limits = device_limits(cl, self.device, info.fp64)
        self._kernels: dict[tuple, Any] = {}
        self._scratch: DeviceArena | None = None

    # -- registry ---------------------------------------------------------------------------
    def unsupported(self, thunk: Mapping[str, Any]) -> str | None:
        dtypes = {thunk.get("dtype"), thunk.get("src_dtype")}
        if "f64" in dtypes and not self.info.fp64:
            return f"f64 needs cl_khr_fp64, which {self.info.name} does not report"
        if thunk["op"] in SCAN_OPS:
            return None  # the driver runs here; an unsupported body thunk falls back inside it
        return launches.unsupported(thunk, self.limits)

    # -- memory -----------------------------------------------------------------------------
    def buffer(self, nbytes: int) -> Any:
        """An uninitialised read-write ``cl.Buffer`` of ``nbytes`` (at least 1: OpenCL refuses empty ones)."""
        return self.cl.Buffer(self.context, self.cl.mem_flags.READ_WRITE, max(nbytes, 1))

    def alloc(self, nbytes: int) -> DeviceArena:
        arena = DeviceArena(self.buffer(nbytes), nbytes)
        self.zero(arena, 0, max(nbytes, 1))
        return arena

    def write(self, arena: DeviceArena, offset: int, data: np.ndarray) -> None:
        data = np.ascontiguousarray(data, dtype=np.uint8)
        if data.size:
            self.cl.enqueue_copy(self.queue, arena.buf, data, dst_offset=offset)

    def read(self, arena: DeviceArena, offset: int, nbytes: int) -> np.ndarray:
        out = np.empty(nbytes, np.uint8)
        if nbytes:
            self.cl.enqueue_copy(self.queue, out, arena.buf, src_offset=offset)
        return out

    def zero(self, arena: DeviceArena, offset: int, nbytes: int) -> None:
        # a host write rather than clEnqueueFillBuffer: Oclgrind's uninitialized-value checker does
        # not count filled (or buffer-to-buffer copied) bytes as initialized, and CI runs under it
        self.write(arena, offset, np.zeros(nbytes, np.uint8))

    def finish(self) -> None:
        self.queue.finish()

    # -- launch -----------------------------------------------------------------------------
    def launch(self, thunk: Mapping[str, Any], arena: DeviceArena, **options: Any) -> None:
        """Run one thunk on ``arena`` in place (``options``: ``rnn_kernel``, ``recompute``)."""
        if thunk["op"] in SCAN_OPS:
            from host_fallback import scan

            memory = DeviceMemory(self, options)
            if thunk["op"] == "scan":
                scan.run_scan(memory, thunk, arena)
            else:
                scan.run_scan_backward(memory, thunk, arena, options.get("recompute", "segment"))
            return
        self.run_plan(launches.plan(thunk, self.limits, **options), arena)

    def run_plan(self, plan: launches.LaunchPlan, arena: DeviceArena) -> None:
        """Enqueue the launches of one planned thunk on ``arena``."""
        buffers = {ARENA: arena.buf, SCRATCH: self._scratch_buffer(plan.scratch_bytes)}
        for item in plan.launches:
            self.enqueue(item, buffers)

    def enqueue(self, item: Launch, buffers: Mapping[Buf, Any]) -> None:
        """Set the arguments of one launch (buffers resolved through ``buffers``) and enqueue it."""
        if item.empty:
            return
        kernel = self._kernel(item)
        kernel.set_args(*(buffers[a] if isinstance(a, Buf) else a for a in item.args))
        self.cl.enqueue_nd_range_kernel(self.queue, kernel, item.global_size, item.local_size)

    def _scratch_buffer(self, nbytes: int) -> Any:
        # grow-only and shared by every launch: the in-order queue serialises its users
        if self._scratch is None or self._scratch.nbytes < nbytes:
            self._scratch = DeviceArena(self.buffer(max(nbytes, 64)), max(nbytes, 64))
        return self._scratch.buf

    def _kernel(self, item: Launch) -> Any:
        prog = programs.program_for("opencl", item, self.limits)
        key = (prog.digest, item.kernel)
        kernel = self._kernels.get(key)
        if kernel is None:
            kernel = self._kernels[key] = getattr(self.program(prog), item.kernel)
        return kernel

    def program(self, prog: programs.Program) -> Any:
        """The built program for ``prog``, compiled once per (context, source hash, options)."""
        key = programs.cache_key(self.context.int_ptr, prog, BUILD_OPTIONS)
        built = _PROGRAMS.get(key)
        if built is None:
            built = self.cl.Program(self.context, prog.source)
            try:
                built.build(options=list(BUILD_OPTIONS), devices=[self.device])
            except self.cl.Error as err:
                raise KernelBuildError(
                    f"building the {prog.label} for {self.info.name} ({self.info.spec}) failed",
                    _build_log(self.cl, built, self.device, err), list(BUILD_OPTIONS), prog.source,
                ) from err
            _PROGRAMS[key] = built
        return built


def device_limits(cl: Any, device: Any, fp64: bool) -> launches.DeviceLimits:
    """The launch limits of ``device``; its type picks the target unless ``RLX_TARGET`` forces one."""
    # a device that also says CPU (Oclgrind says every type) gets the cpu shapes unless forced
    gpu = bool(device.type & (cl.device_type.GPU | cl.device_type.ACCELERATOR)) and not device.type & cl.device_type.CPU
    target = launches.limits.requested_target("gpu" if gpu else "cpu")
    # the warp / wavefront width where the vendor's extension reports it, else the target's usual width
    extensions = device.extensions.split()
    if "cl_nv_device_attribute_query" in extensions:
        sub_group = device.warp_size_nv
    elif "cl_amd_device_attribute_query" in extensions:
        sub_group = device.wavefront_width_amd
    else:
        sub_group = 32 if target == "gpu" else 1
    return launches.DeviceLimits(device.max_work_group_size, device.local_mem_size, fp64, target=target,
                                 sub_group=int(sub_group), compute_units=device.max_compute_units)


def _build_log(cl: Any, program: Any, device: Any, err: Exception) -> str:
    try:
        log = program.get_build_info(device, cl.program_build_info.LOG)
    except cl.Error:
        log = ""
    return log.strip() or str(err)


class DeviceMemory:
    """The scan driver's memory protocol (``host_fallback.scan.Memory``) over device arenas.

    An arena from :meth:`alloc` starts as a host image (zeros): the driver's writes and zeroings
    (``init`` entries of a body arena, the first dcarry) land in that image, and the arena's pristine
    bytes reach the device in ONE host write just before a kernel, a copy or a read first touches it.
    Besides saving transfers, this keeps Oclgrind's uninitialized-value shadow exact: it flags bytes
    that arrived through several offset host writes to one buffer, and never bytes written at once.
    """

    def __init__(self, session: OpenCLSession, options: Mapping[str, Any]):
        self.session = session
        self.options = dict(options)
        self._plans: dict[int, launches.LaunchPlan | None] = {}

    def alloc(self, nbytes: int) -> DeviceArena:
        return DeviceArena(self.session.buffer(nbytes), nbytes, np.zeros(max(nbytes, 1), np.uint8))

    def free(self, arena: DeviceArena) -> None:
        arena.pending = None
        arena.buf.release()

    def _ready(self, *arenas: DeviceArena) -> None:
        """Upload the host image of every arena not yet on the device, each in one write."""
        for arena in arenas:
            if arena.pending is not None:
                image, arena.pending = arena.pending, None
                self.session.write(arena, 0, image)

    def write(self, arena: DeviceArena, offset: int, data: np.ndarray) -> None:
        if arena.pending is not None:
            data = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
            arena.pending[offset: offset + data.size] = data
        else:
            self.session.write(arena, offset, data)

    def zero(self, arena: DeviceArena, offset: int, nbytes: int) -> None:
        if arena.pending is not None:
            arena.pending[offset: offset + nbytes] = 0
        else:
            self.session.zero(arena, offset, nbytes)

    def copy(self, src: DeviceArena, src_off: int, dst: DeviceArena, dst_off: int, nbytes: int) -> None:
        if src is dst and src_off < dst_off + nbytes and dst_off < src_off + nbytes:
            raise ValueError(f"overlapping copy of {nbytes} bytes from offset {src_off} to {dst_off} in one arena")
        self._ready(src, dst)
        # the copy kernel rather than clEnqueueCopyBuffer, for Oclgrind's sake (see OpenCLSession.zero)
        src_buf, dst_buf = Buf("src"), Buf("dst")
        item = launches.body.copy_launch(self.session.limits, nbytes, (src_buf, src_off), (dst_buf, dst_off))
        self.session.enqueue(item, {src_buf: src.buf, dst_buf: dst.buf})

    def accumulate(self, dst: DeviceArena, dst_off: int, src: DeviceArena, src_off: int, count: int, dtype: str) -> None:
        self._ready(dst, src)
        dst_buf, src_buf = Buf("dst"), Buf("src")
        item = launches.body.accumulate(self.session.limits, dtype, count, (dst_buf, dst_off), (src_buf, src_off))
        self.session.enqueue(item, {dst_buf: dst.buf, src_buf: src.buf})

    def run(self, schedule: Mapping[str, Any], arena: DeviceArena) -> None:
        """Run a body schedule on the device; a thunk the device cannot run goes through the host."""
        self._ready(arena)
        for thunk in schedule["thunks"]:
            plan = self._plan(thunk)
            if plan is None:
                self._on_host(thunk, arena)
            elif thunk["op"] in SCAN_OPS:  # a nested scan drives its own body
                self.session.launch(thunk, arena, **self.options)
            else:
                self.session.run_plan(plan, arena)

    def _plan(self, thunk: Mapping[str, Any]) -> launches.LaunchPlan | None:
        """A body runs once per step, so each of its thunks is decided and planned once per scan execution.

        ``None`` when the device cannot run the thunk (an empty plan for a nested scan).
        """
        key = id(thunk)  # the body schedules outlive this DeviceMemory, so ids stay unique meanwhile
        if key not in self._plans:
            if self.session.unsupported(thunk) is not None:
                self._plans[key] = None
            elif thunk["op"] in SCAN_OPS:
                self._plans[key] = launches.LaunchPlan(())
            else:
                self._plans[key] = launches.plan(thunk, self.session.limits, **self.options)
        return self._plans[key]

    def _on_host(self, thunk: Mapping[str, Any], arena: DeviceArena) -> None:
        import host_fallback

        # body arenas are small: move the whole arena rather than the thunk's footprint
        host = self.session.read(arena, 0, arena.nbytes)
        host_fallback.execute(thunk, host, **self.options)
        self.session.write(arena, 0, host)
