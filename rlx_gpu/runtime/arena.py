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

from typing import Any, Sequence

import numpy as np

from host_fallback.arena import STORAGE

from ..backends.allocation import allocating
from ..errors import DLPackError, RlxError
from ..schedule.model import Schedule, TensorView
from .dlpack import ArenaView, DeviceTensor, import_tensor


def host_array(name: str, values: Any) -> np.ndarray:
    """``values`` for tensor ``name`` as a NumPy array: a DLPack producer's host memory as a view of its
    own dtype (no copy), anything else through ``numpy.asarray``."""
    if isinstance(values, np.ndarray):
        return values
    if not hasattr(values, "__dlpack__"):
        return np.asarray(values)
    taken = import_tensor(values)
    if isinstance(taken, DeviceTensor):
        raise DLPackError(f"tensor {name!r}: values live on {taken.device}:{taken.device_id}; this arena takes "
                          f"host memory: pass tensor.cpu()")
    return taken.array()


def read_spans(views: Sequence[TensorView]) -> list[tuple[int, int, list[int]]]:
    """How to read ``views`` out of a device arena in few copies: ``(offset, nbytes, indices into views)``
    per copy, a span covering neighbours while it is at most twice their own bytes (each copy is a
    command of its own, about 15 µs on PoCL, and a decode step's outputs lie side by side)."""
    spans: list[tuple[int, int, list[int]]] = []
    for i in sorted(range(len(views)), key=lambda i: views[i].offset):
        v = views[i]
        if spans:
            lo, nbytes, members = spans[-1]
            hi = max(lo + nbytes, v.offset + v.nbytes)
            if hi - lo <= 2 * sum(views[j].nbytes for j in [*members, i]):
                spans[-1] = (lo, hi - lo, [*members, i])
                continue
        spans.append((v.offset, v.nbytes, [i]))
    return spans


def span_view(span: np.ndarray, view: TensorView, lo: int) -> np.ndarray:
    """Tensor ``view`` inside ``span``, the bytes read from offset ``lo`` (a view, in its storage dtype)."""
    return span[view.offset - lo: view.offset - lo + view.nbytes].view(STORAGE[view.dtype]).reshape(view.shape)


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
        values = host_array(name, values)
        if values.shape != view.shape:
            raise RlxError(f"tensor {name!r} has shape {list(view.shape)}, got values of shape {list(values.shape)}")
        session = self.device.session
        with session.lock:
            if self.device.on_host:  # the arena is host memory: the write is the one copy
                data = np.ascontiguousarray(values, dtype=STORAGE[view.dtype])
                session.write(self.handle, view.offset, data.reshape(-1).view(np.uint8))
            else:  # staged as a copy of its own (the caller may change values before it is sent)
                self.stage(view.offset, values.astype(STORAGE[view.dtype], order="C").reshape(-1).view(np.uint8))

    def stage(self, offset: int, data: np.ndarray, changed: Sequence[tuple[int, int]] | None = None) -> None:
        """Stage the bytes ``data`` (``numpy.uint8``, contiguous) for ``offset`` of a device arena, sent by the
        next :meth:`flush`; the caller leaves ``data`` unchanged until then. ``changed``: the ``(offset,
        nbytes)`` whose values differ from the device's (None: all of them)."""
        session = self.device.session
        with session.lock:
            self._staged.append((offset, data))
            for lo, nbytes in changed if changed is not None else [(offset, data.size)]:
                session.touched(self.handle, lo, nbytes)  # kept scratch staged from them is stale

    def flush(self) -> int:
        """Send the staged writes to the device, runs of adjacent ones as one copy (a run calls this);
        returns the number of copies sent."""
        if not self._staged:  # nothing staged (a host arena always): no lock to take
            return 0
        session = self.device.session
        with session.lock:  # taken whole under the lock: a write staged meanwhile waits for the next flush
            staged, self._staged = self._staged, []
            if not staged:
                return 0
            ordered = sorted(staged, key=lambda write: write[0])
            if all(lo + data.size <= hi for (lo, data), (hi, _) in zip(ordered, ordered[1:])):
                staged = ordered  # disjoint writes commute: in offset order, neighbours go as one copy
            start, end, parts, copies = staged[0][0], staged[0][0], [], 1
            for offset, data in staged:
                if offset != end:  # not adjacent to the run so far: send the run
                    session.write(self.handle, start, np.concatenate(parts) if len(parts) > 1 else parts[0])
                    start, parts, copies = offset, [], copies + 1
                parts.append(data)
                end = offset + data.size
            session.write(self.handle, start, np.concatenate(parts) if len(parts) > 1 else parts[0])
            return copies

    def read_many(self, names: list[str]) -> dict[str, np.ndarray]:
        """Copies of several tensors, as :meth:`read` gives them; from a device arena each group of
        :func:`read_spans` (tensors that lie close) as one copy of the span that covers it."""
        views = [self._view(name) for name in names]
        if self.device.on_host:
            return {name: self.read(name) for name in names}
        self.flush()
        out: dict[str, np.ndarray] = {}
        with self.device.session.lock:
            for lo, nbytes, members in read_spans(views):
                span = self.device.session.read(self.handle, lo, nbytes)
                out.update((names[i], span_view(span, views[i], lo)) for i in members)
        return {name: out[name] for name in names}

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
