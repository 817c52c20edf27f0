"""The device side of every op, registered against its name by the module that plans it.

Each planner module calls ``register(ops, plan, unsupported, v2_fields=..., family=...)`` on import;
``launches`` imports every module of its package, so a new op's planner module is all it takes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from host_fallback.registry import Registry

from .core import LaunchPlan, Thunk
from .limits import DeviceLimits


@dataclass(frozen=True)
class DeviceOp:
    """What the device kernels of one op need: ``plan(thunk, limits, **options)`` gives its launches,
    ``unsupported(thunk, limits)`` the reason a device cannot run a thunk (or ``None``), ``v2_fields`` the
    version-2 fields (ABI.md §8) its kernels implement (a thunk using another runs on the host), ``family``
    the program its launches build (``kernels/<family>.cl``) and ``shared_texts`` the kernel texts of
    ``kernels/`` that program puts before its own (text it shares with other families)."""

    plan: Callable[..., LaunchPlan]
    unsupported: Callable[[Thunk, DeviceLimits], str | None]
    v2_fields: frozenset[str]
    family: str
    shared_texts: tuple[str, ...] = ()


PLANNERS: Registry[DeviceOp] = Registry("launch planner")


def register(ops: str | Iterable[str], plan: Callable[..., LaunchPlan],
             unsupported: Callable[[Thunk, DeviceLimits], str | None], *, family: str,
             v2_fields: frozenset[str] = frozenset(), shared_texts: tuple[str, ...] = ()) -> None:
    """Register ``plan`` and its companions for each op of ``ops`` (the ops of one family name the same
    ``shared_texts``)."""
    other = next((op for op in PLANNERS.values() if op.family == family and op.shared_texts != shared_texts), None)
    if other is not None:
        raise ValueError(f"kernel family {family!r}: {ops} name shared texts {shared_texts}, its other ops "
                         f"{other.shared_texts}")
    PLANNERS.add(ops, DeviceOp(plan, unsupported, frozenset(v2_fields), family, tuple(shared_texts)))


def families() -> tuple[str, ...]:
    """Every program family a registered planner launches, in the order they were registered."""
    return tuple(dict.fromkeys(op.family for op in PLANNERS.values()))


def shared_texts(family: str) -> tuple[str, ...]:
    """The kernel texts the program of ``family`` puts before its own (``register``'s ``shared_texts``)."""
    return next((op.shared_texts for op in PLANNERS.values() if op.family == family), ())
