"""Allocation failures as ``DeviceError``: what was being allocated, how much, and on which device.

A backend's primitives raise ``MemoryError`` when their device cannot allocate (NumPy does so on the
host; the OpenCL and CUDA primitives translate their APIs' out-of-memory errors into it); the
sessions and the executor turn it into a ``DeviceError`` here, where they know what they allocated.
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterator

from ..errors import DeviceError
from ..units import human_bytes


def requested_bytes(err: MemoryError) -> int | None:
    """The size of the allocation that failed, where the error says it (NumPy's names shape and dtype)."""
    shape, dtype = getattr(err, "shape", None), getattr(err, "dtype", None)
    if shape is None or dtype is None:
        return None
    return math.prod(shape) * dtype.itemsize


def allocation_failed(what: str, device: str, err: MemoryError, nbytes: int | None = None) -> DeviceError:
    """The ``DeviceError`` of a failed allocation of ``what`` (``nbytes``, else what ``err`` says) on ``device``."""
    size = nbytes if nbytes is not None else requested_bytes(err)
    amount = "memory" if size is None else f"{human_bytes(size)} ({size} bytes)"
    return DeviceError(f"could not allocate {amount} for {what} on {device}: out of memory ({err}); free memory "
                       f"(other arenas or processes), raise the process's memory limit, or shrink the schedule")


@contextlib.contextmanager
def allocating(what: str, device: str, nbytes: int | None = None) -> Iterator[None]:
    """Turn a ``MemoryError`` raised inside into :func:`allocation_failed`'s ``DeviceError``."""
    try:
        yield
    except MemoryError as err:
        raise allocation_failed(what, device, err, nbytes) from err
