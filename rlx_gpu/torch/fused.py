"""One state-space or linear-attention call of the graph builder as a ``torch.autograd.Function``.

A ``FusedCall`` names a ``Graph`` method (``selective_scan``, ``mamba2``, ``gated_delta_net``), its
static keyword arguments and its tensors by the forward op's field names (ABI.md §4, §8). The forward
runs a graph holding that one call; the backward runs a graph holding the call and its
``Graph.backward``: the ``OP_backward`` thunk of ABI.md §9, which recomputes the forward from the same
inputs, so nothing but the inputs is kept between the two. Both graphs are compiled once per
signature (``bridge.run_graph``): a training loop plans nothing after its first step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Iterable, Mapping

import torch

from ..graph.builder import Graph
from ..graph.nodes import Tensor
from .bridge import rlx_dtype, run_graph

#: The positional arguments of each graph method, by field name, in order.
POSITIONAL: dict[str, tuple[str, ...]] = {"selective_scan": ("x", "delta", "a", "b", "c"),
                                          "mamba2": ("x", "dt", "a", "b", "c"),
                                          "gated_delta_net": ("q", "k", "v", "g", "beta")}
#: The graph methods' keyword for a field, where the two names differ.
KEYWORDS = {"d": "D", "state": "initial_state"}
#: The name a call gets in its graph: the builder names its final states' outputs ``{CALL}.state``,
#: ``{CALL}.h_n``, ``{CALL}.c_n``.
CALL = "call"
FINAL_STATE = f"{CALL}.state"


@dataclass(frozen=True)
class FusedCall:
    """One call: the graph method ``op``, its hashable keyword arguments and its tensors' field names."""

    op: str
    static: tuple[tuple[str, Hashable], ...]
    fields: tuple[str, ...]

    def emit(self, graph: Graph, tensors: dict[str, Tensor]) -> tuple[Tensor, Tensor | None]:
        """Declare the call in ``graph`` on ``tensors`` (by field); its output and final state (or None)."""
        args = [tensors[f] for f in POSITIONAL[self.op]]
        kwargs = {KEYWORDS.get(f, f): t for f, t in tensors.items() if f not in POSITIONAL[self.op]}
        out = getattr(graph, self.op)(*args, **kwargs, **dict(self.static), name=CALL)
        return out if isinstance(out, tuple) else (out, None)


def declare(graph: Graph, inputs: Mapping[str, torch.Tensor]) -> dict[str, Tensor]:
    """One graph input per torch tensor of ``inputs``, of its name, shape and element type."""
    return {name: graph.input(name, tuple(t.shape), rlx_dtype(t, name)) for name, t in inputs.items()}


def output_gradients(graph: Graph, y: Tensor, d_y: Tensor, d_state: dict[str, Tensor] | None,
                     wanted: Iterable[str]) -> None:
    """Emit the backward thunk of the call that returned ``y`` and mark the gradients of the ``wanted``
    fields as outputs ``grad.FIELD`` (no input ``d_...`` takes such a name). The call's own outputs (its
    final states) are unmarked first, so its forward thunk is pruned: the backward thunk recomputes what
    it needs of it."""
    grads = graph.backward(y, d_y, d_state)
    for name in [n for n in graph.outputs if n.startswith(f"{CALL}.")]:
        del graph.outputs[name]
    for field in wanted:
        graph.output(f"grad.{field}", grads[field])


def _forward_graph(call: FusedCall, inputs: dict[str, torch.Tensor]) -> Graph:
    graph = Graph()
    y, _ = call.emit(graph, declare(graph, inputs))
    graph.output("y", y)
    return graph


def _backward_graph(call: FusedCall, inputs: dict[str, torch.Tensor], wanted: tuple[str, ...]) -> Graph:
    graph = Graph()
    tensors = declare(graph, inputs)
    y, final = call.emit(graph, {f: tensors[f] for f in call.fields})
    d_state = {"state": tensors["d_final_state"]} if final is not None else None
    output_gradients(graph, y, tensors["d_dst"], d_state, wanted)
    return graph


def run_forward(call: FusedCall, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The call's output and final state (or None), without autograd."""
    inputs = dict(zip(call.fields, tensors))
    out = run_graph(("forward", call), lambda: _forward_graph(call, inputs), inputs)
    return out["y"], out.get(FINAL_STATE)


class FusedFunction(torch.autograd.Function):
    """``apply(call, *tensors)`` -> ``(y, final state or None)``, differentiable in every float tensor."""

    @staticmethod
    def forward(ctx: Any, call: FusedCall, *tensors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        y, final = run_forward(call, tensors)
        ctx.call = call
        ctx.save_for_backward(*tensors)
        ctx.has_final = final is not None
        return y, final

    @staticmethod
    def backward(ctx: Any, d_y: torch.Tensor, d_final: torch.Tensor | None) -> tuple[Any, ...]:
        # autograd materializes the gradient of an unused output as zeros; the final state's is None
        # when the call returned no state
        call: FusedCall = ctx.call
        tensors = ctx.saved_tensors
        wanted = tuple(f for f, need in zip(call.fields, ctx.needs_input_grad[1:]) if need)
        inputs = {**dict(zip(call.fields, tensors)), "d_dst": d_y}
        if ctx.has_final:
            inputs["d_final_state"] = d_final
        out = run_graph(("backward", call, wanted), lambda: _backward_graph(call, inputs, wanted), inputs)
        return (None, *(out.get(f"grad.{f}") for f in call.fields))


def cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``t`` in ``dtype`` (``t`` itself when it is already, without the cost of a ``to`` call; None stays None)."""
    return t if t is None or t.dtype == dtype else t.to(dtype)


def fused(op: str, tensors: dict[str, torch.Tensor | None], **static: Hashable) -> tuple[torch.Tensor, Any]:
    """Run graph method ``op`` on ``tensors`` (by field; ``None`` ones left out) with autograd.

    Returns the call's output and its final state (``None`` without an initial ``state``).
    """
    given = {f: t for f, t in tensors.items() if t is not None}
    call = FusedCall(op, tuple(sorted(static.items())), tuple(given))
    if torch.is_grad_enabled() and any(t.requires_grad for t in given.values()):
        return FusedFunction.apply(call, *given.values())
    return run_forward(call, tuple(given.values()))  # a decode step: no graph for autograd to record
