"""A thunk's tensors bound to one host arena: the host kernels read and write them by field name.

Where each tensor lives is the ABI's (``abi.regions``); this module adds the NumPy views of it, and takes a
caller's arrays in place of some of them (``given_views``: a call plan's zero-copy path, ``runtime.given``).
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from .abi import Region, Thunk, regions
from .arena import COMPUTE, STORAGE, view


def given_views(by_field: Mapping[str, Region], given: Mapping[int, np.ndarray]) -> dict[str, np.ndarray] | None:
    """The arrays of ``given`` (a field's arena offset -> an array to read or write in place of its arena view:
    a caller's memory) by field, shaped as ``Bound.view`` shapes them; None where one does not fit, and then
    nothing may run on them. Each must be the field's bytes exactly (in its storage dtype; a byte region, a
    saved forward, in any), C-contiguous and aligned, writable where the thunk writes it, and none that the
    thunk writes may share memory with another (ABI.md: no output overlaps an input)."""
    at: dict[int, list[Region]] = {}
    for r in by_field.values():
        if r.nbytes:
            at.setdefault(r.offset, []).append(r)
    views, written = {}, []
    for offset, a in given.items():
        places = at.get(offset, ())
        if len(places) != 1:  # no field there, or two (an aliasing this path does not sort out)
            return None
        r, flags = places[0], a.flags
        storage = STORAGE[r.dtype]
        if not (a.nbytes == r.nbytes and (a.dtype == storage or r.dtype == "u8") and flags.c_contiguous
                and flags.aligned and (flags.writeable or not r.writes)):
            return None
        views[r.field] = a.reshape(-1).view(storage).reshape(r.shape)
        if r.writes:
            written.append(a)
    if any(a is not w and np.may_share_memory(w, a) for w in written for a in given.values()):
        return None
    return views


class Bound:
    """A thunk's regions bound to one host arena: ``load``/``store``/``view`` by field name."""

    def __init__(self, thunk: Thunk, arena: np.ndarray, by_field: Mapping[str, Region] | None = None,
                 given: Mapping[str, np.ndarray] | None = None):
        """``by_field``: the thunk's regions by field, when the caller computed them once already; ``given``:
        arrays by field in place of their arena views (``given_views``)."""
        self.arena = arena
        self.regions = by_field if by_field is not None else {r.field: r for r in regions(thunk)}
        self._views: dict[str, np.ndarray] = dict(given) if given else {}

    def every_view(self) -> "Bound":
        """Itself with the view of every field made (a thunk run again on the same arena reuses them)."""
        for field in self.regions:
            self.view(field)
        return self

    def with_given(self, given: Mapping[str, np.ndarray]) -> "Bound":
        """A ``Bound`` of the same arena with the arrays of ``given`` by field (``given_views``) in place of their
        views, and this one's other views."""
        return Bound({}, self.arena, self.regions, {**self._views, **given})  # the regions known: no thunk read

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

    def read(self, field: str, index: Any = ...) -> np.ndarray:
        """``field`` (or the block ``index`` selects) in its compute type for a kernel that only reads it: the
        arena's own view where its storage type is its compute type (f32, f64; a decode step's weights, not
        copied each call), else a fresh array (``load``)."""
        return self.view(field)[index].astype(COMPUTE[self.regions[field].dtype], copy=False)

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
        target[...] = np.asarray(values).reshape(target.shape).astype(STORAGE[self.regions[field].dtype], copy=False)
