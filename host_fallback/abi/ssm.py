"""The state-space ops of ABI.md §4 and §8: ``selective_scan`` (Mamba-1) and ``mamba2`` (SSD)."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from . import reserve
from .aliasing import ALIASING
from .model import Field, OpDef, Region, Thunk, newer, offsets, positive, rule, same
from .state import CARRIED_FIELDS, DATA_RULES, STATE_FIELDS, check_carried, divides, optional_regions, state_regions


def _selective_scan(t: Thunk) -> list[Region]:
    b, s, h, n, dt, pt = t["batch"], t["seq"], t["hidden"], t["state_size"], t["dtype"], t["param_dtype"]
    bc = (b, s, n) if t["groups"] == 1 else (b, s, t["groups"], n)
    out = [
        Region("x", t["x"], (b, s, h), dt, "r"),
        Region("delta", t["delta"], (b, s, h), dt, "r"),
        Region("a", t["a"], (h, n), pt, "r"),
        Region("b", t["b"], bc, dt, "r"),
        Region("c", t["c"], bc, dt, "r"),
    ]
    out += optional_regions(t, ("delta_bias", "d"), (h,), pt) + optional_regions(t, ("z",), (b, s, h), dt)
    out += state_regions(t, (h, n))
    out.append(Region("dst", t["dst"], (b, s, h), dt, "w"))
    return out + reserve.region(t)


def _mamba2(t: Thunk) -> list[Region]:
    b, s, h, p, n, dt, pt = t["batch"], t["seq"], t["heads"], t["head_dim"], t["state_size"], t["dtype"], t["param_dtype"]
    out = [
        Region("x", t["x"], (b, s, h, p), dt, "r"),
        Region("dt", t["dt"], (b, s, h), dt, "r"),
        Region("a", t["a"], (h,), pt, "r"),
        Region("b", t["b"], (b, s, t["groups"], n), dt, "r"),
        Region("c", t["c"], (b, s, t["groups"], n), dt, "r"),
    ]
    out += optional_regions(t, ("dt_bias", "d"), (h,), pt) + optional_regions(t, ("z",), (b, s, h, p), dt)
    out += state_regions(t, (h, p, n))
    out.append(Region("dst", t["dst"], (b, s, h, p), dt, "w"))
    return out + reserve.region(t)


def _check_selective_scan(t: Thunk) -> None:
    divides(t, "groups", "hidden")
    check_carried(t)
    reserve.refuse_packed(t)


def _check_mamba2(t: Thunk) -> None:
    divides(t, "groups", "heads")
    check_carried(t)
    reserve.refuse_packed(t)


#: The chunk length of mamba2's saved forward (ABI.md §9.1, docs/abi.md): its states are those leaving each
#: chunk of this many tokens, whatever chunk length a backend computes with.
RESERVE_CHUNK = 64


#: The chunk length of selective_scan's saved forward: the states leaving each chunk of this many tokens.
SCAN_RESERVE_CHUNK = 32


def mamba2_reserve_slots(t: Thunk) -> list[reserve.Slot]:
    """The reserve of a mamba2 thunk (the fields given suffice): ``states [batch, C, heads, head_dim,
    state_size]``, the state leaving each chunk of ``RESERVE_CHUNK`` tokens (``C = ceil(seq / 64)``; the last
    is the final state), ``y [batch, seq, heads, head_dim]``, the output before ``d`` and ``z``
    (``Σ_n S[p,n]·c[n]``), then ``scores [batch, C, heads, 64, 64]``, each chunk's decayed scores
    ``W[l, s] = (c_l · b_s) exp(cum_l - cum_s)`` (``cum``: the log-decay ``dt·a`` summed from the chunk's start
    through the step; 0 for ``s > l`` and past ``seq``), all in ``reserve.element_type``."""
    b, s, h, p, n = t["batch"], t["seq"], t["heads"], t["head_dim"], t["state_size"]
    count, ct, length = -(-s // RESERVE_CHUNK), reserve.element_type(t), RESERVE_CHUNK
    return reserve.packed([("states", 0, (b, count, h, p, n), ct), ("y", 0, (b, s, h, p), ct),
                           ("scores", 0, (b, count, h, length, length), ct)])


def mamba2_reserve_bytes(t: Thunk) -> int:
    """The least ``reserve_bytes`` of a mamba2 thunk (ABI.md §9.1)."""
    return reserve.size(mamba2_reserve_slots(t))


def selective_scan_reserve_slots(t: Thunk) -> list[reserve.Slot]:
    """The reserve of a selective_scan thunk (the fields given suffice): ``states [batch, C, hidden,
    state_size]``, the state ``h`` leaving each chunk of ``SCAN_RESERVE_CHUNK`` tokens (``C = ceil(seq / 32)``;
    the last is the final state), in ``reserve.element_type``."""
    count = -(-t["seq"] // SCAN_RESERVE_CHUNK)
    return reserve.packed([("states", 0, (t["batch"], count, t["hidden"], t["state_size"]), reserve.element_type(t))])


def selective_scan_reserve_bytes(t: Thunk) -> int:
    """The least ``reserve_bytes`` of a selective_scan thunk (ABI.md §9.1)."""
    return reserve.size(selective_scan_reserve_slots(t))


#: op -> the slots of its saved forward (a backward op's are its forward's).
RESERVE_SLOTS = {"selective_scan": selective_scan_reserve_slots, "mamba2": mamba2_reserve_slots}


def _sampler(step: str) -> Any:
    """Conformance inputs: a positive step size (``delta`` / ``dt``) and a negative decay ``a``."""
    def sample(field: str, params: Mapping[str, Any], x: np.ndarray) -> np.ndarray:
        if field == step:
            return np.abs(x) * 0.5
        return -np.abs(x) if field == "a" else x
    return sample


def _gate_fields(bias: str, softplus: str) -> tuple[Field, ...]:
    return (newer(bias, "opt_offset", None), newer(softplus, "bool", False))


def _skip_fields() -> tuple[Field, ...]:
    return (newer("d", "opt_offset", None), newer("z", "opt_offset", None))


SELECTIVE_SCAN = OpDef(
    "selective_scan",
    offsets("x", "delta", "a", "b", "c", "dst") + positive("batch", "seq", "hidden", "state_size")
    + (newer("groups", "pos", 1),) + _gate_fields("delta_bias", "delta_softplus") + _skip_fields()
    + CARRIED_FIELDS + STATE_FIELDS + reserve.FIELDS,
    _selective_scan, rules=(rule(_check_selective_scan), reserve.rule(selective_scan_reserve_bytes), ALIASING),
    data_rules=DATA_RULES, states=("state",), differentiable=True, sample=_sampler("delta"), place=(4, 1),
    reserve_size=selective_scan_reserve_bytes)

MAMBA2 = OpDef(
    "mamba2",
    offsets("x", "dt", "a", "b", "c", "dst") + positive("batch", "seq", "heads", "head_dim", "state_size")
    + (newer("groups", "pos", same("heads")),) + _gate_fields("dt_bias", "dt_softplus")
    + (newer("dt_limit", "limit", None),) + _skip_fields() + CARRIED_FIELDS + STATE_FIELDS + reserve.FIELDS,
    _mamba2, rules=(rule(_check_mamba2), reserve.rule(mamba2_reserve_bytes), ALIASING), data_rules=DATA_RULES,
    states=("state",), differentiable=True, sample=_sampler("dt"), place=(4, 2), reserve_size=mamba2_reserve_bytes)
