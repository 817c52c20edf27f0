"""lstm, gru and rnn as ``torch.autograd.Function``s: the forward thunk of ABI.md §3 forward, its §9
backward thunk backward.

The backward thunk recomputes the forward from the inputs it is given (the input, the weight
streams, the initial states and the lengths), so nothing but those inputs is kept between the two
passes. Gradients come back for the input, every weight stream and the initial states; a module
(``rlx_gpu.torch.nn``) packs its parameters into the streams with torch ops, so torch's autograd
carries the streams' gradients on to the parameters.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch.autograd.function import once_differentiable

from ..graph.builder import Graph
from ..graph.nodes import Tensor
from .bridge import rlx_dtype, run_graph
from .fused import CALL, declare, output_gradients


@dataclass(frozen=True)
class Recurrence:
    """The static arguments of one lstm, gru or rnn thunk: with the input shapes, what keys its schedules.

    ``proj_size`` applies to an lstm (torch's projection, ABI.md §8's ``w_hr``), ``relu`` to an rnn
    (torch's ``nonlinearity="relu"``; tanh otherwise).
    """

    op: str
    hidden: int
    num_layers: int = 1
    bidirectional: bool = False
    proj_size: int = 0
    relu: bool = False

    @property
    def weights(self) -> tuple[str, ...]:
        """The weight-stream fields of the thunk, in the order ``apply`` takes them."""
        if self.op == "gru":
            return "w_ih", "w_hh", "b_ih", "b_hh"
        return ("w_ih", "w_hh", "bias") + (("w_hr",) if self.proj_size else ())

    @property
    def states(self) -> tuple[str, ...]:
        """The carried-state fields, in the order ``apply`` takes and returns them."""
        return ("h0", "c0") if self.op == "lstm" else ("h0",)

    def emit(self, g: Graph, t: Mapping[str, Tensor]) -> Tensor:
        """Emit the forward thunk on the graph tensors ``t`` (by field; ``seq_lens`` optional); returns ``y``."""
        common = dict(hidden=self.hidden, num_layers=self.num_layers, bidirectional=self.bidirectional,
                      lengths=t.get("seq_lens"), name=CALL)
        if self.op == "lstm":
            out = g.lstm(t["x"], t["w_ih"], t["w_hh"], t["bias"], h0=t["h0"], c0=t["c0"], proj_size=self.proj_size,
                         w_hr=t.get("w_hr"), **common)
        elif self.op == "gru":
            out = g.gru(t["x"], t["w_ih"], t["w_hh"], t["b_ih"], t["b_hh"], h0=t["h0"], **common)
        else:
            out = g.rnn(t["x"], t["w_ih"], t["w_hh"], t["bias"], h0=t["h0"], relu=self.relu, **common)
        return out[0]


def _declared(inputs: Mapping[str, torch.Tensor]) -> tuple[Graph, dict[str, Tensor]]:
    """A graph of x's element type with one input per tensor of ``inputs``."""
    g = Graph(rlx_dtype(inputs["x"], "x"))
    return g, declare(g, inputs)


def _forward_graph(spec: Recurrence, inputs: Mapping[str, torch.Tensor]) -> Graph:
    """The forward thunk: outputs ``y`` and the final states ``{CALL}.h_n`` (and ``{CALL}.c_n``)."""
    g, t = _declared(inputs)
    g.output("y", spec.emit(g, t))
    return g


def _backward_graph(spec: Recurrence, inputs: Mapping[str, torch.Tensor]) -> Graph:
    """The backward thunk: outputs ``grad.NAME`` for the input, every weight stream and the initial states."""
    g, t = _declared(inputs)
    y = spec.emit(g, t)
    output_gradients(g, y, t["d_y"], {s: t[f"d_{s}"] for s in spec.states}, ("x", *spec.weights, *spec.states))
    return g


class RecurrentFunction(torch.autograd.Function):
    """``(y, *final_states) = apply(spec, seq_lens, x, *weight_streams, *initial_states)``.

    ``spec`` is a ``Recurrence``; ``seq_lens`` an int32 ``[batch]`` tensor or None; ``x [batch, seq,
    input_size]``; the weight streams are ABI.md §3's in ``spec.weights`` order; the states
    ``[num_layers*dirs, batch, width]`` in ``spec.states`` order. All floating-point tensors share x's
    dtype and device.
    """

    @staticmethod
    def forward(ctx: Any, spec: Recurrence, seq_lens: torch.Tensor | None, x: torch.Tensor,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        names = ("x", *spec.weights, *spec.states)
        inputs = dict(zip(names, (x, *tensors)))
        if seq_lens is not None:
            inputs["seq_lens"] = seq_lens
        out = run_graph(("forward", spec), lambda: _forward_graph(spec, inputs), inputs)
        ctx.spec, ctx.names = spec, tuple(inputs)
        ctx.save_for_backward(*inputs.values())
        finals = {"h0": f"{CALL}.h_n", "c0": f"{CALL}.c_n"}
        return (out["y"], *(out[finals[s]] for s in spec.states))

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, d_y: torch.Tensor, *d_finals: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        spec: Recurrence = ctx.spec
        inputs = dict(zip(ctx.names, ctx.saved_tensors))
        x = inputs["x"]
        inputs["d_y"] = d_y.to(x.dtype)
        inputs.update({f"d_{s}": d.to(x.dtype) for s, d in zip(spec.states, d_finals)})
        grads = run_graph(("backward", spec), lambda: _backward_graph(spec, inputs), inputs)
        return (None, None, grads["grad.x"], *(grads[f"grad.{name}"] for name in (*spec.weights, *spec.states)))


def recurrent(spec: Recurrence, x: torch.Tensor, weights: Mapping[str, torch.Tensor],
              states: Mapping[str, torch.Tensor], seq_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Run the thunk ``spec`` describes, differentiably: ``(y, h_n)`` or, for an lstm, ``(y, h_n, c_n)``.

    Parameters
    ----------
    spec : Recurrence
        The op and its static arguments.
    x : torch.Tensor
        ``[batch, seq, input_size]``, any strides.
    weights : mapping of str to torch.Tensor
        The weight streams of ABI.md §3 by field (``spec.weights``).
    states : mapping of str to torch.Tensor
        The initial states by field (``spec.states``), ``[num_layers*dirs, batch, width]``.
    seq_lens : torch.Tensor, optional
        int32 ``[batch]``: row ``b`` runs its first ``seq_lens[b]`` steps (ABI.md §8), ``y`` is 0 past
        them and its final state is the one after its last step.
    """
    return RecurrentFunction.apply(spec, seq_lens, x, *(weights[n] for n in spec.weights),
                                   *(states[n] for n in spec.states))
