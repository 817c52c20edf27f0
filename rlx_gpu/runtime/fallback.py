"""Host fallback while the arena lives on a device (DESIGN.md principle 15, ggml's scheduler splits).

Consecutive thunks placed on the host form one :class:`HostRun`: the bytes the run needs from the
device are copied into a host image of the arena once, before its first thunk, and every byte it
writes is copied back once, after its last, instead of each thunk copying its own footprint both ways.
Top-level thunks and the body thunks of a scan the device drives are grouped by the same rule.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from host_fallback.abi import footprint

from ..backends.allocation import allocating
from ..backends.base import Session
from ..backends.options import RunOptions
from ..schedule.model import Thunk
from .placement import Assignment

Ranges = tuple[tuple[int, int], ...]  # (offset, nbytes), sorted, disjoint and not touching


def merged(ranges: Iterable[tuple[int, int]]) -> Ranges:
    """``ranges`` as the fewest sorted ``(offset, nbytes)`` that cover the same bytes."""
    out: list[list[int]] = []
    for offset, nbytes in sorted(r for r in ranges if r[1] > 0):
        if out and offset <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], offset + nbytes - out[-1][0])
        else:
            out.append([offset, nbytes])
    return tuple((o, n) for o, n in out)


def without(ranges: Ranges, taken: Ranges) -> Ranges:
    """The bytes of ``ranges`` outside ``taken`` (both merged)."""
    out = []
    for offset, nbytes in ranges:
        start, end = offset, offset + nbytes
        for t_off, t_n in taken:
            if t_off + t_n <= start or t_off >= end:
                continue
            if t_off > start:
                out.append((start, t_off - start))
            start = max(start, t_off + t_n)
        if start < end:
            out.append((start, end - start))
    return tuple(out)


class HostRun:
    """Consecutive thunks placed on the host while their arena is on a device.

    ``inbound`` is what the run needs from the device: every byte some thunk reads before an earlier
    thunk of the run writes it. ``outbound`` is every byte the run writes. :meth:`steps` gives one
    runner per thunk: the first copies ``inbound`` in, the last copies ``outbound`` back, and each runs
    its host kernel on the image in between.
    """

    def __init__(self, session: Session, host: Session, thunks: Sequence[Thunk], options: RunOptions):
        self.session = session
        self.kernels = tuple(host.runner(t, options) for t in thunks)
        written: Ranges = ()
        inbound: list[tuple[int, int]] = []
        for thunk in thunks:
            reads, writes = footprint(thunk)
            inbound += without(merged((r.offset, r.nbytes) for r in reads), written)
            written = merged([*written, *((w.offset, w.nbytes) for w in writes)])
        self.inbound, self.outbound = merged(inbound), written

    def steps(self) -> list[Callable[..., int]]:
        """One runner per thunk, in order: ``step(arena, image=None)`` returns the bytes it copied
        (``image``: the host image of ``arena``; None, the arena's own, made on first use)."""
        return [partial(self._step, index) for index in range(len(self.kernels))]

    def _step(self, index: int, arena: Any, image: np.ndarray | None = None) -> int:
        first, last = index == 0, index == len(self.kernels) - 1
        if image is None:
            if arena.image is None:
                with allocating("the host image of the arena", "the host", arena.nbytes):
                    arena.image = np.zeros(arena.nbytes, np.uint8)
            image = arena.image
        copied = 0
        if first:
            for offset, nbytes in self.inbound:
                image[offset: offset + nbytes] = self.session.read(arena, offset, nbytes)
                copied += nbytes
        self.kernels[index](image)
        if last:
            for offset, nbytes in self.outbound:
                self.session.write(arena, offset, image[offset: offset + nbytes])
                copied += nbytes
        return copied


def host_runs(assignments: Iterable[Assignment], device: str) -> list[list[Assignment]]:
    """The assignments placed on the host (not on ``device``), as runs of consecutive thunks of one
    schedule level: placement lists a level's thunks in order, a device scan's body thunks right after it,
    so consecutive host assignments with the same parent path are consecutive thunks of one schedule."""
    runs: list[list[Assignment]] = []
    previous: Assignment | None = None
    for a in assignments:
        if a.backend != device:
            if previous is not None and previous.backend != device and _follows(previous, a):
                runs[-1].append(a)
            else:
                runs.append([a])
        previous = a
    return runs


def _follows(before: Assignment, after: Assignment) -> bool:
    """Whether ``after`` is the thunk right after ``before`` in the same schedule (top level or one body)."""
    def level(a: Assignment) -> tuple[tuple[str, ...], str]:
        return a.path[:-1], a.path[-1].removesuffix(f"thunk {a.index}")  # the body's name is the label's head
    return after.index == before.index + 1 and level(after) == level(before)
