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


class HeldState:
    """The mark of a carried state a call left in its plan's arena (``runtime.host_call``'s ``carried``): the
    tensor ``t`` that holds the same values now (the caller's state written back, or the final state returned).
    ``mark(s)`` is true while ``s`` is that same tensor, at the same address and ``_version``: no torch operation
    has written it since, so the next call need not write it into the arena again. A write torch's version counter
    does not see (through ``.data`` or NumPy) is not seen here either, as for a parameter's stamp
    (``bridge.stamp``): ``rlx_gpu.torch.clear_cache()`` after one. An inference tensor keeps no version: no mark
    (``HeldState.of``: None), so it is written on every call."""

    __slots__ = ("_ref", "_version", "_address")

    def __init__(self, t: torch.Tensor):
        self._ref, self._version, self._address = weakref.ref(t), t._version, t.data_ptr()

    @classmethod
    def of(cls, t: torch.Tensor) -> "HeldState | None":
        return None if t.is_inference() else cls(t)

    def __call__(self, s: torch.Tensor) -> bool:
        return self._ref() is s and s._version == self._version and s.data_ptr() == self._address
