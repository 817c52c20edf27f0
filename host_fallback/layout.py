"""Where every tensor of a thunk lives: the shape rules of ABI.md §3-§6, §8 and §9, written once.

``regions(thunk)`` lists each tensor a thunk touches with its byte offset, shape, element type and
access mode. The validator derives footprints from it, the executor copies exactly these ranges for
a fallback, and the host kernels bind their NumPy views through it.

Every size is an exact Python integer, computed in time independent of the values (no list as long
as ``num_layers``), so a validator can compare it with its limits before anything is allocated.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any, Callable, Mapping

import numpy as np

from .arena import COMPUTE, ELEM_SIZE, STORAGE, view
from .fields import complete, state_rows
from .gradients import BACKWARD, FLAGGED_STATES, gradient

Thunk = Mapping[str, Any]

GATES = {"lstm": 4, "gru": 3, "rnn": 1}
#: The bias streams of each recurrent op (GRU keeps its input and hidden biases apart) and its carried states.
RECURRENT_BIASES = {"lstm": ("bias",), "gru": ("b_ih", "b_hh"), "rnn": ("bias",)}
RECURRENT_STATES = {op: FLAGGED_STATES[op] for op in GATES}


@dataclass(frozen=True)
class Region:
    """One tensor of a thunk: ``field`` names it as the schedule spells it (``xs_inputs[1]``)."""

    field: str
    offset: int
    shape: tuple[int, ...]
    dtype: str  # an ABI dtype, or "u8" for the scan family's byte-level slots
    access: str  # "r", "w" or "rw"
    nbytes: int = dataclass_field(init=False)  # exact: shape's product times the element size

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", math.prod(self.shape) * ELEM_SIZE[self.dtype])

    @property
    def reads(self) -> bool:
        return "r" in self.access

    @property
    def writes(self) -> bool:
        return "w" in self.access


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


def _recurrent(t: Thunk) -> list[Region]:
    t = complete(t)
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
    return out


def _state_regions(t: Thunk, shape: tuple[int, ...]) -> list[Region]:
    """The §8 runtime-data and carried-state regions shared by selective_scan, mamba2 and gated_delta_net."""
    out = []
    if t["cu_seqlens"] is not None:
        out.append(Region("cu_seqlens", t["cu_seqlens"], (t["num_seqs"] + 1,), "i32", "r"))
    if t["state_slots"] is not None:
        rows = t["num_seqs"] if t["cu_seqlens"] is not None else t["batch"]
        out.append(Region("state_slots", t["state_slots"], (rows,), "i32", "r"))
    if t["carry_state"]:
        out.append(Region("state", t["state"], (state_rows(t),) + shape, t["state_dtype"], "rw"))
    return out


def _optional(t: Thunk, fields: tuple[str, ...], shape: tuple[int, ...], dtype: str) -> list[Region]:
    return [Region(f, t[f], shape, dtype, "r") for f in fields if t[f] is not None]


def _selective_scan(t: Thunk) -> list[Region]:
    t = complete(t)
    b, s, h, n, dt, pt = t["batch"], t["seq"], t["hidden"], t["state_size"], t["dtype"], t["param_dtype"]
    bc = (b, s, n) if t["groups"] == 1 else (b, s, t["groups"], n)
    out = [
        Region("x", t["x"], (b, s, h), dt, "r"),
        Region("delta", t["delta"], (b, s, h), dt, "r"),
        Region("a", t["a"], (h, n), pt, "r"),
        Region("b", t["b"], bc, dt, "r"),
        Region("c", t["c"], bc, dt, "r"),
    ]
    out += _optional(t, ("delta_bias", "d"), (h,), pt) + _optional(t, ("z",), (b, s, h), dt)
    out += _state_regions(t, (h, n))
    out.append(Region("dst", t["dst"], (b, s, h), dt, "w"))
    return out


def _mamba2(t: Thunk) -> list[Region]:
    t = complete(t)
    b, s, h, p, n, dt, pt = t["batch"], t["seq"], t["heads"], t["head_dim"], t["state_size"], t["dtype"], t["param_dtype"]
    out = [
        Region("x", t["x"], (b, s, h, p), dt, "r"),
        Region("dt", t["dt"], (b, s, h), dt, "r"),
        Region("a", t["a"], (h,), pt, "r"),
        Region("b", t["b"], (b, s, t["groups"], n), dt, "r"),
        Region("c", t["c"], (b, s, t["groups"], n), dt, "r"),
    ]
    out += _optional(t, ("dt_bias", "d"), (h,), pt) + _optional(t, ("z",), (b, s, h, p), dt)
    out += _state_regions(t, (h, p, n))
    out.append(Region("dst", t["dst"], (b, s, h, p), dt, "w"))
    return out


def _gated_delta_net(t: Thunk) -> list[Region]:
    t = complete(t)
    b, s, h, k, dt = t["batch"], t["seq"], t["heads"], t["state_size"], t["dtype"]
    hv, v = t["value_heads"], t["value_size"]
    out = [Region(f, t[f], (b, s, h, k), dt, "r") for f in ("q", "k")]
    out.append(Region("v", t["v"], (b, s, hv, v), dt, "r"))
    out.append(Region("g", t["g"], (b, s, hv, k) if t["gate_per_channel"] else (b, s, hv), dt, "r"))
    out.append(Region("beta", t["beta"], (b, s, hv), dt, "r"))
    out += _state_regions(t, (hv, k, v))
    out.append(Region("dst", t["dst"], (b, s, hv, v), dt, "w"))
    return out


def strided_extent(shape: list[int], strides: list[int]) -> int:
    """Elements spanned by a strided read of ``shape`` (0 when the shape is empty)."""
    if any(d == 0 for d in shape):
        return 0
    return 1 + sum((d - 1) * st for d, st in zip(shape, strides))


def _unary(t: Thunk) -> list[Region]:
    return [Region("x", t["x"], (t["n"],), t["dtype"], "r"), Region("dst", t["dst"], (t["n"],), t["dtype"], "w")]


def _binary(t: Thunk) -> list[Region]:
    dt = t["dtype"]
    return [
        Region("a", t["a"], (strided_extent(t["shape"], t["a_strides"]),), dt, "r"),
        Region("b", t["b"], (strided_extent(t["shape"], t["b_strides"]),), dt, "r"),
        Region("dst", t["dst"], tuple(t["shape"]), dt, "w"),
    ]


def _matmul(t: Thunk) -> list[Region]:
    batch, m, k, n, dt = t["batch"], t["m"], t["k"], t["n"], t["dtype"]

    def extent(stride: int, size: int) -> int:
        return 0 if batch == 0 or size == 0 else (batch - 1) * stride + size

    return [
        Region("a", t["a"], (extent(t["a_batch_stride"], m * k),), dt, "r"),
        Region("b", t["b"], (extent(t["b_batch_stride"], k * n),), dt, "r"),
        Region("dst", t["dst"], (batch, m, n), dt, "w"),
    ]


def _reduce_sum(t: Thunk) -> list[Region]:
    o, r, i, dt = t["outer"], t["r"], t["inner"], t["dtype"]
    return [Region("x", t["x"], (o, r, i), dt, "r"), Region("dst", t["dst"], (o, i), dt, "w")]


def _copy(t: Thunk) -> list[Region]:
    return [Region("src", t["src"], (t["nbytes"],), "u8", "r"), Region("dst", t["dst"], (t["nbytes"],), "u8", "w")]


def _fill(t: Thunk) -> list[Region]:
    return [Region("dst", t["dst"], (t["n"],), t["dtype"], "w")]


def _cast(t: Thunk) -> list[Region]:
    return [Region("src", t["src"], (t["n"],), t["src_dtype"], "r"), Region("dst", t["dst"], (t["n"],), t["dtype"], "w")]


def trajectory_rows(t: Thunk) -> int:
    """Rows of a saved trajectory: ``K`` for a checkpointed one, else ``length``."""
    k, length = t["num_checkpoints"], t["length"]
    return k if 0 < k < length else length


def _bytes(field: str, offset: int, nbytes: int, access: str) -> Region:
    return Region(field, offset, (nbytes,), "u8", access)


def _scan(t: Thunk) -> list[Region]:
    length, carry = t["length"], t["carry_bytes"]
    out = [_bytes("outer_init_off", t["outer_init_off"], carry, "r")]
    out += [_bytes(f"xs_inputs[{i}]", outer, length * step, "r") for i, (_, outer, step) in enumerate(t["xs_inputs"])]
    out += [_bytes(f"bcast_inputs[{i}]", outer, total, "r") for i, (_, outer, total) in enumerate(t["bcast_inputs"])]
    rows = trajectory_rows(t) if t["save_trajectory"] else 1
    out.append(_bytes("outer_final_off", t["outer_final_off"], rows * carry, "w"))
    return out


def _scan_backward_common(t: Thunk) -> list[Region]:
    length, carry = t["length"], t["carry_bytes"]
    upstream_rows = length if t["save_trajectory"] else 1
    out = [
        _bytes("outer_init_off", t["outer_init_off"], carry, "r"),
        _bytes("outer_traj_off", t["outer_traj_off"], trajectory_rows(t) * carry, "r"),
        _bytes("outer_upstream_off", t["outer_upstream_off"], upstream_rows * carry, "r"),
    ]
    out += [_bytes(f"outer_xs_offs[{i}]", outer, length * step, "r") for i, (outer, step) in enumerate(t["outer_xs_offs"])]
    return out


def _scan_backward(t: Thunk) -> list[Region]:
    return _scan_backward_common(t) + [_bytes("outer_dinit_off", t["outer_dinit_off"], t["carry_bytes"], "w")]


def _scan_backward_xs(t: Thunk) -> list[Region]:
    dxs = _bytes("outer_dxs_off", t["outer_dxs_off"], t["length"] * t["per_step_bytes"], "w")
    return _scan_backward_common(t) + [dxs]


def forward_thunk(t: Thunk) -> dict[str, Any]:
    """The forward thunk a backward thunk (ABI.md §9) differentiates, completed; its ``dst`` is ``d_dst``'s
    offset (the forward's output is not stored: the range stands for its shape)."""
    return complete({**t, "op": BACKWARD[t["op"]], "dst": t["d_dst"]})


def _backward(t: Thunk) -> list[Region]:
    """The forward's regions, every one read-only, then ``d_dst`` (read, shaped like ``dst``) and one
    gradient per floating-point input in its input's shape and element type: an ordinary write range,
    or, for a carried state, read (the final state's gradient) and written in place (the initial one's)."""
    t = complete(t)
    forward = regions(forward_thunk(t))
    out = [Region(r.field, r.offset, r.shape, r.dtype, "r") for r in forward if r.field != "dst"]
    out += [Region("d_dst", r.offset, r.shape, r.dtype, "r") for r in forward if r.field == "dst"]
    out += [Region(gradient(r.field), t[gradient(r.field)], r.shape, r.dtype, "rw" if r.writes else "w")
            for r in forward if r.field != "dst" and r.dtype != "i32"]
    return out


RULES: dict[str, Callable[[Thunk], list[Region]]] = {
    "lstm": _recurrent,
    "gru": _recurrent,
    "rnn": _recurrent,
    "selective_scan": _selective_scan,
    "mamba2": _mamba2,
    "gated_delta_net": _gated_delta_net,
    "unary": _unary,
    "binary": _binary,
    "matmul": _matmul,
    "reduce_sum": _reduce_sum,
    "copy": _copy,
    "fill": _fill,
    "cast": _cast,
    "scan": _scan,
    "scan_backward": _scan_backward,
    "scan_backward_xs": _scan_backward_xs,
    **{op: _backward for op in BACKWARD},
}


def regions(thunk: Thunk) -> list[Region]:
    """Every tensor ``thunk`` reads or writes, in field order."""
    return RULES[thunk["op"]](thunk)


class Bound:
    """A thunk's regions bound to one host arena: ``load``/``store``/``view`` by field name."""

    def __init__(self, thunk: Thunk, arena: np.ndarray, by_field: Mapping[str, Region] | None = None):
        """``by_field``: the thunk's regions by field, when the caller computed them once already."""
        self.arena = arena
        self.regions = by_field if by_field is not None else {r.field: r for r in regions(thunk)}
        self._views: dict[str, np.ndarray] = {}

    def view(self, field: str) -> np.ndarray:
        """``field`` as a writable view of the arena (made once per field; callers never reshape it in place)."""
        made = self._views.get(field)
        if made is None:
            r = self.regions[field]
            made = self._views[field] = view(self.arena, r.offset, r.dtype, r.shape)
        return made

    def load(self, field: str, index: Any = ...) -> np.ndarray:
        """``field`` (or the block ``index`` selects from it) in a fresh array of its compute type."""
        return self.view(field)[index].astype(COMPUTE[self.regions[field].dtype])

    def in_place(self, field: str, index: Any = ...) -> np.ndarray | None:
        """``field`` (or the block ``index`` selects) as a writable view of the arena when its storage
        type is its compute type (f32, f64), for a tensor a kernel reads and then updates in place
        (ABI.md: carried states); else ``None`` (16-bit storage: ``load``, compute, ``store``)."""
        r = self.regions[field]
        return self.view(field)[index] if STORAGE[r.dtype] == COMPUTE[r.dtype] else None

    def store(self, field: str, values: np.ndarray, index: Any = ...) -> None:
        """Write ``values`` to ``field`` (or to the block ``index`` selects), rounded to nearest even
        into its storage type."""
        target = self.view(field)[index]
        target[...] = np.asarray(values).reshape(target.shape).astype(STORAGE[self.regions[field].dtype])
