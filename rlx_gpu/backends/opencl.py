"""OpenCL backend (pyopencl): the primitives of ``core.Primitives`` in OpenCL calls, nothing else.

Device specs are ``opencl:PLATFORM:DEVICE`` indices; ``PYOPENCL_CTX`` picks a device as pyopencl reads
it. Arenas, caches, launch plans and the scan driver's device memory come from
:class:`~rlx_gpu.backends.core.KernelSession`.

On a CPU device whose memory is the host's and that offers fine-grained buffer SVM (OpenCL 2.0 shared
virtual memory: PoCL, Intel's CPU runtime), every buffer is such an allocation (``shared``): the host
writes and reads it in place, so a write or a read is a host copy rather than a command (each command
costs 15-60 µs on PoCL, most of a decode step), and launches are waited for only when the host next
touches memory (fine-grained SVM is coherent at that wait, OpenCL 2.0 §3.3.6). Elsewhere buffers are
``cl.Buffer`` objects moved by blocking copy commands. On PoCL's threaded CPU driver a wait first polls the
launch (:func:`polls_launches`): its worker threads would wake a sleeping waiter through the OS.
"""
from __future__ import annotations

import contextlib
import os
import re
import time
import warnings
from typing import Any, Iterator, Sequence

import numpy as np

from ..errors import DeviceError, KernelBuildError, KernelBuildWarning
from ..launches import DeviceLimits, Launch
from ..launches.limits import requested_target
from ..units import human_bytes
from .base import BackendUnavailable, DeviceInfo
from .core import KernelSession
from .opencl_binaries import BinaryCache, cache_dir as binaries_dir, keeps_own_builds
from .opencl_icd import register, registered_platforms
from .programs import Program

NAME = "opencl"
SPEC_INDICES = ("platform", "device")
PRELUDE = ("kernels_opencl", "prelude.cl")
DEVICE_ENV = "PYOPENCL_CTX"
BUILD_OPTIONS = ("-cl-std=CL1.2",)  # the text must stay within OpenCL C 1.2 (Oclgrind, older drivers)
SIMULATORS = ("Oclgrind",)
#: how long a wait polls a launch before it sleeps (:func:`polls_launches`): a one-token decode kernel, and PoCL's
#: ~30 µs wake of its worker threads, fit many times over; a longer launch costs a fraction of a core this long
POLL_SECONDS = 200e-6
#: PoCL's name, and its threaded CPU driver's device names (``pthread-<cpu>``; ``basic-<cpu>`` runs every command
#: in the thread that enqueues it)
POCL = "Portable Computing Language"
POCL_THREADED = "pthread"
#: fine-grained buffer SVM, aligned to a cache line pair as ``cl.Buffer`` storage is on the CPU runtimes
SVM_ALIGNMENT = 128
#: what an implementation writes into every build log without saying anything of the source: Intel's progress
#: lines, its optimization remarks and its vectorizer's report per kernel
LOG_CHATTER = re.compile(r"(Compilation|Linking|Device build) (started|done)|Options used by backend compiler:.*"
                         r"|remark: .*|Kernel \"\w+\" was (successfully vectorized \(\d+\)|not vectorized)|Done\.")


def diagnostics(log: str) -> list[str]:
    """The lines of a build log that are the compiler's diagnostics (warnings, notes, the source they quote)."""
    return [line for line in log.splitlines() if line.strip() and not LOG_CHATTER.fullmatch(line.strip())]


def reproduce_command(spec: str, program: Program) -> str:
    """The one-line command that builds ``program`` alone on device ``spec`` in a fresh process (opencl_builds)."""
    words = ["python -m rlx_gpu.backends.opencl_builds", "--device", spec, "--target", program.target,
             "--family", program.family, "--dtype", program.dtype]
    if program.src_dtype:
        words += ["--src-dtype", program.src_dtype]
    if program.defines:
        words += ["--defines", ",".join(f"{name}={value}" for name, value in program.defines)]
    return " ".join(words)


def _cl():
    register()  # before the loader's first platform query: the wheel runtimes' ICD files (opencl_icd)
    try:
        import pyopencl as cl
    except ImportError as err:
        raise BackendUnavailable(f"pyopencl is not importable ({err}); install it with: pip install 'pyopencl[pocl]'") from err
    return cl


