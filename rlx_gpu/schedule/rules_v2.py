"""The cross-field rules of ABI.md §8 and §9, by op: what the version-2 fields require of each other.

A backward op (§9) follows its forward's rules, and gives the gradient of an optional input exactly
when it gives the input.

Each rule gets the fields a thunk gives (``op`` and ``dtype`` included, version-2 fields only where
given, each already checked for its kind) and raises ``FieldError`` naming the field to fix.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping

from host_fallback.arena import ELEM_SIZE
from host_fallback.fields import ACTIVATION_SLOTS
from host_fallback.gradients import BACKWARD, OPTIONAL_INPUTS, gradient
from host_fallback.scan_rules import FieldError

Fields = Mapping[str, Any]


def _fail(t: Fields, field: str, message: str) -> FieldError:
    return FieldError(t["op"], field, message)


def _divides(t: Fields, field: str, whole: str) -> None:
    if field in t and t[whole] % t[field]:
        raise _fail(t, field, f"{t[field]} does not divide {whole} = {t[whole]}")


def _wide_enough(t: Fields, field: str) -> None:
    """``state_dtype`` / ``param_dtype``: the thunk's dtype, f32 or f64, at least as wide as the thunk's."""
    if field not in t:
        return
    chosen, dtype = t[field], t["dtype"]
    if chosen not in (dtype, "f32", "f64") or ELEM_SIZE[chosen] < ELEM_SIZE[dtype]:
        allowed = ", ".join(dict.fromkeys(d for d in (dtype, "f32", "f64") if ELEM_SIZE[d] >= ELEM_SIZE[dtype]))
        raise _fail(t, field, f"{chosen} cannot hold a {dtype} thunk's values; expected one of {allowed}")


def _paired(t: Fields, tensor: str, count: str) -> None:
    """An integer tensor and its count come together (``cu_seqlens`` + ``num_seqs``, ``state_slots`` + ``num_slots``)."""
    has_tensor, has_count = t.get(tensor) is not None, count in t
    if has_tensor and not has_count:
        raise _fail(t, count, f"missing: {tensor} needs {count}")
    if has_count and not has_tensor:
        raise _fail(t, count, f"given without {tensor}")


def _state(t: Fields) -> None:
    """The §8 rules shared by selective_scan, mamba2 and gated_delta_net."""
    _paired(t, "cu_seqlens", "num_seqs")
    _paired(t, "state_slots", "num_slots")
    if t.get("cu_seqlens") is not None and t["batch"] != 1:
        raise _fail(t, "cu_seqlens", f"packed sequences need batch = 1, got batch = {t['batch']}")
    if t.get("state_slots") is not None and not t.get("carry_state"):
        raise _fail(t, "state_slots", "state slots need carry_state = true (a pool of carried states)")
    _wide_enough(t, "state_dtype")


def _carried(t: Fields) -> None:
    """selective_scan and mamba2: ``state`` is present exactly when ``carry_state`` is true."""
    carry, state = t.get("carry_state", False), t.get("state")
    if carry and state is None:
        raise _fail(t, "state", "missing: carry_state = true needs the state offset")
    if state is not None and not carry:
        raise _fail(t, "state", "given without carry_state = true")
    _wide_enough(t, "param_dtype")
    _state(t)


def _selective_scan(t: Fields) -> None:
    _divides(t, "groups", "hidden")
    _carried(t)


def _mamba2(t: Fields) -> None:
    _divides(t, "groups", "heads")
    _carried(t)


def _gated_delta_net(t: Fields) -> None:
    if "value_heads" in t and t["value_heads"] % t["heads"]:
        raise _fail(t, "value_heads", f"{t['value_heads']} is no multiple of heads = {t['heads']}")
    _state(t)


def _recurrent(t: Fields) -> None:
    if t.get("reverse") and t["bidirectional"]:
        raise _fail(t, "reverse", "reverse needs bidirectional = false (a bidirectional layer walks both ways)")
    clip = t.get("clip", 0.0)
    if not (math.isfinite(clip) and clip >= 0):  # NaN < 0 is false: NaN would pass a plain comparison
        raise _fail(t, "clip", f"expected a finite number >= 0 (0: no clip), got {clip}")
    if "activations" in t:
        slots, dirs = ACTIVATION_SLOTS[t["op"]], 2 if t["bidirectional"] else 1
        if len(t["activations"]) != slots * dirs:
            raise _fail(t, "activations", f"expected {slots} per direction ({slots * dirs} for {dirs} direction"
                                          f"{'s' if dirs > 1 else ''}), got {len(t['activations'])}")
        if t.get("relu"):
            raise _fail(t, "relu", "relu must be false when activations are given (they name the function)")


def _lstm(t: Fields) -> None:
    _recurrent(t)
    proj = t.get("proj_size", 0)
    if proj and proj >= t["hidden"]:
        raise _fail(t, "proj_size", f"expected 0 < proj_size < hidden = {t['hidden']}, got {proj}")
    if proj and t.get("w_hr") is None:
        raise _fail(t, "w_hr", f"missing: proj_size = {proj} needs the projection weights w_hr")
    if t.get("w_hr") is not None and not proj:
        raise _fail(t, "w_hr", "given without proj_size")


RULES_V2: dict[str, Callable[[Fields], None]] = {
    "selective_scan": _selective_scan, "mamba2": _mamba2, "gated_delta_net": _gated_delta_net,
    "lstm": _lstm, "gru": _recurrent, "rnn": _recurrent,
}


def _backward_rule(forward: str) -> Callable[[Fields], None]:
    forward_rule = RULES_V2[forward]

    def rule(t: Fields) -> None:
        forward_rule({**t, "op": forward})
        for name in OPTIONAL_INPUTS[forward]:
            has_input, has_gradient = t.get(name) is not None, t.get(gradient(name)) is not None
            if has_input and not has_gradient:
                raise _fail(t, gradient(name), f"missing: {name} is given, so its gradient is written")
            if has_gradient and not has_input:
                raise _fail(t, gradient(name), f"given without {name} (the gradient of an absent input)")
    return rule


RULES_V2.update({backward: _backward_rule(forward) for backward, forward in BACKWARD.items()})

__all__ = ["RULES_V2"]
