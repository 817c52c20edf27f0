"""Runs a schedule on one device: placement, launch plans and runners bound once per schedule, host
fallback runs that copy their joint footprint once each way, and the session lock held for a whole run."""
from __future__ import annotations

import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple

import numpy as np
from host_fallback import scan
from host_fallback.abi import SCAN_OPS, runtime_data

from ..backends.allocation import allocating
from ..backends.base import Session
from ..schedule.io import load_schedule
from ..schedule.model import Schedule
from ..units import human_bytes
from .arena import Arena
from .config import Config, load_config
from .data_checks import DataCheck, data_checks, int32_reader, refused
from .fallback import HostRun, host_runs
from .options import RunOptions
from .placement import Assignment, place
from .registry import open_session, resolve, status

_new_tuple = tuple.__new__  # a NamedTuple made without its Python ``__new__``: tuple.__new__(cls, values)

#: One bound top-level thunk: runs on (device arena, host image) and returns the bytes it copied.
BoundThunk = Callable[[Any, "np.ndarray | None"], int]


class ThunkRecord(NamedTuple):
    """How one thunk ran: where, for how long, and the bytes its fallback copied (body fallbacks included);
    a tuple, made on every run at a fraction of a frozen dataclass's cost."""

    index: int
    op: str
    dtype: str
    backend: str
    seconds: float
    copied_bytes: int


@dataclass
class RunReport:
    """What the last ``Device.run`` (or call of a ``CallPlan``) did. ``copies``: the host-device copies a
    run on a resident arena made, each a command of its own (staged inputs sent, integer tensors read
    for their checks, and a call plan's outputs read); 0 where arenas are host memory (the host, an
    OpenCL CPU device's shared memory: ``Session.shared``)."""

    device: str
    records: list[ThunkRecord] = field(default_factory=list)
    seconds: float = 0.0
    copies: int = 0

    @property
    def fallback_bytes(self) -> int:
        return sum(r.copied_bytes for r in self.records)


class LastReport:
    """The ``last_report`` of a ``Device`` or a ``CallPlan``, kept in its plain attribute ``_report``: None, a
    ``RunReport``, or a run of one host thunk kept unmade as ``(device spec, (index, op, dtype, backend), seconds,
    copied bytes)`` (``Device._alone``, ``HostCall``), made into its ``RunReport`` when first read. A decode step's
    run makes no report object nobody reads (after a kernel that swept the cache each is a µs); the runs set
    ``_report`` themselves, a plain attribute's store (no frame, and the object's attributes stay where Python reads
    them fastest)."""

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        report = obj._report
        if type(report) is tuple:
            spec, thunk, seconds, copied = report
            report = obj._report = RunReport(spec, [_new_tuple(ThunkRecord, (*thunk, seconds, copied))], seconds)
        return report

    def __set__(self, obj: Any, report: RunReport | None) -> None:
        obj._report = report


@dataclass(frozen=True)
class BoundSchedule:
    """A schedule bound to one device, the per-schedule work a run repeats nothing of: placement,
    launch plans, runners (host runs included), the fallback warning."""

    assignments: tuple[Assignment, ...]
    steps: tuple[tuple[Any, str, BoundThunk], ...]  # (thunk, backend, runner) per top-level thunk
    warning: str | None
    needs_image: bool  # a top-level thunk falls back, so a device run keeps a host image of the arena
    early_checks: tuple[DataCheck, ...] = ()  # integer tensors checked before anything runs
    late_checks: dict[int, DataCheck] = field(default_factory=dict)  # step index -> check just before it
    # one host thunk (its data checks, if any, early): its runner, which takes arrays in place of arena views
    # (``execute_given``)
    given: Callable[[Any, Any], bool] | None = None
    # the same schedule's run on an arena's handle, ``alone(handle)`` (``Device._alone``)
    alone: Callable[[Any], tuple[str, tuple, float, int]] | None = None
    # one thunk, on the device (or the host), no data check: a run is that thunk's launches (a decode step's)
    single_thunk: bool = False


