"""The recurrent ops of ABI.md §3 and §8: ``lstm``, ``gru`` and ``rnn`` (stacked, optionally bidirectional)."""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import numpy as np

from . import int_tensors, reserve
from .aliasing import ALIASING
from .model import (ELEM_SIZE, Checked, Field, OpDef, Region, Rule, Thunk, fail, flags, newer, offsets, positive,
                    rule)

GATES = {"lstm": 4, "gru": 3, "rnn": 1}
#: The bias streams of each recurrent op (GRU keeps its input and hidden biases apart) and its carried states.
RECURRENT_BIASES = {"lstm": ("bias",), "gru": ("b_ih", "b_hh"), "rnn": ("bias",)}
RECURRENT_STATES = {"lstm": ("h0", "c0"), "gru": ("h0",), "rnn": ("h0",)}
#: The activation slots of each recurrent op (ABI.md §8 ``activations``): lstm f, g, h; gru f, g; rnn f.
ACTIVATION_SLOTS = {"lstm": 3, "gru": 2, "rnn": 1}
#: The activation functions of ``activations``, and which of alpha, beta each reads.
ACTIVATIONS: dict[str, tuple[str, ...]] = {
    "sigmoid": (), "tanh": (), "relu": (), "affine": ("alpha", "beta"), "leaky_relu": ("alpha",),
    "thresholded_relu": ("alpha",), "scaled_tanh": ("alpha", "beta"), "hard_sigmoid": ("alpha", "beta"),
    "elu": ("alpha",), "softsign": (), "softplus": (),
}


def recurrent_dims(t: Thunk) -> tuple[int, int]:
    """Return ``(gates, dirs)`` of an lstm/gru/rnn thunk."""
    return GATES[t["op"]], 2 if t["bidirectional"] else 1


def output_width(t: Thunk) -> int:
    """Width of one direction's output and hidden state: ``proj_size`` when an lstm projects, else ``hidden``."""
    return t.get("proj_size") or t["hidden"]


def layer_input_sizes(t: Thunk) -> list[int]:
    """``in_l`` for every layer: ``input_size`` below, ``dirs*hidden`` (``dirs*proj_size``) above."""
    _, dirs = recurrent_dims(t)
    return [t["input_size"]] + [dirs * output_width(t)] * (t["num_layers"] - 1)


def recurrent_weight_shapes(op: str, input_size: int, hidden: int, num_layers: int,
                            bidirectional: bool, proj_size: int = 0) -> dict[str, tuple[int, ...]]:
    """Shape of every weight stream of an lstm/gru/rnn (ABI.md §3, §8's ``proj_size``), by field, in field order."""
    gates, dirs = GATES[op], 2 if bidirectional else 1
    width = proj_size or hidden
    # Σ_l dirs*G*hidden*in_l in closed form: no list as long as num_layers
    w_ih = dirs * gates * hidden * (input_size + (num_layers - 1) * dirs * width)
    shapes = {"w_ih": (w_ih,),
              "w_hh": (num_layers * dirs, gates * hidden, width)}
    shapes.update({f: (num_layers * dirs, gates * hidden) for f in RECURRENT_BIASES[op]})
    return shapes


def _layout(t: Thunk) -> list[Region]:
    _, dirs = recurrent_dims(t)
    b, s, i, h, layers = t["batch"], t["seq"], t["input_size"], t["hidden"], t["num_layers"]
    dt, width = t["dtype"], output_width(t)
    weights = recurrent_weight_shapes(t["op"], i, h, layers, t["bidirectional"], t.get("proj_size", 0))
    out = [Region("x", t["x"], (b, s, i), dt, "r")]
    out += [Region(f, t[f], shape, dt, "r") for f, shape in weights.items()]
    if t.get("peepholes") is not None:
        out.append(Region("peepholes", t["peepholes"], (layers * dirs, 3 * h), dt, "r"))
    if t.get("w_hr") is not None:
        out.append(Region("w_hr", t["w_hr"], (layers * dirs, width, h), dt, "r"))
    if t["seq_lens"] is not None:
        out.append(Region("seq_lens", t["seq_lens"], (b,), "i32", "r"))
    if t["carry"]:
        out += [Region(f, t[f], (layers * dirs, b, h if f == "c0" else width), dt, "rw")
                for f in RECURRENT_STATES[t["op"]]]
    out.append(Region("dst", t["dst"], (b, s, dirs * width), dt, "w"))
    return out + reserve.region(t)


def _default_activations(*per_direction: str) -> Callable[[Thunk], tuple[tuple[str, float, float], ...]]:
    """The activations of version 1: ``per_direction`` for each direction (rnn's follow ``relu``)."""
    def default(t: Thunk) -> tuple[tuple[str, float, float], ...]:
        names = per_direction or ("relu" if t.get("relu") else "tanh",)
        return tuple((name, 0.0, 0.0) for _ in range(2 if t["bidirectional"] else 1) for name in names)
    return default


def _fields(op: str, biases: tuple[str, ...], *extra: Field) -> tuple[Field, ...]:
    """ABI.md §3's fields of ``op`` (``extra`` after its version-1 flags), then §8's."""
    return (offsets("x", "w_ih", "w_hh", *biases) + offsets(*RECURRENT_STATES[op], used_when="carry") + offsets("dst")
            + positive("batch", "seq", "input_size", "hidden", "num_layers") + flags("bidirectional", "carry")
            + tuple(f for f in extra if f.version == 1)
            + (newer("seq_lens", "opt_offset", None), newer("reverse", "bool", False), newer("clip", "float", 0.0),
               newer("activations", "activations", _ACTIVATION_DEFAULTS[op], tuple(ACTIVATIONS)))
            + tuple(f for f in extra if f.version > 1) + reserve.FIELDS)


