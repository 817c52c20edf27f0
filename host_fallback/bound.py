"""A thunk's tensors bound to one host arena: the host kernels read and write them by field name.

Where each tensor lives is the ABI's (``abi.regions``); this module adds the NumPy views of it.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from .abi import Region, Thunk, regions
from .arena import COMPUTE, STORAGE, view


class Bound:
    """A thunk's regions bound to one host arena: ``load``/``store``/``view`` by field name."""

    def __init__(self, thunk: Thunk, arena: np.ndarray, by_field: Mapping[str, Region] | None = None):
        """``by_field``: the thunk's regions by field, when the caller computed them once already."""
        self.arena = arena
        self.regions = by_field if by_field is not None else {r.field: r for r in regions(thunk)}
        self._views: dict[str, np.ndarray] = {}

    def view(self, field: str) -> np.ndarray:
        """``field`` as a writable view of the arena (made once per field; callers never reshape it in place)."""
        made = self._views.get(field)
        if made is None:
            r = self.regions[field]
            made = self._views[field] = view(self.arena, r.offset, r.dtype, r.shape)
        return made

    def load(self, field: str, index: Any = ...) -> np.ndarray:
        """``field`` (or the block ``index`` selects from it) in a fresh array of its compute type."""
        return self.view(field)[index].astype(COMPUTE[self.regions[field].dtype])

    def in_place(self, field: str, index: Any = ...) -> np.ndarray | None:
        """``field`` (or the block ``index`` selects) as a writable view of the arena when its storage
        type is its compute type (f32, f64), for a tensor a kernel reads and then updates in place
        (ABI.md: carried states); else ``None`` (16-bit storage: ``load``, compute, ``store``)."""
        r = self.regions[field]
        return self.view(field)[index] if STORAGE[r.dtype] == COMPUTE[r.dtype] else None

    def store(self, field: str, values: np.ndarray, index: Any = ...) -> None:
        """Write ``values`` to ``field`` (or to the block ``index`` selects), rounded to nearest even
        into its storage type."""
        target = self.view(field)[index]
        target[...] = np.asarray(values).reshape(target.shape).astype(STORAGE[self.regions[field].dtype])
