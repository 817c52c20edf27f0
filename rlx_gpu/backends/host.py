"""The host backend: NumPy kernels of ``host_fallback`` on a ``numpy.uint8`` arena."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

import host_fallback

from .base import DeviceInfo

NAME = "host"


def probe() -> list[DeviceInfo]:
    return [DeviceInfo(NAME, "host", f"NumPy {np.__version__} on the CPU", fp64=True)]


class HostSession:
    """Arenas are NumPy arrays; launching is calling the host kernel."""

    def __init__(self, info: DeviceInfo):
        self.info = info

    def unsupported(self, thunk: Mapping[str, Any]) -> str | None:
        return None if thunk["op"] in host_fallback.KERNELS else f"host_fallback has no {thunk['op']} kernel"

    def alloc(self, nbytes: int) -> np.ndarray:
        return np.zeros(nbytes, dtype=np.uint8)

    def write(self, arena: np.ndarray, offset: int, data: np.ndarray) -> None:
        arena[offset: offset + data.size] = data

    def read(self, arena: np.ndarray, offset: int, nbytes: int) -> np.ndarray:
        return arena[offset: offset + nbytes].copy()

    def launch(self, thunk: Mapping[str, Any], arena: np.ndarray, **options: Any) -> None:
        host_fallback.execute(thunk, arena, **options)

    def finish(self) -> None:
        pass


def open(info: DeviceInfo) -> HostSession:  # noqa: A001 - the backend surface names it open
    return HostSession(info)
