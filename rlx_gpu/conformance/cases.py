"""Small representative thunks of every op, laid out in an arena (optionally with guard zones).

Used by ``rlx-gpu devices`` for the support matrix and by the conformance suite for its cases.
"""
from __future__ import annotations

import base64
from typing import Any

import numpy as np

from host_fallback.abi import BACKWARD, ELEM_SIZE, INT_FIELDS, SCAN_OPS, OPS as SPECS, regions
from host_fallback.registry import import_all

from ..graph.layout import ALIGN
from ..schedule.model import ABI_V1, ABI_V2
from .registry import CASES

import_all(__package__, "reference")  # the reference modules declare their ops' cases (``registry.declare_cases``)

#: Parameters of one small case per op, as its reference module declares it (``registry.declare_cases``); a
#: backward op's is its forward's. The scan family's cases carry their own bodies (below).
SMALL: dict[str, dict[str, Any]] = {op: dict(CASES[op].small) for op in SPECS if op in CASES and CASES[op].small}
SMALL.update({backward: SMALL[forward] for backward, forward in BACKWARD.items()})


def _body(dtype: str, carry_n: int) -> dict[str, Any]:
    """A body ``next = carry + x`` on ``carry_n`` elements: carry at 0, x after it, output after that."""
    nb = carry_n * ELEM_SIZE[dtype]
    add = dict(op="binary", dtype=dtype, fn="add", a=0, b=nb, dst=2 * nb, shape=[carry_n], a_strides=[1],
               b_strides=[1])
    return {"arena_bytes": 3 * nb, "thunks": [add]}


def _vjp_body(dtype: str, carry_n: int) -> dict[str, Any]:
    """The vjp of ``carry + x``: dcarry = d_output; slots carry, x, d_output, dcarry in that order."""
    nb = carry_n * ELEM_SIZE[dtype]
    return {"arena_bytes": 4 * nb, "thunks": [dict(op="copy", dtype=dtype, src=2 * nb, dst=3 * nb, nbytes=nb)]}


def scan_case(op: str, dtype: str, length: int = 6, carry_n: int = 4) -> dict[str, Any]:
    """Fields (offsets 0) of a scan-family thunk over the ``carry + x`` body."""
    nb = carry_n * ELEM_SIZE[dtype]
    if op == "scan":
        return dict(body=_body(dtype, carry_n), body_input_off=0, body_output_off=2 * nb, outer_init_off=0,
                    outer_final_off=0, length=length, carry_bytes=nb, save_trajectory=True,
                    xs_inputs=[[nb, 0, nb]], bcast_inputs=[], num_checkpoints=0)
    fields = dict(body_vjp=_vjp_body(dtype, carry_n), body_carry_in_off=0, body_x_offs=[nb],
                  body_d_output_off=2 * nb, body_dcarry_out_off=3 * nb, outer_init_off=0, outer_traj_off=0,
                  outer_upstream_off=0, outer_xs_offs=[[0, nb]], length=length, carry_bytes=nb,
                  carry_elem_size=ELEM_SIZE[dtype], save_trajectory=True, num_checkpoints=2,
                  forward_body=_body(dtype, carry_n), forward_body_carry_in_off=0, forward_body_output_off=2 * nb,
                  forward_body_x_offs=[nb])
    if op == "scan_backward":
        fields["outer_dinit_off"] = 0
    else:
        fields.update(xs_idx=0, body_dxs_out_off=3 * nb, outer_dxs_off=0, per_step_bytes=nb)
    return fields


