"""Implementations registered against an op by name (DESIGN.md principle 17).

One ``Registry`` per kind of implementation — host kernel, launch planner, float64 reference, builder
method, torch function ... — filled where each implementation is written (the module registers it on
import) and read at plan or bind time, never per call. An op may instead be *exempt* from a registry,
with the reason why it has no entry; ``missing(ops)`` names the ops with neither, which the
completeness test (tests/project/test_op_registries.py) reads for every registry.

Standard library only: ``host_fallback`` (which imports nothing of ``rlx_gpu``) and every layer of
``rlx_gpu`` register through it.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Callable, Dict, Iterable, TypeVar

T = TypeVar("T")


class NotRegistered(KeyError):
    """``registry[op]`` of an op without an entry: names the op, the registry's kind and what it holds."""

    def __str__(self) -> str:
        return str(self.args[0])


def _names(ops: str | Iterable[str]) -> tuple[str, ...]:
    return (ops,) if isinstance(ops, str) else tuple(ops)


class Registry(Dict[str, T]):
    """op name -> its implementation of one ``kind``; a ``dict``, so a lookup costs what a dict's does.

    ``exempt(ops, reason)`` records ops that have no implementation of this kind by design. With ``many``,
    an op may have several implementations: its entry is the tuple of them, in the order they were added.
    """

    def __init__(self, kind: str, *, many: bool = False) -> None:
        super().__init__()
        self.kind = kind
        self.many = many
        self.reasons: dict[str, str] = {}

    def add(self, ops: str | Iterable[str], impl: T) -> T:
        """Register ``impl`` for each op of ``ops`` (a name or several); an op registered twice is an error
        (unless ``many``)."""
        for op in _names(ops):
            if op in self.reasons or (op in self and not self.many):
                raise ValueError(f"{self.kind} of op {op!r} registered twice")
            self[op] = self.get(op, ()) + (impl,) if self.many else impl
        return impl

    def register(self, *ops: str) -> Callable[[T], T]:
        """``add`` as a decorator: ``@KERNELS.register("lstm", "gru")``."""
        return lambda impl: self.add(ops, impl)

    def exempt(self, ops: str | Iterable[str], reason: str) -> None:
        """Record that each op of ``ops`` has no implementation of this kind, and why."""
        for op in _names(ops):
            if op in self or op in self.reasons:
                raise ValueError(f"op {op!r} is both registered and exempt as a {self.kind}")
            self.reasons[op] = reason

    def missing(self, ops: Iterable[str]) -> list[str]:
        """The ops of ``ops`` with neither an entry nor a reason, in their order."""
        return [op for op in ops if op not in self and op not in self.reasons]

    def __missing__(self, op: str) -> T:
        why = f" ({self.reasons[op]})" if op in self.reasons else ""
        raise NotRegistered(f"no {self.kind} for op {op!r}{why}; registered: {', '.join(sorted(self)) or 'none'}")


def import_all(package: str, prefix: str = "", skip: str | None = None) -> None:
    """Import every module of ``package`` whose name starts with ``prefix`` (and not with ``skip``): each
    registers its own implementations on import, so adding one is adding its module, with no list to keep."""
    for module in pkgutil.iter_modules(importlib.import_module(package).__path__):
        if module.name.startswith(prefix) and not (skip and module.name.startswith(skip)):
            importlib.import_module(f"{package}.{module.name}")