class Device:
    """An opened device plus the host for fallback; ``run`` is the entry point of ABI.md §7.

    One ``Device`` may be used from many threads: a device session serialises runs (its lock is held
    for a whole run and every resident-arena operation); the host runs them at once.
    """

    last_report = LastReport()

    def __init__(self, session: Session, config: Config, options: RunOptions | None = None):
        self.session = session
        self.config = config
        self.options = options if options is not None else RunOptions.build(config)
        self.on_host = session.info.backend == "host"
        self.host = session if self.on_host else open_session(status("host").devices[0])
        self.thunks_run = 0  # top-level thunks this Device has run, on any backend, for tests and reports
        self._report: RunReport | tuple | None = None  # ``last_report`` (``LastReport``)
        # id(schedule) -> (a weak reference to it, its BoundSchedule); Schedules are unhashable Mappings
        self._bound: dict[int, tuple[weakref.ref, BoundSchedule]] = {}

    @property
    def spec(self) -> str:
        return self.session.info.spec

    def __repr__(self) -> str:
        return f"Device({self.spec!r}, {self.session.info.name!r})"

    def place(self, schedule: Any) -> list[Assignment]:
        """Where every thunk would run and why (body thunks of device scans included), running nothing."""
        return place(load_schedule(schedule), self.session, self.config)

    def arena(self, schedule: Any) -> Arena:
        """A resident arena for ``schedule`` on this device: zeros plus ``init``, kept until freed."""
        schedule = load_schedule(schedule)
        self.bind(schedule)
        return Arena(self, schedule)

    def bind(self, schedule: Schedule) -> BoundSchedule:
        """Place, check and plan ``schedule`` once; later runs reuse it."""
        key = id(schedule)
        entry = self._bound.get(key)
        if entry is not None and entry[0]() is schedule:
            return entry[1]
        with self.session.lock:
            self.session.check_fits(schedule.arena_bytes, "the arena of this schedule (arena_bytes)")
            for thunk in (t for t in schedule.thunks if t.op in SCAN_OPS):
                self.session.check_fits(scan.working_bytes(thunk, self.options.recompute),
                                        f"thunk {thunk.index} ({thunk.op})'s body arenas and recompute cache")
            bound = self._bind(schedule)
        self._bound[key] = (weakref.ref(schedule, lambda _, cache=self._bound: cache.pop(key, None)), bound)
        return bound

    def _bind(self, schedule: Schedule) -> BoundSchedule:
        assignments = tuple(place(schedule, self.session, self.config))
        device = self.session.info.backend
        fallback: dict[int, BoundThunk] = {}  # id(thunk) -> its step of a host run, at every depth
        for run in host_runs(assignments, device):
            host_run = HostRun(self.session, self.host, [a.thunk for a in run], self.options)
            fallback.update(zip((id(a.thunk) for a in run), host_run.steps()))
        steps = []
        for a in (a for a in assignments if not a.nested):
            if a.backend == device:
                runner = self.session.runner(a.thunk, self.options, fallback)
                steps.append((a.thunk, a.backend, lambda dev, image, run=runner: run(dev)))
            else:
                steps.append((a.thunk, a.backend, fallback[id(a.thunk)]))
        fallbacks = [a for a in assignments if a.backend != device]
        warning = None
        if fallbacks and self.config.fallback == "warn":
            listed = ", ".join(f"{a.where if a.nested else a.index} ({a.op} {a.dtype})" for a in fallbacks[:8])
            warning = (f"{len(fallbacks)} thunk(s) fall back to the host from {self.spec}: {listed}"
                       f"{' ...' if len(fallbacks) > 8 else ''}; `rlx-gpu plan` says why")
        needs_image = any(a.backend != device for a in assignments if not a.nested)
        checks = data_checks(schedule.thunks)
        step_of = {id(thunk): i for i, (thunk, _, _) in enumerate(steps)}
        one_thunk = len(steps) == 1 and steps[0][1] == device
        single_thunk = one_thunk and not checks
        # its integer tensors (state slots, packed sequences) checked before it runs, as ``execute_given`` does
        given = runner if self.on_host and one_thunk and all(c.early for c in checks) else None
        return BoundSchedule(assignments, tuple(steps), warning, needs_image, tuple(c for c in checks if c.early),
                             {step_of[id(c.thunk)]: c for c in checks if not c.early}, given,
                             self._alone(*steps[0]) if self.on_host and single_thunk else None, single_thunk)

    def _alone(self, thunk: Any, backend: str, step: BoundThunk) -> Callable[[Any], tuple[str, tuple, float, int]]:
        """The run of a schedule of one host thunk and no data check (``BoundSchedule.given``) on a resident arena's
        handle, bound once: nothing to send, lock, check or wait for (``execute``'s first case; a caller writing the
        arena itself, ``host_call.HostCall``, calls it straight). ``alone(handle)`` returns the run's report as
        ``LastReport`` keeps one unmade, kept as this Device's ``last_report``."""
        clock, static, spec = time.perf_counter, (thunk.index, thunk.op, thunk.dtype, backend), self.session.info.spec

        def alone(handle: Any) -> tuple[str, tuple, float, int]:
            started = clock()
            try:
                copied = step(handle, None)
            except runtime_data.DataError as err:  # as ``_execute``: a scan driver refused a body thunk's data
                raise refused(thunk, err) from None
            self.thunks_run += 1
            report = self._report = (spec, static, clock() - started, copied)  # kept unmade (``LastReport``)
            return report
        return alone

    def run(self, schedule: Any, arena: np.ndarray | Arena | None = None, *, profile: bool = False) -> Any:
        """Run ``schedule``.

        With a NumPy ``arena`` (or None: zeros), on a copy of it with ``init`` applied, returning the
        new arena (ABI.md §7). With a resident :class:`Arena` from :meth:`arena`, in place on the
        device, returning it. ``profile`` waits for every thunk to finish so each gets its own time
        in ``last_report``.
        """
        schedule = load_schedule(schedule)
        bound = self.bind(schedule)
        if bound.warning:
            warnings.warn(bound.warning, stacklevel=2)
        if isinstance(arena, Arena):
            arena.check(self, schedule)
            self.execute(bound, arena, profile=profile)
            return arena
        host_arena = self._initial_arena(schedule, arena)
        for check in bound.early_checks:
            check.run(int32_reader(lambda offset, nbytes: host_arena[offset: offset + nbytes]))
        if self.on_host:
            self._execute(bound, host_arena, host_arena, profile)
            return host_arena
        with self.session.lock:
            dev_arena = self.session.upload(host_arena, "the arena of this schedule")
            try:
                self._execute(bound, dev_arena, host_arena, profile)
                return self.session.read(dev_arena, 0, schedule.arena_bytes)
            finally:
                self.session.free(dev_arena)

    def execute(self, bound: BoundSchedule, arena: Arena, *, profile: bool = False,
                held: Callable[[int, int], np.ndarray | None] | None = None, checks: bool = True) -> RunReport:
        """Run ``bound`` in place on the resident ``arena`` (of this device and its schedule), under the
        session lock: the staged writes sent, the early data checks, the steps with their late checks.

        ``held(offset, nbytes)`` gives the bytes an early check reads when the caller holds them on the
        host (None: read them from the arena, one read each: a command on a device). ``checks=False``
        runs no data check (a run being captured into a CUDA graph cannot read the device: the call
        plan's stream path says what that means). Returns the report, also kept as ``last_report``.
        """
        if bound.alone is not None:  # one host thunk, no data check: nothing to send, lock, check or wait for
            bound.alone(arena.handle)
            return self.last_report  # made from the values ``alone`` kept
        if bound.single_thunk and not profile:  # one thunk to enqueue: ``_one_thunk``'s report, no loop's bookkeeping
            (thunk, backend, step), = bound.steps
            started = time.perf_counter()
            with self.session.lock:
                copies = arena.flush()
                try:
                    copied = step(arena.handle, None)
                except runtime_data.DataError as err:  # as ``_execute``: a scan driver refused a body thunk's data
                    raise refused(thunk, err) from None
            report = self._one_thunk(thunk, backend, time.perf_counter() - started, copied)
            if not self.session.shared:
                report.copies = copies
            return report
        with self.session.lock:
            copies = arena.flush()
            if checks and bound.early_checks:
                def read(offset: int, nbytes: int) -> np.ndarray:
                    nonlocal copies
                    data = held(offset, nbytes) if held is not None else None
                    if data is None:
                        data, copies = self.session.read(arena.handle, offset, nbytes), copies + 1
                    return data
                reader = int32_reader(read)
                for check in bound.early_checks:
                    check.run(reader)
            report = self._execute(bound, arena.handle, arena.image() if bound.needs_image else None, profile, checks)
        if not self.session.shared:
            report.copies = copies + checks * sum(len(c.regions) for c in bound.late_checks.values())
        return report

    def execute_given(self, bound: BoundSchedule, arena: Arena, given: Mapping[int, np.ndarray]) -> RunReport | None:
        """Run ``bound`` (``bound.given``: one host thunk) on the resident host ``arena`` with the arrays of
        ``given`` (a tensor's arena offset -> an array the kernel reads or writes in place of its arena view: a
        caller's memory), its integer tensors checked first (read where they lie: a given array or the arena;
        a ``RunError`` before anything runs); the report, or None where the kernel does not take them (nothing
        ran: the caller copies them in and calls ``execute``)."""
        (thunk, backend, _), = bound.steps
        started = time.perf_counter()
        if bound.early_checks:
            def read(offset: int, nbytes: int) -> np.ndarray:
                return given[offset] if offset in given else self.session.read(arena.handle, offset, nbytes)
            reader = int32_reader(read)
            for check in bound.early_checks:
                check.run(reader)
        if not bound.given(arena.handle, given):
            return None
        return self._one_thunk(thunk, backend, time.perf_counter() - started, 0)

    def _one_thunk(self, thunk: Any, backend: str, seconds: float, copied: int) -> RunReport:
        """The report of a run of one thunk that took ``seconds``, kept as ``last_report`` (a decode step's:
        the record made by ``tuple.__new__``, the spec read straight, two Python frames less after a kernel that
        swept the cache)."""
        record = _new_tuple(ThunkRecord, (thunk.index, thunk.op, thunk.dtype, backend, seconds, copied))
        report = RunReport(self.session.info.spec, [record], seconds)
        self.thunks_run += 1
        self._report = report  # ``last_report``
        return report

    def _execute(self, bound: BoundSchedule, dev_arena: Any, image: np.ndarray | None, profile: bool,
                 checks: bool = True) -> RunReport:
        report = RunReport(self.spec)
        started = time.perf_counter()
        for i, (thunk, backend, step) in enumerate(bound.steps):
            if checks and i in bound.late_checks:
                self._check_data((bound.late_checks[i],), dev_arena)
            t0 = time.perf_counter()
            try:
                copied = step(dev_arena, image)
            except runtime_data.DataError as err:  # a scan driver refused a body thunk's run-time data
                raise refused(thunk, err) from None
            if profile:
                self.session.finish()
            report.records.append(ThunkRecord(thunk.index, thunk.op, thunk.dtype, backend,
                                              time.perf_counter() - t0, copied))
        self.thunks_run += len(bound.steps)
        report.seconds = time.perf_counter() - started
        self._report = report  # ``last_report``
        return report

    def _check_data(self, checks: tuple[DataCheck, ...], dev_arena: Any) -> None:
        """Read each check's integer tensors from the device arena (one small read each) and check them."""
        for check in checks:
            check.run(int32_reader(lambda offset, nbytes: self.session.read(dev_arena, offset, nbytes)))

    @staticmethod
    def _initial_arena(schedule: Schedule, arena: np.ndarray | None) -> np.ndarray:
        if arena is None:
            with allocating("the arena of this schedule (arena_bytes)", "the host", schedule.arena_bytes):
                return schedule.pristine_arena()
        if not isinstance(arena, np.ndarray) or arena.dtype != np.uint8 or arena.shape != (schedule.arena_bytes,):
            got = f"{type(arena).__name__} {getattr(arena, 'dtype', '')} {getattr(arena, 'shape', '')}"
            raise ValueError(f"arena must be a numpy uint8 array of arena_bytes = {schedule.arena_bytes} "
                             f"({human_bytes(schedule.arena_bytes)}) or a resident Arena, got {got}")
        with allocating("a copy of the arena given to run", "the host", schedule.arena_bytes):
            out = arena.copy()
        schedule.apply_init(out)
        return out


def get_device(spec: str | None = None, config: Config | str | None = None, **options: Any) -> Device:
    """Open a device by spec (``None``: ``RLX_DEVICE``, then the config's ``device``).

    ``options`` are run options (:class:`~rlx_gpu.runtime.options.RunOptions`: ``recompute``,
    ``rnn_kernel``, ``workers`` ...); an unknown one is an error naming the known ones. On a CUDA device the
    config's ``cuda.tf32`` picks the session (``registry.open_session``; ``RLX_CUDA_TF32``, where set, wins).
    """
    cfg = config if isinstance(config, Config) else load_config(config)
    return Device(open_session(resolve(spec, cfg), cfg.tf32), cfg, RunOptions.build(cfg, **options))
