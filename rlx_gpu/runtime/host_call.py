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
bookkeeping. A caller that knows its inputs dense may give them by address (``moved``: one ``memmove`` each, no
writer's frame), and a plan of one host thunk with every input written runs that thunk straight
(``BoundSchedule.alone``), its report kept unmade until read (``executor.LastReport``); a decode step whose weight
streams are unchanged takes ``moving``, that call bound as one closure. On a device the writes wait for the
launches before, as ``call``'s do, and the kernel reads nothing where the caller holds it (``given`` is the
host's): a handed input is copied in, an output updated in place of it copied back.
"""
from __future__ import annotations

import ctypes
from typing import Any, Callable, Hashable, Sequence

import numpy as np

from ..errors import RlxError, RunError
from .call_plan import CallPlan

_ABSENT = object()
#: ``move(target, source, nbytes)``: C's memmove called holding the GIL. ``ctypes.memmove`` releases and takes back
#: the GIL around each call, which after a kernel that swept the cache costs more than moving a decode step's few
#: hundred bytes; the same function through ``PYFUNCTYPE`` keeps it (nothing else can run during a copy this short).
move = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(
    ctypes.cast(ctypes.memmove, ctypes.c_void_p).value)
_copy = np.ndarray.copy  # mapped without a comprehension's frame
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
    in ``in_place`` (output index -> the index of that input among ``handed``), that input's array itself.

    ``moved`` names the inputs ``writes`` writes, in order, where a caller may give them by address instead:
    ``host_call(args, addresses)`` moves each one's bytes from its address by one ``memmove``, its writer not
    called (a caller that knows each is dense, of its place's dtype and size: a decode step's checked tensors)."""

    __slots__ = ("plan", "writes", "stamped", "handed", "moved", "_hand", "_slots", "_kept", "_unstamped",
                 "_stamped_only", "_taken", "_in_place", "_alone", "_handle", "_views", "_targets", "_sizes", "_lock",
                 "_recorded", "moving", "_device", "_ranges")  # read as slots, not from an instance dictionary: a decode step reads a dozen

    def __init__(self, plan: CallPlan, writes: Sequence[Write], stamped: Sequence[Stamped],
                 handed: Sequence[tuple[int, int, Callable[[Any], np.ndarray]]], in_place: dict[int, int],
                 taken: Sequence[int], moved: Sequence[str] = ()):
        arena = places(plan, shared=True)
        if arena is None:
            raise RlxError(f"HostCall binds a plan whose arena is host memory (the host's, or a device's shared "
                           f"memory), called once already; this one is {plan!r}")
        layout = plan._given
        # the kernel reads the handed inputs where they lie where the plan's ``given`` layout lets it (each large
        # enough), else they are copied in and the outputs updated in place of them copied back
        self._hand = bool(handed) and layout is not None and all(layout.inputs[i] for i, _, _ in handed)
        self.plan, self.writes, self.stamped, self.handed = plan, tuple(writes), tuple(stamped), tuple(handed)
        self._slots = plan._slots
        self._kept = {slot.name: slot.kept for slot in plan._slots}  # an unchanged stamp skips the write
        names = frozenset(name for name, *_ in stamped)
        self._unstamped = tuple(name for name in plan.inputs if name not in names)
        self._stamped_only = names.issuperset  # whether the plan's recorded stamps are of stamped inputs alone
        self._taken = tuple(taken)
        self._in_place = dict(in_place)
        # every input written and no output handed over, a plan of one host thunk (a decode step's): that thunk run
        # straight (``BoundSchedule.alone``, not ``CallPlan._run``'s frames), each output taken copied from its view
        written = not handed and not (layout is not None and layout.new_outputs)
        self._alone = plan._bound.alone if written else None
        self._handle = plan._arena.handle
        self._views = tuple(plan._host_outputs[j] for j in self._taken) if self._alone is not None else ()
        self.moved = tuple(moved)
        self._targets = tuple(arena[name].ctypes.data for name in moved)
        self._sizes = tuple(arena[name].nbytes for name in moved)
        # the plan's lock and its recorded stamps: each the plan's own for life
        self._lock, self._recorded = plan._lock, plan._stamps
        self.moving = self._moving()
        # on a device of shared memory: where each input lies, noted as written (``CallPlan._touched``) while the
        # arena keeps scratch staged from its bytes
        self._device = plan._touched is not None
        self._ranges = {slot.name: (slot.offset, slot.raw.size) for slot in plan._slots}

    def _moving(self) -> Callable[[Any, Sequence[int]], tuple[np.ndarray, ...] | None] | None:
        """The fast case of ``host_call(args, addresses)`` bound as one closure (``moving``), for a call of a plan of
        one host thunk whose written inputs all come by address (``moved``) and whose stamped inputs are kept and
        share one argument and stamp function (a recurrent decode step: x and the states by address, the weight
        streams stamped by their packing's key): ``moving(arg, addresses)`` (``arg`` that shared argument) moves the
        inputs in, runs the thunk and returns the outputs taken, or returns None, doing nothing, where the stamp is
        None or the plan records another stamp than it, or one of another input (then ``host_call`` writes what is
        due). Each attribute read and loop of the general call after a kernel that swept the cache is a µs. None
        for another call."""
        common = {(at, stamp_of) for _, at, _, stamp_of in self.stamped}
        if not self.moved or self._alone is None or len(common) != 1 or not all(self._kept[n] for n, *_ in self.stamped):
            return None
        (_, stamp_of), = common
        plan, lock, slots, recorded, alone, handle = self.plan, self._lock, self._slots, self._recorded, self._alone, \
            self._handle
        names, moves, views = tuple(name for name, *_ in self.stamped), tuple(zip(self._targets, self._sizes)), self._views
        count = len(names)

        def moving(arg: Any, addresses: Sequence[int]) -> tuple[np.ndarray, ...] | None:
            stamp = stamp_of(arg)
            with lock:
                if plan._slots is not slots:
                    raise RlxError("this HostCall's plan was freed since; bind another")
                if stamp is None or len(recorded) != count:
                    return None
                for name in names:
                    if recorded.get(name, _ABSENT) is not stamp:
                        return None
                try:
                    for (target, nbytes), address in zip(moves, addresses):
                        move(target, address, nbytes)
                    report = alone(handle)
                except RunError:  # as the call's: the stamps hold
                    raise
                except BaseException:
                    recorded.clear()
                    raise
                plan._report = report  # kept unmade (``executor.LastReport``)
                return tuple(map(_copy, views))
        return moving

    def __call__(self, args: Sequence[Any], addresses: Sequence[int] | None = None) -> list[np.ndarray]:
        plan = self.plan
        with self._lock:
            if plan._slots is not self._slots:
                raise RlxError("this HostCall's plan was freed since; bind another")
            if self._device:  # the launches before are done with the arena's bytes (one wait, as ``CallPlan.call``)
                plan._finish()
            recorded, written = self._recorded, ()
            if recorded and not self._stamped_only(recorded):  # a call of the plan (``CallPlan.call``) wrote these
                for name in self._unstamped:
                    recorded.pop(name, None)
            try:
                if addresses is None:
                    for at, put in self.writes:
                        put(args[at])
                else:  # the bytes of each of ``moved`` where the caller holds them
                    for target, address, nbytes in zip(self._targets, addresses, self._sizes):
                        move(target, address, nbytes)
                for name, at, put, stamp_of in self.stamped:
                    arg = args[at]
                    stamp = stamp_of(arg)
                    if stamp is None or not self._kept[name]:
                        recorded.pop(name, None)
                        put(arg)
                        written += (name,)
                        continue
                    prior = recorded.get(name, _ABSENT)
                    if prior is stamp:  # the stamp this call wrote or found equal before: nothing to compare
                        continue
                    if prior != stamp:
                        recorded.pop(name, None)  # set once written: a write that fails leaves none
                        put(arg)
                        written += (name,)
                    recorded[name] = stamp  # kept as given: a caller giving the same object next compares nothing
                report = None if self._alone is None else self._alone(self._handle)
            except RunError:  # refused by a data check after the inputs went in: the stamps hold (``CallPlan._run``)
                raise
            except BaseException:  # a place may be half written: every input is written again next call
                recorded.clear()
                raise
            if self._device and plan._arena.handle.kept:  # kept scratch staged from what changed is stale
                for name in (*self._unstamped, *written):
                    plan._touched(plan._arena.handle, *self._ranges[name])
            if report is not None:  # every input written (a decode step's small ones): the run alone
                plan._report = report  # kept unmade (``executor.LastReport``)
                return list(map(_copy, self._views))
            if not self.handed:
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