#: a kernel every OpenCL C compiler must build: a device whose compiler refuses it cannot run any kernel
PROBE_SOURCE = "__kernel void rlx_probe(__global int *out) { out[get_global_id(0)] = 1; }"


def _compile_failure(cl, device) -> str | None:
    """``None`` when ``device``'s compiler builds :data:`PROBE_SOURCE`, else why not (its build log).

    An implementation's compiler may not know the CPU it runs on (PoCL 3.0's LLVM 14 on an AMD Zen 5
    reports ``unknown target CPU 'generic'`` for every program); such a device is listed but not used."""
    built = cl._cl._Program(cl.Context([device]), PROBE_SOURCE)
    try:
        built._build(options=b"", devices=[device])  # raw, as build_program: Intel's log is never empty
    except cl.Error as err:
        log = " ".join(line.strip() for line in built.get_build_info(device, cl.program_build_info.LOG).splitlines()
                       if line.strip())
        return f"its compiler builds no kernel: {log or err}"
    return None


def probe() -> list[DeviceInfo]:
    """Every OpenCL device: GPUs and accelerators first, then CPU devices, simulators such as Oclgrind last, and
    among each the wheel runtimes this package registered after the others (installing one never changes which
    device ``opencl`` names); a device whose compiler cannot build a trivial kernel carries the reason in
    ``details["unusable"]``."""
    cl = _cl()
    try:
        platforms = cl.get_platforms()
    except cl.Error as err:
        raise BackendUnavailable(f"no OpenCL platform found ({err}); install an ICD, e.g. pip install 'pyopencl[pocl]'") from err
    infos = []
    ours = registered_platforms()
    for pi, platform in enumerate(platforms):
        for di, dev in enumerate(platform.get_devices()):
            details = {
                "platform": platform.name,
                "version": dev.version,
                "driver": dev.driver_version,
                "max_work_group": dev.max_work_group_size,
                "local_mem_bytes": dev.local_mem_size,
                "global_mem_bytes": dev.global_mem_size,
                "max_alloc_bytes": dev.max_mem_alloc_size,
                "simulator": platform.name in SIMULATORS,
                "registered_by_rlx_gpu": platform.name in ours,
            }
            if (failure := _compile_failure(cl, dev)) is not None:
                details["unusable"] = failure
            fp64 = "cl_khr_fp64" in dev.extensions.split()
            details["matrix_extensions"] = matrix_extensions(dev.extensions)
            infos.append(DeviceInfo(NAME, f"opencl:{pi}:{di}", f"{dev.name.strip()} ({platform.name})", fp64, details,
                                    cpu=not _accelerator(cl, dev)))
    if not infos:
        raise BackendUnavailable("OpenCL platforms exist but report no device")
    return sorted(infos, key=lambda info: (bool(info.details["simulator"]), info.cpu,
                                           bool(info.details["registered_by_rlx_gpu"])))


#: OpenCL extensions that expose a device's matrix units to kernels (issue 38). Detected, never assumed, and
#: listed by ``rlx-gpu devices``; no kernel uses them yet (no device this project runs on offers one), so
#: their absence costs nothing: the portable kernels run everywhere.
MATRIX_EXTENSIONS = ("cl_khr_cooperative_matrix", "cl_intel_subgroup_matrix_multiply_accumulate")


def matrix_extensions(extensions: str) -> tuple[str, ...]:
    """The matrix-unit extensions (``MATRIX_EXTENSIONS``) named in a device's extension string."""
    named = set(extensions.split())
    return tuple(e for e in MATRIX_EXTENSIONS if e in named)


def _accelerator(cl: Any, device: Any) -> bool:
    """Whether ``device`` is a GPU or an accelerator; one that also says CPU (Oclgrind says every type) is not."""
    return bool(device.type & (cl.device_type.GPU | cl.device_type.ACCELERATOR)) and not device.type & cl.device_type.CPU


def device_from_env(value: str, devices: Sequence[DeviceInfo]) -> str:
    """The device ``PYOPENCL_CTX`` picks: ``p``, ``p:d``, or platform and device name fragments."""
    parts = [p.strip() for p in value.split(":")]
    if all(p.isdigit() for p in parts if p):
        return ":".join([NAME, *[p for p in parts if p]][:3])
    for info in devices:
        name, platform = info.name.lower(), str(info.details.get("platform", "")).lower()
        if parts[0].lower() in platform and (len(parts) < 2 or parts[1].lower() in name):
            return info.spec
    raise DeviceError(f"{DEVICE_ENV}={value!r} names no OpenCL device; "
                      f"opencl has {', '.join(d.spec + ' ' + d.name for d in devices) or 'none'}")


