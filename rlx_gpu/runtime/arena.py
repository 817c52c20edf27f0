"""Resident arenas: a schedule's arena kept on a device between runs.

``arena = device.arena(schedule)`` allocates it pristine (zeros plus ``init``) on the device;
``arena.write("x", values)`` and ``arena.read("y")`` move one named tensor; ``device.run(schedule,
arena)`` runs in place, any number of times; ``arena.free()`` (or leaving a ``with`` block) releases it.
``write`` takes any DLPack producer (torch bf16 included); on the host ``arena.view("y")`` hands a
tensor out by DLPack without a copy.

On a kernel device ``write`` stages a copy of the values and the next run, read or ``flush`` sends
what is staged, tensors that follow each other in the arena (a step's inputs, laid out in a row) as ONE
host-to-device copy: each copy is a command of its own (about 15 µs on PoCL, blocking or not), which
for a decode step's five inputs was most of the call.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from host_fallback.arena import STORAGE

from ..backends.allocation import allocating
from ..errors import DLPackError, RlxError
from ..schedule.model import Schedule, TensorView
from .dlpack import ArenaView, DeviceTensor, import_tensor


class Arena:
    """A device arena of ``schedule.arena_bytes`` holding that schedule's tensors between runs.

    ``device`` is the ``runtime.executor.Device`` that allocated it (its session holds the memory).
    """

    def __init__(self, device: Any, schedule: Schedule):
        self.device = device
        self.schedule = schedule
        self.nbytes = schedule.arena_bytes
        self._image: np.ndarray | None = None  # host copy for thunks that fall back (their footprint only)
        self._staged: list[tuple[int, np.ndarray]] = []  # (offset, bytes) written but not sent yet, in order
        session = device.session
        with session.lock:
            self.handle: Any = session.upload(schedule.pristine_arena(), "the arena of this schedule (arena_bytes)",
                                              resident=True)

    def __repr__(self) -> str:
        state = "freed" if self.handle is None else f"{self.nbytes} bytes"
        return f"Arena({self.device.spec!r}, {state})"

    def __enter__(self) -> "Arena":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.free()

    def _view(self, name: str) -> TensorView:
        if self.handle is None:
            raise RlxError("this arena was freed; allocate another with device.arena(schedule)")
        view = self.schedule.tensors.get(name)
        if view is None:
            known = ", ".join(self.schedule.tensors) or "none (give the schedule a 'tensors' table, ABI.md §2)"
            raise RlxError(f"the schedule names no tensor {name!r}; it has {known}")
        return view

    def write(self, name: str, values: Any) -> None:
        """Store ``values`` (its shape must match) into tensor ``name``, rounded to its storage dtype.

        ``values`` may be any DLPack producer in host memory (torch f32/f16/bf16/f64, dense): in the
        tensor's own dtype its bytes go straight into the arena, one copy and no conversion (a device
        arena stages that copy until the next run or read).
        """
        view = self._view(name)
        if not isinstance(values, np.ndarray):
            values = self._taken(name, values) if hasattr(values, "__dlpack__") else np.asarray(values)
        if values.shape != view.shape:
            raise RlxError(f"tensor {name!r} has shape {list(view.shape)}, got values of shape {list(values.shape)}")
        session = self.device.session
        with session.lock:
            if self.device.on_host:  # the arena is host memory: the write is the one copy
                data = np.ascontiguousarray(values, dtype=STORAGE[view.dtype])
                session.write(self.handle, view.offset, data.reshape(-1).view(np.uint8))
            else:  # staged as a copy of its own (the caller may change values before it is sent)
                data = values.astype(STORAGE[view.dtype], order="C").reshape(-1).view(np.uint8)
                self._staged.append((view.offset, data))
                session.touched(self.handle, view.offset, data.size)  # kept scratch staged from it is stale

    def flush(self) -> None:
        """Send the staged writes to the device, runs of adjacent ones as one copy (a run calls this)."""
        session = self.device.session
        with session.lock:  # taken whole under the lock: a write staged meanwhile waits for the next flush
            staged, self._staged = self._staged, []
            if not staged:
                return
            ordered = sorted(staged, key=lambda write: write[0])
            if all(lo + data.size <= hi for (lo, data), (hi, _) in zip(ordered, ordered[1:])):
                staged = ordered  # disjoint writes commute: in offset order, neighbours go as one copy
            start, end, parts = staged[0][0], staged[0][0], []
            for offset, data in staged:
                if offset != end:  # not adjacent to the run so far: send the run
                    session.write(self.handle, start, np.concatenate(parts) if len(parts) > 1 else parts[0])
                    start, parts = offset, []
                parts.append(data)
                end = offset + data.size
            session.write(self.handle, start, np.concatenate(parts) if len(parts) > 1 else parts[0])

    def read_many(self, names: list[str]) -> dict[str, np.ndarray]:
        """Copies of several tensors, as :meth:`read` gives them; from a device arena as one copy of
        the span that covers them when that span is at most twice their bytes (each copy is a command
        of its own, about 15 µs on PoCL, and a decode step's outputs lie side by side)."""
        views = [self._view(name) for name in names]
        lo = min((v.offset for v in views), default=0)
        hi = max((v.offset + v.nbytes for v in views), default=0)
        if self.device.on_host or len(views) < 2 or hi - lo > 2 * sum(v.nbytes for v in views):
            return {name: self.read(name) for name in names}
        self.flush()
        with self.device.session.lock:
            span = self.device.session.read(self.handle, lo, hi - lo)
        return {name: span[v.offset - lo: v.offset - lo + v.nbytes].view(STORAGE[v.dtype]).reshape(v.shape)
                for name, v in zip(names, views)}

    def _taken(self, name: str, values: Any) -> np.ndarray:
        """A DLPack producer's memory as a NumPy view of its own dtype (no copy)."""
        taken = import_tensor(values)
        if isinstance(taken, DeviceTensor):
            raise DLPackError(f"tensor {name!r}: values live on {taken.device}:{taken.device_id}; this arena takes "
                              f"host memory: pass tensor.cpu()")
        return taken.array()

    def view(self, name: str) -> ArenaView:
        """Tensor ``name`` as a zero-copy DLPack view (host arenas): ``torch.from_dlpack(arena.view("y"))``.

        The view is live: the next run writes through it (clone to keep a value), and it keeps the
        arena's memory alive after ``free`` while a consumer holds it.
        """
        view = self._view(name)
        if not self.device.on_host:
            raise DLPackError(f"the arena lives on {self.device.spec}, which offers no zero-copy host view; "
                              f"use arena.read({name!r})")
        return ArenaView(self.handle, view.offset, view.dtype, view.shape, owner=self)

    def read(self, name: str) -> np.ndarray:
        """A copy of tensor ``name`` in its storage dtype (``float16``, ``bfloat16``, ``float32``, ``float64``)."""
        view = self._view(name)
        self.flush()
        with self.device.session.lock:
            data = self.device.session.read(self.handle, view.offset, view.nbytes)
        return data.view(STORAGE[view.dtype]).reshape(view.shape)

    def check(self, device: Any, schedule: Schedule) -> None:
        """Refuse a run by another device, of a schedule larger than this arena, or after :meth:`free`."""
        if self.handle is None:
            raise RlxError("this arena was freed; allocate another with device.arena(schedule)")
        if device is not self.device:
            raise RlxError(f"this arena lives on {self.device!r}, not {device!r}")
        if schedule.arena_bytes > self.nbytes:
            raise RlxError(f"the schedule needs arena_bytes = {schedule.arena_bytes}; this arena has {self.nbytes}")

    def image(self) -> np.ndarray:
        """The host image that fallback thunks run on (only their footprint is ever copied into it)."""
        if self._image is None:
            with allocating("the host image of a resident arena", "the host", self.nbytes):
                self._image = np.zeros(self.nbytes, np.uint8)
        return self._image

    def free(self) -> None:
        """Release the device memory; the arena cannot be used afterwards (a second call does nothing)."""
        if self.handle is not None:
            with self.device.session.lock:
                self.device.session.free(self.handle)
            self.handle = self._image = None
            self._staged = []
