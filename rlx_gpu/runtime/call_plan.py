"""A call plan: one schedule called again and again on one device, each call doing only what changed.

``plan = CallPlan(schedule, device)``; ``outs = plan(inputs, stamps)``. The first call binds the
schedule (placement, runners, data checks: ``Device.bind``), allocates its resident arena and works out
once where each input and output lies and how it moves. Every call then copies the inputs in, runs
the bound steps (``Device.execute``: the checks, fallbacks and report of ``Device.run``) and copies the
outputs out, into new arrays the caller owns, in their storage dtype.

A stamp (any hashable: the torch side passes ``(data_ptr, tensor._version)``) marks an input's value: an input
given with the stamp of its last write is not written again, so weights cross once per version, not once per
call. An input some thunk writes (a carried state updated in place) or that shares bytes with another input is
written on every call whatever its stamp.

Where the arena is host memory (the host; an OpenCL CPU device's shared memory, ``Session.shared``) an input is
one copy into its place in the arena and an output one copy out, after the launches before are waited for (on a
device, one wait per call); on the host, a one-thunk schedule's large tensors go to its kernel where the caller
holds them, without a copy where it takes them (``given``), and a caller may write the inputs itself
(``host_call.HostCall``). On another device every copy is a command of its own (about 15 µs on PoCL): the inputs
are staged in host buffers of the plan and sent by one copy per cluster of neighbouring inputs (``Staging``), the
outputs read by one copy per span of neighbours, and the integer tensors an early data check reads come from
those host buffers, not from the device; ``last_report.copies`` counts the commands.

On CUDA, ``plan.on_stream(inputs, outputs, stream)`` runs a call whose tensors stay on the device, every copy
and launch enqueued on the caller's stream (torch's current stream) and nothing waited for, so the caller may
capture the call into a CUDA graph of its own: each input is one device-to-device copy into the resident arena,
each output one out of it into memory the caller allocated. Its rules are on that method.
"""
from __future__ import annotations

import itertools
import threading
import warnings
import weakref
from typing import Any, Hashable, Mapping, NamedTuple, Sequence

import numpy as np

from host_fallback.abi import SCAN_OPS, Region, footprint
from host_fallback.arena import view

from ..errors import InputError, RlxError, RunError
from ..schedule.io import load_schedule
from ..schedule.model import TensorView
from .arena import Arena, host_array, read_spans, span_view
from .dlpack import DeviceTensor, import_tensor
from .executor import BoundSchedule, Device, LastReport, RunReport
from .given import Given, gathered, given_layout, handed_outputs
from .staging import Staging

_ABSENT = object()
_NO_STAMPS = itertools.repeat(None)  # a call given no stamps: None for every input
_LEGACY_STREAM = 1  # DLPack's (and CUDA's cudaStreamLegacy) name of the legacy default stream


class _Input(NamedTuple):
    """One input: ``array`` is where a call copies it (in an arena of host memory its place there, on
    another device the plan's staging buffer), ``raw`` the same bytes as ``uint8`` (a tuple: a call
    unpacks it)."""

    name: str
    shape: tuple[int, ...]
    array: np.ndarray
    raw: np.ndarray
    offset: int
    kept: bool  # no thunk writes it and no other input shares its bytes: an unchanged stamp skips its write
    cluster: int  # staged: the index of the staging buffer it lies in (-1 in an arena of host memory)


def _overlap(a: TensorView | Region, b: TensorView | Region) -> bool:
    """Whether two tensors of one arena share a byte."""
    return a.offset < b.offset + b.nbytes and b.offset < a.offset + a.nbytes


