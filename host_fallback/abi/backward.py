"""ABI.md §9's backward ops, generated from their forward's definition: ``OP_backward`` for every
differentiable ``OP``.

``OP_backward`` takes every field of ``OP`` except ``dst``, plus ``d_dst`` and one ``d_NAME`` per
floating-point input ``NAME`` of the forward (the carried states' ``d_h0``/``d_c0``/``d_state``
among them, read as the final state's gradient and written back as the initial state's). Its
regions, rules, run-time data rules and conformance inputs follow the forward's.
"""
from __future__ import annotations

from typing import Any

from .int_tensors import INT_FIELDS
from .model import Checked, Field, OpDef, Region, Rule, Thunk, fail
from .reserve import RESERVE


def gradient(name: str) -> str:
    """The field holding the gradient of the loss with respect to tensor field ``name``."""
    return f"d_{name}"


def float_inputs(forward: OpDef) -> tuple[Field, ...]:
    """The forward's floating-point tensor fields but ``dst`` and the saved forward (``reserve``, read-only on
    the backward): the ones a backward op gives a gradient."""
    return tuple(f for f in forward.fields if f.kind in ("offset", "opt_offset") and f.name not in ("dst", RESERVE)
                 and f.name not in INT_FIELDS)


def optional_inputs(forward: OpDef) -> tuple[str, ...]:
    """The forward's optional (version-2) floating-point inputs: their gradients are optional too, given
    exactly when the input is (``state`` of selective_scan and mamba2: exactly with ``carry_state``)."""
    return tuple(f.name for f in float_inputs(forward) if f.nullable)


def flagged_states(forward: OpDef) -> tuple[str, ...]:
    """The states version 1 names even without the op's carry flag (an unused offset, written 0); their
    gradients exist only with a carried state: a backward op without one leaves them out."""
    return tuple(f.name for f in float_inputs(forward) if f.used_when)


def _fields(forward: OpDef) -> tuple[Field, ...]:
    """Every field of the forward but ``dst``, ``d_dst``, and a gradient of the same kind as each
    floating-point input (optional exactly where it is; the gradient of a state used only with the carry
    flag is a version-2 field, required with the flag only); a gradient's default is absent."""
    kept = tuple(f for f in forward.fields if f.name != "dst")
    grads = tuple(Field(gradient(f.name), f.kind, used_when=f.used_when, version=2 if f.used_when else f.version)
                  for f in float_inputs(forward))
    return kept + (Field("d_dst", "offset"),) + grads


def as_forward(t: Thunk, forward: OpDef) -> dict[str, Any]:
    """The forward thunk a backward thunk differentiates, completed; its ``dst`` is ``d_dst``'s offset (the
    forward's output is not stored: the range stands for its shape)."""
    return forward.complete({**t, "op": forward.name, "dst": t["d_dst"]})


def _layout(forward: OpDef):
    def layout(t: Thunk) -> list[Region]:
        """The forward's regions, every one read-only, then ``d_dst`` (read, shaped like ``dst``) and one
        gradient per floating-point input in its input's shape and element type: an ordinary write range,
        or, for a carried state, read (the final state's gradient) and written in place (the initial one's)."""
        regs = forward.layout(as_forward(t, forward))
        out = [Region(r.field, r.offset, r.shape, r.dtype, "r") for r in regs if r.field != "dst"]
        out += [Region("d_dst", r.offset, r.shape, r.dtype, "r") for r in regs if r.field == "dst"]
        out += [Region(gradient(r.field), t[gradient(r.field)], r.shape, r.dtype, "rw" if r.writes else "w")
                for r in regs if r.field not in ("dst", RESERVE) and r.dtype != "i32"]
        return out
    return layout


def _forward_rule(forward: OpDef, rule: Rule) -> Rule:
    """A forward rule on the fields given, run on the backward thunk's as the forward's."""
    def check(c: Checked) -> None:
        rule.check(Checked({**c.given, "op": forward.name}))
    return Rule(check)


def _gradients_paired(forward: OpDef) -> Rule:
    """The gradient of an optional input is given exactly when the input is."""
    names = optional_inputs(forward)

    def check(c: Checked) -> None:
        t = c.given
        for name in names:
            has_input, has_gradient = t.get(name) is not None, t.get(gradient(name)) is not None
            if has_input and not has_gradient:
                raise fail(t, gradient(name), f"missing: {name} is given, so its gradient is written")
            if has_gradient and not has_input:
                raise fail(t, gradient(name), f"given without {name} (the gradient of an absent input)")
    return Rule(check)


def backward_of(forward: OpDef) -> OpDef:
    """``forward``'s backward op (ABI.md §9): version 2, its forward's rules on the fields given first."""
    given = tuple(_forward_rule(forward, r) for r in forward.rules if not r.on_footprint)
    on_footprint = tuple(r for r in forward.rules if r.on_footprint)
    return OpDef(f"{forward.name}_backward", _fields(forward), _layout(forward), forward.dtypes, version=2,
                 rules=given + (_gradients_paired(forward),) + on_footprint, data_rules=forward.data_rules,
                 states=tuple(gradient(s) for s in forward.states), forward=forward.name, sample=forward.sample,
                 place=(9, *forward.place), reserve_size=forward.reserve_size)
