"""The gated delta rule of ABI.md §4 and §8: ``gated_delta_net`` (grouped value heads, a carried state)."""
from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from .aliasing import ALIASING
from .model import OpDef, Region, Thunk, fail, flags, newer, offsets, positive, rule, same
from .state import DATA_RULES, STATE_FIELDS, check_state, state_regions


def gdn_scale(t: Thunk) -> float:
    """The factor of gated_delta_net's step 4: ``scale``, or ``1/sqrt(state_size)`` when absent."""
    return 1.0 / math.sqrt(t["state_size"]) if t.get("scale") is None else float(t["scale"])


def _layout(t: Thunk) -> list[Region]:
    b, s, h, k, dt = t["batch"], t["seq"], t["heads"], t["state_size"], t["dtype"]
    hv, v = t["value_heads"], t["value_size"]
    out = [Region(f, t[f], (b, s, h, k), dt, "r") for f in ("q", "k")]
    out.append(Region("v", t["v"], (b, s, hv, v), dt, "r"))
    out.append(Region("g", t["g"], (b, s, hv, k) if t["gate_per_channel"] else (b, s, hv), dt, "r"))
    out.append(Region("beta", t["beta"], (b, s, hv), dt, "r"))
    out += state_regions(t, (hv, k, v))
    out.append(Region("dst", t["dst"], (b, s, hv, v), dt, "w"))
    return out


def _check(t: Thunk) -> None:
    if "value_heads" in t and t["value_heads"] % t["heads"]:
        raise fail(t, "value_heads", f"{t['value_heads']} is no multiple of heads = {t['heads']}")
    check_state(t)


def _sample(field: str, params: Mapping[str, Any], x: np.ndarray) -> np.ndarray:
    """Conformance inputs: a decaying gate, ``beta`` in (0, 1), unit-norm keys."""
    if field == "g":
        return -np.abs(x) * 0.3
    if field == "beta":
        return 1.0 / (1.0 + np.exp(-x))
    if field == "k":
        return x / np.linalg.norm(x, axis=-1, keepdims=True)
    return x


GATED_DELTA_NET = OpDef(
    "gated_delta_net",
    offsets("q", "k", "v", "g", "beta") + offsets("state", used_when="carry_state") + offsets("dst")
    + positive("batch", "seq", "heads", "state_size") + flags("gate_per_channel", "carry_state")
    + (newer("value_heads", "pos", same("heads")), newer("value_size", "pos", same("state_size")),
       newer("scale", "opt_float", None), newer("qk_l2norm", "bool", False)) + STATE_FIELDS,
    _layout, rules=(rule(_check), ALIASING), data_rules=DATA_RULES, states=("state",), differentiable=True,
    sample=_sample, place=(4, 3))

