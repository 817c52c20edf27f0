"""The version-2 fields of ABI.md §8 and §9: their defaults, and a thunk completed with them.

Every §8 field is optional; absent means its default, which is version 1's meaning. ``complete``
returns a thunk as a plain dict holding every field of its op, so a kernel, a launch planner or a
reference reads ``t["d"]`` (``None``: no skip term) without asking whether the producer wrote it.
A field given with its default value is the same thunk as the field absent: ``is_default`` tells
which, so a writer can leave it out and a version-1 schedule round-trips unchanged.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping

from .gradients import BACKWARD, FLAGGED_STATES, OPTIONAL_INPUTS, forward_op, gradient

Thunk = Mapping[str, Any]

#: The activation slots of each recurrent op (ABI.md §8 ``activations``): lstm f, g, h; gru f, g; rnn f.
ACTIVATION_SLOTS = {"lstm": 3, "gru": 2, "rnn": 1}
#: The activation functions of ``activations``, and which of alpha, beta each reads.
ACTIVATIONS: dict[str, tuple[str, ...]] = {
    "sigmoid": (), "tanh": (), "relu": (), "affine": ("alpha", "beta"), "leaky_relu": ("alpha",),
    "thresholded_relu": ("alpha",), "scaled_tanh": ("alpha", "beta"), "hard_sigmoid": ("alpha", "beta"),
    "elu": ("alpha",), "softsign": (), "softplus": (),
}
#: The integer (``i32``) tensor fields of ABI.md §8: runtime data, checked before a thunk runs.
INT_FIELDS = ("seq_lens", "cu_seqlens", "state_slots")


def _same(name: str) -> Callable[[Thunk], Any]:
    return lambda t: t[name]


def _default_activations(t: Thunk) -> tuple[tuple[str, float, float], ...]:
    op = forward_op(t["op"])
    per_direction = {"lstm": ("sigmoid", "tanh", "tanh"), "gru": ("sigmoid", "tanh"),
                     "rnn": ("relu" if t.get("relu") else "tanh",)}[op]
    dirs = 2 if t["bidirectional"] else 1
    return tuple((name, 0.0, 0.0) for _ in range(dirs) for name in per_direction)


_STATE = {"carry_state": False, "state": None, "state_dtype": _same("dtype"),
          "cu_seqlens": None, "num_seqs": 0, "state_slots": None, "num_slots": 0}
_RECURRENT = {"seq_lens": None, "reverse": False, "clip": 0.0, "activations": _default_activations}

#: op -> field -> default (a value, or a function of the thunk for defaults that follow other fields).
DEFAULTS: dict[str, dict[str, Any]] = {
    "selective_scan": {"groups": 1, "delta_bias": None, "delta_softplus": False, "d": None, "z": None,
                       "param_dtype": _same("dtype"), **_STATE},
    "mamba2": {"groups": _same("heads"), "dt_bias": None, "dt_softplus": False, "dt_limit": None, "d": None,
               "z": None, "param_dtype": _same("dtype"), **_STATE},
    "gated_delta_net": {"value_heads": _same("heads"), "value_size": _same("state_size"), "scale": None,
                        "qk_l2norm": False, "state_dtype": _same("dtype"), "cu_seqlens": None, "num_seqs": 0,
                        "state_slots": None, "num_slots": 0},
    "lstm": {**_RECURRENT, "peepholes": None, "input_forget": False, "proj_size": 0, "w_hr": None},
    "gru": {**_RECURRENT, "linear_before_reset": True},
    "rnn": dict(_RECURRENT),
}
# a backward op (ABI.md §9) takes its forward's version-2 fields, and the gradients of its optional inputs and
# of the states it carries only with its carry flag
DEFAULTS.update({backward: {**DEFAULTS[op], **{gradient(name): None for name in OPTIONAL_INPUTS[op] + FLAGGED_STATES[op]}}
                 for backward, op in BACKWARD.items()})


def default(t: Thunk, name: str) -> Any:
    """The value field ``name`` of ``t``'s op has when ``t`` leaves it out."""
    value = DEFAULTS[t["op"]][name]
    return value(t) if callable(value) else value


def complete(t: Thunk) -> dict[str, Any]:
    """``t`` as a plain dict with every version-2 field of its op, absent ones at their defaults."""
    out = dict(t)
    for name in DEFAULTS.get(t["op"], ()):
        if name not in out:
            out[name] = default(out, name)
    return out


def is_default(t: Thunk, name: str, value: Any) -> bool:
    """Whether ``value`` for field ``name`` means the same as leaving the field out."""
    return _plain(value) == _plain(default(t, name))


def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def used(t: Thunk) -> list[str]:
    """The version-2 fields ``t`` gives with a value other than their default, in table order."""
    return [name for name in DEFAULTS.get(t["op"], ()) if name in t and not is_default(t, name, t[name])]


def gdn_scale(t: Thunk) -> float:
    """The factor of gated_delta_net's step 4: ``scale``, or ``1/sqrt(state_size)`` when absent."""
    return 1.0 / math.sqrt(t["state_size"]) if t.get("scale") is None else float(t["scale"])


def state_rows(t: Thunk) -> int:
    """Rows of a carried state tensor: the slot pool, else one per sequence (varlen), else one per batch row."""
    if t.get("state_slots") is not None:
        return t["num_slots"]
    if t.get("cu_seqlens") is not None:
        return t["num_seqs"]
    return t["batch"]
