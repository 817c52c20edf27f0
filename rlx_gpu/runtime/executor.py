"""Runs a schedule on one device arena, with host fallback copies of exactly each thunk's footprint."""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..backends.base import Session
from ..schedule.io import load_schedule
from ..schedule.model import Schedule
from ..schedule.ops import footprint
from ..units import human_bytes
from .config import Config, load_config
from .placement import Assignment, place
from .registry import open_session, resolve, status


@dataclass(frozen=True)
class ThunkRecord:
    """How one thunk ran: where, for how long, and the bytes its fallback copied."""

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


class Device:
    """An opened device plus the host for fallback; ``run`` is the entry point of ABI.md §7."""

    def __init__(self, session: Session, config: Config):
        self.session = session
        self.config = config
        self.host = session if session.info.backend == "host" else open_session(status("host").devices[0])
        self.launches = 0  # thunks launched on any backend by this Device, for tests and reports
        self.last_report: RunReport | None = None

    @property
    def spec(self) -> str:
        return self.session.info.spec

    def __repr__(self) -> str:
        return f"Device({self.spec!r}, {self.session.info.name!r})"

    def place(self, schedule: Any) -> list[Assignment]:
        """Where every thunk would run and why, without running anything."""
        return place(load_schedule(schedule), self.session, self.config)

    def run(self, schedule: Any, arena: np.ndarray | None = None, *, profile: bool = False) -> np.ndarray:
        """Run ``schedule`` on a copy of ``arena`` (zeros when None) and return the new arena.

        ``profile`` waits for every thunk to finish so each gets its own time in ``last_report``.
        """
        schedule = load_schedule(schedule)
        assignments = place(schedule, self.session, self.config)
        host_arena = self._initial_arena(schedule, arena)
        fallbacks = [a for a in assignments if a.backend != self.session.info.backend]
        if fallbacks and self.config.fallback == "warn":
            listed = ", ".join(f"{a.index} ({a.op} {a.dtype})" for a in fallbacks[:8])
            warnings.warn(f"{len(fallbacks)} thunk(s) fall back to the host from {self.spec}: {listed}"
                          f"{' ...' if len(fallbacks) > 8 else ''}; `rlx-gpu plan` says why", stacklevel=2)
        report = RunReport(self.spec)
        started = time.perf_counter()
        on_host = self.session is self.host
        dev_arena = host_arena if on_host else self.session.alloc(schedule.arena_bytes)
        if not on_host:
            self.session.write(dev_arena, 0, host_arena)
        options = {"recompute": self.config.recompute}
        for thunk, where in zip(schedule.thunks, assignments):
            t0 = time.perf_counter()
            copied = 0
            if where.backend == self.session.info.backend:
                self.session.launch(thunk, dev_arena, **options)
            else:
                copied = self._fallback(thunk, dev_arena, host_arena, options)
            self.launches += 1
            if profile:
                self.session.finish()
            report.records.append(ThunkRecord(thunk.index, thunk.op, thunk.dtype, where.backend,
                                              time.perf_counter() - t0, copied))
        result = host_arena if on_host else self.session.read(dev_arena, 0, schedule.arena_bytes)
        report.seconds = time.perf_counter() - started
        self.last_report = report
        return result

    def _fallback(self, thunk: Any, dev_arena: Any, host_arena: np.ndarray, options: dict) -> int:
        """Copy the read footprint to the host, run there, copy the write footprint back; bytes moved."""
        reads, writes = footprint(thunk)
        for r in reads:
            host_arena[r.offset: r.offset + r.nbytes] = self.session.read(dev_arena, r.offset, r.nbytes)
        self.host.launch(thunk, host_arena, **options)
        for r in writes:
            self.session.write(dev_arena, r.offset, host_arena[r.offset: r.offset + r.nbytes])
        return sum(r.nbytes for r in reads) + sum(r.nbytes for r in writes)

    @staticmethod
    def _initial_arena(schedule: Schedule, arena: np.ndarray | None) -> np.ndarray:
        if arena is None:
            return schedule.pristine_arena()
        if not isinstance(arena, np.ndarray) or arena.dtype != np.uint8 or arena.shape != (schedule.arena_bytes,):
            got = f"{type(arena).__name__} {getattr(arena, 'dtype', '')} {getattr(arena, 'shape', '')}"
            raise ValueError(f"arena must be a numpy uint8 array of arena_bytes = {schedule.arena_bytes} "
                             f"({human_bytes(schedule.arena_bytes)}), got {got}")
        out = arena.copy()
        schedule.apply_init(out)
        return out


def get_device(spec: str | None = None, config: Config | str | None = None) -> Device:
    """Open a device by spec (``None``: ``RLX_DEVICE``, then the config's ``device``)."""
    cfg = config if isinstance(config, Config) else load_config(config)
    return Device(open_session(resolve(spec, cfg)), cfg)
