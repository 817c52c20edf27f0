"""The run-time data of ABI.md §8 inside a scan body: checked by the scan driver, on every device.

A version-2 thunk in a body reads its integer tensors (``seq_lens``, ``cu_seqlens``, ``state_slots``)
from the body arena, and where their bytes come from decides when they are checked:

- *given*: bytes no body thunk writes and the driver fills only from the body's ``init``, a broadcast
  input or a row of an ``xs`` input. Every step's values are known before the scan starts, so they
  are all checked then: a refused scan has written nothing, its outputs and the caller's arena are
  unchanged.
- *computed*: bytes a body thunk writes, or a carry slot the driver fills with a carry (or dcarry).
  They are read from the body arena just before their thunk, at every step, as top-level data an
  earlier thunk writes is: nothing of that body thunk runs, while the steps before it have run.

Reads go through the driver's ``Memory.read``, so the host and the device backends share this check.
"""
from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from .abi import Region, regions, runtime_data


@dataclass(frozen=True)
class Feed:
    """A copy the driver makes from the outer arena into a body arena: ``nbytes`` from
    ``outer_off + step·stride`` to ``body_off`` (``stride`` 0: the same bytes at every step)."""

    body_off: int
    outer_off: int
    nbytes: int
    stride: int


def _overlaps(lo: int, n: int, other_lo: int, other_n: int) -> bool:
    return lo < other_lo + other_n and other_lo < lo + n


class BodyData:
    """The integer tensors of one body's thunks, sorted into given and computed (see the module).

    ``field`` is the scan's field holding the body (``body``, ``body_vjp``, ``forward_body``);
    ``feeds`` the driver's copies into it from the outer arena; ``slots`` the ``(offset, nbytes)``
    ranges it fills with carries.
    """

    def __init__(self, field: str, body: Mapping[str, Any], feeds: Sequence[Feed],
                 slots: Sequence[tuple[int, int]]):
        self.field, self.body, self.feeds = field, body, tuple(feeds)
        thunks = body["thunks"]
        ints = [(index, r) for index, thunk in enumerate(thunks) for r in runtime_data.int_regions(thunk)]
        written = list(slots) + [(r.offset, r.nbytes) for t in thunks for r in regions(t) if r.writes] if ints else []
        self.given: list[tuple[int, Region]] = []
        self.computed: dict[int, list[Region]] = {}
        for index, r in ints:
            if any(_overlaps(r.offset, r.nbytes, lo, n) for lo, n in written):
                self.computed.setdefault(index, []).append(r)
            else:
                self.given.append((index, r))

    def where(self, index: int, step: int | None = None) -> str:
        """The body thunk ``index`` as a ``DataError`` names it from the scan down."""
        thunk = self.body["thunks"][index]
        return f"field {self.field!r} → thunk {index} ({thunk['op']}){'' if step is None else f' at step {step}'}, "

    def check_given(self, mem: Any, outer: Any, length: int) -> None:
        """Check the given tensors of every step (before the scan writes anything)."""
        for index, r in self.given:
            thunk = self.body["thunks"][index]
            for step, values in self._given_values(mem, outer, r, length):
                try:
                    runtime_data.check(thunk, lambda _: values.view("<i4"), (r.field,))
                except runtime_data.DataError as err:
                    raise err.within(self.where(index, step)) from None

    def _given_values(self, mem: Any, outer: Any, r: Region, length: int) -> Iterator[tuple[int | None, np.ndarray]]:
        """``(step, bytes)`` of region ``r`` before each step; one ``(None, bytes)`` when no step changes them."""
        base = np.zeros(r.nbytes, np.uint8)
        for entry in self.body.get("init") or ():
            data = np.frombuffer(base64.b64decode(entry["b64"]), np.uint8)
            lo, hi = max(r.offset, entry["offset"]), min(r.offset + r.nbytes, entry["offset"] + data.size)
            if lo < hi:
                base[lo - r.offset: hi - r.offset] = data[lo - entry["offset"]: hi - entry["offset"]]
        rows = []
        for f in self.feeds:  # in the driver's order: broadcast inputs, then xs rows
            lo, hi = max(r.offset, f.body_off), min(r.offset + r.nbytes, f.body_off + f.nbytes)
            if lo >= hi:
                continue
            src = f.outer_off + lo - f.body_off
            if f.stride == 0:
                base[lo - r.offset: hi - r.offset] = mem.read(outer, src, hi - lo)
            else:  # every step's row of the overlap in one read
                rows.append((lo - r.offset, hi - lo, f.stride, mem.read(outer, src, (length - 1) * f.stride + hi - lo)))
        if not rows:
            yield None, base
            return
        for step in range(length):
            values = base.copy()
            for at, n, stride, span in rows:
                values[at: at + n] = span[step * stride: step * stride + n]
            yield step, values

    def before(self, mem: Any, arena: Any, step: int) -> "BeforeThunk":
        """The hook the driver's ``Memory.run`` calls before each body thunk of one step."""
        return BeforeThunk(self, mem, arena, step)


class BeforeThunk:
    """Called with a body thunk's index before it runs: checks its computed tensors in the body arena.

    ``reads`` is false when the body has none, so a memory may run the body without calling it
    (a replayed CUDA graph, whose body holds no nested scan); ``at`` is the thunk last announced.
    """

    def __init__(self, data: BodyData, mem: Any, arena: Any, step: int):
        self.data, self.mem, self.arena, self.step = data, mem, arena, step
        self.reads = bool(data.computed)
        self.at = 0

    def __call__(self, index: int) -> None:
        self.at = index
        computed = self.data.computed.get(index)
        if computed:
            read = lambda r: self.mem.read(self.arena, r.offset, r.nbytes).view("<i4")  # noqa: E731
            runtime_data.check(self.data.body["thunks"][index], read, tuple(r.field for r in computed))

    def run(self) -> None:
        """Run the body through the memory; a refusal (this hook's or a nested scan's) names the body thunk."""
        try:
            self.mem.run(self.data.body, self.arena, self)
        except runtime_data.DataError as err:
            raise err.within(self.data.where(self.at, self.step)) from None
