"""The cross-field rules of the scan family (ABI.md §6), written once.

The host driver checks them before it runs (a runtime may call ``host_fallback`` directly) and
``rlx_gpu``'s validator calls the same function, adding the thunk's place in the schedule.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

from .arena import ELEM_SIZE

Thunk = Mapping[str, Any]

UPSTREAM_DTYPES = {4: "f32", 8: "f64"}  # carry_elem_size 2 means the thunk's own 16-bit dtype


class FieldError(ValueError):
    """A field value the ABI forbids; ``field`` names it as the schedule spells it."""

    def __init__(self, op: str, field: str, message: str):
        super().__init__(f"{op}, field {field!r}: {message}")
        self.field, self.message = field, message


def upstream_dtype(t: Thunk) -> str:
    """Element type of upstream rows and dcarry: 4 → f32, 8 → f64, 2 → the thunk's 16-bit dtype."""
    size = t["carry_elem_size"]
    dtype = UPSTREAM_DTYPES.get(size, t.get("dtype"))
    if dtype not in ("f32", "f64", "f16", "bf16") or ELEM_SIZE[dtype] != size:
        raise FieldError(t["op"], "carry_elem_size", f"carry_elem_size={size} with dtype={t.get('dtype')!r}; "
                                                     "use 4 (f32), 8 (f64), or 2 with dtype f16 or bf16")
    return dtype


def check(t: Thunk) -> None:
    """Raise ``FieldError`` for the first rule of ABI.md §6 that ``t`` breaks."""
    k, length = t["num_checkpoints"], t["length"]
    if not 0 <= k <= length:
        raise FieldError(t["op"], "num_checkpoints",
                         f"{k} checkpoints exceed length {length} (num_checkpoints={k}; expected 0..{length})")
    if t["op"] == "scan":
        _check_scan(t)
    else:
        _check_backward(t)


def _slot(t: Thunk, body_field: str, field: str, offset: int, nbytes: int) -> None:
    """A body slot lies inside its body arena."""
    size = t[body_field]["arena_bytes"]
    if offset < 0 or offset + nbytes > size:
        raise FieldError(t["op"], field, f"slot [{offset}, {offset + nbytes}) lies outside the {body_field} arena "
                                         f"of {size} bytes")


def _output(t: Thunk, body_field: str, field: str, nbytes: int) -> None:
    """An output slot fits, and an output tensor the body declares there holds exactly ``nbytes``."""
    body, offset = t[body_field], t[field]
    _slot(t, body_field, field, offset, nbytes)
    tensors = body.get("tensors") or {}
    for name in body.get("outputs") or ():
        spec = tensors.get(name)
        if spec is not None and spec["offset"] == offset:
            size = math.prod(spec["shape"]) * ELEM_SIZE[spec["dtype"]]
            if size != nbytes:
                raise FieldError(t["op"], field, f"{body_field} output {name!r} is {size} bytes at {field}={offset}, "
                                                 f"but the step writes {nbytes} (carry_bytes={t['carry_bytes']})")


def _inputs(t: Thunk, body_field: str, expected: int, what: str) -> None:
    """A body that names its inputs names exactly the slots the thunk fills."""
    names = list(t[body_field].get("inputs") or ())
    if names and len(names) != expected:
        raise FieldError(t["op"], body_field, f"{body_field} takes {len(names)} inputs ({', '.join(names)}), "
                                              f"expected {expected} ({what})")


def _check_scan(t: Thunk) -> None:
    k, length, c = t["num_checkpoints"], t["length"], t["carry_bytes"]
    if 0 < k < length and not t["save_trajectory"]:
        raise FieldError(t["op"], "num_checkpoints", f"{k} checkpoints need save_trajectory: true")
    _slot(t, "body", "body_input_off", t["body_input_off"], c)
    _output(t, "body", "body_output_off", c)
    for i, (body_off, _, step_bytes) in enumerate(t["xs_inputs"]):
        _slot(t, "body", f"xs_inputs[{i}]", body_off, step_bytes)
    for i, (body_off, _, total) in enumerate(t["bcast_inputs"]):
        _slot(t, "body", f"bcast_inputs[{i}]", body_off, total)
    _inputs(t, "body", 1 + len(t["xs_inputs"]) + len(t["bcast_inputs"]),
            "the carry, one per xs input, one per bcast input")


def _check_backward(t: Thunk) -> None:
    c, k, length = t["carry_bytes"], t["num_checkpoints"], t["length"]
    size = t["carry_elem_size"]
    upstream_dtype(t)
    if c % size:
        raise FieldError(t["op"], "carry_bytes", f"carry_bytes={c} is not a multiple of carry_elem_size={size}")
    n_xs = len(t["outer_xs_offs"])
    if len(t["body_x_offs"]) != n_xs:
        raise FieldError(t["op"], "body_x_offs", f"{len(t['body_x_offs'])} body slots for {n_xs} outer_xs_offs")
    _slot(t, "body_vjp", "body_carry_in_off", t["body_carry_in_off"], c)
    _slot(t, "body_vjp", "body_d_output_off", t["body_d_output_off"], c)
    _output(t, "body_vjp", "body_dcarry_out_off", c)
    for i, (body_off, (_, step_bytes)) in enumerate(zip(t["body_x_offs"], t["outer_xs_offs"])):
        _slot(t, "body_vjp", f"body_x_offs[{i}]", body_off, step_bytes)
    _inputs(t, "body_vjp", 2 + n_xs, "the carry, one per xs input, the output gradient")
    if t["op"] == "scan_backward_xs":
        if t["xs_idx"] >= n_xs:
            raise FieldError(t["op"], "xs_idx", f"{t['xs_idx']} names no xs input; there are {n_xs}")
        if t["per_step_bytes"] != t["outer_xs_offs"][t["xs_idx"]][1]:
            raise FieldError(t["op"], "per_step_bytes", f"{t['per_step_bytes']} differs from xs input "
                                                        f"{t['xs_idx']}'s {t['outer_xs_offs'][t['xs_idx']][1]}")
        _output(t, "body_vjp", "body_dxs_out_off", t["per_step_bytes"])
    fwd = t["forward_body"]
    if 0 < k < length and fwd is None:
        raise FieldError(t["op"], "forward_body", f"{k} checkpoints of {length} steps need a forward_body to "
                                                  "recompute carries, got null")
    if fwd is not None:
        if len(t["forward_body_x_offs"]) != n_xs:
            raise FieldError(t["op"], "forward_body_x_offs",
                             f"{len(t['forward_body_x_offs'])} slots for {n_xs} xs inputs")
        _slot(t, "forward_body", "forward_body_carry_in_off", t["forward_body_carry_in_off"], c)
        _output(t, "forward_body", "forward_body_output_off", c)
        for i, (body_off, (_, step_bytes)) in enumerate(zip(t["forward_body_x_offs"], t["outer_xs_offs"])):
            _slot(t, "forward_body", f"forward_body_x_offs[{i}]", body_off, step_bytes)
        _inputs(t, "forward_body", 1 + n_xs, "the carry, one per xs input")