def lay_out(op: str, dtype: str, params: dict[str, Any] | None = None, guard: int = 0) -> tuple[dict, int]:
    """A thunk dict of ``op`` with its tensors placed one after another, ``guard`` bytes around each.

    ``params`` give the thunk's other fields; an optional (version-2) tensor is placed where its param
    is True, and an integer tensor (``cu_seqlens`` ...) where its param is the list of its values (the
    caller writes them; ``num_seqs`` follows from ``cu_seqlens``); a tensor param False or None is left
    out. Returns ``(thunk, arena_bytes)``. Offsets are aligned to ``planner.ALIGN`` bytes.
    """
    if op in SCAN_OPS:
        fields = scan_case(op, dtype) if params is None else dict(params)
    else:
        fields = dict(SMALL[op] if params is None else params)
    # a version-2 tensor used only under a flag (a carried state's gradient) exists only with its flag
    offset_fields = [f.name for f in SPECS[op].fields if f.kind == "offset"
                     and not (f.version > 1 and f.used_when and not fields.get(f.used_when))]
    for f in SPECS[op].fields:
        if f.kind != "opt_offset" or f.name not in fields:
            continue
        value = fields.pop(f.name)
        if value is True or isinstance(value, list):
            offset_fields.append(f.name)
            if f.name == "cu_seqlens":
                fields.setdefault("num_seqs", len(value) - 1)
    thunk = {"op": op, "dtype": dtype, **{n: 0 for n in offset_fields}, **fields}
    cursor = guard
    placed: dict[str, int] = {}
    for region in regions(thunk):
        placed[region.field] = cursor
        cursor = _align(cursor + region.nbytes + guard)
    for label, offset in placed.items():
        _place(thunk, label, offset)
    return thunk, max(cursor, ALIGN)


def _place(thunk: dict, label: str, offset: int) -> None:
    """Write an offset into the field a region label names (``x``, ``xs_inputs[0]``, ``outer_xs_offs[1]``)."""
    if "[" not in label:
        thunk[label] = offset
        return
    name, index = label[:-1].split("[")
    row = list(thunk[name][int(index)])
    row[1 if name in ("xs_inputs", "bcast_inputs") else 0] = offset
    thunk[name] = [row if i == int(index) else r for i, r in enumerate(thunk[name])]


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def int_values(params: dict[str, Any]) -> dict[str, list[int]]:
    """The values of the integer tensors ``params`` gives as lists (``lay_out`` places them)."""
    return {name: params[name] for name in INT_FIELDS if isinstance(params.get(name), list)}


def schedule_of(thunk: dict, arena_bytes: int) -> dict[str, Any]:
    """A one-thunk schedule dict, labelled version 2 when the thunk is of a version-2 op or names a version-2
    field (even at its default)."""
    spec = SPECS.get(thunk["op"])
    abi = ABI_V2 if spec is not None and (spec.version > 1 or spec.v2_fields & set(thunk)) else ABI_V1
    return {"abi": abi, "arena_bytes": arena_bytes, "thunks": [thunk]}


#: The GPU shapes (geometry test, docs/kernels.md table, timing on a GPU): name -> (op, parameters).
GPU_SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "lstm B64 S512 H1024": ("lstm", dict(batch=64, seq=512, input_size=1024, hidden=1024, num_layers=1,
                                         bidirectional=False, carry=False)),
    "gru B64 S512 H1024": ("gru", dict(batch=64, seq=512, input_size=1024, hidden=1024, num_layers=1,
                                       bidirectional=False, carry=False)),
    "selective_scan B8 S4096 D4096 N16": ("selective_scan", dict(batch=8, seq=4096, hidden=4096, state_size=16)),
    "mamba2 B8 S4096 H32 P64 N128": ("mamba2", dict(batch=8, seq=4096, heads=32, head_dim=64, state_size=128)),
    "gdn B4 S8192 H16 N128 per-head": ("gated_delta_net", dict(batch=4, seq=8192, heads=16, state_size=128,
                                                               gate_per_channel=False, carry_state=False)),
    "gdn B4 S8192 H16 N128 per-channel": ("gated_delta_net", dict(batch=4, seq=8192, heads=16, state_size=128,
                                                                  gate_per_channel=True, carry_state=False)),
    "gdn decode B64 S1 H16 N128": ("gated_delta_net", dict(batch=64, seq=1, heads=16, state_size=128,
                                                           gate_per_channel=False, carry_state=True)),
    "matmul 4096^3": ("matmul", dict(batch=1, m=4096, k=4096, n=4096, trans_a=False, trans_b=False,
                                     a_batch_stride=0, b_batch_stride=0)),
}


