"""Mamba-3 SISO of ABI.md §11: ``mamba3`` (trapezoidal discretisation, a data-dependent rotary state, four
carried state tensors, with §8's packed sequences, carried state and state slots)."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from .aliasing import ALIASING
from .model import ELEM_SIZE, OpDef, Region, Thunk, fail, newer, offsets, positive, rule, same
from .state import DATA_RULES, STATE_FIELDS, carried_regions, check_state, divides, optional_regions, wide_enough

#: The four carried state tensors, in the anchor's ``(angle, ssm, k, v)`` order.
STATES = ("angle_state", "state", "k_state", "v_state")
#: The per-token, per-head inputs stored in ``dt_dtype``.
STEP_INPUTS = ("adt", "dt", "trap")


def state_dtype_default(t: Thunk) -> str:
    """§11: the states are f32 by default, f64 for an f64 thunk (unlike §8's default, the thunk's dtype)."""
    return "f64" if t["dtype"] == "f64" else "f32"


def state_shapes(t: Thunk) -> dict[str, tuple[int, ...]]:
    """One row of each carried state: ``angle_state [H,A]``, ``state [H,P,N]``, ``k_state [H,N]``, ``v_state [H,P]``."""
    h, p, n, a = t["heads"], t["head_dim"], t["state_size"], t["num_angles"]
    return {"angle_state": (h, a), "state": (h, p, n), "k_state": (h, n), "v_state": (h, p)}


def _layout(t: Thunk) -> list[Region]:
    b, s, h, p, n, g = t["batch"], t["seq"], t["heads"], t["head_dim"], t["state_size"], t["groups"]
    dt, st = t["dtype"], t["dt_dtype"]
    out = [Region("q", t["q"], (b, s, g, n), dt, "r"), Region("k", t["k"], (b, s, g, n), dt, "r"),
           Region("v", t["v"], (b, s, h, p), dt, "r")]
    out += [Region(f, t[f], (b, s, h), st, "r") for f in STEP_INPUTS]
    out.append(Region("angles", t["angles"], (b, s, h, t["num_angles"]), st, "r"))
    out += optional_regions(t, ("q_bias", "k_bias"), (h, n), t["param_dtype"])
    out += optional_regions(t, ("d",), (h,), t["param_dtype"]) + optional_regions(t, ("z",), (b, s, h, p), dt)
    out += carried_regions(t, state_shapes(t))
    out.append(Region("dst", t["dst"], (b, s, h, p), dt, "w"))
    return out


def _check(t: Thunk) -> None:
    n = t["state_size"]
    if n % 2:
        raise fail(t, "state_size", f"{n} is odd; the rotation turns pairs, so state_size must be even")
    if not 1 <= t["num_angles"] <= n // 2:
        raise fail(t, "num_angles", f"{t['num_angles']} is outside 1 <= num_angles <= state_size/2 = {n // 2}")
    divides(t, "groups", "heads")
    wide_enough(t, "dt_dtype")
    wide_enough(t, "param_dtype")
    if "state_dtype" in t and (t["state_dtype"] not in ("f32", "f64")
                               or ELEM_SIZE[t["state_dtype"]] < ELEM_SIZE[t["dtype"]]):
        allowed = "f64" if t["dtype"] == "f64" else "f32, f64"
        raise fail(t, "state_dtype", f"{t['state_dtype']} cannot hold mamba3's state of a {t['dtype']} thunk; "
                                     f"expected one of {allowed}")
    carry = t.get("carry_state", False)
    for field in STATES:
        if carry and t.get(field) is None:
            raise fail(t, field, "missing: carry_state = true needs all four state offsets "
                                 f"({', '.join(STATES)})")
        if not carry and t.get(field) is not None:
            raise fail(t, field, "given without carry_state = true")
    check_state(t)


def _sample(field: str, params: Mapping[str, Any], x: np.ndarray) -> np.ndarray:
    """Conformance inputs: a negative log-decay ``adt``, a positive step ``dt``; logits and rates as drawn."""
    if field == "adt":
        return -np.abs(x) * 0.5
    if field == "dt":
        return np.abs(x) * 0.5
    return x


MAMBA3 = OpDef(
    "mamba3",
    offsets("q", "k", "v", "adt", "dt", "trap", "angles", "dst")
    + positive("batch", "seq", "heads", "head_dim", "state_size", "num_angles")
    + (newer("groups", "pos", same("heads")), newer("q_bias", "opt_offset", None), newer("k_bias", "opt_offset", None),
       newer("d", "opt_offset", None), newer("z", "opt_offset", None), newer("dt_dtype", "dtype", same("dtype")),
       newer("param_dtype", "dtype", same("dtype")), newer("carry_state", "bool", False))
    + tuple(newer(f, "opt_offset", None) for f in STATES)
    + (newer("state_dtype", "dtype", state_dtype_default),) + STATE_FIELDS[1:],
    _layout, version=2, rules=(rule(_check), ALIASING), data_rules=DATA_RULES, states=STATES,
    differentiable=True, sample=_sample, place=(11, 1))
