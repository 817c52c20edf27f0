"""The kernel-session core: everything a device backend shares, written once over a few primitives.

A backend module implements ``primitives.Primitives`` — memory, program build, kernel launch and the
device's limits, in its own API — and wraps it in a :class:`KernelSession`. Arenas, the grow-only
scratch, the program and kernel caches, running a launch plan, the scan driver's device memory
(:class:`ScanMemory`, nested scans included), the device-memory limits and the session lock all
live here. Where each thunk runs is the runtime's decision: a scan's body thunks placed on the host
arrive as ready runners (``on_host``), so the core only follows placement.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

import numpy as np
from host_fallback.abi import SCAN_OPS, footprint, runtime_data

from .. import launches
from ..errors import DeviceError
from ..launches import ARENA, SCRATCH, Buf, Launch
from ..units import human_bytes
from . import programs
from .allocation import allocating
from .base import NONE_ON_HOST, Runner
from .options import RunOptions
from .primitives import DeviceArena, Primitives

Thunk = Mapping[str, Any]

_PROGRAMS: dict[tuple, Any] = {}  # programs.cache_key -> built program, shared by every session of a device
_PROGRAMS_LOCK = threading.Lock()


@dataclass(frozen=True, eq=False)
class BoundPlan:
    """A launch plan with each launch's kernel resolved: what repeated runs enqueue directly.

    ``steady`` is ``launches`` without the plan's staging launches: what a run enqueues on a resident
    arena whose kept scratch (:class:`KeptScratch`) still holds their output.
    """

    launches: tuple[tuple[Any, Launch], ...]
    scratch_bytes: int
    steady: tuple[tuple[Any, Launch], ...]
    staging_reads: tuple[tuple[int, int], ...]


@dataclass(eq=False)
class KeptScratch:
    """The scratch of one bound plan on one resident arena; ``fresh`` while its staged part is valid,
    i.e. no write has touched ``reads`` (the arena ranges it was staged from) since it was made."""

    buffer: Any
    reads: tuple[tuple[int, int], ...]
    fresh: bool = False


class KernelSession:
    """One opened device: arenas, scratch, compile caches, launch plans and the scan driver's memory.

    ``lock`` serialises everything that enqueues: the executor holds it for a whole run, so kernel
    arguments set by one thread are never overwritten by another before their launch.
    """

    def __init__(self, prims: Primitives):
        self.prims = prims
        self.info = prims.info
        self.limits = prims.limits
        self.shared = prims.shared
        self.lock = threading.RLock()
        self._kernels: dict[tuple[str, str], Any] = {}  # (program digest, kernel name) -> kernel
        self._launches: dict[Launch, Any] = {}  # a launch without its arguments -> its kernel
        self._scratch: DeviceArena | None = None
        # a plan's scratch is kept with its resident arena, not the shared one (which a larger plan's run
        # frees and grows): set while a caller may capture the launches into a graph of its own
        self.pinned_scratch = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.info.spec!r})"

    # -- registry ---------------------------------------------------------------------------
    def unsupported(self, thunk: Thunk) -> str | None:
        """``None`` when this device runs ``thunk`` (a scan: its driver), else the reason."""
        if "f64" in {thunk.get("dtype"), thunk.get("src_dtype")} and not self.info.fp64:
            return f"f64 needs {self.prims.fp64_feature}, which {self.info.name} does not report"
        if thunk["op"] in SCAN_OPS:
            return None  # the driver runs here; each body thunk is placed on its own
        return launches.unsupported(thunk, self.limits)

    # -- memory -----------------------------------------------------------------------------
    def check_fits(self, nbytes: int, what: str) -> None:
        """Raise ``DeviceError`` when ``nbytes`` exceed the largest buffer or the memory of this device."""
        limit, kind = min((self.prims.max_alloc_bytes, "largest allocation"), (self.prims.global_mem_bytes, "memory"))
        if nbytes > limit:
            raise DeviceError(f"{what} needs {nbytes} bytes ({human_bytes(nbytes)}), more than the {kind} of "
                              f"{self.info.name} ({self.info.spec}): {limit} bytes ({human_bytes(limit)}); "
                              f"shrink the schedule or run it on a device with more memory")

    @property
    def where(self) -> str:
        """The device as messages name it."""
        return f"{self.info.name} ({self.info.spec})"

    def _buffer(self, nbytes: int, what: str) -> Any:
        self.check_fits(nbytes, what)
        with allocating(what, self.where, nbytes):
            return self.prims.allocate(max(nbytes, 1))

    def alloc(self, nbytes: int, what: str = "an arena", resident: bool = False) -> DeviceArena:
        """A zeroed arena of ``nbytes``; ``resident`` when it lives between runs (``DeviceArena.kept``)."""
        arena = DeviceArena(self._buffer(nbytes, what), nbytes, resident=resident)
        with allocating(what, self.where, nbytes):  # a device may allocate on first use: the zeroing
            self.prims.zero(arena.buffer, 0, max(nbytes, 1))
        return arena

    def upload(self, data: np.ndarray, what: str = "an arena", resident: bool = False) -> DeviceArena:
        """A new arena holding ``data`` (``numpy.uint8``), sent in one host write and not zeroed first."""
        data = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
        arena = DeviceArena(self._buffer(data.size, what), data.size, resident=resident)
        if data.size:
            self.prims.write(arena.buffer, 0, data)
        return arena

    def free(self, arena: DeviceArena) -> None:
        arena.pending = arena.image = None
        arena.args.clear()
        for kept in arena.kept.values():
            self.prims.release(kept.buffer)
        arena.kept.clear()
        self.prims.release(arena.buffer)

    def write(self, arena: DeviceArena, offset: int, data: np.ndarray) -> None:
        data = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
        if data.size:
            self.prims.write(arena.buffer, offset, data)
            self.touched(arena, offset, data.size)

    @staticmethod
    def touched(arena: DeviceArena, offset: int, nbytes: int) -> None:
        """Note that ``nbytes`` at ``offset`` of ``arena`` changed: kept scratch staged from them is stale."""
        for kept in arena.kept.values():
            if kept.fresh and any(lo < offset + nbytes and offset < lo + n for lo, n in kept.reads):
                kept.fresh = False

    def read(self, arena: DeviceArena, offset: int, nbytes: int) -> np.ndarray:
        out = np.empty(nbytes, np.uint8)
        if nbytes:
            self.prims.read(arena.buffer, offset, out)
        return out

    def zero(self, arena: DeviceArena, offset: int, nbytes: int) -> None:
        if nbytes:
            self.prims.zero(arena.buffer, offset, nbytes)
            self.touched(arena, offset, nbytes)

    def finish(self) -> None:
        self.prims.finish()

    def host_view(self, arena: DeviceArena) -> np.ndarray:
        return self.prims.host_view(arena.buffer)

    def scratch(self, nbytes: int) -> Any:
        """The scratch buffer, grown to ``nbytes``: shared by every launch, which the queue serialises."""
        if self._scratch is None or self._scratch.nbytes < nbytes:
            size = max(nbytes, 64)
            if self._scratch is not None:
                self.prims.release(self._scratch.buffer)
                self._scratch = None
            self._scratch = DeviceArena(self._buffer(size, "the launch scratch"), size)
        return self._scratch.buffer

    # -- programs ---------------------------------------------------------------------------
    def program(self, prog: programs.Program) -> Any:
        """The built program for ``prog``, compiled once per (device, source digest, options)."""
        key = programs.cache_key(self.prims.device_key, prog, self.prims.build_options)
        with _PROGRAMS_LOCK:
            built = _PROGRAMS.get(key)
            if built is None:
                built = _PROGRAMS[key] = self.prims.build_program(prog)
        return built

    def kernel(self, launch: Launch) -> Any:
        """The kernel ``launch`` runs, from the program ``programs.program_for`` gives it.

        Kernels are kept by (program digest, name); a launch seen before (arguments aside) skips
        assembling its program text.
        """
        seen = replace(launch, args=())
        kernel = self._launches.get(seen)
        if kernel is None:
            prog = programs.program_for(self.prims.dialect, launch, self.limits)
            key = (prog.digest, launch.kernel)
            kernel = self._kernels.get(key)
            if kernel is None:
                kernel = self._kernels[key] = self.prims.get_kernel(self.program(prog), launch.kernel)
            self._launches[seen] = kernel
        return kernel

    # -- launches ---------------------------------------------------------------------------
    def bind(self, plan: launches.LaunchPlan) -> BoundPlan:
        """Resolve every kernel of ``plan`` once (compiling what is not yet built)."""
        bound = tuple((index, self.kernel(item), item) for index, item in enumerate(plan.launches) if not item.empty)
        return BoundPlan(tuple((kernel, item) for _, kernel, item in bound), plan.scratch_bytes,
                         tuple((kernel, item) for index, kernel, item in bound if index not in plan.staging),
                         plan.staging_reads if plan.staging else ())

    def run_bound(self, bound: BoundPlan, arena: DeviceArena) -> int:
        """Enqueue a bound plan on ``arena``; no bytes move to the host (returns 0)."""
        launches, scratch = self.resolve(bound, arena)
        self.enqueue_bound(launches, arena, scratch)
        return 0

    def resolve(self, bound: BoundPlan, arena: DeviceArena) -> tuple[tuple[tuple[Any, Launch], ...], Any]:
        """The launches a run of ``bound`` on ``arena`` enqueues, and the scratch buffer they use.

        On a resident arena a plan with staging launches (or any scratch, while ``pinned_scratch``) gets
        its own scratch, kept with the arena; its staging launches run only while that scratch is not
        fresh (first run, or after a write overlapped what they read). Elsewhere every launch runs, on
        the session's shared scratch.
        """
        launches, scratch = bound.launches, None
        if arena.resident and (bound.staging_reads or self.pinned_scratch and bound.scratch_bytes):
            kept = arena.kept.get(bound)
            if kept is None:
                what = "the kept scratch of a thunk's staged weights on a resident arena"
                kept = arena.kept[bound] = KeptScratch(self._buffer(bound.scratch_bytes, what), bound.staging_reads)
            launches, scratch, kept.fresh = bound.steady if kept.fresh else launches, kept.buffer, True
        elif bound.scratch_bytes:
            scratch = self.scratch(bound.scratch_bytes)
        return launches, scratch

    def enqueue_bound(self, launches: tuple[tuple[Any, Launch], ...], arena: DeviceArena, scratch: Any) -> None:
        """Enqueue bound launches, their ``ARENA`` arguments on ``arena``'s buffer, their ``SCRATCH`` ones on
        ``scratch``.

        The argument tuples are made once per arena and scratch and kept with the arena (``DeviceArena.args``):
        a decode loop on a resident arena makes none, and ``Primitives.enqueue`` gets the same tuple each run,
        so a backend whose kernels keep their arguments (OpenCL) sets them only when they change.
        """
        kept = arena.args.get(id(launches))
        if kept is None or kept[0] is not launches or kept[1] is not scratch:
            buffer = arena.buffer
            kept = arena.args[id(launches)] = (launches, scratch, tuple(
                (kernel, item, tuple(buffer if a is ARENA else scratch if a is SCRATCH else a for a in item.args))
                for kernel, item in launches))
        enqueue = self.prims.enqueue
        for kernel, item, args in kept[2]:
            enqueue(kernel, item, args)

    def enqueue(self, item: Launch, buffers: Mapping[Buf, Any]) -> None:
        """Enqueue one launch whose ``Buf`` arguments ``buffers`` resolves (to buffers from ``allocate``)."""
        if not item.empty:
            self.prims.enqueue(self.kernel(item), item, tuple(buffers[a] if isinstance(a, Buf) else a for a in item.args))

    def runner(self, thunk: Thunk, options: RunOptions, on_host: Mapping[int, Runner] = NONE_ON_HOST) -> Runner:
        """Plan ``thunk`` once; the returned function runs it on an arena.

        ``on_host`` maps the ``id`` of every body thunk (at any depth) that placement sent to the host
        to the runner that runs it there; every other body thunk runs here.
        """
        writes = tuple((r.offset, r.nbytes) for r in footprint(thunk)[1])
        if thunk["op"] in SCAN_OPS:
            def run(arena: DeviceArena) -> int:
                return self._run_scan(thunk, arena, options, on_host)
        else:
            plan = launches.plan(thunk, self.limits, **options.planner_keywords)
            self.check_fits(plan.scratch_bytes, f"the launch scratch of thunk {getattr(thunk, 'index', '?')} ({thunk['op']})")
            bound = self.bind(plan)

            def run(arena: DeviceArena) -> int:
                return self.run_bound(bound, arena)

        def run_and_note(arena: DeviceArena) -> int:
            copied = run(arena)
            if arena.kept:  # what this thunk wrote may be what another (or its own) kept scratch was staged from
                for offset, nbytes in writes:
                    self.touched(arena, offset, nbytes)
            return copied
        return run_and_note

    def launch(self, thunk: Thunk, arena: DeviceArena, **options: Any) -> None:
        """Run one thunk on ``arena`` in place (``options``: those of ``RunOptions``); as ``host_fallback.execute``,
        an integer tensor outside ABI.md §8's rules raises ``runtime_data.DataError`` before anything runs, and a
        thunk this device's kernels do not take (which placement would have sent to the host) ``DeviceError``
        naming the reason."""
        reason = self.unsupported(thunk)
        if reason is not None:
            index = getattr(thunk, "index", None)
            which = f"thunk {index} ({thunk['op']})" if index is not None else f"a {thunk['op']} thunk"
            raise DeviceError(f"{which} cannot run on {self.info.spec}: {reason}")
        with self.lock:
            runtime_data.check(thunk, lambda r: self.read(arena, r.offset, r.nbytes).view("<i4"))
            self.runner(thunk, RunOptions.build(**options))(arena)

    def _run_scan(self, thunk: Thunk, arena: DeviceArena, options: RunOptions, on_host: Mapping[int, Runner]) -> int:
        from host_fallback import scan

        memory = self.scan_memory(options, on_host)
        # a body thunk on the host allocates host scratch; the device's own allocations say more themselves
        with allocating(f"thunk {getattr(thunk, 'index', '?')} ({thunk['op']})'s host-side body work", self.where):
            if thunk["op"] == "scan":
                scan.run_scan(memory, thunk, arena)
            else:
                scan.run_scan_backward(memory, thunk, arena, options.recompute)
        return memory.copied

    def scan_memory(self, options: RunOptions, on_host: Mapping[int, Runner]) -> "ScanMemory":
        """The scan driver's device memory for one scan execution (a backend may extend it)."""
        return ScanMemory(self, options, on_host)


