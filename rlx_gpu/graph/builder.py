"""The Graph builder: declare named inputs, weights and ops, mark outputs, compile to a validated Schedule.

``Graph`` is a ``nodes.BodyGraph`` (declarations and body ops) with the recurrent and state-space ops
of ``sequence_ops``, the scans of ``scans`` and ``compile()`` through ``lowering``.
"""
from __future__ import annotations

from typing import Any, Sequence

from ..errors import GraphError
from .lowering import Executable, compile_graph
from .nodes import BodyGraph, Node, Slot, Tensor
from .scans import ScanGrads, scan, scan_grad
from .sequence_ops import SequenceOps

__all__ = ["Graph", "GraphError", "Node", "Slot", "Tensor"]


class Graph(BodyGraph, SequenceOps):
    """A program under construction; ``compile()`` lays out its arena and returns an ``Executable``.

    ``dtype`` is the default element type of inputs, weights and constants.
    """

    # ----------------------------------------------------------------- scans
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

    def scan_grad(self, body: BodyGraph, init: Any, xs: Sequence[Any] = (), bcast: Sequence[Any] = (), *,
                  d_final: Any = None, d_traj: Any = None, num_checkpoints: int = 0,
                  length: int | None = None) -> ScanGrads:
        """Gradients of a scan with respect to its init, xs and bcast inputs: see ``scans.scan_grad``."""
        return scan_grad(self, body, init, xs, bcast, d_final=d_final, d_traj=d_traj,
                         num_checkpoints=num_checkpoints, length=length)

    def compile(self, device: str | None = None) -> Executable:
        """Lay out the arena, lower to a validated Schedule and bind it to ``device`` (see ``get_device``)."""
        return compile_graph(self, device)
