"""Lowering a graph: prune, lay out the arena, and emit the JSON form of a schedule (ABI.md §2).

The result goes through ``load_schedule``, so the validator checks everything the builder emits.
"""
from __future__ import annotations

import base64
import itertools
from typing import Any, Mapping

import numpy as np

from host_fallback.arena import load

from ..errors import GraphError
from ..runtime.executor import Device, get_device
from ..schedule.io import load_schedule
from ..schedule.model import ABI_VERSION, Schedule
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


class _Lowering:
    """Lowers a graph and every body it nests, each once."""

    def __init__(self) -> None:
        self.done: dict[int, tuple[dict[str, Any], ArenaLayout]] = {}

    def graph(self, graph: BodyGraph) -> tuple[dict[str, Any], ArenaLayout]:
        if id(graph) in self.done:
            return self.done[id(graph)]
        if not graph.outputs:
            raise GraphError("the graph has no outputs: mark at least one with graph.output(name, tensor)")
        nodes = live_nodes(graph)
        pinned_in = [t.buf for t in itertools.chain(graph.inputs.values(), graph.weights.values())]
        pinned_out = [t.buf for t in graph.outputs.values()]
        used = {t.buf for n in nodes for t in n.tensors()} | set(pinned_in) | set(pinned_out)
        arena = arena_layout({buf: graph.buffers[buf] for buf in sorted(used)},
                     [[t.buf for t in n.tensors()] for n in nodes], pinned_in, pinned_out)
        off = arena.offsets
        named = {**graph.inputs, **{k: v for k, v in graph.weights.items() if not k.startswith("const.")},
                 **graph.outputs}
        schedule = {
            "abi": ABI_VERSION,
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
                return off[v.buf]
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
    schedule, arena = _Lowering().graph(graph)
    return schedule, arena.report


class Executable:
    """A compiled graph: ``run(**inputs)`` returns the outputs by name.

    Inputs are converted to the storage type (rounding to nearest even into f16/bf16) and outputs
    come back in the compute type (f32 for 16-bit storage, f64 for f64).
    """

    def __init__(self, schedule: Schedule, layout_report: LayoutReport, device: str | None):
        self.schedule = schedule
        self.layout_report = layout_report
        self.device_spec = device
        self._device: Device | None = None

    @property
    def device(self) -> Device:
        if self._device is None:
            self._device = get_device(self.device_spec)
        return self._device

    def run(self, **arrays: Any) -> dict[str, np.ndarray]:
        """Run once: ``arrays`` by input name in, every output by name out."""
        missing = [n for n in self.schedule.inputs if n not in arrays]
        extra = [n for n in arrays if n not in self.schedule.inputs]
        if missing or extra:
            raise GraphError(f"run() takes the inputs {list(self.schedule.inputs)}; missing {missing}, "
                             f"unknown {extra}")
        arena = self.schedule.pristine_arena()
        for name in self.schedule.inputs:
            view = self.schedule.tensors[name]
            values = np.asarray(arrays[name], dtype=np.float64)  # one rounding, straight into storage
            if values.shape != view.shape:
                raise GraphError(f"input {name!r} has shape {list(values.shape)}, expected {list(view.shape)}")
            view.write(arena, values)
        arena = self.device.run(self.schedule, arena)
        return {n: load(arena, self.schedule.tensors[n].offset, self.schedule.tensors[n].dtype,
                        self.schedule.tensors[n].shape) for n in self.schedule.outputs}


def compile_graph(graph: BodyGraph, device: str | None = None) -> Executable:
    """Lower, validate and bind ``graph`` to ``device``."""
    schedule, report = lower(graph)
    return Executable(load_schedule(schedule), report, device)
