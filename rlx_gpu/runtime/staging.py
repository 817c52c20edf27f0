"""A device call plan's host buffers for its inputs (``call_plan.CallPlan`` on a device whose arena is not
host memory): neighbouring inputs share one buffer, so the inputs a call writes cross in one copy per
cluster rather than one per input (each copy a command of its own, about 15 µs on PoCL)."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from host_fallback.abi import Region
from host_fallback.arena import view

from ..schedule.model import Schedule, TensorView
from .arena import Arena


#: Bytes between two inputs that one host-to-device copy carries along rather than being split in two
#: (a copy is a command of about 15 µs on PoCL, in which time some 100 KB more cross).
BRIDGE = 64 << 10


class Staging:
    """A device plan's host buffers for its inputs. Inputs in offset order, less than ``BRIDGE`` bytes
    apart with nothing a thunk writes between them, form a cluster sharing one buffer: their bytes and
    the bytes between them (pristine: zeros and init), so the buffer holds what the device holds. The
    inputs a call writes then go as one copy per cluster, from the first written to the last."""

    def __init__(self, schedule: Schedule, inputs: Sequence[str], written: Sequence[Region]):
        views = sorted(((schedule.tensors[name], name) for name in inputs), key=lambda vn: vn[0].offset)
        spans: list[list[int]] = []  # [start, end] per cluster
        self.cluster: dict[str, int] = {}
        for v, name in views:
            end = spans[-1][1] if spans else 0
            if spans and (v.offset <= end or v.offset - end <= BRIDGE and not any(
                    w.offset < v.offset and end < w.offset + w.nbytes for w in written)):  # a thunk writes between
                spans[-1][1] = max(end, v.offset + v.nbytes)
            else:
                spans.append([v.offset, v.offset + v.nbytes])
            self.cluster[name] = len(spans) - 1
        pristine = schedule.pristine_arena()
        self.buffers = tuple((start, pristine[start: end].copy()) for start, end in spans)

    def array(self, name: str, v: TensorView) -> np.ndarray:
        """Where input ``name`` is staged: its place in its cluster's buffer, in its storage dtype."""
        start, buffer = self.buffers[self.cluster[name]]
        return view(buffer, v.offset - start, v.dtype, v.shape)

    def stage(self, arena: Arena, written: Sequence[Any]) -> None:
        """Stage the inputs ``written`` (a call plan's slots: ``offset``, ``raw`` bytes, ``cluster``) into
        ``arena``: per cluster, the bytes from the first to the last."""
        runs: dict[int, tuple[int, int]] = {}
        for slot in written:
            lo, hi = slot.offset, slot.offset + slot.raw.size
            run = runs.get(slot.cluster)
            runs[slot.cluster] = (lo, hi) if run is None else (min(run[0], lo), max(run[1], hi))
        for k, (lo, hi) in runs.items():
            start, buffer = self.buffers[k]
            arena.stage(lo, buffer[lo - start: hi - start],
                        changed=[(s.offset, s.raw.size) for s in written if s.cluster == k])

    def held(self, offset: int, nbytes: int) -> np.ndarray | None:
        """The ``nbytes`` at ``offset`` when they lie in one buffer (as the device holds them: an input
        some thunk writes is written again on every call), else None."""
        for start, buffer in self.buffers:
            if start <= offset and offset + nbytes <= start + buffer.size:
                return buffer[offset - start: offset - start + nbytes]
        return None
