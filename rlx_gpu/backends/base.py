"""The surface every backend module offers: discovery, one device session, memory and launch."""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, ContextManager, Mapping, Protocol, Sequence

import numpy as np

#: Runs one planned thunk on an arena in place; returns the bytes it moved between device and host.
Runner = Callable[[Any], int]
#: ``on_host`` when placement sent no body thunk to the host (a direct ``launch``, or a run without fallback)
NONE_ON_HOST: Mapping[int, Runner] = MappingProxyType({})


class BackendUnavailable(RuntimeError):
    """A backend cannot run here; the message says why (missing package, no device ...)."""


@dataclass(frozen=True)
class DeviceInfo:
    """One device a backend can open: ``spec`` is what ``get_device`` accepts (``opencl:0:1``).

    ``cpu``: the device computes on the machine's CPU (the host; an OpenCL CPU device such as PoCL; a
    simulator). ``device: auto`` takes the host over a backend's CPU device; naming the device runs it.
    """

    backend: str
    spec: str
    name: str
    fp64: bool
    details: Mapping[str, Any] = field(default_factory=dict, hash=False, compare=False)
    cpu: bool = False


class Session(Protocol):
    """An opened device: arenas live here and thunks launch here (``core.KernelSession`` for device
    backends, ``host.HostSession`` for the host)."""

    info: DeviceInfo
    lock: ContextManager[Any]  # held by the executor for a whole run and each resident-arena operation
    shared: bool  # arenas are memory the host writes and reads in place: a write or a read is no command

    def unsupported(self, thunk: Mapping[str, Any]) -> str | None:
        """``None`` when this device runs ``thunk``, else the reason it does not."""

    def check_fits(self, nbytes: int, what: str) -> None:
        """Raise ``DeviceError`` naming ``what``, the size, the limit and the device when ``nbytes`` cannot be allocated."""

    def alloc(self, nbytes: int, what: str = "an arena", resident: bool = False) -> Any:
        """A zeroed device arena of ``nbytes``; ``resident`` when it lives between runs (the session may
        keep data staged from it, such as transposed weights, alongside)."""

    def upload(self, data: np.ndarray, what: str = "an arena", resident: bool = False) -> Any:
        """A new device arena holding ``data`` (``numpy.uint8``): one allocation and one host write."""

    def free(self, arena: Any) -> None:
        """Release an arena from :meth:`alloc` or :meth:`upload`."""

    def write(self, arena: Any, offset: int, data: np.ndarray) -> None:
        """Copy host bytes (``numpy.uint8``) into the arena at ``offset``."""

    def read(self, arena: Any, offset: int, nbytes: int) -> np.ndarray:
        """Copy ``nbytes`` at ``offset`` out of the arena into a new ``numpy.uint8`` array."""

    def runner(self, thunk: Mapping[str, Any], options: Any, on_host: Mapping[int, Runner] = NONE_ON_HOST) -> Runner:
        """Plan ``thunk`` once under ``options`` (a ``RunOptions``); the result runs it on an arena and
        returns the bytes it moved to and from the host. ``on_host`` maps the ``id`` of each body thunk
        placement sent to the host to the runner that runs it there (the executor's host runs)."""

    def launch(self, thunk: Mapping[str, Any], arena: Any, **options: Any) -> None:
        """Run one thunk on the arena in place (``options`` by ``RunOptions`` field name)."""

    def finish(self) -> None:
        """Wait until every launch has completed (for timing, and where ``shared`` before the host touches an
        arena's bytes through :meth:`host_view`)."""

    def host_view(self, arena: Any) -> np.ndarray:
        """Where ``shared``: the arena's bytes as the host reads and writes them in place (``numpy.uint8``)."""


class Backend(Protocol):
    """What a backend module declares about itself; ``rlx_gpu.backends.MODULES`` names the module and
    the registry, the config and the program assembly discover the rest from it.

    Attributes
    ----------
    NAME : str
        The backend's name: the head of its device specs, its key in ``MODULES``, in a config's
        ``priority`` and ``overrides``.
    SPEC_INDICES : tuple of str
        The ``:N`` parts a device spec may add, outermost first (``("platform", "device")`` makes
        ``opencl[:platform[:device]]``; ``()`` allows the bare name only).
    PRELUDE : tuple of (str, str) or None
        The data folder and file of the kernel dialect's prelude (``("kernels_opencl", "prelude.cl")``);
        the dialect's name is ``NAME``. None for a backend that compiles no kernels.
    DEVICE_ENV : str or None
        An environment variable that picks one of its devices (``PYOPENCL_CTX``), read when no
        ``RLX_DEVICE`` is set and for a bare spec ``NAME``; the module then has ``device_from_env``.
    """

    NAME: str
    SPEC_INDICES: tuple[str, ...]
    PRELUDE: tuple[str, str] | None
    DEVICE_ENV: str | None

    def device_from_env(self, value: str, devices: Sequence[DeviceInfo]) -> str:
        """The device spec ``value`` of ``DEVICE_ENV`` names, among ``devices`` (those ``probe`` found)."""

    def probe(self) -> list[DeviceInfo]:
        """The devices present; raises ``BackendUnavailable`` with the reason when none can be used."""

    def open(self, info: DeviceInfo) -> Session:
        """Open one probed device."""
