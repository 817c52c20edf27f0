"""Every op of ABI.md, by name (``OPS``), and what the rest of the code asks of a thunk through it.

The ops are found, not listed: every ``OpDef`` at the top level of a module of this package is one. They
are ordered by their place in ABI.md (``OpDef.place``): the forward ops of §3-§4, the body ops of §5, the
scan family of §6, the ops of §10 on, then the backward ops of §9 (generated from their forwards, in
their forwards' order). A new op is one definition module beside this one.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from . import backward
from .model import OpDef, Region, Thunk


def _defined() -> tuple[OpDef, ...]:
    """Every ``OpDef`` the package's modules define at their top level, in ABI.md's order."""
    found: dict[str, OpDef] = {}
    for module in pkgutil.iter_modules(importlib.import_module(__package__).__path__):
        for value in vars(importlib.import_module(f"{__package__}.{module.name}")).values():
            if isinstance(value, OpDef) and found.setdefault(value.name, value) is not value:
                raise ValueError(f"op {value.name!r} is defined twice (module {module.name})")
    for op in found.values():
        if not op.place:
            raise ValueError(f"op {op.name!r} has no place in ABI.md: give its OpDef place=(section, rank)")
    return tuple(sorted(found.values(), key=lambda op: op.place))


_DEFINED = _defined()

OPS: dict[str, OpDef] = {op.name: op for op in _DEFINED}
OPS.update({b.name: b for b in (backward.backward_of(op) for op in _DEFINED if op.differentiable)})

#: The forward ops that have a backward op, in the order of ABI.md §9.
FORWARD_OPS = tuple(op.name for op in _DEFINED if op.differentiable)
#: backward op -> the forward op it differentiates.
BACKWARD: dict[str, str] = {op.name: op.forward for op in OPS.values() if op.forward}
#: The optional floating-point inputs of each differentiable op (see ``backward.optional_inputs``).
OPTIONAL_INPUTS = {op: backward.optional_inputs(OPS[op]) for op in FORWARD_OPS}
#: The states each differentiable op names without its carry flag (see ``backward.flagged_states``).
FLAGGED_STATES = {op: backward.flagged_states(OPS[op]) for op in FORWARD_OPS}


def forward_op(op: str) -> str:
    """The forward op ``op`` differentiates, or ``op`` itself when it is no backward op."""
    return BACKWARD.get(op, op)


def forward_thunk(t: Thunk) -> dict[str, Any]:
    """The forward thunk a backward thunk (ABI.md §9) differentiates, completed (see ``backward.as_forward``)."""
    return backward.as_forward(t, OPS[BACKWARD[t["op"]]])


#: op -> its regions function: an op without version-2 fields needs no completing (this runs per thunk at plan time).
_REGIONS = {name: op.regions if op.defaults else op.layout for name, op in OPS.items()}


def regions(t: Thunk) -> list[Region]:
    """Every tensor ``t`` reads or writes, in field order."""
    return _REGIONS[t["op"]](t)


def footprint(t: Thunk) -> tuple[list[Region], list[Region]]:
    """``(reads, writes)``: the regions a thunk reads and the ones it writes (read-write ones in both)."""
    regs = regions(t)
    return [r for r in regs if r.reads], [r for r in regs if r.writes]


def complete(t: Thunk) -> dict[str, Any]:
    """``t`` as a plain dict with every version-2 field of its op, absent ones at their defaults.

    A kernel, a launch planner or a reference then reads ``t["d"]`` (``None``: no skip term) without
    asking whether the producer wrote it."""
    return OPS[t["op"]].complete(t)


def default(t: Thunk, name: str) -> Any:
    """The value field ``name`` of ``t``'s op has when ``t`` leaves it out."""
    return OPS[t["op"]].default(t, name)


def is_default(t: Thunk, name: str, value: Any) -> bool:
    """Whether ``value`` for field ``name`` means the same as leaving the field out: a field given with its
    default is the same thunk as the field absent, so a writer may leave it out."""
    return _plain(value) == _plain(default(t, name))


def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def used(t: Thunk) -> list[str]:
    """The version-2 fields ``t`` gives with a value other than their default, in field order."""
    return [name for name in OPS[t["op"]].defaults if name in t and not is_default(t, name, t[name])]
