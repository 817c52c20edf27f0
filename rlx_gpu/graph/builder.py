"""The Graph builder: declare named inputs, weights and ops, mark outputs, compile to a validated Schedule.

``Graph`` is a ``nodes.BodyGraph`` (declarations and body ops) with the recurrent and state-space ops
of ``sequence_ops``, the scans of ``scans``, reverse mode through ``autodiff`` and ``compile()``
through ``lowering``.
"""
from __future__ import annotations

from typing import Any, Sequence

from ..errors import GraphError
from .autodiff import grad
from .lowering import Executable, compile_graph
from .nodes import BodyGraph, Node, Slot, Tensor
from .registry import BUILDERS
from .scans import ScanGrads, scan, scan_grad
from .mamba3_ops import Mamba3Ops

__all__ = ["Graph", "GraphError", "Node", "Slot", "Tensor"]


class Graph(BodyGraph, Mamba3Ops):
    """A program under construction; ``compile()`` lays out its arena and returns an ``Executable``.

    ``dtype`` is the default element type of inputs, weights and constants.
    """

    # ----------------------------------------------------------------- scans
    @BUILDERS.register("scan")
    def scan(self, body: BodyGraph, init: Any, xs: Sequence[Any] = (), bcast: Sequence[Any] = (), *,
             length: int | None = None, save_trajectory: bool = False, num_checkpoints: int = 0) -> Tensor:
        """``carry = body(carry, xs[0][t], ..., *bcast)`` for ``t < length``; returns the final carry.

        ``body`` is a Graph of body ops whose inputs, in declaration order, are the carry, one row
        of every xs input and every bcast input, and whose one output is the next carry. With
        ``save_trajectory`` the result is ``[rows, *carry]``: every step's carry, or with
        ``0 < num_checkpoints < length`` the carries of steps ``ceil((k+1)·length/K) - 1``.
        """
        return scan(self, body, init, xs, bcast, length=length, save_trajectory=save_trajectory,
                    num_checkpoints=num_checkpoints)

    @BUILDERS.register("scan_backward", "scan_backward_xs")
    def scan_grad(self, body: BodyGraph, init: Any, xs: Sequence[Any] = (), bcast: Sequence[Any] = (), *,
                  d_final: Any = None, d_traj: Any = None, num_checkpoints: int = 0,
                  length: int | None = None) -> ScanGrads:
        """Gradients of a scan with respect to its init, xs and bcast inputs: see ``scans.scan_grad``."""
        return scan_grad(self, body, init, xs, bcast, d_final=d_final, d_traj=d_traj,
                         num_checkpoints=num_checkpoints, length=length)

    def grad(self, outputs: Tensor | Sequence[Tensor], wrt: Tensor | Sequence[Tensor],
             d_outputs: Any = None, *, recompute: bool = False) -> Tensor | tuple[Tensor, ...]:
        """Reverse mode over this graph: the gradients of ``outputs`` with respect to ``wrt``, as new tensors.

        ``torch.autograd.grad(outputs, inputs, grad_outputs)`` (or ``jax.vjp``'s pullback) over the ops
        declared so far: the result is the vector-Jacobian product ``Σ_i d_outputs[i]ᵀ·∂outputs[i]/∂wrt``,
        one tensor per ``wrt`` (a tuple, or one tensor when ``wrt`` is one tensor), shaped and typed
        like it; zero where the outputs do not depend on it (torch's ``materialize_grads``).

        Parameters
        ----------
        outputs : Tensor or sequence of Tensor
            What to differentiate: any tensors of this graph (a loss, a layer's output, a final state).
        wrt : Tensor or sequence of Tensor
            The tensors to differentiate with respect to: inputs, weights or intermediate values.
        d_outputs : tensor, array or sequence of them, optional
            The cotangent of each output (``grad_outputs``), shaped like it; arrays become constants.
            Without it every output must have one element (a loss), whose cotangent is 1.
        recompute : bool, optional
            False (the default): an lstm, gru, rnn or mamba2 (not packed) saves its forward for its backward
            (``backward``'s reserve); True: their backward thunks recompute the forward (less memory, slower).

        Body ops differentiate by their rules (``autodiff``), each fused op (lstm, gru, rnn,
        selective_scan, mamba2, gated_delta_net) by one backward thunk of ABI.md §9 (``backward``;
        a carried state's gradient flows to the initial state the caller passed) and each scan by
        ``scan_grad`` (its forward's checkpoints reused). Mark the gradients with ``output`` to read
        them; what no output needs is pruned at ``compile()``.
        """
        return grad(self, outputs, wrt, d_outputs, recompute=recompute)

    def compile(self, device: str | None = None) -> Executable:
        """Lay out the arena, lower to a validated Schedule and bind it to ``device`` (see ``get_device``)."""
        return compile_graph(self, device)
