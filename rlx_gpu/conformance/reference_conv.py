"""Float64 references of ``causal_conv1d`` and ``causal_conv1d_backward`` (ABI.md §10), written from its text.

Deliberately plain and independent of ``host_fallback``: one sequence (a batch row, or a packed sequence of
``cu_seqlens``) at a time, its inputs extended on the left by ``width-1`` values (the row's carried state,
or zeros), then one token and one tap at a time, every channel at once. The backward is the chain rule
through the same loops: every product ``weight[d,w] * e[t+w, d]`` hands its gradient to both factors, and the
final state (the last ``width-1`` values of ``e``) hands ``d_state`` back to the values it holds. Inputs are
any float arrays (rounded storage values as they are stored); results are float64.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from .registry import CARRIED, PACKED, SLOTS, Load, declare_cases, reference

#: The optional fields of §10 these references implement (all of them).
FIELDS = frozenset({"bias", "activation", "carry_state", "state", "state_dtype", "cu_seqlens", "num_seqs",
                    "state_slots", "num_slots"})


def _sigmoid(u: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-u))


def _sequences(batch: int, seq: int, cu_seqlens) -> list[tuple[int, int, range]]:
    """``(batch row, state row, tokens)`` of every sequence: each batch row, or each packed sequence."""
    if cu_seqlens is None:
        return [(b, b, range(seq)) for b in range(batch)]
    cu = [int(v) for v in cu_seqlens]
    return [(0, r, range(cu[r], cu[r + 1])) for r in range(len(cu) - 1)]


def _extended(x_row: np.ndarray, tokens: range, initial: np.ndarray) -> np.ndarray:
    """``e [width-1 + len, dim]``: the initial values (``initial [dim, width-1]``, oldest first), then the tokens."""
    return np.concatenate([initial.T, x_row[tokens.start:tokens.stop]], axis=0)


def causal_conv1d(x, weight, *, bias=None, activation="none", state=None, cu_seqlens=None, state_slots=None):
    """``x [B,S,D]``, ``weight [D,W]`` -> ``y [B,S,D]``, or ``(y, final pool)`` with ``state`` (the pool
    ``[R or num_slots, D, W-1]`` the rows start from; entries no row names unchanged)."""
    x, weight = np.asarray(x, np.float64), np.asarray(weight, np.float64)
    batch, seq, dim = x.shape
    width = weight.shape[1]
    bias = np.zeros(dim) if bias is None else np.asarray(bias, np.float64)
    pool = None if state is None else np.array(state, np.float64)
    y = np.zeros(x.shape)
    for b, r, tokens in _sequences(batch, seq, cu_seqlens):
        entry = r if state_slots is None else int(state_slots[r])
        initial = np.zeros((dim, width - 1)) if pool is None else pool[entry].copy()
        e = _extended(x[b], tokens, initial)
        for k, t in enumerate(tokens):
            total = bias.copy()
            for w in range(width):
                total = total + weight[:, w] * e[k + w]
            with np.errstate(invalid="ignore"):
                y[b, t] = total * _sigmoid(total) if activation == "silu" else total
        if pool is not None:
            pool[entry] = e[len(e) - (width - 1):].T
    return y if pool is None else (y, pool)


def causal_conv1d_backward(x, weight, d_dst, *, bias=None, activation="none", state=None, d_state=None,
                           cu_seqlens=None, state_slots=None) -> dict[str, np.ndarray]:
    """The gradients ``d_x``, ``d_weight``, ``d_bias`` (with ``bias``) and, with ``state``, ``d_state``: the
    pool ``d_state`` (the final states' gradient) with each named entry replaced by its initial state's."""
    x, weight, d_dst = (np.asarray(a, np.float64) for a in (x, weight, d_dst))
    batch, seq, dim = x.shape
    width = weight.shape[1]
    bias_v = np.zeros(dim) if bias is None else np.asarray(bias, np.float64)
    d_pool = None if state is None else np.array(d_state, np.float64)
    d_x, d_weight, d_bias = np.zeros(x.shape), np.zeros(weight.shape), np.zeros(dim)
    for b, r, tokens in _sequences(batch, seq, cu_seqlens):
        entry = r if state_slots is None else int(state_slots[r])
        initial = np.zeros((dim, width - 1)) if state is None else np.asarray(state, np.float64)[entry]
        e = _extended(x[b], tokens, initial)
        d_e = np.zeros(e.shape)
        if d_pool is not None:  # the final state is e's last width-1 values
            d_e[len(e) - (width - 1):] += d_pool[entry].T
        for k, t in enumerate(tokens):
            pre = bias_v + sum(weight[:, w] * e[k + w] for w in range(width))
            grad = d_dst[b, t]
            if activation == "silu":
                s = _sigmoid(pre)
                with np.errstate(invalid="ignore"):  # inf * 0: the formula's NaN
                    grad = grad * s * (1 + pre * (1 - s))
            d_bias += grad
            for w in range(width):
                d_weight[:, w] += grad * e[k + w]
                d_e[k + w] += grad * weight[:, w]
        d_x[b, tokens.start:tokens.stop] = d_e[width - 1:]
        if d_pool is not None:
            d_pool[entry] = d_e[:width - 1].T
    out = {"d_x": d_x, "d_weight": d_weight}
    if bias is not None:
        out["d_bias"] = d_bias
    if d_pool is not None:
        out["d_state"] = d_pool
    return out


def _fields(t: Mapping[str, Any], load: Load) -> dict[str, Any]:
    """The optional §10 fields of thunk ``t`` (completed) as the functions above take them."""
    out: dict[str, Any] = {f: load(f) for f in ("bias", "cu_seqlens", "state_slots") if t[f] is not None}
    out["activation"] = t["activation"]
    if t["carry_state"]:
        out["state"] = load("state")
    return out


@reference("causal_conv1d", v2_fields={"causal_conv1d": FIELDS})
def forward(t: Mapping[str, Any], load: Load) -> dict[str, np.ndarray]:
    """``{field: float64}`` of every tensor a ``causal_conv1d`` thunk ``t`` (completed) writes."""
    result = causal_conv1d(load("x"), load("weight"), **_fields(t, load))
    if t["carry_state"]:
        return {"dst": result[0], "state": result[1]}
    return {"dst": result}


@reference("causal_conv1d_backward", v2_fields={"causal_conv1d_backward": FIELDS | {"d_bias", "d_state"}})
def backward(t: Mapping[str, Any], load: Load) -> dict[str, np.ndarray]:
    """``{field: float64}`` of every tensor a ``causal_conv1d_backward`` thunk ``t`` (completed) writes."""
    extra = {"d_state": load("d_state")} if t["carry_state"] else {}
    return causal_conv1d_backward(load("x"), load("weight"), load("d_dst"), **_fields(t, load), **extra)


def _conv(b: int, s: int, dim: int, width: int, carry_state: bool = True, **v2: Any) -> dict:
    """A causal_conv1d case, its state carried unless told (a backward op's case adds ``d_state``)."""
    carried = dict(carry_state=True, state=True) if carry_state else {}
    return dict(batch=b, seq=s, dim=dim, width=width, **carried, **v2)


# widths 2..8 sampled; packed sequences with empty ones and ones shorter than width-1 through slots (the carried
# values then stay in the window); a decode step into slots; two chunks of the cpu target's 256 tokens; the
# backward likewise (d_weight summed over chunks, rows and sequences)
declare_cases("causal_conv1d", small=dict(batch=2, seq=7, dim=6, width=4), thunks=[
    (_conv(2, 5, 3, 2), {}, False),
    (_conv(1, 12, 5, 3, cu_seqlens=[0, 1, 1, 9, 12], state_slots=[3, 0, 4, 1], num_slots=5, bias=True,
           activation="silu"), {}, False),
    (_conv(1, 10, 4, 8, cu_seqlens=[0, 2, 2, 10], state_slots=[1, 2, 0], num_slots=3), {}, False),
    (_conv(3, 1, 6, 4, state_slots=[2, 0, 4], num_slots=5, bias=True), {}, False),
    (_conv(2, 300, 3, 5, bias=True, activation="silu", carry_state=False), {}, False),
], present={"activation": {"activation": "silu"}, "carry_state": CARRIED, "state": CARRIED,
            "state_dtype": {**CARRIED, "state_dtype": "f32"}, "cu_seqlens": PACKED, "num_seqs": PACKED,
            "state_slots": {**CARRIED, **SLOTS}, "num_slots": {**CARRIED, **SLOTS}})
declare_cases("causal_conv1d_backward", thunks=[
    (_conv(2, 9, 3, 7, bias=True, d_bias=True, carry_state=False), {}, False),
    (_conv(1, 12, 5, 4, cu_seqlens=[0, 2, 2, 9, 12], state_slots=[3, 0, 4, 1], num_slots=5, bias=True, d_bias=True,
           activation="silu", d_state=True), {}, False),
    (_conv(2, 1, 4, 3, state_slots=[1, 0], num_slots=2, d_state=True), {}, False),
    (_conv(1, 300, 3, 6, activation="silu", d_state=True), {}, False),
])
