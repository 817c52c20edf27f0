"""The arena layout: liveness-based, one aligned byte offset per buffer, reusing the space of dead ones.

A buffer is live from the first step that touches it to the last one. Inputs and weights are live
for the whole program (a scan writes a body's broadcast inputs and constants once, before its first
step), outputs from their first step until after the last, so the caller can read them back.
Two buffers live at the same step never share a byte, which also keeps a thunk's outputs apart
from its inputs (both are live at that step).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Iterable, Mapping, Sequence

from ..units import human_bytes

#: Every offset is a multiple of this: enough for any element type and for device alignment rules.
ALIGN = 256


def aligned(nbytes: int) -> int:
    """Round ``nbytes`` up to the next multiple of ``ALIGN`` (at least one unit, so no two buffers share)."""
    return max(ALIGN, -(-nbytes // ALIGN) * ALIGN)


@dataclass(frozen=True)
class LayoutReport:
    """What the layout achieved: the arena against the sum of the (aligned) buffer sizes."""

    arena_bytes: int
    tensor_bytes: int
    buffers: int

    @property
    def ratio(self) -> float:
        """Arena size over the sum of buffer sizes; below 1 means space was reused."""
        return self.arena_bytes / self.tensor_bytes if self.tensor_bytes else 1.0

    def __str__(self) -> str:
        return (f"arena {human_bytes(self.arena_bytes)} for {human_bytes(self.tensor_bytes)} of tensors "
                f"in {self.buffers} buffers ({self.ratio:.0%})")


@dataclass(frozen=True)
class ArenaLayout:
    """Byte offset of every buffer key, and the arena size that holds them."""

    offsets: Mapping[Hashable, int]
    report: LayoutReport

    @property
    def arena_bytes(self) -> int:
        return self.report.arena_bytes


def _best_fit_gap(active: list[tuple[int, int]], size: int) -> int:
    """Offset of the smallest gap between the live ``(offset, size)`` blocks that fits ``size``, else the top."""
    best, best_room, cursor = None, None, 0
    for offset, length in sorted(active):
        room = offset - cursor
        if room >= size and (best_room is None or room < best_room):
            best, best_room = cursor, room
        cursor = max(cursor, offset + length)
    return cursor if best is None else best


def arena_layout(sizes: Mapping[Hashable, int], steps: Sequence[Iterable[Hashable]],
         live_in: Iterable[Hashable] = (), live_out: Iterable[Hashable] = ()) -> ArenaLayout:
    """Assign offsets to the buffers in ``sizes``.

    ``steps[i]`` lists the buffers step ``i`` touches; ``live_in`` buffers are live throughout,
    ``live_out`` ones until after the last step. A buffer that no step touches and that is
    in neither set is still given space (it is live at its own point only).
    """
    first: dict[Hashable, int] = {}
    last: dict[Hashable, int] = {}
    for i, touched in enumerate(steps):
        for key in touched:
            first.setdefault(key, i)
            last[key] = i
    for key in live_in:
        first[key], last[key] = -1, len(steps)
    for key in live_out:
        first.setdefault(key, len(steps))
        last[key] = len(steps)
    for key in sizes:
        first.setdefault(key, len(steps))
        last.setdefault(key, len(steps))
    born: dict[int, list[Hashable]] = {}
    for key, step in first.items():
        born.setdefault(step, []).append(key)
    offsets: dict[Hashable, int] = {}
    active: dict[Hashable, tuple[int, int]] = {}
    top = 0
    for step in sorted(born):
        for key in [k for k in active if last[k] < step]:
            del active[key]
        # Largest first keeps big buffers low and lets small ones fill the gaps they leave.
        for key in sorted(born[step], key=lambda k: -sizes[k]):
            size = aligned(sizes[key])
            offset = _best_fit_gap(list(active.values()), size)
            offsets[key] = offset
            active[key] = (offset, size)
            top = max(top, offset + size)
    total = sum(aligned(n) for n in sizes.values())
    return ArenaLayout(offsets, LayoutReport(max(top, ALIGN), total, len(sizes)))