#: How ``body_case`` feeds a body thunk's integer tensors (see there).
FEEDS = ("init", "xs", "computed", "carry")


def body_case(scan_op: str, op: str, params: dict[str, Any], feed: str, length: int = 3) -> tuple[dict, dict[str, int]]:
    """A ``scan_op`` schedule (``scan_case``'s ``carry + x`` body) whose body holds a thunk of ``op`` after
    its own: ``body`` for ``scan``, ``body_vjp`` for the backward scans. Its integer tensors (``params``
    gives them as lists, as ``lay_out`` takes them) are fed by ``feed``:

    - ``init``: the body's ``init`` holds the values of ``params``;
    - ``xs``: an extra ``xs`` input, one row per step in the outer arena;
    - ``computed``: an extra ``xs`` input lands in spare body bytes a ``copy`` body thunk moves into place;
    - ``carry`` (``scan`` only, one tensor): the tensor is the scan's carry, its first value in the outer arena.

    Returns the schedule and, per fed tensor, the outer offset where the caller writes its values: row
    ``s`` of an ``xs`` input at ``s`` times the tensor's bytes after it, or the initial carry.
    """
    thunk, nbytes = lay_out(op, "f32", params)
    ints = [r for r in regions(thunk) if r.dtype == "i32"]
    fields = scan_case(scan_op, "f32", length)
    body = fields["body" if scan_op == "scan" else "body_vjp"]
    base = _align(body["arena_bytes"])
    offsets = {r.field for r in regions(thunk)}
    body["thunks"] = body["thunks"] + [{k: v + base if k in offsets else v for k, v in thunk.items()}]
    spare = body["arena_bytes"] = base + nbytes
    feeds: dict[str, tuple[str, int]] = {}  # field -> (the scan field holding its outer offset, the row index)
    for r in ints:
        at = r.offset + base
        if feed == "init":
            data = np.asarray(params[r.field], "<i4").tobytes()
            body.setdefault("init", []).append({"offset": at, "b64": base64.b64encode(data).decode()})
        elif feed == "carry":
            fields.update(body_input_off=at, body_output_off=at, carry_bytes=r.nbytes, save_trajectory=False)
            feeds[r.field] = ("outer_init_off", -1)
        else:
            if feed == "computed":
                body["thunks"].insert(-1, dict(op="copy", dtype="f32", src=spare, dst=at, nbytes=r.nbytes))
                at = spare
                spare = body["arena_bytes"] = _align(spare + r.nbytes)
            if scan_op == "scan":
                feeds[r.field] = ("xs_inputs", len(fields["xs_inputs"]))
                fields["xs_inputs"] = fields["xs_inputs"] + [[at, 0, r.nbytes]]
            else:  # the forward body gets the row too, in spare bytes of its own
                fwd = fields["forward_body"] = dict(fields["forward_body"])
                fields["forward_body_x_offs"] = fields["forward_body_x_offs"] + [fwd["arena_bytes"]]
                fwd["arena_bytes"] = _align(fwd["arena_bytes"] + r.nbytes)
                feeds[r.field] = ("outer_xs_offs", len(fields["outer_xs_offs"]))
                fields["body_x_offs"] = fields["body_x_offs"] + [at]
                fields["outer_xs_offs"] = fields["outer_xs_offs"] + [[0, r.nbytes]]
    scan, outer_bytes = lay_out(scan_op, "f32", fields)
    places = {name: scan[key] if row < 0 else scan[key][row][1 if key == "xs_inputs" else 0]
              for name, (key, row) in feeds.items()}
    return {"abi": ABI_V2, "arena_bytes": outer_bytes, "thunks": [scan]}, places