_ACTIVATION_DEFAULTS = {"lstm": _default_activations("sigmoid", "tanh", "tanh"),
                        "gru": _default_activations("sigmoid", "tanh"), "rnn": _default_activations()}


def check_recurrent(t: Thunk) -> None:
    """The §8 rules of every recurrent op, on the fields given."""
    if t.get("reverse") and t["bidirectional"]:
        raise fail(t, "reverse", "reverse needs bidirectional = false (a bidirectional layer walks both ways)")
    clip = t.get("clip", 0.0)
    if not (math.isfinite(clip) and clip >= 0):  # NaN < 0 is false: NaN would pass a plain comparison
        raise fail(t, "clip", f"expected a finite number >= 0 (0: no clip), got {clip}")
    if "activations" in t:
        slots, dirs = ACTIVATION_SLOTS[t["op"]], 2 if t["bidirectional"] else 1
        if len(t["activations"]) != slots * dirs:
            raise fail(t, "activations", f"expected {slots} per direction ({slots * dirs} for {dirs} direction"
                                         f"{'s' if dirs > 1 else ''}), got {len(t['activations'])}")
        if t.get("relu"):
            raise fail(t, "relu", "relu must be false when activations are given (they name the function)")


def check_lstm(t: Thunk) -> None:
    check_recurrent(t)
    proj = t.get("proj_size", 0)
    if proj and proj >= t["hidden"]:
        raise fail(t, "proj_size", f"expected 0 < proj_size < hidden = {t['hidden']}, got {proj}")
    if proj and t.get("w_hr") is None:
        raise fail(t, "w_hr", f"missing: proj_size = {proj} needs the projection weights w_hr")
    if t.get("w_hr") is not None and not proj:
        raise fail(t, "w_hr", "given without proj_size")


def _named_counts(c: Checked) -> None:
    """A named tensor placed at an input must hold exactly the element count ABI.md §3 expects."""
    for r in c.regions:
        named = c.named(r) if r.reads else None
        expected = r.nbytes // ELEM_SIZE[r.dtype]
        if named is not None and named[1] != expected:
            raise fail(c.thunk, r.field, f"input {named[0]!r} has {named[1]} elements, expected {expected}")


NAMED_COUNTS = Rule(_named_counts, on_footprint=True)


#: What a recurrent op's reserve holds per layer-direction (ABI.md §9.1, docs/abi.md): each ``[seq, batch, n]``
#: with ``n`` in units of ``hidden`` (``"W"``: the output width, ``proj_size`` or ``hidden``).
_SAVED_STEPS = {"lstm": (("y", 4), ("u", 4), ("h_prev", "W"), ("c_prev", 1), ("c_new", 1), ("hc", 1)),
                "gru": (("y", 3), ("u", 3), ("h_prev", 1), ("hn", 1)),
                "rnn": (("y", 1), ("u", 1), ("h_prev", 1))}


def reserve_slots(t: Thunk) -> list[reserve.Slot]:
    """The reserve of a recurrent thunk (the fields given suffice): per layer-direction ``ld`` the arrays of
    ``_SAVED_STEPS`` (and ``raw`` ``[seq, batch, hidden]`` with ``proj_size``), then every layer's output but
    the top one's (``out``, ``[seq, batch, dirs*width]``), all time-major in the compute type (f64 for f64,
    else f32); then per ``ld`` the clip's mask ``[seq, batch, G*hidden]`` as bytes (1: the gradient passes)."""
    gates, dirs = recurrent_dims(t)
    s, b, h, layers = t["seq"], t["batch"], t["hidden"], t["num_layers"]
    width, compute = output_width(t), "f64" if t["dtype"] == "f64" else "f32"
    saved = _SAVED_STEPS[t["op"]] + ((("raw", 1),) if t.get("proj_size") else ())
    arrays = [(name, ld, (s, b, width if n == "W" else n * h), compute)
              for ld in range(layers * dirs) for name, n in saved]
    arrays += [("out", layer, (s, b, dirs * width), compute) for layer in range(layers - 1)]
    arrays += [("mask", ld, (s, b, gates * h), "u8") for ld in range(layers * dirs)]
    return reserve.packed(arrays)


def reserve_bytes(t: Thunk) -> int:
    """The least ``reserve_bytes`` of a recurrent thunk (ABI.md §9.1)."""
    return reserve.size(reserve_slots(t))


def _sample(field: str, params: Mapping[str, Any], x: np.ndarray) -> np.ndarray:
    return x * 0.5 if field.startswith("w_") else x  # weights of half the scale keep the gates off saturation


def _op(op: str, rank: int, biases: tuple[str, ...], check: Callable[[Thunk], None], *extra: Field) -> OpDef:
    """The recurrent op ``op``: ``rank`` is its place among §3's."""
    return OpDef(op, _fields(op, biases, *extra), _layout,
                 rules=(rule(check), reserve.rule(reserve_bytes), ALIASING, NAMED_COUNTS),
                 data_rules={"seq_lens": int_tensors.seq_lens}, states=RECURRENT_STATES[op], differentiable=True,
                 sample=_sample, place=(3, rank), reserve_size=reserve_bytes)


LSTM = _op("lstm", 1, ("bias",), check_lstm,
           newer("peepholes", "opt_offset", None), newer("input_forget", "bool", False),
           newer("proj_size", "count", 0), newer("w_hr", "opt_offset", None))
GRU = _op("gru", 2, ("b_ih", "b_hh"), check_recurrent, newer("linear_before_reset", "bool", True))
RNN = _op("rnn", 3, ("bias",), check_recurrent, Field("relu", "bool"))
