"""The run-time rules of ABI.md §8's integer tensors (``seq_lens``, ``cu_seqlens``, ``state_slots``).

They are data in the arena, so validation cannot see them; a runtime reads them and applies these
rules (``abi.runtime_data.check``) before the thunk runs. Each rule gets the tensor's values (int64)
and the completed thunk, and raises ``DataError`` for the first value it forbids.
"""
from __future__ import annotations

import numpy as np

from .model import DataError, Thunk

#: The integer (``i32``) tensor fields of ABI.md §8.
INT_FIELDS = ("seq_lens", "cu_seqlens", "state_slots")


def _first(bad: np.ndarray) -> int | None:
    hits = np.flatnonzero(bad)
    return int(hits[0]) if hits.size else None


def seq_lens(lens: np.ndarray, t: Thunk) -> None:
    seq = t["seq"]
    i = _first((lens < 0) | (lens > seq))
    if i is not None:
        raise DataError("seq_lens", i, int(lens[i]), f"a length must be in [0, seq = {seq}]")


def cu_seqlens(cu: np.ndarray, t: Thunk) -> None:
    seq = t["seq"]
    if cu[0] != 0:
        raise DataError("cu_seqlens", 0, int(cu[0]), "the first offset must be 0")
    i = _first(cu[1:] < cu[:-1])
    if i is not None:
        raise DataError("cu_seqlens", i + 1, int(cu[i + 1]), f"offsets must not decrease (cu_seqlens[{i}] = "
                                                             f"{int(cu[i])})")
    last = cu.size - 1
    if cu[last] != seq:
        raise DataError("cu_seqlens", last, int(cu[last]), f"the last offset must equal seq = {seq}")


def state_slots(slots: np.ndarray, t: Thunk) -> None:
    num_slots = t["num_slots"]
    i = _first((slots < 0) | (slots >= num_slots))
    if i is not None:
        raise DataError("state_slots", i, int(slots[i]), f"a slot must be in [0, num_slots = {num_slots})")
    order = np.argsort(slots, kind="stable")
    twice = _first(slots[order][1:] == slots[order][:-1])
    if twice is not None:
        i, first = int(order[twice + 1]), int(order[twice])
        raise DataError("state_slots", i, int(slots[i]), f"slot already used by row {first}; a thunk uses each "
                                                         "slot once")
