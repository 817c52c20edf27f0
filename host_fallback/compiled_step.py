"""The compiled step paths of ``selective_scan``, ``mamba2`` and ``gated_delta_net`` (``jit``): where they
apply, and their kernel's arguments bound from an arena.

A compiled step runs a thunk's whole step path in one Numba call (``jit_ssm_steps``: every row, channel or
head and token, the version-2 fields, the carried state updated where it lies), where NumPy's step path
makes a dozen array passes a token and the Python around them (B1 decode: 45-75 µs against 5-15). It
applies to a thunk whose every tensor is stored in f32 (the integer runtime data aside) and whose outputs
(``dst``, ``state``) overlap no other tensor; the caller asks only when the step path runs on one thread.
Everything else, and every thunk where Numba is missing or ``RLX_HOST_JIT=0``, takes NumPy's paths.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from . import jit
from .abi import Region
from .bound import Bound

Thunk = Mapping[str, Any]
#: The kernel's arguments from the thunk's arena views.
Arguments = Callable[[Bound], tuple]

_F32 = np.dtype(np.float32)
#: An optional tensor the thunk does not have, or the empty pool, slots or ``cu_seqlens`` (by rank, as the
#: kernels take them).
NONE = {rank: np.empty((0,) * rank, _F32) for rank in (1, 2, 3, 4)}
NO_INDEX = np.empty(0, np.int32)


def _applies(by_field: Mapping[str, Region]) -> bool:
    """Every float tensor stored in f32, and no output range overlapping another tensor's."""
    if any(r.dtype not in ("f32", "i32") for r in by_field.values()):
        return False
    outputs = [r for r in by_field.values() if r.writes]
    return not any(o is not r and o.nbytes and r.nbytes and o.offset < r.offset + r.nbytes
                   and r.offset < o.offset + o.nbytes for o in outputs for r in by_field.values())


class CompiledStep:
    """The compiled kernel ``name`` of one thunk, its arguments bound once per arena (a decode runs on one
    arena call after call); ``run(arena)`` says whether it ran (False: no Numba, ``RLX_HOST_JIT=0`` when
    the thunk was prepared, or arena views the kernel does not take, read-only or misaligned). The kernel
    is looked up once, as the thunk is prepared (``RLX_HOST_JIT`` read then, not on every step)."""

    def __init__(self, t: Thunk, by_field: Mapping[str, Region], name: str, arguments: Arguments):
        self.t, self.by_field, self.name, self.arguments = t, by_field, name, arguments
        self.kernel = jit.kernel(name)
        self.last: tuple[np.ndarray, tuple | None] | None = None

    @classmethod
    def of(cls, t: Thunk, by_field: Mapping[str, Region], name: str, arguments: Arguments) -> "CompiledStep | None":
        """The thunk's compiled step, ``None`` where its dtypes or tensors' placement rule it out."""
        return cls(t, by_field, name, arguments) if _applies(by_field) else None

    def run(self, arena: np.ndarray) -> bool:
        kernel = self.kernel
        if kernel is None:
            return False
        last = self.last
        if last is None or last[0] is not arena:
            args = self.arguments(Bound(self.t, arena, self.by_field))
            usable = all(a.flags.aligned and a.flags.writeable for a in args if isinstance(a, np.ndarray))
            last = self.last = (arena, args if usable else None)
        if last[1] is None:
            return False
        kernel(*last[1])
        return True


def view(bound: Bound, field: str, rank: int, present: bool) -> np.ndarray:
    """``field``'s arena view where the thunk has it, else the empty array of ``rank``."""
    return bound.view(field) if present else NONE[rank]


def rows(t: Thunk, bound: Bound) -> tuple[np.ndarray, np.ndarray]:
    """``(cu_seqlens, state_slots)`` as the kernels take them: the arena's int32 views, empty where absent."""
    return (bound.view("cu_seqlens") if t["cu_seqlens"] is not None else NO_INDEX,
            bound.view("state_slots") if t["carry_state"] and t["state_slots"] is not None else NO_INDEX)
