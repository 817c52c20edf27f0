"""Typed views of a uint8 host arena: the element types of ABI.md §1 and their rounding."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from .abi import ELEM_SIZE

#: Storage type of every ABI dtype; ``u8`` names the byte-level slots of the scan family and ``i32`` the
#: integer tensors of version 2 (``seq_lens``, ``cu_seqlens``, ``state_slots``: little-endian int32).
STORAGE: dict[str, np.dtype] = {
    "f32": np.dtype(np.float32),
    "f16": np.dtype(np.float16),
    "bf16": np.dtype(ml_dtypes.bfloat16),
    "f64": np.dtype(np.float64),
    "u8": np.dtype(np.uint8),
    "i32": np.dtype("<i4"),
}

#: Arithmetic type of the thunk dtypes: 16-bit storage computes in f32, f64 in f64.
COMPUTE: dict[str, np.dtype] = {
    "f32": np.dtype(np.float32),
    "f16": np.dtype(np.float32),
    "bf16": np.dtype(np.float32),
    "f64": np.dtype(np.float64),
}

assert {name: dt.itemsize for name, dt in STORAGE.items()} == ELEM_SIZE, "storage and the ABI's element sizes disagree"


def view(arena: np.ndarray, offset: int, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Return a writable view of ``shape`` elements of ``dtype`` stored at byte ``offset``."""
    storage = STORAGE[dtype]
    count = math.prod(shape)
    raw = arena[offset: offset + count * storage.itemsize]
    return raw.view(storage).reshape(shape)


def load(arena: np.ndarray, offset: int, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Read a tensor into a fresh array of its compute type."""
    return view(arena, offset, dtype, shape).astype(COMPUTE[dtype])


def store(arena: np.ndarray, offset: int, dtype: str, values: np.ndarray) -> None:
    """Write ``values`` at byte ``offset``, rounding to nearest even into the storage type."""
    target = view(arena, offset, dtype, values.shape)
    target[...] = np.asarray(values).astype(STORAGE[dtype])