class ScanMemory:
    """The scan driver's memory protocol (``host_fallback.scan.Memory``) over device arenas.

    An arena from :meth:`alloc` starts as a host image (zeros): the driver's writes and zeroings
    (``init`` entries of a body arena, the first dcarry) land in that image, and the arena's pristine
    bytes reach the device in ONE host write just before a kernel, a copy or a read first touches it.
    Besides saving transfers, this keeps Oclgrind's uninitialized-value shadow exact: it flags bytes
    that arrived through several offset host writes to one buffer, and never bytes written at once.

    A body runs once per step, so each body thunk is planned once per scan execution. A body thunk
    placed on the host runs through the runner ``on_host`` gives it, which moves the footprint of its
    group of host thunks; ``copied`` counts those bytes.
    """

    def __init__(self, session: KernelSession, options: RunOptions, on_host: Mapping[int, Runner]):
        self.session = session
        self.options = options
        self.on_host = on_host
        self.copied = 0
        self._runners: dict[int, Runner] = {}  # body schedules outlive this object, so ids stay unique

    def alloc(self, nbytes: int) -> DeviceArena:
        buffer = self.session._buffer(nbytes, "a scan body arena")
        with allocating("the host image of a scan body arena", self.session.where, nbytes):
            return DeviceArena(buffer, nbytes, np.zeros(max(nbytes, 1), np.uint8))

    def free(self, arena: DeviceArena) -> None:
        self.session.free(arena)

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
        # the copy kernel rather than a copy call of the API: Oclgrind counts its bytes as initialised
        src_buf, dst_buf = Buf("src"), Buf("dst")
        item = launches.body.copy_launch(self.session.limits, nbytes, (src_buf, src_off), (dst_buf, dst_off))
        self.session.enqueue(item, {src_buf: src.buffer, dst_buf: dst.buffer})

    def accumulate(self, dst: DeviceArena, dst_off: int, src: DeviceArena, src_off: int, count: int, dtype: str) -> None:
        self._ready(dst, src)
        dst_buf, src_buf = Buf("dst"), Buf("src")
        item = launches.body.accumulate(self.session.limits, dtype, count, (dst_buf, dst_off), (src_buf, src_off))
        self.session.enqueue(item, {dst_buf: dst.buffer, src_buf: src.buffer})

    def read(self, arena: DeviceArena, offset: int, nbytes: int) -> np.ndarray:
        if arena.pending is not None:
            return arena.pending[offset: offset + nbytes]
        return self.session.read(arena, offset, nbytes)

    def run(self, schedule: Mapping[str, Any], arena: DeviceArena, before: Callable[[int], None]) -> None:
        """Run a body schedule on ``arena``: each thunk where placement put it, after ``before`` checked it."""
        self._ready(arena)
        for index, thunk in enumerate(schedule["thunks"]):
            runner = self._runners.get(id(thunk))
            if runner is None:
                runner = self._runners[id(thunk)] = self._runner(thunk)
            before(index)
            self.copied += runner(arena)

    def _runner(self, thunk: Thunk) -> Runner:
        on_host = self.on_host.get(id(thunk))
        return on_host if on_host is not None else self.session.runner(thunk, self.options, self.on_host)
