"""The dialect-free description of a kernel launch: program, kernel, geometry and arguments."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

Thunk = Mapping[str, Any]


@dataclass(frozen=True)
class Buf:
    """A device buffer argument resolved by the backend: the arena, or the launch's scratch."""

    name: str


ARENA = Buf("arena")
SCRATCH = Buf("scratch")


@dataclass(frozen=True)
class Launch:
    """One kernel launch. ``global_size`` counts work-items (a multiple of ``local_size``)."""

    family: str
    kernel: str
    dtype: str
    global_size: tuple[int, ...]
    local_size: tuple[int, ...]
    args: tuple[Any, ...]
    src_dtype: str | None = None  # only for cast: the program variant with the cast kernel
    defines: tuple[tuple[str, int], ...] = ()  # compile-time constants of this launch's program variant

    @property
    def empty(self) -> bool:
        return any(g == 0 for g in self.global_size)


@dataclass(frozen=True)
class Plan:
    """Every launch of one thunk, in order, and the scratch bytes they share."""

    launches: tuple[Launch, ...]
    scratch_bytes: int = 0
    notes: tuple[str, ...] = field(default=())


def ceil_to(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def grid(sizes: tuple[int, ...], local: tuple[int, ...]) -> tuple[int, ...]:
    """Round each global extent up to its local size (kernels bound-check the tail)."""
    return tuple(ceil_to(s, l) for s, l in zip(sizes, local))


def linear_local(n: int, cap: int = 64) -> int:
    """A 1-D local size: a power of two up to ``cap``, no larger than needed."""
    size = 1
    while size < min(n, cap):
        size *= 2
    return size


def i64(v: int) -> np.int64:
    return np.int64(v)


def i32(v: int | bool) -> np.int32:
    return np.int32(int(v))


def real(dtype: str, v: float) -> np.floating:
    """A scalar of the compute type of ``dtype`` (f64 for f64, else f32)."""
    return np.float64(v) if dtype == "f64" else np.float32(v)


def elem_size(dtype: str) -> int:
    return {"f32": 4, "f16": 2, "bf16": 2, "f64": 8}[dtype]


def real_size(dtype: str) -> int:
    return 8 if dtype == "f64" else 4
