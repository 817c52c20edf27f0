"""The backward ops of ABI.md §9: which forward op each one differentiates, and its gradient fields.

``OP_backward`` takes every field of ``OP`` except ``dst``, plus ``d_dst`` and one ``d_NAME`` per
floating-point input ``NAME`` of the forward (the carried states' ``d_h0``/``d_c0``/``d_state``
among them, read as the final state's gradient and written back as the initial state's). The field
names and shapes are derived from the forward's; this module holds only what the derivation needs.
"""
from __future__ import annotations

#: The forward ops that have a backward op, in the order of ABI.md §9.
FORWARD_OPS = ("lstm", "gru", "rnn", "selective_scan", "mamba2", "gated_delta_net")
#: backward op -> the forward op it differentiates.
BACKWARD: dict[str, str] = {f"{op}_backward": op for op in FORWARD_OPS}
#: The optional (version-2) floating-point inputs of each forward op: their gradients are optional too,
#: given exactly when the input is (``state`` of selective_scan and mamba2: exactly with ``carry_state``).
OPTIONAL_INPUTS: dict[str, tuple[str, ...]] = {
    "lstm": ("peepholes", "w_hr"), "gru": (), "rnn": (),
    "selective_scan": ("delta_bias", "d", "z", "state"), "mamba2": ("dt_bias", "d", "z", "state"),
    "gated_delta_net": (),
}

#: The state tensors version 1 names even without the op's carry flag (an unused offset, written 0).
#: Their gradients exist only with a carried state (ABI.md §9): a backward op without one leaves them out.
FLAGGED_STATES: dict[str, tuple[str, ...]] = {
    "lstm": ("h0", "c0"), "gru": ("h0",), "rnn": ("h0",), "selective_scan": (), "mamba2": (),
    "gated_delta_net": ("state",),
}


def forward_op(op: str) -> str:
    """The forward op ``op`` differentiates, or ``op`` itself when it is no backward op."""
    return BACKWARD.get(op, op)


def gradient(name: str) -> str:
    """The field holding the gradient of the loss with respect to tensor field ``name``."""
    return f"d_{name}"
