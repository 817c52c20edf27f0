"""NumPy views of the tensors a hot path gets call after call (a decode's state, its parameters), kept while the
same tensor holds the same memory (``bridge.hot_path``'s steps make a dozen views a call: 0.6 µs each)."""
from __future__ import annotations

import weakref
from typing import Any, Callable

import numpy as np
import torch


class _Memory:
    """An array interface over memory someone else owns: the base of a ``HeldView``'s array."""

    __slots__ = ("__array_interface__",)

    def __init__(self, interface: dict[str, Any]):
        self.__array_interface__ = interface


def _gone() -> None:
    return None


class HeldView:
    """The NumPy view of the CPU tensor a hot path gets at one argument call after call (a decode's state, a
    parameter), kept while that same tensor holds the same memory: ``view(t)`` checks a weak reference and
    the address (0.2 µs) where ``t.numpy(force=True)`` makes a new view (0.6 µs, more after a kernel swept
    the cache). The kept array reads the tensor's memory through its array interface, so it does not keep
    the tensor alive; the weak reference says whether the tensor (and so its memory) is still there."""

    __slots__ = ("_entry",)

    def __init__(self) -> None:
        self._entry: tuple[Callable[[], Any], int, np.ndarray | None] = (_gone, -1, None)

    def __call__(self, t: torch.Tensor) -> np.ndarray:
        held, address, array = self._entry  # one read: another thread may replace it meanwhile
        if held() is t and t.data_ptr() == address:
            return array
        array = t.numpy(force=True)
        address = t.data_ptr()
        if array.__array_interface__["data"][0] != address or not array.size:  # a copy (force=True), or no memory
            return array
        self._entry = (weakref.ref(t), address, np.asarray(_Memory(array.__array_interface__)))
        return array
