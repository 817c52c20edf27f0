"""The host backend: NumPy kernels of ``host_fallback`` on a ``numpy.uint8`` arena.

Re-entrant: the kernels keep no shared state (their scratch is per thread), so runs from several
threads proceed at once and ``lock`` does nothing.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Mapping

import numpy as np

import host_fallback

from ..errors import DeviceError
from ..units import human_bytes
from .allocation import allocating, allocation_failed
from .base import NONE_ON_HOST, DeviceInfo, Runner
from .options import RunOptions

NAME = "host"
SPEC_INDICES: tuple[str, ...] = ()
PRELUDE = None  # no kernel dialect: the host runs host_fallback's NumPy kernels
DEVICE_ENV = None


def physical_memory() -> int:
    """Bytes of physical memory of this machine (what a host arena can at most be)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def probe() -> list[DeviceInfo]:
    return [DeviceInfo(NAME, "host", f"NumPy {np.__version__} on the CPU", fp64=True, cpu=True)]


class HostSession:
    """Arenas are NumPy arrays; launching is calling the host kernel."""

    lock = contextlib.nullcontext()
    shared = True

    def __init__(self, info: DeviceInfo):
        self.info = info

    def unsupported(self, thunk: Mapping[str, Any]) -> str | None:
        return None if thunk["op"] in host_fallback.KERNELS else f"host_fallback has no {thunk['op']} kernel"

    def check_fits(self, nbytes: int, what: str) -> None:
        """Raise ``DeviceError`` when ``nbytes`` exceed this machine's physical memory."""
        limit = physical_memory()
        if nbytes > limit:
            raise DeviceError(f"{what} needs {nbytes} bytes ({human_bytes(nbytes)}), more than the "
                              f"{human_bytes(limit)} of memory of this machine ({self.info.spec}); "
                              f"shrink the schedule")

    def alloc(self, nbytes: int, what: str = "an arena", resident: bool = False) -> np.ndarray:
        """A zeroed arena; ``resident`` changes nothing here (host kernels keep nothing between runs)."""
        with allocating(what, self.info.spec, nbytes):
            return np.zeros(nbytes, dtype=np.uint8)

    def upload(self, data: np.ndarray, what: str = "an arena", resident: bool = False) -> np.ndarray:
        """A new arena holding a copy of ``data``."""
        with allocating(what, self.info.spec, data.nbytes):
            return np.array(data, dtype=np.uint8).reshape(-1)

    def free(self, arena: np.ndarray) -> None:
        """NumPy frees the arena with its last reference."""

    def write(self, arena: np.ndarray, offset: int, data: np.ndarray) -> None:
        arena[offset: offset + data.size] = data

    def read(self, arena: np.ndarray, offset: int, nbytes: int) -> np.ndarray:
        return arena[offset: offset + nbytes].copy()

    def runner(self, thunk: Mapping[str, Any], options: RunOptions,
               on_host: Mapping[int, Runner] = NONE_ON_HOST) -> Runner:
        """Call the host kernel with the options it takes (the thunk is validated: no bounds check per call);
        ``on_host`` does not apply, everything runs here. ``run(arena, given)`` runs it on the given arrays in
        place of those arena views (``host_fallback.bound_kernel``) where it can and says whether it did."""
        what = f"the scratch and body arenas of thunk {getattr(thunk, 'index', '?')} ({thunk['op']})"
        self.check_fits(host_fallback.working_bytes(thunk), f"thunk {getattr(thunk, 'index', '?')} ({thunk['op']})'s "
                                                            "working memory besides the arena (a lower bound)")
        with allocating(what, self.info.spec):  # the kernel's thunk-only setup may allocate
            kernel = host_fallback.bound_kernel(thunk, options.host_keywords)

        def run(arena: np.ndarray, given: Mapping[int, np.ndarray] | None = None) -> int | bool:
            try:
                if given is not None:
                    return bool(kernel(arena, given))
                kernel(arena)
            except MemoryError as err:
                raise allocation_failed(what, self.info.spec, err) from err
            return 0
        return run

    def launch(self, thunk: Mapping[str, Any], arena: np.ndarray, **options: Any) -> None:
        host_fallback.execute(thunk, arena, **RunOptions.build(**options).host_keywords)

    def host_view(self, arena: np.ndarray) -> np.ndarray:
        return arena

    def finish(self) -> None:
        pass


def open(info: DeviceInfo) -> HostSession:  # noqa: A001 - the backend surface names it open
    return HostSession(info)
