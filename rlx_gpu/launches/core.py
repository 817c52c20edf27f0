"""The dialect-free description of a kernel launch: program, kernel, geometry and arguments."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from host_fallback.arena import COMPUTE

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
    target: str = "cpu"  # the target whose tuning constants the program is built with
    defines: tuple[tuple[str, int], ...] = ()  # this launch's compile-time constants (extra #defines)

    @property
    def empty(self) -> bool:
        return any(g == 0 for g in self.global_size)

    @property
    def groups(self) -> tuple[int, ...]:
        """Work-groups per dimension (CUDA's gridDim)."""
        return tuple(g // l for g, l in zip(self.global_size, self.local_size))


@dataclass(frozen=True)
class LaunchPlan:
    """Every launch of one thunk, in order, and the scratch bytes they share.

    ``staging`` lists (by index) the launches that only stage data for the others, e.g. weights
    transposed into scratch: each reads nothing of the arena outside ``staging_reads`` (``(offset, nbytes)``
    ranges), and writes only scratch bytes that no other launch of the plan writes. Their output may
    therefore be kept between runs on a resident arena, and the launches skipped until a write
    overlaps ``staging_reads`` (``backends.core`` does this).
    """

    launches: tuple[Launch, ...]
    scratch_bytes: int = 0
    notes: tuple[str, ...] = field(default=())
    staging: tuple[int, ...] = ()
    staging_reads: tuple[tuple[int, int], ...] = ()


def ceil_to(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def grid(sizes: tuple[int, ...], local: tuple[int, ...]) -> tuple[int, ...]:
    """Round each global extent up to its local size (kernels bound-check the tail)."""
    return tuple(ceil_to(s, l) for s, l in zip(sizes, local))


def strided_grid(sizes: tuple[int, ...], local: tuple[int, ...], max_grid: tuple[int, ...]) -> tuple[int, ...]:
    """``grid`` with at most ``max_grid`` work-groups per dimension, for kernels that stride over
    the rest of their extents (``for (i = GID(d); i < n; i += GSIZE(d))``)."""
    return tuple(min(ceil_to(s, l), cap * l) for s, l, cap in zip(sizes, local, max_grid))


def linear_local(n: int, cap: int = 64) -> int:
    """A 1-D local size: a power of two up to ``cap``, no larger than needed."""
    size = 1
    while size < min(n, cap):
        size *= 2
    return size


def real_size(dtype: str) -> int:
    """Bytes of one value of the compute type of ``dtype``."""
    return COMPUTE[dtype].itemsize
