"""Lowering a graph: prune, lay out the arena, and emit the JSON form of a schedule (ABI.md §2).

The result goes through ``load_schedule``, so the validator checks everything the builder emits.
"""
from __future__ import annotations

import base64
import collections
import itertools
import threading
from typing import Any, Mapping

import numpy as np

from host_fallback.abi import ELEM_SIZE, OPS, used
from host_fallback.arena import COMPUTE, STORAGE

from ..errors import GraphError
from ..runtime.call_plan import CallPlan
from ..runtime.config import check_spec
from ..runtime.executor import Device, get_device
from ..schedule.io import load_schedule
from ..schedule.model import ABI_V1, ABI_V2, Schedule
from .layout import ArenaLayout, LayoutReport, arena_layout
from .nodes import BodyGraph, Node, Slot, Tensor


def live_nodes(graph: BodyGraph) -> list[Node]:
    """The nodes that contribute to an output, in order (a vjp graph replays more than it needs)."""
    needed = {t.buf for t in graph.outputs.values()}
    kept: list[Node] = []
    for node in reversed(graph.nodes):
        if any(t.buf in needed for t in node.writes):
            kept.append(node)
            needed.update(t.buf for t in node.tensors())
    return kept[::-1]


def elided_copies(graph: BodyGraph, nodes: list[Node]) -> dict[int, int]:
    """``{copy dst: its src}`` for every copy of a top-level input that nothing else reads or returns.

    The builder copies a carried state before a thunk updates it in place, so the caller's tensor
    stays intact; at the top level an input is written afresh before every run, so when nothing else
    reads it the thunk may update the input's own bytes and the copy is left out (one thunk less per
    decode step). Body graphs keep their copies: the scan driver reuses a body's inputs across steps.
    """
    inputs = {t.buf for t in graph.inputs.values()}
    outputs = {t.buf for t in graph.outputs.values()}
    readers = collections.Counter(t.buf for n in nodes for t in n.tensors())
    same = {}
    for n in nodes:
        if n.op != "copy":
            continue
        src, dst = n.fields["src"], n.fields["dst"]
        if (src.buf in inputs and src.buf not in outputs and readers[src.buf] == 1 and dst.buf not in inputs
                and graph.buffers[src.buf] == graph.buffers[dst.buf] == n.fields["nbytes"]):
            same[dst.buf] = src.buf
    return same


class _Lowering:
    """Lowers a graph and every body it nests, each once."""

    def __init__(self) -> None:
        self.done: dict[int, tuple[dict[str, Any], ArenaLayout]] = {}

    def graph(self, graph: BodyGraph, top: bool = False) -> tuple[dict[str, Any], ArenaLayout]:
        if id(graph) in self.done:
            return self.done[id(graph)]
        if not graph.outputs:
            raise GraphError("the graph has no outputs: mark at least one with graph.output(name, tensor)")
        nodes = live_nodes(graph)
        same = elided_copies(graph, nodes) if top else {}
        nodes = [n for n in nodes if not (n.op == "copy" and n.fields["dst"].buf in same)]

        def buf(t: Tensor) -> int:
            return same.get(t.buf, t.buf)

        pinned_in = [t.buf for t in itertools.chain(graph.inputs.values(), graph.weights.values())]
        pinned_out = [buf(t) for t in graph.outputs.values()]
        used = {buf(t) for n in nodes for t in n.tensors()} | set(pinned_in) | set(pinned_out)
        arena = arena_layout({b: graph.buffers[b] for b in sorted(used)},
                             [[buf(t) for t in n.tensors()] for n in nodes], pinned_in, pinned_out)
        off = {**arena.offsets, **{dst: arena.offsets[src] for dst, src in same.items()}}
        named = {**graph.inputs, **{k: v for k, v in graph.weights.items() if not k.startswith("const.")},
                 **graph.outputs}
        schedule = {
            "abi": ABI_V1,
            "arena_bytes": arena.arena_bytes,
            "tensors": {k: {"offset": off[t.buf], "dtype": t.dtype, "shape": list(t.shape)} for k, t in named.items()},
            "inputs": list(graph.inputs),
            "outputs": list(graph.outputs),
            "init": [{"offset": off[t.buf], "b64": base64.b64encode(graph.init[t.buf]).decode()}
                     for t in graph.weights.values() if graph.init[t.buf]],
            "thunks": [self.thunk(n, off) for n in nodes if n.op != "reshape"],
        }
        self.done[id(graph)] = schedule, arena
        return schedule, arena

    def thunk(self, node: Node, off: Mapping[int, int]) -> dict[str, Any]:
        def resolve(v: Any) -> Any:
            if isinstance(v, Tensor):
                return off[v.buf] + v.offset * ELEM_SIZE[v.dtype]
            if isinstance(v, Slot):
                return self.graph(v.graph)[1].offsets[v.tensor.buf]
            if isinstance(v, BodyGraph):
                return self.graph(v)[0]
            if isinstance(v, (list, tuple)):
                return [resolve(x) for x in v]
            return v

        return {"op": node.op, "dtype": node.dtype, **{k: resolve(v) for k, v in node.fields.items()}}


