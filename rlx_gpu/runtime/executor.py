"""Runs a schedule on one device: placement, launch plans and runners prepared once per schedule,
host fallback copies of exactly each thunk's footprint, and the session lock held for a whole run."""
from __future__ import annotations

import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from host_fallback import scan

from ..backends.allocation import allocating
from ..backends.base import Session
from ..backends.core import HostStep
from ..schedule.io import load_schedule
from ..schedule.model import Schedule
from ..schedule.ops import SCAN_OPS
from ..units import human_bytes
from .arena import Arena
from .config import Config, load_config
from .options import RunOptions
from .placement import Assignment, place
from .registry import open_session, resolve, status

#: One prepared top-level thunk: runs on (device arena, host image) and returns the bytes it copied.
Step = Callable[[Any, "np.ndarray | None"], int]


@dataclass(frozen=True)
class ThunkRecord:
    """How one thunk ran: where, for how long, and the bytes its fallback copied (body fallbacks included)."""

    index: int
    op: str
    dtype: str
    backend: str
    seconds: float
    copied_bytes: int


@dataclass
class RunReport:
    """What the last ``Device.run`` did."""

    device: str
    records: list[ThunkRecord] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def fallback_bytes(self) -> int:
        return sum(r.copied_bytes for r in self.records)


@dataclass(frozen=True)
class Prepared:
    """The per-schedule work a run repeats nothing of: placement, plans, runners, the fallback warning."""

    assignments: tuple[Assignment, ...]
    steps: tuple[tuple[Any, str, Step], ...]  # (thunk, backend, step) per top-level thunk
    warning: str | None
    needs_image: bool  # a top-level thunk falls back, so a device run keeps a host image of the arena


class Device:
    """An opened device plus the host for fallback; ``run`` is the entry point of ABI.md §7.

    One ``Device`` may be used from many threads: a device session serialises runs (its lock is held
    for a whole run and every resident-arena operation); the host runs them at once.
    """

    def __init__(self, session: Session, config: Config, options: RunOptions | None = None):
        self.session = session
        self.config = config
        self.options = options if options is not None else RunOptions.build(config)
        self.on_host = session.info.backend == "host"
        self.host = session if self.on_host else open_session(status("host").devices[0])
        self.launches = 0  # thunks launched on any backend by this Device, for tests and reports
        self.last_report: RunReport | None = None
        # id(schedule) -> (a weak reference to it, its Prepared); Schedules are unhashable Mappings
        self._prepared: dict[int, tuple[weakref.ref, Prepared]] = {}

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
        self.prepare(schedule)
        return Arena(self, schedule)

    def prepare(self, schedule: Schedule) -> Prepared:
        """Place, check and plan ``schedule`` once; later runs reuse it."""
        key = id(schedule)
        entry = self._prepared.get(key)
        if entry is not None and entry[0]() is schedule:
            return entry[1]
        with self.session.lock:
            self.session.check_fits(schedule.arena_bytes, "the arena of this schedule (arena_bytes)")
            for thunk in (t for t in schedule.thunks if t.op in SCAN_OPS):
                self.session.check_fits(scan.working_bytes(thunk, self.options.recompute),
                                        f"thunk {thunk.index} ({thunk.op})'s body arenas and recompute cache")
            prepared = self._prepare(schedule)
        self._prepared[key] = (weakref.ref(schedule, lambda _, cache=self._prepared: cache.pop(key, None)), prepared)
        return prepared

    def _prepare(self, schedule: Schedule) -> Prepared:
        assignments = tuple(place(schedule, self.session, self.config))
        on_host = frozenset(id(a.thunk) for a in assignments if a.nested and a.backend == "host")
        steps = []
        for a in (a for a in assignments if not a.nested):
            if a.backend == self.session.info.backend:
                runner = self.session.runner(a.thunk, self.options, on_host)
                steps.append((a.thunk, a.backend, lambda dev, image, run=runner: run(dev)))
            else:
                host_step = HostStep(self.session, a.thunk, self.options)
                steps.append((a.thunk, a.backend, host_step))
        fallbacks = [a for a in assignments if a.backend != self.session.info.backend]
        warning = None
        if fallbacks and self.config.fallback == "warn":
            listed = ", ".join(f"{a.where if a.nested else a.index} ({a.op} {a.dtype})" for a in fallbacks[:8])
            warning = (f"{len(fallbacks)} thunk(s) fall back to the host from {self.spec}: {listed}"
                       f"{' ...' if len(fallbacks) > 8 else ''}; `rlx-gpu plan` says why")
        needs_image = any(a.backend != self.session.info.backend for a in assignments if not a.nested)
        return Prepared(assignments, tuple(steps), warning, needs_image)

    def run(self, schedule: Any, arena: np.ndarray | Arena | None = None, *, profile: bool = False) -> Any:
        """Run ``schedule``.

        With a NumPy ``arena`` (or None: zeros), on a copy of it with ``init`` applied, returning the
        new arena (ABI.md §7). With a resident :class:`Arena` from :meth:`arena`, in place on the
        device, returning it. ``profile`` waits for every thunk to finish so each gets its own time
        in ``last_report``.
        """
        schedule = load_schedule(schedule)
        prepared = self.prepare(schedule)
        if prepared.warning:
            warnings.warn(prepared.warning, stacklevel=2)
        if isinstance(arena, Arena):
            arena.check(self, schedule)
            with self.session.lock:
                arena.flush()
                self._execute(prepared, arena.handle, arena.image() if prepared.needs_image else None, profile)
            return arena
        host_arena = self._initial_arena(schedule, arena)
        if self.on_host:
            self._execute(prepared, host_arena, host_arena, profile)
            return host_arena
        with self.session.lock:
            dev_arena = self.session.alloc(schedule.arena_bytes, "the arena of this schedule")
            try:
                self.session.write(dev_arena, 0, host_arena)
                self._execute(prepared, dev_arena, host_arena, profile)
                return self.session.read(dev_arena, 0, schedule.arena_bytes)
            finally:
                self.session.free(dev_arena)

    def _execute(self, prepared: Prepared, dev_arena: Any, image: np.ndarray | None, profile: bool) -> None:
        report = RunReport(self.spec)
        started = time.perf_counter()
        for thunk, backend, step in prepared.steps:
            t0 = time.perf_counter()
            copied = step(dev_arena, image)
            if profile:
                self.session.finish()
            report.records.append(ThunkRecord(thunk.index, thunk.op, thunk.dtype, backend,
                                              time.perf_counter() - t0, copied))
        self.launches += len(prepared.steps)
        report.seconds = time.perf_counter() - started
        self.last_report = report

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
    ``rnn_kernel``, ``workers`` ...); an unknown one is an error naming the known ones.
    """
    cfg = config if isinstance(config, Config) else load_config(config)
    return Device(open_session(resolve(spec, cfg)), cfg, RunOptions.build(cfg, **options))
