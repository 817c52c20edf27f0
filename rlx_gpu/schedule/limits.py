"""The one table of size limits a schedule must respect (ABI.md §1: "sizes are exact").

Every size, count and footprint is an exact Python integer and is compared with these limits before
anything is allocated, launched, or built in proportion to a value. A device may report a smaller
arena (its largest allocation); that check belongs to the device session.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limit:
    """One limit: ``value`` is the largest accepted, ``what`` says what it bounds."""

    name: str
    value: int
    what: str


TABLE: tuple[Limit, ...] = (
    Limit("arena_bytes", 2**48, "bytes of one arena (outer or body); every offset and footprint ends inside it"),
    Limit("dimension", 2**48, "any dimension, element count, stride, length or byte count of a field"),
    Limit("num_layers", 2**12, "layers of one lstm/gru/rnn thunk"),
    Limit("rank", 6, "dimensions of a binary op's shape and strides"),
    Limit("view_rank", 64, "dimensions of a named tensor view"),
    Limit("nesting_depth", 32, "scan bodies nested inside one another"),
    Limit("thunks", 2**16, "thunks of a schedule, every nested body counted each time it appears"),
    Limit("scan_steps", 2**24, "body executions a schedule's scans declare (length x nested steps, summed)"),
)

LIMITS: dict[str, int] = {limit.name: limit.value for limit in TABLE}

MAX_ARENA_BYTES = LIMITS["arena_bytes"]
MAX_DIM = LIMITS["dimension"]
MAX_NUM_LAYERS = LIMITS["num_layers"]
MAX_RANK = LIMITS["rank"]
MAX_VIEW_RANK = LIMITS["view_rank"]
MAX_NESTING_DEPTH = LIMITS["nesting_depth"]
MAX_THUNKS = LIMITS["thunks"]
MAX_SCAN_STEPS = LIMITS["scan_steps"]

__all__ = ["Limit", "TABLE", "LIMITS", "MAX_ARENA_BYTES", "MAX_DIM", "MAX_NUM_LAYERS", "MAX_RANK", "MAX_VIEW_RANK",
           "MAX_NESTING_DEPTH", "MAX_THUNKS", "MAX_SCAN_STEPS"]
