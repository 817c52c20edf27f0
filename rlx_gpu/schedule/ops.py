"""The one table of op specs: every op's fields, their kinds, its dtypes and its cross-field rules.

Tensor shapes and footprints come from ``host_fallback.layout`` (the shape rules of the ABI, shared
with the host kernels, which must import without ``rlx_gpu``); this module adds what validation needs.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Mapping

from host_fallback.arena import COMPUTE, ELEM_SIZE
from host_fallback.body import BINARY, UNARY
from host_fallback import scan
from host_fallback.fields import ACTIVATIONS, DEFAULTS, INT_FIELDS
from host_fallback.gradients import FLAGGED_STATES, FORWARD_OPS, OPTIONAL_INPUTS, gradient
from host_fallback.layout import Region, regions

from .limits import MAX_RANK  # noqa: F401  (re-exported for the builder)

#: The ABI's element types of a thunk and the unary/binary functions of ABI.md §5, as the host implements them.
DTYPES = tuple(COMPUTE)
#: The element types of a named tensor: a thunk's, and ``i32`` for the integer tensors of ABI.md §8.
TENSOR_DTYPES = DTYPES + ("i32",)
UNARY_FNS = tuple(UNARY)
BINARY_FNS = tuple(BINARY)


@dataclass(frozen=True)
class Field:
    """One thunk field: ``kind`` names the check ``validate._check_field`` applies to its value.

    A field is optional when it is nullable (an ``opt_`` kind: ``null`` means absent), when
    ``used_when`` names the op's flag without which it is unused (an offset written as 0), or when it
    belongs to ABI version 2 (``version``): a version-2 field may be left out, meaning its default
    (``host_fallback.fields.DEFAULTS``), and a version-1 schedule may not name it.
    """

    name: str
    kind: str
    choices: tuple[str, ...] = ()
    used_when: str = ""
    version: int = 1

    @property
    def nullable(self) -> bool:
        return self.kind.startswith("opt_")

    @property
    def optional(self) -> bool:
        return self.nullable or bool(self.used_when) or self.version > 1


@dataclass(frozen=True)
class OpSpec:
    """An op of ABI.md: its fields (besides ``op`` and ``dtype``), the dtypes it accepts, and the ABI
    version that has it (a version-2 op inside an ``rlx-thunks/1`` schedule is refused)."""

    name: str
    fields: tuple[Field, ...]
    dtypes: tuple[str, ...] = DTYPES
    version: int = 1

    @cached_property
    def field_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    @cached_property
    def optional_fields(self) -> tuple[Field, ...]:
        """The fields a thunk of this op may go without (see ``Field.optional``)."""
        return tuple(f for f in self.fields if f.optional)

    @cached_property
    def required(self) -> tuple[str, ...]:
        """The fields every thunk of this op names (version 1's)."""
        return tuple(f.name for f in self.fields if f.version == 1)

    @cached_property
    def v2_fields(self) -> frozenset[str]:
        return frozenset(f.name for f in self.fields if f.version > 1)

    @cached_property
    def keys(self) -> frozenset[str]:
        """Every key a thunk of this op has: its fields, ``op`` and ``dtype``."""
        return frozenset(self.field_names) | {"op", "dtype"}


def _offsets(*names: str, used_when: str = "") -> tuple[Field, ...]:
    return tuple(Field(n, "offset", used_when=used_when) for n in names)


def _pos(*names: str) -> tuple[Field, ...]:
    return tuple(Field(n, "pos") for n in names)


def _flags(*names: str) -> tuple[Field, ...]:
    return tuple(Field(n, "bool") for n in names)


def _v2(*fields: Field) -> tuple[Field, ...]:
    return tuple(Field(f.name, f.kind, f.choices, f.used_when, version=2) for f in fields)


#: ABI.md §8's fields shared by selective_scan, mamba2 and gated_delta_net (``state`` aside: gdn has it in v1).
_STATE_V2 = _v2(Field("state_dtype", "dtype"), Field("cu_seqlens", "opt_offset"), Field("num_seqs", "pos"),
                Field("state_slots", "opt_offset"), Field("num_slots", "pos"))
_CARRIED_V2 = _v2(Field("carry_state", "bool"), Field("state", "opt_offset"), Field("param_dtype", "dtype"))
_RECURRENT_V2 = _v2(Field("seq_lens", "opt_offset"), Field("reverse", "bool"), Field("clip", "float"),
                    Field("activations", "activations", tuple(ACTIVATIONS)))
_RECURRENT_PARAMS = _pos("batch", "seq", "input_size", "hidden", "num_layers") + _flags("bidirectional", "carry")
_SCAN_BACKWARD = (
    Field("body_vjp", "schedule"), Field("body_carry_in_off", "offset"), Field("body_x_offs", "offsets"),
    Field("body_d_output_off", "offset"), Field("body_dcarry_out_off", "offset"),
    Field("outer_init_off", "offset"), Field("outer_traj_off", "offset"), Field("outer_upstream_off", "offset"),
    Field("outer_xs_offs", "pairs"), Field("length", "pos"), Field("carry_bytes", "pos"),
    Field("carry_elem_size", "elem_size"), Field("save_trajectory", "bool"),
    Field("num_checkpoints", "count"), Field("forward_body", "opt_schedule"),
    Field("forward_body_carry_in_off", "offset"), Field("forward_body_output_off", "offset"),
    Field("forward_body_x_offs", "offsets"),
)

SPECS: dict[str, OpSpec] = {s.name: s for s in (
    OpSpec("lstm", _offsets("x", "w_ih", "w_hh", "bias") + _offsets("h0", "c0", used_when="carry") + _offsets("dst")
           + _RECURRENT_PARAMS + _RECURRENT_V2
           + _v2(Field("peepholes", "opt_offset"), Field("input_forget", "bool"), Field("proj_size", "count"),
                 Field("w_hr", "opt_offset"))),
    OpSpec("gru", _offsets("x", "w_ih", "w_hh", "b_ih", "b_hh") + _offsets("h0", used_when="carry") + _offsets("dst")
           + _RECURRENT_PARAMS + _RECURRENT_V2 + _v2(Field("linear_before_reset", "bool"))),
    OpSpec("rnn", _offsets("x", "w_ih", "w_hh", "bias") + _offsets("h0", used_when="carry") + _offsets("dst")
           + _RECURRENT_PARAMS + _flags("relu") + _RECURRENT_V2),
    OpSpec("selective_scan", _offsets("x", "delta", "a", "b", "c", "dst")
           + _pos("batch", "seq", "hidden", "state_size")
           + _v2(Field("groups", "pos"), Field("delta_bias", "opt_offset"), Field("delta_softplus", "bool"),
                 Field("d", "opt_offset"), Field("z", "opt_offset")) + _CARRIED_V2 + _STATE_V2),
    OpSpec("mamba2", _offsets("x", "dt", "a", "b", "c", "dst")
           + _pos("batch", "seq", "heads", "head_dim", "state_size")
           + _v2(Field("groups", "pos"), Field("dt_bias", "opt_offset"), Field("dt_softplus", "bool"),
                 Field("dt_limit", "limit"), Field("d", "opt_offset"), Field("z", "opt_offset"))
           + _CARRIED_V2 + _STATE_V2),
    OpSpec("gated_delta_net", _offsets("q", "k", "v", "g", "beta") + _offsets("state", used_when="carry_state")
           + _offsets("dst")
           + _pos("batch", "seq", "heads", "state_size") + _flags("gate_per_channel", "carry_state")
           + _v2(Field("value_heads", "pos"), Field("value_size", "pos"), Field("scale", "opt_float"),
                 Field("qk_l2norm", "bool")) + _STATE_V2),
    OpSpec("unary", _offsets("x", "dst") + (Field("n", "count"), Field("fn", "enum", UNARY_FNS))),
    OpSpec("binary", _offsets("a", "b", "dst") + (Field("fn", "enum", BINARY_FNS), Field("shape", "shape"),
                                                  Field("a_strides", "strides"), Field("b_strides", "strides"))),
    OpSpec("matmul", _offsets("a", "b", "dst") + (Field("batch", "count"),) + _pos("m", "k", "n")
           + _flags("trans_a", "trans_b") + (Field("a_batch_stride", "count"), Field("b_batch_stride", "count"))),
    OpSpec("reduce_sum", _offsets("x", "dst") + _pos("outer", "r", "inner")),
    OpSpec("copy", _offsets("src", "dst") + (Field("nbytes", "count"),)),
    OpSpec("fill", _offsets("dst") + (Field("n", "count"), Field("value", "float"))),
    OpSpec("cast", _offsets("src", "dst") + (Field("n", "count"), Field("src_dtype", "dtype"))),
    OpSpec("scan", (
        Field("body", "schedule"), Field("body_input_off", "offset"), Field("body_output_off", "offset"),
        Field("outer_init_off", "offset"), Field("outer_final_off", "offset"), Field("length", "pos"),
        Field("carry_bytes", "pos"), Field("save_trajectory", "bool"), Field("xs_inputs", "xs"),
        Field("bcast_inputs", "bcast"), Field("num_checkpoints", "count"))),
    OpSpec("scan_backward", _SCAN_BACKWARD + (Field("outer_dinit_off", "offset"),)),
    OpSpec("scan_backward_xs", _SCAN_BACKWARD + (
        Field("xs_idx", "count"), Field("body_dxs_out_off", "offset"), Field("outer_dxs_off", "offset"),
        Field("per_step_bytes", "pos"))),
)}



def _backward(forward: OpSpec) -> OpSpec:
    """ABI.md §9's ``OP_backward``: every field of ``OP`` but ``dst`` (all read), ``d_dst``, and a gradient
    ``d_NAME`` of the same kind as each floating-point tensor ``NAME`` (optional exactly where it is; the
    gradient of a state used only with the carry flag is a version-2 field, required with the flag only)."""
    kept = tuple(f for f in forward.fields if f.name != "dst")
    tensors = [f for f in kept if f.kind in ("offset", "opt_offset") and f.name not in INT_FIELDS]
    assert {f.name for f in tensors if f.nullable} == set(OPTIONAL_INPUTS[forward.name]), forward.name
    assert {f.name for f in tensors if f.used_when} == set(FLAGGED_STATES[forward.name]), forward.name
    grads = tuple(Field(gradient(f.name), f.kind, used_when=f.used_when, version=2 if f.used_when else f.version)
                  for f in tensors)
    return OpSpec(f"{forward.name}_backward", kept + (Field("d_dst", "offset"),) + grads, forward.dtypes, version=2)


SPECS.update({s.name: s for s in map(_backward, [SPECS[op] for op in FORWARD_OPS])})

SCAN_OPS = scan.SCAN_OPS

assert all(SPECS[op].v2_fields == frozenset(DEFAULTS[op]) for op in DEFAULTS), "op table and defaults disagree"


def footprint(thunk: Mapping[str, Any]) -> tuple[list[Region], list[Region]]:
    """``(reads, writes)``: the regions a thunk reads and the ones it writes (read-write ones in both)."""
    regs = regions(thunk)
    return [r for r in regs if r.reads], [r for r in regs if r.writes]

