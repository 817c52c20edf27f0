"""The gated delta rule of ABI.md §4 and §8: ``gated_delta_net`` (grouped value heads, a carried state)."""
from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from . import reserve
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
    return out + reserve.region(t)


def _check(t: Thunk) -> None:
    if "value_heads" in t and t["value_heads"] % t["heads"]:
        raise fail(t, "value_heads", f"{t['value_heads']} is no multiple of heads = {t['heads']}")
    check_state(t)
    reserve.refuse_packed(t)


#: The chunk length of gated_delta_net's saved forward (ABI.md §9.1, docs/abi.md): its states leave, and its
#: products and inverses belong to, chunks of this many tokens, whatever chunk length a backend computes with.
RESERVE_CHUNK = 32


def reserve_slots(t: Thunk) -> list[reserve.Slot]:
    """The reserve of a gated_delta_net thunk (the fields given suffice), chunks of ``RESERVE_CHUNK`` tokens
    (``C = ceil(seq / 32)``, the last one padded with zero inputs), per value head ``j`` (key head ``j //
    (value_heads / heads)``), all in ``reserve.element_type``:

    - ``states [batch, C, value_heads, state_size, value_size]``: the state leaving each chunk (the last is
      the final state);
    - ``qk [batch, C, value_heads, 32, 32]``: each chunk's decayed ``q_r · k_s`` for ``s <= r`` (0 above the
      diagonal; before ``scale``), ``kk`` the same of ``k_r · k_s`` for ``s < r`` (0 on and above it), the
      decay ``exp(cum_r - cum_s)`` per key channel inside the dot product where the gate is per channel;
    - ``inverse [batch, C, value_heads, 32, 32]``: ``(I + diag(beta) kk)^-1``, unit lower triangular;
    - ``u [batch, C, value_heads, 32, value_size]``: what each token adds to the state, ``u = inverse diag(beta)
      (v - (gamma k) S)``, ``S`` the state entering the chunk, ``gamma_r`` the decay from it through token ``r``
      (0 past ``seq``).
    """
    b, count, hv = t["batch"], -(-t["seq"] // RESERVE_CHUNK), t.get("value_heads") or t["heads"]
    n, ct, square = t["state_size"], reserve.element_type(t), (RESERVE_CHUNK, RESERVE_CHUNK)
    lead = (b, count, hv)
    width = t.get("value_size") or n
    return reserve.packed([("states", 0, (*lead, n, width), ct), ("qk", 0, (*lead, *square), ct),
                           ("kk", 0, (*lead, *square), ct), ("inverse", 0, (*lead, *square), ct),
                           ("u", 0, (*lead, RESERVE_CHUNK, width), ct)])


def reserve_bytes(t: Thunk) -> int:
    """The least ``reserve_bytes`` of a gated_delta_net thunk (ABI.md §9.1)."""
    return reserve.size(reserve_slots(t))


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
       newer("scale", "opt_float", None), newer("qk_l2norm", "bool", False)) + STATE_FIELDS
    + reserve.FIELDS,
    _layout, rules=(rule(_check), reserve.rule(reserve_bytes), ALIASING), data_rules=DATA_RULES, states=("state",),
    differentiable=True, sample=_sample, place=(4, 3), reserve_size=reserve_bytes)

