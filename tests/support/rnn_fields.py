"""The recurrent device cases with every optional field (ABI.md §8) at once, one per op, and their backward
ops with the gradient of every optional input: the device, backward-device and ptxas tests share them."""
from __future__ import annotations

from host_fallback.abi import OPTIONAL_INPUTS, gradient
from rlx_gpu.conformance.combined import RNN_BASE, RNN_FIELDS

RECURRENT = ("lstm", "gru", "rnn")
#: one case per op, every optional field on at once: the catalog's combined-field cases of the recurrences
BASE, FIELDS = RNN_BASE, RNN_FIELDS


def backward_case(op: str, params: dict) -> tuple[str, dict]:
    """The backward op of ``op`` and ``params`` with the gradient of every optional input they place."""
    return f"{op}_backward", {**params, **{gradient(n): True for n in OPTIONAL_INPUTS[op] if params.get(n)}}


#: op -> (backward op, params): every §8 field at once, with d_h0 / d_c0 (carry) over two bidirectional layers
BACKWARD_FIELDS = {op: backward_case(op, dict(FIELDS[op], relu=False) if op == "rnn" else FIELDS[op])
                   for op in RECURRENT}