def lower(graph: BodyGraph) -> tuple[dict[str, Any], LayoutReport]:
    """The JSON form of ``graph``'s schedule and the layout report for its (outer) arena."""
    schedule, arena = _Lowering().graph(graph, top=True)
    nested = list(_schedules(schedule))
    # version 2 only where a §8 field or a §9 op is used
    if any(used(thunk) or OPS[thunk["op"]].version == 2 for s in nested for thunk in s["thunks"]):
        for s in nested:
            s["abi"] = ABI_V2
    return schedule, arena.report


def _schedules(schedule: dict[str, Any]) -> Any:
    """``schedule`` and every body it nests (each once; a body lowered once may appear twice)."""
    seen: set[int] = set()
    todo = [schedule]
    while todo:
        s = todo.pop()
        if id(s) in seen:
            continue
        seen.add(id(s))
        yield s
        todo += [v for thunk in s["thunks"] for v in thunk.values() if isinstance(v, dict) and "thunks" in v]


class Executable:
    """A compiled graph: ``run(**inputs)`` returns the outputs by name.

    Runs go through a :class:`~rlx_gpu.runtime.call_plan.CallPlan` made on the first run: a resident
    arena on the device (zeros plus ``init``: the weights) that every run writes only the inputs into,
    runs in place and reads only the outputs of. Inputs are NumPy arrays or any DLPack producer (torch
    bf16 included), converted to the storage type (rounding to nearest even into f16/bf16); outputs
    come back in the compute type (f32 for 16-bit storage, f64 for f64). Runs of one Executable take
    turns, since they share the arena.
    """

    def __init__(self, schedule: Schedule, layout_report: LayoutReport, device: str | None):
        self.schedule = schedule
        self.layout_report = layout_report
        self.device_spec = device
        self._device: Device | None = None
        self._plan: CallPlan | None = None
        self._lock = threading.Lock()  # the first run makes the plan once
        self._compute = {n: COMPUTE.get(schedule.tensors[n].dtype, STORAGE[schedule.tensors[n].dtype])
                         for n in schedule.outputs}  # an i32 output stays int32

    @property
    def device(self) -> Device:
        if self._device is None:
            self._device = get_device(self.device_spec)
        return self._device

    @property
    def plan(self) -> CallPlan:
        """The call plan every run goes through (made on first use, on :attr:`device`)."""
        if self._plan is None:
            with self._lock:
                if self._plan is None:
                    self._plan = CallPlan(self.schedule, self.device)
        return self._plan

    def run(self, **arrays: Any) -> dict[str, np.ndarray]:
        """Run once: ``arrays`` by input name in, every output by name out.

        Returns
        -------
        dict of str to numpy.ndarray
            Each output in its compute dtype: float32 for f32, f16 and bf16 tensors, float64 for f64.
            An f16 or bf16 output holds exactly the 16-bit values stored in the arena, widened to
            float32 (a lossless conversion); the ``read`` of a resident arena
            (``device.arena(schedule)``) and a ``CallPlan`` return the storage dtype itself.
        """
        compute = self._compute
        return {n: a.astype(compute[n], copy=False) for n, a in self.plan(arrays).items()}


def compile_graph(graph: BodyGraph, device: str | None = None) -> Executable:
    """Lower, validate and bind ``graph`` to ``device`` (a malformed spec is refused here, not at run)."""
    if device is not None:
        check_spec(device)
    schedule, report = lower(graph)
    return Executable(load_schedule(schedule), report, device)
