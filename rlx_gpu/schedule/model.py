"""The schedule model of ABI.md §2: frozen TensorView, InitBlock, Thunk and Schedule (reading and writing: ``io``).

``Thunk`` and ``Schedule`` are read-only Mappings over their ABI fields, so the host kernels (which know
nothing of rlx_gpu) take them exactly as they take a thunk parsed from JSON.
"""
from __future__ import annotations

import base64
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Iterator

import numpy as np

from host_fallback.abi import ELEM_SIZE, OPS, is_default
from host_fallback.arena import STORAGE, view

ABI_V1, ABI_V2 = "rlx-thunks/1", "rlx-thunks/2"
#: The labels this reader accepts; version 2 (ABI.md §8) is a superset of version 1.
ABI_VERSIONS = (ABI_V1, ABI_V2)


@dataclass(frozen=True)
class TensorView:
    """A named view of the arena: ``shape`` elements of ``dtype`` at byte ``offset``."""

    offset: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def count(self) -> int:
        return math.prod(self.shape)  # a Python int (shapes are validated), without np.prod's ~5 µs

    @property
    def nbytes(self) -> int:
        return self.count * ELEM_SIZE[self.dtype]

    def read(self, arena: np.ndarray) -> np.ndarray:
        """A copy of this tensor out of a host arena, in its storage dtype."""
        return view(arena, self.offset, self.dtype, self.shape).copy()

    def write(self, arena: np.ndarray, values: np.ndarray) -> None:
        """Store ``values`` (any float dtype, rounded to nearest even) into a host arena."""
        values = np.asarray(values)
        if values.shape != self.shape:
            raise ValueError(f"expected shape {list(self.shape)} for this {self.dtype} tensor, got {list(values.shape)}")
        view(arena, self.offset, self.dtype, self.shape)[...] = values.astype(STORAGE[self.dtype])


@dataclass(frozen=True)
class InitBlock:
    """Constant bytes written at ``offset`` before the first thunk runs."""

    offset: int
    data: bytes


@dataclass(frozen=True, eq=False)
class Thunk(Mapping):
    """One validated thunk: ``index`` is its position in its schedule, ``fields`` its ABI fields."""

    index: int
    op: str
    dtype: str
    fields: Mapping[str, Any]

    def __getitem__(self, key: str) -> Any:
        if key == "op":
            return self.op
        if key == "dtype":
            return self.dtype
        return self.fields[key]

    def __iter__(self) -> Iterator[str]:
        yield "op"
        yield "dtype"
        yield from self.fields

    def __len__(self) -> int:
        return 2 + len(self.fields)

    def to_dict(self) -> dict[str, Any]:
        """The thunk as the schedule file spells it; a version-2 field at its default is left out."""
        out: dict[str, Any] = {"op": self.op, "dtype": self.dtype}
        newer = OPS[self.op].defaults
        for key, value in self.fields.items():
            if key in newer and is_default(self, key, value):
                continue
            out[key] = value.to_dict() if isinstance(value, Schedule) else _plain(value)
        return out


@dataclass(frozen=True, eq=False)
class Schedule(Mapping):
    """A validated schedule; nested scan bodies are Schedules too."""

    arena_bytes: int
    thunks: tuple[Thunk, ...]
    tensors: Mapping[str, TensorView] = field(default_factory=dict)
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    init: tuple[InitBlock, ...] = ()
    abi: str = ABI_V1

    _KEYS = ("abi", "arena_bytes", "tensors", "inputs", "outputs", "init", "thunks")

    def __getitem__(self, key: str) -> Any:
        if key == "abi":
            return self.abi
        if key == "init":
            return [{"offset": b.offset, "b64": base64.b64encode(b.data).decode()} for b in self.init]
        if key == "tensors":
            return {n: {"offset": t.offset, "dtype": t.dtype, "shape": list(t.shape)} for n, t in self.tensors.items()}
        if key in ("inputs", "outputs"):
            return list(getattr(self, key))
        if key in self._KEYS:
            return getattr(self, key)
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._KEYS)

    def __len__(self) -> int:
        return len(self._KEYS)

    def pristine_arena(self) -> np.ndarray:
        """A zeroed arena with ``init`` applied."""
        arena = np.zeros(self.arena_bytes, dtype=np.uint8)
        self.apply_init(arena)
        return arena

    def apply_init(self, arena: np.ndarray) -> None:
        """Write every ``init`` block into a host arena in place."""
        for block in self.init:
            arena[block.offset: block.offset + len(block.data)] = np.frombuffer(block.data, dtype=np.uint8)

    def to_dict(self) -> dict[str, Any]:
        out = {k: self[k] for k in self._KEYS if k != "thunks"}
        out["thunks"] = [t.to_dict() for t in self.thunks]
        return out


def _plain(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def freeze_fields(fields: dict[str, Any]) -> Mapping[str, Any]:
    """Read-only field mapping; lists become tuples so a thunk cannot be changed after validation."""
    def freeze(v: Any) -> Any:
        return tuple(freeze(x) for x in v) if isinstance(v, list) else v

    return MappingProxyType({k: freeze(v) for k, v in fields.items()})