def open(info: DeviceInfo) -> KernelSession:  # noqa: A001 - the backend surface names it open
    return KernelSession(OpenCLPrimitives(info))


def shares_host_memory(cl: Any, device: Any) -> bool:
    """Whether ``device`` runs on the host's memory and its buffers can be fine-grained SVM: a CPU device
    (not a simulator, whose memory is its own) reporting host-unified memory and fine-grained buffer SVM."""
    if _accelerator(cl, device) or device.platform.name in SIMULATORS:
        return False
    try:
        return bool(device.host_unified_memory) and bool(
            device.svm_capabilities & cl.device_svm_capabilities.FINE_GRAIN_BUFFER)
    except (cl.Error, AttributeError):  # an OpenCL 1.x device has no SVM query
        return False


def polls_launches(cl: Any, device: Any) -> bool:
    """Whether a wait for a launch on ``device`` polls the launch's status, yielding the CPU between looks, for
    up to :data:`POLL_SECONDS` before it sleeps: on PoCL's threaded CPU driver (``pthread-``), whose worker
    threads wake a waiter asleep in ``clWaitForEvents`` through the OS (30 µs and more a wait on a 2-core VM;
    polling, its one-token decode steps took 0.66-0.87x their time: docs/performance.md). Not on Intel's CPU
    runtime, whose own threads spin (a waiter polling beside them made its steps up to 4.6x slower on a loaded
    machine), nor on PoCL's ``basic`` driver, which runs a launch in the thread that enqueues it, nor on a GPU."""
    return not _accelerator(cl, device) and device.platform.name == POCL and device.name.startswith(POCL_THREADED)


#: give the CPU to another ready thread (releasing the GIL meanwhile): sched_yield where the OS has it
_yield = getattr(os, "sched_yield", None) or (lambda: time.sleep(0))


def settle(event: Any, status: Any, seconds: float = POLL_SECONDS) -> None:
    """Poll ``event`` (its ``status`` info: queued 3 ... complete 0, an error below 0) until its command has
    completed or failed, or ``seconds`` have passed, yielding the CPU between looks (a worker thread of the
    device's may be waiting for it); the caller then waits for it as ever, which raises a failure."""
    clock = time.perf_counter
    deadline = clock() + seconds
    while event.get_info(status) > 0 and clock() < deadline:
        _yield()


