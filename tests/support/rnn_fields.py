"""The recurrent device cases with every optional field (ABI.md §8) at once, one per op, and their backward
ops with the gradient of every optional input: the device, backward-device and ptxas tests share them."""
from __future__ import annotations

from host_fallback.abi import OPTIONAL_INPUTS, gradient

RECURRENT = ("lstm", "gru", "rnn")
BASE = dict(batch=5, seq=6, input_size=3, hidden=5, num_layers=2, bidirectional=True, carry=True)
#: one case per op, every optional field on at once (the variants of launches.limits.RNN_FIELD_VARIANTS)
FIELDS = {
    "lstm": dict(BASE, seq_lens=[6, 2, 0, 5, 1], clip=0.9, peepholes=True, input_forget=True, proj_size=3, w_hr=True,
                 activations=[["hard_sigmoid", 0.3, 0.6], ["elu", 0.8, 0.0], ["scaled_tanh", 1.2, 0.7],
                              ["hard_sigmoid", 0.3, 0.4], ["elu", 1.1, 0.0], ["softsign", 0.0, 0.0]]),
    "gru": dict(BASE, seq_lens=[3, 6, 1, 0, 4], clip=1.1, linear_before_reset=False,
                activations=[["leaky_relu", 0.05, 0.0], ["affine", 0.7, 0.1],
                             ["leaky_relu", 0.2, 0.0], ["softplus", 0.0, 0.0]]),
    "rnn": dict(BASE, seq_lens=[2, 6, 6, 0, 3], clip=0.8,
                activations=[["thresholded_relu", 0.1, 0.0], ["sigmoid", 0.0, 0.0]]),
}


def backward_case(op: str, params: dict) -> tuple[str, dict]:
    """The backward op of ``op`` and ``params`` with the gradient of every optional input they place."""
    return f"{op}_backward", {**params, **{gradient(n): True for n in OPTIONAL_INPUTS[op] if params.get(n)}}


#: op -> (backward op, params): every §8 field at once, with d_h0 / d_c0 (carry) over two bidirectional layers
BACKWARD_FIELDS = {op: backward_case(op, dict(FIELDS[op], relu=False) if op == "rnn" else FIELDS[op])
                   for op in RECURRENT}
