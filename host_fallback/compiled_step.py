"""The compiled step paths of ``selective_scan``, ``mamba2``, ``gated_delta_net`` and ``mamba3`` (``jit``): where
they apply, and their kernel's arguments bound from an arena.

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
    return all(r.dtype in ("f32", "i32") for r in by_field.values()) and apart(by_field)


def apart(by_field: Mapping[str, Region]) -> bool:
    """No output range overlapping another tensor's (also ``selective_scan_backward``'s compiled reverse's rule)."""
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
        # the fields a call may give arrays for (``run``'s ``given``): (offset, nbytes, shape, writes, argument index)
        self.slots: tuple[tuple[int, int, tuple[int, ...], bool, int], ...] = ()

    @classmethod
    def of(cls, t: Thunk, by_field: Mapping[str, Region], name: str, arguments: Arguments) -> "CompiledStep | None":
        """The thunk's compiled step, ``None`` where its dtypes or tensors' placement rule it out."""
        return cls(t, by_field, name, arguments) if _applies(by_field) else None

    def run(self, arena: np.ndarray, given: Mapping[int, np.ndarray] | None = None) -> bool:
        """Run on ``arena``; with ``given`` (a field's arena offset -> an array to read or write in place of
        its arena view), on those arrays where they fit (``substituted``), else nothing runs (False)."""
        kernel = self.kernel
        if kernel is None:
            return False
        last = self.last
        if last is None or last[0] is not arena:
            bound = Bound(self.t, arena, self.by_field)
            args = self.arguments(bound)
            usable = all(a.flags.aligned and a.flags.writeable for a in args if isinstance(a, np.ndarray))
            last = self.last = (arena, args if usable else None)
            self.slots = tuple((r.offset, r.nbytes, r.shape, r.writes, i) for f, r in self.by_field.items()
                               if f in bound._views for i, a in enumerate(args) if a is bound._views[f])
        args = last[1]
        if args is None:
            return False
        if given:
            args = self.substituted(args, given)
            if args is None:
                return False
        kernel(*args)
        return True

    def substituted(self, args: tuple, given: Mapping[int, np.ndarray]) -> tuple | None:
        """``args`` with each given field's array in place of its arena view where they fit (``fitting``); None
        where one does not."""
        fitted = fitting(given, {offset: (nbytes, shape, writes) for offset, nbytes, shape, writes, _ in self.slots})
        if fitted is None:
            return None
        args = list(args)
        for offset, _, _, _, i in self.slots:
            if offset in fitted:
                args[i] = fitted[offset]
        return tuple(args)


def fitting(given: Mapping[int, np.ndarray], places: Mapping[int, tuple[int, tuple[int, ...], bool]]
            ) -> dict[int, np.ndarray] | None:
    """The arrays of ``given`` (a field's arena offset -> an array a compiled kernel is to take in place of that
    field's arena view), each in its field's shape, where every one fits its place (``places``: offset -> the
    field's bytes, shape and whether the kernel writes it): f32, C-contiguous, aligned, writable, of the field's
    bytes, and none written sharing memory with another given array (ABI.md: no output overlaps an input); None
    where one does not, or is given for no place."""
    fitted, written = {}, []
    for offset, a in given.items():
        place = places.get(offset)
        flags = a.flags
        if place is None or not (a.dtype == _F32 and a.nbytes == place[0] and flags.c_contiguous and flags.aligned
                                 and flags.writeable):
            return None
        fitted[offset] = a if a.shape == place[1] else a.reshape(place[1])
        if place[2]:
            written.append(a)
    for w in written:
        if any(a is not w and np.may_share_memory(w, a) for a in given.values()):
            return None
    return fitted


def view(bound: Bound, field: str, rank: int, present: bool) -> np.ndarray:
    """``field``'s arena view where the thunk has it, else the empty array of ``rank``."""
    return bound.view(field) if present else NONE[rank]


def rows(t: Thunk, bound: Bound) -> tuple[np.ndarray, np.ndarray]:
    """``(cu_seqlens, state_slots)`` as the kernels take them: the arena's int32 views, empty where absent."""
    return (bound.view("cu_seqlens") if t["cu_seqlens"] is not None else NO_INDEX,
            bound.view("state_slots") if t["carry_state"] and t["state_slots"] is not None else NO_INDEX)
