"""The short convolution of ABI.md §10: ``causal_conv1d`` (depthwise, causal, width 2..8, with §8's packed
sequences, carried state and state slots)."""
from __future__ import annotations

from .aliasing import ALIASING
from .model import OpDef, Region, Thunk, fail, newer, offsets, positive, rule
from .state import DATA_RULES, STATE_FIELDS, check_carried, optional_regions, state_regions

#: the widths §10 allows
WIDTHS = range(2, 9)
ACTIVATIONS = ("none", "silu")


def _layout(t: Thunk) -> list[Region]:
    b, s, d, dt = t["batch"], t["seq"], t["dim"], t["dtype"]
    out = [Region("x", t["x"], (b, s, d), dt, "r"), Region("weight", t["weight"], (d, t["width"]), dt, "r")]
    out += optional_regions(t, ("bias",), (d,), dt)
    out += state_regions(t, (d, t["width"] - 1))
    out.append(Region("dst", t["dst"], (b, s, d), dt, "w"))
    return out


def _check(t: Thunk) -> None:
    if t["width"] not in WIDTHS:
        raise fail(t, "width", f"{t['width']} is outside 2 <= width <= 8")
    check_carried(t)


CAUSAL_CONV1D = OpDef(
    "causal_conv1d",
    offsets("x", "weight", "dst") + positive("batch", "seq", "dim", "width")
    + (newer("bias", "opt_offset", None), newer("activation", "enum", "none", ACTIVATIONS),
       newer("carry_state", "bool", False), newer("state", "opt_offset", None)) + STATE_FIELDS,
    _layout, version=2, rules=(rule(_check), ALIASING), data_rules=DATA_RULES, states=("state",),
    differentiable=True, place=(10, 1))
