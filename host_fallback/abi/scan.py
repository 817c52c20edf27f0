"""The scan family of ABI.md §6 and §9: ``scan``, ``scan_backward`` and ``scan_backward_xs``.

Their cross-field rules are written once: a scan driver checks them before it runs (a runtime may
call ``host_fallback`` directly) and ``rlx_gpu``'s validator runs the same rule, adding the thunk's
place in the schedule.
"""
from __future__ import annotations

import math

from .aliasing import ALIASING
from .model import ELEM_SIZE, Field, FieldError, OpDef, Region, Thunk, rule

UPSTREAM_DTYPES = {4: "f32", 8: "f64"}  # carry_elem_size 2 means the thunk's own 16-bit dtype


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


_BACKWARD_FIELDS = (
    Field("body_vjp", "schedule"), Field("body_carry_in_off", "offset"), Field("body_x_offs", "offsets"),
    Field("body_d_output_off", "offset"), Field("body_dcarry_out_off", "offset"),
    Field("outer_init_off", "offset"), Field("outer_traj_off", "offset"), Field("outer_upstream_off", "offset"),
    Field("outer_xs_offs", "pairs"), Field("length", "pos"), Field("carry_bytes", "pos"),
    Field("carry_elem_size", "elem_size"), Field("save_trajectory", "bool"),
    Field("num_checkpoints", "count"), Field("forward_body", "opt_schedule"),
    Field("forward_body_carry_in_off", "offset"), Field("forward_body_output_off", "offset"),
    Field("forward_body_x_offs", "offsets"),
)
_RULES = (rule(check), ALIASING)

SCAN = OpDef("scan", (
    Field("body", "schedule"), Field("body_input_off", "offset"), Field("body_output_off", "offset"),
    Field("outer_init_off", "offset"), Field("outer_final_off", "offset"), Field("length", "pos"),
    Field("carry_bytes", "pos"), Field("save_trajectory", "bool"), Field("xs_inputs", "xs"),
    Field("bcast_inputs", "bcast"), Field("num_checkpoints", "count")), _scan, rules=_RULES, place=(6, 1))
SCAN_BACKWARD = OpDef("scan_backward", _BACKWARD_FIELDS + (Field("outer_dinit_off", "offset"),), _scan_backward,
                      rules=_RULES, place=(6, 2))
SCAN_BACKWARD_XS = OpDef("scan_backward_xs", _BACKWARD_FIELDS + (
    Field("xs_idx", "count"), Field("body_dxs_out_off", "offset"), Field("outer_dxs_off", "offset"),
    Field("per_step_bytes", "pos")), _scan_backward_xs, rules=_RULES,
                      place=(6, 3))
#: The scan family: thunks holding nested schedules, run by a scan driver.
SCAN_OPS = frozenset({SCAN.name, SCAN_BACKWARD.name, SCAN_BACKWARD_XS.name})
