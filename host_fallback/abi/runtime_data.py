"""The run-time data check of ABI.md §8's integer tensors: each op's ``data_rules`` applied before a thunk runs.

``seq_lens``, ``cu_seqlens`` and ``state_slots`` are data in the arena, so validation cannot see
them; a runtime reads them (one small read) and calls ``check`` before launching the thunk. Kernels
trust them afterwards: every index they derive from them is then inside the footprint. A value a rule
forbids raises ``DataError``.
"""
from __future__ import annotations

from typing import Any, Callable, Collection, Mapping

import numpy as np

from . import ops  # a module, not its OPS: ``ops`` imports this package's modules (this one too) to find the ops
from .int_tensors import INT_FIELDS
from .model import DataError, Region


def int_regions(thunk: Mapping[str, Any]) -> list[Region]:
    """The integer tensors ``thunk`` reads (none for a thunk without them)."""
    op = ops.OPS[thunk["op"]]
    if not op.data_rules:
        return []
    t = op.complete(thunk)
    if all(t.get(f) is None for f in op.data_rules):
        return []
    return [r for r in op.layout(t) if r.dtype == "i32"]


def check(thunk: Mapping[str, Any], read: Callable[[Region], np.ndarray],
          fields: Collection[str] = INT_FIELDS) -> None:
    """Raise ``DataError`` for the first value of an integer tensor of ``thunk`` outside ABI.md §8's rules.

    ``read(region)`` returns the region's values (any integer array of its shape); only the tensors
    named in ``fields`` are read (each rule concerns one tensor alone).
    """
    checker(thunk, fields)(read)


def checker(thunk: Mapping[str, Any], fields: Collection[str] = INT_FIELDS
            ) -> Callable[[Callable[[Region], np.ndarray]], None]:
    """``check`` of ``thunk`` worked out once (the thunk completed, its integer regions laid out, each one's rule
    found): ``run(read)`` reads and checks the values, for a runtime that checks the same thunk call after call."""
    op = ops.OPS[thunk["op"]]
    t = op.complete(thunk)
    by_field = {r.field: r for r in int_regions(t) if r.field in fields}
    checked = [(by_field[f], rule) for f, rule in op.data_rules.items() if f in by_field]

    def run(read: Callable[[Region], np.ndarray]) -> None:
        for region, rule in checked:
            rule(np.asarray(read(region)).astype(np.int64).reshape(-1), t)
    return run


__all__ = ["DataError", "check", "checker", "int_regions"]
