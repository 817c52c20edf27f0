"""The surface every backend module offers: discovery, one device session, memory and launch."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Collection, ContextManager, Mapping, Protocol

import numpy as np


class BackendUnavailable(RuntimeError):
    """A backend cannot run here; the message says why (missing package, no device ...)."""


@dataclass(frozen=True)
class DeviceInfo:
    """One device a backend can open: ``spec`` is what ``get_device`` accepts (``opencl:0:1``)."""

    backend: str
    spec: str
    name: str
    fp64: bool
    details: Mapping[str, Any] = field(default_factory=dict, hash=False, compare=False)


class Session(Protocol):
    """An opened device: arenas live here and thunks launch here (``core.KernelSession`` for device
    backends, ``host.HostSession`` for the host)."""

    info: DeviceInfo
    lock: ContextManager[Any]  # held by the executor for a whole run and each resident-arena operation

    def unsupported(self, thunk: Mapping[str, Any]) -> str | None:
        """``None`` when this device runs ``thunk``, else the reason it does not."""

    def check_fits(self, nbytes: int, what: str) -> None:
        """Raise ``DeviceError`` naming ``what``, the size, the limit and the device when ``nbytes`` cannot be allocated."""

    def alloc(self, nbytes: int, what: str = "an arena", resident: bool = False) -> Any:
        """A zeroed device arena of ``nbytes``; ``resident`` when it lives between runs (the session may
        keep data prepared from it, such as staged weights, alongside)."""

    def free(self, arena: Any) -> None:
        """Release an arena from :meth:`alloc`."""

    def write(self, arena: Any, offset: int, data: np.ndarray) -> None:
        """Copy host bytes (``numpy.uint8``) into the arena at ``offset``."""

    def read(self, arena: Any, offset: int, nbytes: int) -> np.ndarray:
        """Copy ``nbytes`` at ``offset`` out of the arena into a new ``numpy.uint8`` array."""

    def runner(self, thunk: Mapping[str, Any], options: Any, on_host: Collection[int] = ()) -> Callable[[Any], int]:
        """Plan ``thunk`` once under ``options`` (a ``RunOptions``); the result runs it on an arena and
        returns the bytes it moved to and from the host (body thunks whose ``id`` is in ``on_host``)."""

    def launch(self, thunk: Mapping[str, Any], arena: Any, **options: Any) -> None:
        """Run one thunk on the arena in place (``options`` by ``RunOptions`` field name)."""

    def finish(self) -> None:
        """Wait until every launch has completed (for timing)."""


class Backend(Protocol):
    """A backend module exposes ``NAME`` plus these two functions."""

    NAME: str

    def probe(self) -> list[DeviceInfo]:
        """The devices present; raises ``BackendUnavailable`` with the reason when none can be used."""

    def open(self, info: DeviceInfo) -> Session:
        """Open one probed device."""
