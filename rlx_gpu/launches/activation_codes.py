"""The recurrent kernels' activation codes: ABI.md §8's activation names numbered once, here, in
``host_fallback.abi.rnn.ACTIVATIONS`` order. Every program gets the table as ``#define RNN_ACT_<NAME> <code>``
(``backends.programs``), so kernels/rnn_cell.cl names each activation and types no number, and a launch's
activation variant (``RNN_ACT_F0`` ..) carries the code of the same table."""
from __future__ import annotations

from host_fallback.abi.rnn import ACTIVATIONS

#: activation name -> its code
ACTIVATION_CODES: dict[str, int] = {name: code for code, name in enumerate(ACTIVATIONS)}


def activation_defines() -> dict[str, int]:
    """``RNN_ACT_SIGMOID``, ``RNN_ACT_TANH``, ... -> the code of that activation."""
    return {f"RNN_ACT_{name.upper()}": code for name, code in ACTIVATION_CODES.items()}