class OpenCLPrimitives:
    """One OpenCL device, context and in-order queue. ``shared`` (None: :func:`shares_host_memory`)
    makes every buffer fine-grained SVM that the host writes and reads in place."""

    dialect = NAME
    build_options = BUILD_OPTIONS
    fp64_feature = "cl_khr_fp64"

    def __init__(self, info: DeviceInfo, shared: bool | None = None):
        cl = _cl()
        _, pi, di = info.spec.split(":")
        self.cl = cl
        self.info = info
        self.device = cl.get_platforms()[int(pi)].get_devices()[int(di)]
        self.context = cl.Context([self.device])
        self.queue = cl.CommandQueue(self.context)
        self.device_key = self.context.int_ptr
        self.limits = device_limits(cl, self.device, info.fp64)
        self.max_alloc_bytes = int(self.device.max_mem_alloc_size)
        self.global_mem_bytes = int(self.device.global_mem_size)
        self._typed: set[Any] = set()  # kernels whose scalar argument types pyopencl has been told
        self._set: dict[Any, tuple] = {}  # kernel -> the argument tuple it holds (a kernel keeps its arguments)
        self.shared = shares_host_memory(cl, self.device) if shared is None else shared
        self._host: dict[int, np.ndarray] = {}  # id(SVM allocation) -> its bytes, as the host sees them
        self._unfinished: Any = None  # the event of the latest launch not waited for
        self.polls = polls_launches(cl, self.device)
        self._status = cl.event_info.COMMAND_EXECUTION_STATUS
        self._buffer_types = (cl.MemoryObjectHolder, cl.SVMPointer)
        platform = self.device.platform
        self.binaries = BinaryCache((platform.name, platform.version, self.device.name, self.device.version,
                                     self.device.driver_version), BUILD_OPTIONS,
                                    None if keeps_own_builds(platform.name) else binaries_dir())

    def allocate(self, nbytes: int) -> Any:
        with self._out_of_memory_as_memory_error():
            if not self.shared:
                return self.cl.Buffer(self.context, self.cl.mem_flags.READ_WRITE, nbytes)
            flags = self.cl.svm_mem_flags.READ_WRITE | self.cl.svm_mem_flags.SVM_FINE_GRAIN_BUFFER
            host = self.cl.svm_empty(self.context, flags, nbytes, np.uint8, alignment=SVM_ALIGNMENT)
            self._host[id(host.base)] = host
            return host.base  # the allocation (a kernel argument); the host's view of it stays in _host

    def release(self, buffer: Any) -> None:
        if self.shared:
            self.finish()  # a launch still running may use it
            del self._host[id(buffer)]
        buffer.release()

    def host_view(self, buffer: Any) -> np.ndarray:
        if not self.shared:
            raise NotImplementedError(f"{self.info.name} ({self.info.spec}) keeps its buffers in memory of its own")
        return self._host[id(buffer)]

    def write(self, buffer: Any, offset: int, data: np.ndarray) -> None:
        if self.shared:
            self.finish()
            self._host[id(buffer)][offset: offset + data.size] = data
            return
        with self._out_of_memory_as_memory_error():  # a buffer's memory may be allocated on first use
            self.cl.enqueue_copy(self.queue, buffer, data, dst_offset=offset)

    @contextlib.contextmanager
    def _out_of_memory_as_memory_error(self) -> Iterator[None]:
        """pyopencl's out-of-memory errors (``cl.MemoryError``, or a status of MEM_OBJECT_ALLOCATION_FAILURE,
        OUT_OF_RESOURCES or OUT_OF_HOST_MEMORY) as ``MemoryError``, the primitives' allocation failure."""
        status = self.cl.status_code
        try:
            yield
        except self.cl.Error as err:
            code = getattr(err, "code", None)
            if isinstance(err, self.cl.MemoryError) or code in (
                    status.MEM_OBJECT_ALLOCATION_FAILURE, status.OUT_OF_RESOURCES, status.OUT_OF_HOST_MEMORY):
                raise MemoryError(str(err)) from err
            raise

    def read(self, buffer: Any, offset: int, out: np.ndarray) -> None:
        if self.shared:
            self.finish()
            out[...] = self._host[id(buffer)][offset: offset + out.size]
            return
        self.cl.enqueue_copy(self.queue, out, buffer, src_offset=offset)

    def zero(self, buffer: Any, offset: int, nbytes: int) -> None:
        # a host write rather than clEnqueueFillBuffer: Oclgrind's uninitialized-value checker does
        # not count filled (or buffer-to-buffer copied) bytes as initialized, and CI runs under it
        self.write(buffer, offset, np.zeros(nbytes, np.uint8))

    def build_program(self, program: Program) -> Any:
        # pyopencl's raw program, built with exactly our options: ``Program.build`` appends ``-I`` of the
        # headers inside the installed pyopencl, and a driver that caches builds (PoCL) keys them by the
        # options, so every new virtual environment or checkout would miss that cache. The kernels
        # include nothing of pyopencl's; ``cl.Kernel`` takes the raw program as it is. ``_build`` rather than
        # ``build``: pyopencl warns of any non-empty log, and Intel's always holds progress lines and remarks;
        # the diagnostics among them are warned of here, with the program they belong to (a binary from the
        # disk cache, ``opencl_binaries``, with those of the build that made it).
        built, log = self._from_binary(program) or self._from_source(program)
        said = diagnostics(log)
        if said:
            warnings.warn(f"the {program.label} built on {self.info.name} with diagnostics "
                          f"({reproduce_command(self.info.spec, program)}):\n" + "\n".join(said), KernelBuildWarning,
                          stacklevel=2)
        return built

    def _from_source(self, program: Program) -> tuple[Any, str]:
        """``program`` built from its text, and the build's log; the binary and log kept in the disk cache."""
        built = self.cl._cl._Program(self.context, program.source)
        try:
            built._build(options=" ".join(BUILD_OPTIONS).encode(), devices=[self.device])
        except self.cl.Error as err:
            raise KernelBuildError(f"building the {program.label} for {self.info.name} ({self.info.spec}) failed; "
                                   f"alone: {reproduce_command(self.info.spec, program)}",
                                   self._build_log(built, err), list(BUILD_OPTIONS), program.source) from err
        log = self._build_log(built, None)
        if self.binaries.directory is not None:  # asking for the binary may compile it (PoCL)
            self.binaries.write(program, built.get_info(self.cl.program_info.BINARIES)[0], log)
        return built, log

    def _from_binary(self, program: Program) -> tuple[Any, str] | None:
        """``program`` built from the binary the disk cache keeps, and the log of the build that made it; ``None``
        when the cache has none or the driver refuses it."""
        kept = self.binaries.read(program)
        if kept is None:
            return None
        binary, log = kept
        try:
            built = self.cl._cl._Program(self.context, [self.device], [binary])
            built._build(options=" ".join(BUILD_OPTIONS).encode(), devices=[self.device])
        except self.cl.Error:
            return None
        self.binaries.loaded += 1
        return built, log

    def _build_log(self, built: Any, err: Exception | None) -> str:
        try:
            log = built.get_build_info(self.device, self.cl.program_build_info.LOG)
        except self.cl.Error:
            log = ""
        return log.strip() or (str(err) if err is not None else "")

    def get_kernel(self, built: Any, name: str) -> Any:
        return self.cl.Kernel(built, name)

    def enqueue(self, kernel: Any, launch: Launch, args: tuple[Any, ...]) -> None:
        if kernel not in self._typed:
            self._check_local_memory(kernel, launch)
            # pyopencl sets an untyped scalar argument through a slow generic path (~13 µs each, most of
            # a small launch's cost on PoCL); told the types once, it packs them in generated code (~0.2 µs)
            kernel.set_scalar_arg_dtypes([None if isinstance(a, self._buffer_types) else a.dtype for a in args])
            self._typed.add(kernel)
        if self._set.get(kernel) is not args:  # the same tuple: the same arguments, still set
            self._set.pop(kernel, None)  # until all are set: a failure midway leaves the kernel's arguments unknown
            kernel.set_args(*args)
            self._set[kernel] = args
        self._unfinished = self.cl.enqueue_nd_range_kernel(self.queue, kernel, launch.global_size, launch.local_size)

    def _check_local_memory(self, kernel: Any, launch: Launch) -> None:
        """A kernel whose LOCAL arrays (the gpu target's tiles) pass the device's local memory is a DeviceError
        naming both sizes, not the driver's bare OUT_OF_RESOURCES at launch."""
        local = int(kernel.get_work_group_info(self.cl.kernel_work_group_info.LOCAL_MEM_SIZE, self.device))
        if local > self.limits.local_mem_bytes:
            raise DeviceError(f"kernel {launch.kernel} ({launch.family}/{launch.dtype}, {launch.target} target) needs "
                              f"{human_bytes(local)} of local memory; {self.info.name} ({self.info.spec}) has "
                              f"{human_bytes(self.limits.local_mem_bytes)}")

    def finish(self) -> None:
        # shared: the queue holds launches only, so waiting for the latest (in order: all) is a finish, and is
        # cheaper than clFinish on PoCL (one wait per decode step); nothing to wait for when none is pending
        if self._unfinished is not None:
            if self.polls:
                settle(self._unfinished, self._status)
            self._unfinished.wait()
            self._unfinished = None
        if not self.shared:
            self.queue.finish()


def device_limits(cl: Any, device: Any, fp64: bool) -> DeviceLimits:
    """The launch limits of ``device``; its type picks the target unless ``RLX_TARGET`` forces one."""
    target = requested_target("gpu" if _accelerator(cl, device) else "cpu")
    # the warp / wavefront width where the vendor's extension reports it, else the work-group multiple the
    # device prefers (its SIMD width; an OpenCL 3.0 query: 1, no grouping claimed, where the device cannot say)
    extensions = device.extensions.split()
    if "cl_nv_device_attribute_query" in extensions:
        sub_group = device.warp_size_nv
    elif "cl_amd_device_attribute_query" in extensions:
        sub_group = device.wavefront_width_amd
    else:
        try:
            sub_group = device.preferred_work_group_size_multiple
        except cl.Error:
            sub_group = 1
    return DeviceLimits(device.max_work_group_size, device.local_mem_size, fp64, target=target,
                        sub_group=int(sub_group), compute_units=device.max_compute_units)
