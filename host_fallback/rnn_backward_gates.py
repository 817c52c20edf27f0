"""The compiled gates of a recompute's chunk (``jit``'s ``lstm_chunk_gates``, ``gru_chunk_gates``): where they apply,
and their calls from ``rnn_backward_steps``' chunk recurrences (``_lstm_chunk``, ``_gru_chunk``).

A backward without a saved forward rebuilds each chunk's gates from every step's entering state at once: one
GEMM over the chunk's steps, then the activations and an lstm's cell, which NumPy runs as a dozen array passes
over ``[steps, batch, G*hidden]``; the kernels make one pass a row. They cover f32 (inside) with the default
activations and no clip (an lstm without coupled gates, a gru with ``linear_before_reset``); NumPy's passes stay
everywhere else, and with ``RLX_HOST_JIT=0`` or without Numba.
"""
from __future__ import annotations

import numpy as np

from . import jit
from .rnn_backward_cell import _Cell

Array = np.ndarray
_DEFAULT = {"lstm": ("sigmoid", "tanh", "tanh"), "gru": ("sigmoid", "tanh")}


def _applies(op: str, cell: _Cell, u: Array) -> bool:
    return (u.dtype == np.float32 and not cell.clip and tuple(a.name for a in cell.acts) == _DEFAULT[op]
            and (cell.linear_before_reset if op == "gru" else not cell.input_forget))


def lstm(cell: _Cell, u: Array, c: Array, lens: Array, backwards: bool) -> dict[str, Array] | None:
    """An lstm chunk's ``u [steps, batch, 4H]`` (its pre-activations, C-contiguous) activated in place, then its
    cell from ``c`` (entering the chunk; not written) in the walk's order (``backwards``: from the last step),
    ``lens`` each row's valid steps in the chunk (``lstm_sequence.lengths``): ``{"c_prev", "c_new", "hc"}``; None
    where the kernel does not apply."""
    gates = jit.kernel("lstm_chunk_gates") if _applies("lstm", cell, u) else None
    if gates is None:
        return None
    kept = {k: np.empty((*u.shape[:2], c.shape[-1]), np.float32) for k in ("c_prev", "c_new", "hc")}
    gates(u, np.array(c, np.float32), lens, backwards, kept["c_prev"], kept["c_new"], kept["hc"])
    return kept


def gru(cell: _Cell, u: Array, hidden: Array, b_hh: Array) -> bool:
    """A gru chunk's gates into ``u`` (``[steps, batch, 3H]``, the input projection plus ``b_ih``) from ``hidden``
    (``h·W_hh^T`` of every step's entering state), whose n block becomes ``W_hn·h + b_hn``: whether the kernel
    applied (else nothing is written)."""
    gates = jit.kernel("gru_chunk_gates") if _applies("gru", cell, u) else None
    if gates is None:
        return False
    gates(u, hidden, np.ascontiguousarray(b_hh, np.float32))
    return True
