"""A call plan on host memory called by a caller that writes the inputs into the arena itself: a decode step's hot
path, on the host or on a device whose arena is host memory (an OpenCL CPU device's shared memory).

``CallPlan.call`` takes each input as an array, checks it and copies it into its place in the arena (or hands
a large one to the kernel where it lies: ``given``), then works out where each output goes. A caller that has
bound a signature once (the torch bridge's hot paths) knows all that already: ``HostCall`` is the plan's call
worked out once for it. Each input is written by a writer of the caller's (``put(arg)``: for a dense tensor,
a ``memmove`` of its bytes into its place in the arena, found once from ``places``), a parameter only when its
stamp changed (the plan's own stamps, so both ways of calling agree); the inputs handed over go to the kernel
as they lie, an output the kernel updates in place of one of them in that input's own memory. A decode step's
call then makes no NumPy view of its small tensors and runs none of ``call``'s per-input and per-output
bookkeeping. On a device the writes wait for the launches before, as ``call``'s do, and the kernel reads nothing
where the caller holds it (``given`` is the host's): a handed input is copied in, an output updated in place of
it copied back.
"""
from __future__ import annotations

from typing import Any, Callable, Hashable, Sequence

import numpy as np

from ..errors import RlxError
from .call_plan import CallPlan

_ABSENT = object()
#: ``(position, put)``: the writer of an input from the call's argument at ``position``.
Write = tuple[int, Callable[[Any], Any]]
#: ``(name, position, put, stamp_of)``: a stamped input's writer and how to stamp its argument (None: no stamp).
Stamped = tuple[str, int, Callable[[Any], Any], Callable[[Any], Hashable | None]]


def places(plan: CallPlan, shared: bool = False) -> dict[str, np.ndarray] | None:
    """Each input's place in the arena of ``plan`` (a plan on the host, called once already): what a caller's
    writers write; with ``shared``, also a plan on a device whose arena is host memory (an OpenCL CPU device's
    shared memory, ``Session.shared``: ``HostCall`` waits for its launches before a write). None for a plan on
    another device or not called yet."""
    if plan._slots is None or not (plan.device.on_host or shared and plan._touched is not None):
        return None
    return {slot.name: slot.array for slot in plan._slots}


class HostCall:
    """``plan`` (on host memory, called once already: ``places(plan, shared=True)``) called as
    ``host_call(args)``: each input written from ``args`` by its writer (``writes``; ``stamped``: a parameter's,
    when its stamp changed), the ``handed`` inputs (``(input index, position, view)``: ``view(arg)`` a
    C-contiguous array of the input's shape and storage dtype) given to the kernel where they lie (copied in
    where the plan's ``given`` layout does not let the kernel take them: too small, or on a device); returns the
    outputs ``taken`` (indices), each a new array, or, for one the kernel updates in place of a handed input listed
    in ``in_place`` (output index -> the index of that input among ``handed``), that input's array itself."""

    def __init__(self, plan: CallPlan, writes: Sequence[Write], stamped: Sequence[Stamped],
                 handed: Sequence[tuple[int, int, Callable[[Any], np.ndarray]]], in_place: dict[int, int],
                 taken: Sequence[int]):
        if places(plan, shared=True) is None:
            raise RlxError(f"HostCall binds a plan whose arena is host memory (the host's, or a device's shared "
                           f"memory), called once already; this one is {plan!r}")
        layout = plan._given
        # the kernel reads the handed inputs where they lie where the plan's ``given`` layout lets it (each large
        # enough), else they are copied in and the outputs updated in place of them copied back
        self._hand = bool(handed) and layout is not None and all(layout.inputs[i] for i, _, _ in handed)
        self.plan, self.writes, self.stamped, self.handed = plan, tuple(writes), tuple(stamped), tuple(handed)
        self._slots = plan._slots
        self._kept = {slot.name: slot.kept for slot in plan._slots}  # an unchanged stamp skips the write
        names = {name for name, *_ in stamped}
        self._unstamped = tuple(name for name in plan.inputs if name not in names)
        self._taken = tuple(taken)
        self._in_place = dict(in_place)
        # on a device of shared memory: where each input lies, noted as written (``CallPlan._touched``) while the
        # arena keeps scratch staged from its bytes
        self._device = plan._touched is not None
        self._ranges = {slot.name: (slot.offset, slot.raw.size) for slot in plan._slots}

    def __call__(self, args: Sequence[Any]) -> list[np.ndarray]:
        plan = self.plan
        with plan._lock:
            if plan._slots is not self._slots:
                raise RlxError("this HostCall's plan was freed since; bind another")
            if self._device:  # the launches before are done with the arena's bytes (one wait, as ``CallPlan.call``)
                plan._finish()
            recorded, written = plan._stamps, None
            if recorded:  # a call of the plan (``CallPlan.call``) may have written these with stamps
                for name in self._unstamped:
                    recorded.pop(name, None)
            try:
                for at, put in self.writes:
                    put(args[at])
                for name, at, put, stamp_of in self.stamped:
                    arg = args[at]
                    stamp = stamp_of(arg)
                    if stamp is None or not self._kept[name] or recorded.get(name, _ABSENT) != stamp:
                        recorded.pop(name, None)  # set once written: a write that fails leaves none
                        put(arg)
                        written = (*written, name) if written else (name,)
                        if stamp is not None:
                            recorded[name] = stamp
            except BaseException:  # a place may be half written: every input is written again next call
                recorded.clear()
                raise
            if self._device and plan._arena.handle.kept:  # kept scratch staged from what changed is stale
                for name in (*self._unstamped, *(written or ())):
                    plan._touched(plan._arena.handle, *self._ranges[name])
            if not self.handed:  # every input written (a decode step's small ones): the run alone
                outputs = plan._run({}, [], None)
                return [outputs[j] for j in self._taken]
            arrays = [view(args[at]) for _, at, view in self.handed]
            if self._hand and plan._given is not None:  # read where they lie, if the kernel takes them
                handed = {i: array for (i, _, _), array in zip(self.handed, arrays)}
            else:  # small, refused by the kernel once, or on a device (no ``given``): copied in
                handed = {}
                for (i, _, _), array in zip(self.handed, arrays):
                    self._slots[i].array[...] = array
            # an output the kernel updates in place of a handed input comes back in that input's own array
            into = [arrays[self._in_place[j]] if j in self._in_place else None for j in range(len(plan.outputs))
                    ] if self._in_place else None
            outputs = plan._run(handed, [], into)
        return [outputs[j] for j in self._taken]
