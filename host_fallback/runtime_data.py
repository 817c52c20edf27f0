"""The run-time rules of ABI.md §8's integer tensors, checked before a thunk runs.

``seq_lens``, ``cu_seqlens`` and ``state_slots`` are data in the arena, so validation cannot see
them; a runtime reads them (one small read) and calls ``check`` before launching the thunk. Kernels
trust them afterwards: every index they derive from them is then inside the footprint.
"""
from __future__ import annotations

from typing import Any, Callable, Collection, Mapping

import numpy as np

from .fields import INT_FIELDS, complete
from .gradients import FORWARD_OPS, forward_op
from .layout import Region, regions


class DataError(ValueError):
    """An integer tensor holds a value outside its rule: ``field``, ``index`` and ``value`` say where.

    ``where`` names the body thunk holding the field when the thunk that ran is a scan (ABI.md §6),
    from that scan down: ``field 'body' → thunk 0 (selective_scan) at step 3, `` (empty at top level).
    """

    def __init__(self, field: str, index: int, value: int, rule: str, where: str = ""):
        super().__init__(f"{where}field {field!r}[{index}] = {value}: {rule}")
        self.field, self.index, self.value, self.rule, self.where = field, index, value, rule, where

    def within(self, where: str) -> "DataError":
        """The same error one scan level up: ``where`` names the body thunk of that scan it came from."""
        return DataError(self.field, self.index, self.value, self.rule, where + self.where)


def int_regions(thunk: Mapping[str, Any]) -> list[Region]:
    """The integer tensors ``thunk`` reads (none for a thunk without them)."""
    if forward_op(thunk["op"]) not in FORWARD_OPS:
        return []
    t = complete(thunk)
    if all(t.get(f) is None for f in INT_FIELDS):
        return []
    return [r for r in regions(t) if r.dtype == "i32"]


def check(thunk: Mapping[str, Any], read: Callable[[Region], np.ndarray],
          fields: Collection[str] = INT_FIELDS) -> None:
    """Raise ``DataError`` for the first value of an integer tensor of ``thunk`` outside ABI.md §8's rules.

    ``read(region)`` returns the region's values (any integer array of its shape); only the tensors
    named in ``fields`` are read (each rule concerns one tensor alone).
    """
    t = complete(thunk)
    values = {r.field: np.asarray(read(r)).astype(np.int64).reshape(-1) for r in int_regions(t) if r.field in fields}
    if "seq_lens" in values:
        _seq_lens(values["seq_lens"], t["seq"])
    if "cu_seqlens" in values:
        _cu_seqlens(values["cu_seqlens"], t["seq"])
    if "state_slots" in values:
        _state_slots(values["state_slots"], t["num_slots"])


def _first(bad: np.ndarray) -> int | None:
    hits = np.flatnonzero(bad)
    return int(hits[0]) if hits.size else None


def _seq_lens(lens: np.ndarray, seq: int) -> None:
    i = _first((lens < 0) | (lens > seq))
    if i is not None:
        raise DataError("seq_lens", i, int(lens[i]), f"a length must be in [0, seq = {seq}]")


def _cu_seqlens(cu: np.ndarray, seq: int) -> None:
    if cu[0] != 0:
        raise DataError("cu_seqlens", 0, int(cu[0]), "the first offset must be 0")
    i = _first(cu[1:] < cu[:-1])
    if i is not None:
        raise DataError("cu_seqlens", i + 1, int(cu[i + 1]), f"offsets must not decrease (cu_seqlens[{i}] = "
                                                             f"{int(cu[i])})")
    last = cu.size - 1
    if cu[last] != seq:
        raise DataError("cu_seqlens", last, int(cu[last]), f"the last offset must equal seq = {seq}")


def _state_slots(slots: np.ndarray, num_slots: int) -> None:
    i = _first((slots < 0) | (slots >= num_slots))
    if i is not None:
        raise DataError("state_slots", i, int(slots[i]), f"a slot must be in [0, num_slots = {num_slots})")
    order = np.argsort(slots, kind="stable")
    twice = _first(slots[order][1:] == slots[order][:-1])
    if twice is not None:
        i, first = int(order[twice + 1]), int(order[twice])
        raise DataError("state_slots", i, int(slots[i]), f"slot already used by row {first}; a thunk uses each "
                                                         "slot once")