class CallPlan:
    """``schedule`` (a ``Schedule`` or anything ``load_schedule`` reads) called repeatedly on ``device``
    (a ``runtime.executor.Device``), on a resident arena of its own.

    ``inputs`` and ``outputs`` name the schedule's tensors. ``profile`` waits for each thunk so its
    record in ``last_report`` (None before a call) holds its own time. Calls of one plan take turns (a lock);
    ``free()``, leaving a ``with`` block or garbage collection releases the arena."""
    last_report = LastReport()  # kept in ``_report``

    def __init__(self, schedule: Any, device: Device, *, profile: bool = False):
        self.schedule = load_schedule(schedule)
        self.device = device
        self.profile = profile
        self.inputs: tuple[str, ...] = tuple(self.schedule.inputs)
        self.outputs: tuple[str, ...] = tuple(self.schedule.outputs)
        self._report: RunReport | tuple | None = None  # ``last_report`` (``LastReport``)
        self._lock = threading.Lock()
        self._slots: tuple[_Input, ...] | None = None
        self._names = frozenset(self.inputs)
        self._stamps: dict[str, Hashable] = {}  # input -> the stamp of its last write
        self._bound: BoundSchedule | None = None
        self._arena: Arena | None = None
        self._release: weakref.finalize | None = None
        self._staging: Staging | None = None  # None where the arena is host memory (written in place)
        self._given: Given | None = None  # on the host, the tensors a call may hand its kernel as they lie
        self._host_outputs: tuple[np.ndarray, ...] = ()  # in place: each output's arena view, in order
        self._spans: tuple[tuple[int, int, tuple[tuple[str, TensorView], ...]], ...] = ()  # staged: the reads
        self._touched: Any = None  # in place on a device: what notes a write (kept scratch staged from it is stale)
        self._freed = False
        self._on_stream = False  # the path of the latest call: its stamps mean nothing to the other path
        self._stream_ready = False  # an eager call on a stream has bound and allocated all a capture needs

    def __repr__(self) -> str:
        state = "freed" if self._freed else "bound" if self._slots is not None else "not called yet"
        return f"CallPlan({self.device!r}, inputs {list(self.inputs)}, outputs {list(self.outputs)}, {state})"

    def __enter__(self) -> "CallPlan":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.free()

    def __call__(self, inputs: Mapping[str, Any], stamps: Mapping[str, Hashable] | None = None
                 ) -> dict[str, np.ndarray]:
        """Run once: ``inputs`` (name -> host array of any strides, or a DLPack producer in host memory) are
        converted to their storage dtype (rounding to nearest even) and copied in; returns every output by
        name, a new array in its storage dtype.

        ``stamps`` (name -> hashable): an input whose stamp equals the one of its last write is not written
        (and may be left out of ``inputs``); an input given without a stamp (or with None) is written and its
        stamp forgotten. Every input must be given on the first call."""
        if not (self._names.issuperset(inputs) and (not stamps or self._names.issuperset(stamps))):
            raise self._unknown(inputs, stamps or {})
        values = [inputs.get(name, _ABSENT) for name in self.inputs]
        given = [stamps.get(name) for name in self.inputs] if stamps else None
        return dict(zip(self.outputs, self.call(values, given)))

    def call(self, values: Sequence[Any], stamps: Sequence[Hashable | None] | None = None,
             into: Sequence[np.ndarray | None] | None = None) -> list[np.ndarray]:
        """``plan(inputs, stamps)`` with the inputs and their stamps (None: none) given in the order of ``inputs``,
        and the outputs returned in the order of ``outputs``: what a caller that binds a signature once calls (no
        name is looked up). ``into`` (in the order of ``outputs``; None: a new array) names arrays of the
        outputs' shapes the outputs are written to (converted to their dtype) and returned as."""
        with self._lock:
            slots = self._slots if self._slots is not None else self._prepare()
            if len(values) != len(slots):
                raise InputError(f"{len(values)} inputs given; the plan takes {len(slots)}: {list(self.inputs)}")
            if self._on_stream:
                self._switch_path(False)
            recorded, arena, staging, staged, touched = self._stamps, self._arena, self._staging, [], self._touched
            if touched is not None:  # in place on a device: the launches before are done with the arena's bytes
                self._finish()
            layout, handed = self._given, {}  # handed: input index -> the caller's array the kernel reads
            for i, (slot, value, stamp) in enumerate(zip(slots, values, stamps or _NO_STAMPS)):
                if stamp is not None and slot.kept and recorded.get(slot.name, _ABSENT) == stamp:
                    continue
                if type(value) is not np.ndarray:
                    if value is _ABSENT:
                        raise self._missing(slot.name, stamp)
                    value = host_array(slot.name, value)
                if value.shape != slot.shape:
                    raise InputError(f"input {slot.name!r} has shape {list(value.shape)}, expected {list(slot.shape)}")
                if recorded:  # the stamp is dropped before the write and set after it: one that fails leaves none
                    recorded.pop(slot.name, None)
                if layout is not None and stamp is None and layout.inputs[i] and value.dtype == slot.array.dtype \
                        and value.flags.c_contiguous:
                    handed[i] = value  # read where the caller holds it (``given``), if the kernel takes it
                    continue
                slot.array[...] = value  # converted to the storage dtype, rounding to nearest even
                if staging is not None:
                    staged.append(slot)
                elif touched is not None:
                    touched(arena.handle, slot.offset, slot.raw.size)
                if stamp is not None:
                    recorded[slot.name] = stamp
            return self._run(handed, staged, into)

    def _run(self, handed: dict[int, np.ndarray], staged: list[_Input], into: Any) -> list[np.ndarray]:
        """The run once the inputs are in (``staged``: to send; ``handed``: the kernel's as they lie), locked."""
        if handed or self._given is not None and self._given.new_outputs:
            out = self._call_given(handed, into)
            if out is not None:
                return out
        try:
            if staged:
                self._staging.stage(self._arena, staged)
            report = self.device.execute(self._bound, self._arena, profile=self.profile,
                                         held=None if self._staging is None else self._staging.held)
        except RunError:  # refused by a data check after the inputs went in: the stamps hold
            raise
        except BaseException:  # the device may have missed a write: write every input again next call
            self._stamps.clear()
            raise
        self._report = report  # ``last_report``
        return self._outputs(report, into)

    def _call_given(self, handed: dict[int, np.ndarray], into: Sequence[np.ndarray | None] | None
                    ) -> list[np.ndarray] | None:
        """The run with the ``handed`` inputs (index -> array) read where the caller holds them and the outputs
        ``given.handed_outputs`` names written in place of the arena; None where the kernel does not take them
        (nothing ran: they are copied into the arena for the run as ever)."""
        given = {self._slots[i].offset: value for i, value in handed.items()}
        handed_out = handed_outputs(self._given, self._host_outputs, given, handed, into)
        report = self.device.execute_given(self._bound, self._arena, given)
        if report is None:  # not taken (no compiled kernel, another path, arrays it refuses): not offered again
            self._given = None
            for i, value in handed.items():
                self._slots[i].array[...] = value
            return None
        self._report = report  # ``last_report``
        return gathered(handed_out, self._host_outputs, into)

    def on_stream(self, inputs: Mapping[str, Any], outputs: Mapping[str, Any], stream: int,
                  stamps: Mapping[str, Hashable] | None = None) -> RunReport:
        """Run once on a CUDA plan, every tensor on the device and every copy and launch enqueued on the caller's
        CUDA ``stream`` (a ``cudaStream_t`` as an int: ``torch.cuda.current_stream().cuda_stream``); the report.

        ``inputs`` (name -> a DLPack producer in the plan device's memory, dense, in the input's storage dtype)
        are copied device to device into the resident arena, ``outputs`` (every output by name, likewise: memory
        the caller allocated, e.g. ``torch.empty`` on the device) filled device to device from it. Nothing waits
        for the device and nothing crosses to the host, so the call may be captured into the caller's CUDA
        graph, with these rules:

        - the first call of a plan binds it (kernels built, arena and scratch allocated and uploaded):
          make it eagerly, as torch's own warm-up before a capture;
        - while ``stream`` captures, every input is copied whatever its stamp (a replay then reads the
          inputs' memory as it is at replay time, as a torch op does) and no stamp is kept;
        - the integer tensors of ABI.md §8 (``seq_lens``, ``cu_seqlens``, ``state_slots``) are checked on
          an eager call, by one read of them from the arena (which waits for the stream); a capture
          cannot read them, and the kernels trust them, so a plan that has them is refused a capture
          (``RunError`` naming the thunk and the field), as is a plan with a thunk falling back to the
          host or a scan (their drivers move bytes through the host).
        """
        with self._lock:
            session = self.device.session
            if self.device.on_host or not hasattr(session, "on_stream"):
                raise RlxError(f"CallPlan.on_stream runs on a CUDA device; this plan runs on {self.device.spec}: "
                               f"call it with host arrays")
            if not (self._names.issuperset(inputs) and (not stamps or self._names.issuperset(stamps))):
                raise self._unknown(inputs, stamps or {})
            with session.on_stream(stream):
                capturing = session.prims.stream_is_capturing()
                if capturing and not self._stream_ready:
                    raise RlxError("the first call of a plan on a stream binds it (builds kernels, allocates and "
                                   "uploads its arena and scratch), which a CUDA graph capture cannot hold; call it "
                                   "once eagerly on the stream first")
                slots = self._slots if self._slots is not None else self._prepare()
                if capturing:
                    self._refuse_capture()
                self._switch_path(True)
                targets = self._targets(outputs, stream)
                recorded, handle, moved = self._stamps, self._arena.handle, 0
                try:
                    for slot in slots:
                        name = slot.name
                        stamp = None if capturing or not stamps else stamps.get(name)
                        if stamp is not None and slot.kept and recorded.get(name, _ABSENT) == stamp:
                            continue
                        values = inputs.get(name, _ABSENT)
                        if values is _ABSENT:
                            raise self._missing(name, stamp)
                        recorded.pop(name, None)
                        session.import_device(handle, slot.offset, self._device_tensor(
                            f"input {name!r}", values, stream, self.schedule.tensors[name]))
                        moved += 1
                        if stamp is not None:
                            recorded[name] = stamp
                    report = self.device.execute(self._bound, self._arena, profile=self.profile, checks=not capturing)
                except RunError:  # refused by a data check after the inputs went in: the stamps hold
                    raise
                except BaseException:
                    recorded.clear()
                    raise
                for offset, tensor in targets:
                    session.export_device(handle, offset, tensor)
            report.copies += moved + len(targets)
            self._stream_ready = True
            self._report = report  # ``last_report``
            return report

    def _switch_path(self, on_stream: bool) -> None:
        """Forget every stamp when a call takes the other path than the latest one: a stream call leaves
        the host path's staging buffers behind the arena, and each path's stamps speak of its own copies."""
        if self._on_stream != on_stream:
            self._stamps.clear()
            self._on_stream = on_stream

    def _refuse_capture(self) -> None:
        """Refuse a capture of a plan whose run must read the device or move bytes through the host."""
        for check in (*self._bound.early_checks, *self._bound.late_checks.values()):
            fields = ", ".join(repr(r.field) for r in check.regions)
            raise RunError(f"thunk {check.thunk.index} ({check.thunk.op}): its integer tensors ({fields}) are "
                           f"checked by reading them from the device (ABI.md §8), which a CUDA graph capture "
                           f"cannot do, and the kernels trust them; call it eagerly")
        for thunk, backend, _ in self._bound.steps:
            if backend != self.device.session.info.backend or thunk.op in SCAN_OPS:
                why = "falls back to the host" if backend != self.device.session.info.backend else \
                    "is a scan, whose driver moves bytes through the host"
                raise RunError(f"thunk {thunk.index} ({thunk.op}) {why}, which a CUDA graph capture cannot "
                               f"hold; call it eagerly")

    def _targets(self, outputs: Mapping[str, Any], stream: int) -> list[tuple[int, DeviceTensor]]:
        """Each output's arena offset and the caller's device memory it goes to, checked before anything runs."""
        if set(outputs) != set(self.outputs):
            raise InputError(f"outputs {sorted(outputs)} given; the plan's outputs are {list(self.outputs)}, "
                             f"each needs device memory of its own")
        tensors = self.schedule.tensors
        return [(tensors[name].offset, self._device_tensor(f"output {name!r}", outputs[name], stream, tensors[name]))
                for name in self.outputs]

    def _device_tensor(self, what: str, obj: Any, stream: int, v: TensorView) -> DeviceTensor:
        # DLPack names the legacy default stream 1: 0 (torch's default stream) is ambiguous there and refused
        tensor = import_tensor(obj, stream=stream or _LEGACY_STREAM)
        if not isinstance(tensor, DeviceTensor):
            raise InputError(f"{what} lies in host memory; CallPlan.on_stream takes device memory on "
                             f"{self.device.spec} (call the plan itself with host arrays)")
        if tensor.dtype != v.dtype or tensor.shape != v.shape:
            raise InputError(f"{what} is {tensor.dtype} {list(tensor.shape)}, expected {v.dtype} {list(v.shape)} "
                             f"(on the stream path nothing is converted)")
        return tensor

    def _finish(self) -> None:
        """Wait for the launches the device has not finished (nothing on the host)."""
        session = self.device.session
        with session.lock:
            session.finish()

    def _outputs(self, report: RunReport, into: Sequence[np.ndarray | None] | None) -> list[np.ndarray]:
        """Every output, in the order of ``outputs``: a new array of its own, or written to its ``into`` array."""
        if self._staging is None:
            if self._touched is not None:
                self._finish()
            out, own = self._host_outputs, False  # views of the arena
        else:
            session, handle, spans = self.device.session, self._arena.handle, {}
            with session.lock:
                for lo, nbytes, members in self._spans:
                    span = session.read(handle, lo, nbytes)
                    spans.update((name, span_view(span, v, lo)) for name, v in members)
            report.copies += len(self._spans)
            out, own = [spans[name] for name in self.outputs], True  # read from the device: new arrays
        if into is None:
            return list(out) if own else [array.copy() for array in out]
        for array, target in zip(out, into):
            if target is not None:
                target[...] = array  # converted to its dtype, rounding to nearest even
        return [target if target is not None else array if own else array.copy() for array, target in zip(out, into)]

    def _prepare(self) -> tuple[_Input, ...]:
        """Bind, allocate the arena and place every input and output (the first call)."""
        if self._freed:
            raise RlxError("this CallPlan was freed; make another with CallPlan(schedule, device)")
        device, schedule = self.device, self.schedule
        self._bound = device.bind(schedule)
        if self._bound.warning:
            warnings.warn(self._bound.warning, stacklevel=4)  # once per plan, at its caller's first call
        self._arena = device.arena(schedule)
        self._release = weakref.finalize(self, self._arena.free)
        tensors, handle, session = schedule.tensors, self._arena.handle, device.session
        written = [w for thunk in schedule.thunks for w in footprint(thunk)[1]]
        memory = session.host_view(handle) if session.shared else None
        self._staging = None if session.shared else Staging(schedule, self.inputs, written)
        self._touched = session.touched if session.shared and not device.on_host else None
        slots = []
        for name in self.inputs:
            v = tensors[name]
            kept = not any(_overlap(v, w) for w in written) and not any(
                _overlap(v, tensors[other]) for other in self.inputs if other != name)
            if self._staging is None:
                array, cluster = view(memory, v.offset, v.dtype, v.shape), -1
            else:
                array, cluster = self._staging.array(name, v), self._staging.cluster[name]
            slots.append(_Input(name, v.shape, array, array.reshape(-1).view(np.uint8), v.offset, kept, cluster))
        outputs = [tensors[name] for name in self.outputs]
        self._host_outputs = tuple(view(memory, v.offset, v.dtype, v.shape) for v in outputs) if session.shared else ()
        self._spans = () if session.shared else tuple((lo, nbytes, tuple((self.outputs[i], outputs[i]) for i in members))
                                                      for lo, nbytes, members in read_spans(outputs))
        self._given = given_layout(schedule, self.inputs, self.outputs) if self._bound.given is not None else None
        self._slots = tuple(slots)
        return self._slots

    def _missing(self, name: str, stamp: Hashable) -> InputError:
        if not next(s for s in self._slots if s.name == name).kept:
            why = "a thunk of the schedule writes it (or it shares bytes with another input), so every call writes it"
        elif name not in self._stamps:
            why = "an input is needed on every call until it has been written with a stamp"
        elif stamp is None:
            why = "an input may be left out only with the stamp of its last write"
        else:
            why = f"its stamp {stamp!r} is not the one of its last write ({self._stamps[name]!r})"
        return InputError(f"input {name!r} is missing: {why}; the plan takes the inputs {list(self.inputs)}")

    def _unknown(self, inputs: Mapping[str, Any], stamps: Mapping[str, Hashable]) -> InputError:
        unknown = [n for n in inputs if n not in self._names] + [n for n in stamps if n not in self._names]
        return InputError(f"the schedule has no input {', '.join(map(repr, dict.fromkeys(unknown)))}; "
                          f"its inputs are {list(self.inputs)}")

    def free(self) -> None:
        """Release the resident arena; a call afterwards is refused (a second free does nothing)."""
        with self._lock:
            self._freed = True
            if self._release is not None:
                self._release()
            self._slots = self._arena = self._bound = self._staging = self._touched = None
            self._host_outputs = self._spans = ()
            self._stream_ready = False
            self._stamps.clear()
