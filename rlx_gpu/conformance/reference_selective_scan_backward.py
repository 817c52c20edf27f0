"""Float64 reference of selective_scan_backward (ABI.md §9), written from selective_scan's formulas of
ABI.md §4 and §8 (no host_fallback code, no finite differences).

Deliberately plain: one recurrence (a batch row, or a packed sequence) and one channel at a time, the
forward one step at a time keeping every state, then the chain rule back through the steps in reverse,
every parameter gradient summed step by step. softplus is the identity above 20 (its slope 1 there).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from .reference_ssm import _rows, _ssm, softplus
from .registry import declare_cases, register

Load = Callable[[str], np.ndarray]

#: The §8 fields of selective_scan this reference implements (all of them), with their gradients.
V2_FIELDS: dict[str, frozenset[str]] = {
    "selective_scan_backward": frozenset({
        "groups", "delta_bias", "delta_softplus", "d", "z", "carry_state", "state", "state_dtype", "param_dtype",
        "cu_seqlens", "num_seqs", "state_slots", "num_slots", "d_delta_bias", "d_d", "d_z", "d_state",
        "reserve", "reserve_bytes"}),  # (a saved forward changes no gradient: the reference recomputes)
}


def _sigmoid(u: np.ndarray) -> np.ndarray:
    return 0.5 * (1 + np.tanh(0.5 * u))


def backward(t: Mapping[str, Any], load: Load) -> dict[str, np.ndarray]:
    """The gradients of a selective_scan_backward thunk ``t`` (completed), its tensors through ``load``."""
    B, S, H, N, groups = t["batch"], t["seq"], t["hidden"], t["state_size"], t["groups"]
    x, raw, a, dy = load("x"), load("delta"), load("a"), load("d_dst")
    b, c = load("b").reshape(B, S, groups, N), load("c").reshape(B, S, groups, N)
    width = H // groups
    bias = load("delta_bias") if t["delta_bias"] is not None else np.zeros(H)
    d = load("d") if t["d"] is not None else None
    z = load("z") if t["z"] is not None else None
    u = raw + bias
    if t["delta_softplus"]:
        delta = softplus(u)
        slope = np.where(u > 20, 1.0, _sigmoid(u))
    else:
        delta, slope = u, np.ones_like(u)
    carry = t["carry_state"]
    slots = [int(v) for v in load("state_slots")] if t["state_slots"] is not None else None
    pool, d_pool = (load("state"), load("d_state").copy()) if carry else (None, None)
    g = {f: np.zeros_like(v) for f, v in (("x", x), ("delta", raw), ("a", a), ("b", b), ("c", c))}
    d_d, d_z, d_bias = np.zeros(H), np.zeros_like(x), np.zeros(H)
    cu = load("cu_seqlens") if t["cu_seqlens"] is not None else None
    for i, r, tokens in _rows(B, S, cu):  # (batch row, state row, tokens) of every recurrence
        entry = r if slots is None else slots[r]
        for ch in range(H):
            grp = ch // width
            # the forward, every state kept: h[k] is the state after token tokens[k-1], h[0] the initial one
            h = [pool[entry, ch].copy() if carry else np.zeros(N)]
            for s in tokens:
                h.append(np.exp(delta[i, s, ch] * a[ch]) * h[-1] + delta[i, s, ch] * b[i, s, grp] * x[i, s, ch])
            # the reverse: dh is the gradient of the state after the step being undone
            dh = d_pool[entry, ch].copy() if carry else np.zeros(N)
            for k in reversed(range(len(tokens))):
                s = tokens[k]
                scan = float(np.dot(c[i, s, grp], h[k + 1]))  # y before the skip and the gate
                dout = dy[i, s, ch]
                if z is not None:
                    gate = _sigmoid(z[i, s, ch])
                    pre = scan + (d[ch] * x[i, s, ch] if d is not None else 0.0)
                    d_z[i, s, ch] = dout * pre * gate * (1 + z[i, s, ch] * (1 - gate))
                    dout = dout * z[i, s, ch] * gate
                if d is not None:
                    d_d[ch] += dout * x[i, s, ch]
                    g["x"][i, s, ch] += dout * d[ch]
                g["c"][i, s, grp] += dout * h[k + 1]
                dh = dh + dout * c[i, s, grp]
                decay = np.exp(delta[i, s, ch] * a[ch])
                d_step = float(np.sum(dh * (decay * a[ch] * h[k] + b[i, s, grp] * x[i, s, ch])))
                g["a"][ch] += dh * decay * delta[i, s, ch] * h[k]
                g["b"][i, s, grp] += dh * delta[i, s, ch] * x[i, s, ch]
                g["x"][i, s, ch] += float(np.sum(dh * delta[i, s, ch] * b[i, s, grp]))
                g["delta"][i, s, ch] = d_step * slope[i, s, ch]
                d_bias[ch] += d_step * slope[i, s, ch]
                dh = dh * decay
            if carry:
                d_pool[entry, ch] = dh
    out = {f"d_{f}": v for f, v in g.items()}
    out["d_b"], out["d_c"] = out["d_b"].reshape(load("b").shape), out["d_c"].reshape(load("c").shape)
    if d is not None:
        out["d_d"] = d_d
    if z is not None:
        out["d_z"] = d_z
    if t["delta_bias"] is not None:
        out["d_delta_bias"] = d_bias
    if carry:
        out["d_state"] = d_pool
    return out


register(V2_FIELDS.keys(), backward, V2_FIELDS)

# one host chunk (32 steps), then three (the last partial); every version-2 field at once over packed sequences
# (one empty, two starting inside a chunk) through state slots. Causality: in the second host chunk of 32 steps.
declare_cases("selective_scan_backward", thunks=[
    (_ssm(2, 5, 5, 4), {}, False),
    (_ssm(2, 70, 5, 3), {}, False),
    (dict(_ssm(1, 70, 4, 3), groups=2, cu_seqlens=[0, 20, 20, 45, 70], state_slots=[3, 0, 4, 1], num_slots=5,
          carry_state=True, state=True, d_state=True, delta_bias=True, d_delta_bias=True, delta_softplus=True, d=True,
          d_d=True, z=True, d_z=True), {}, False),
    (_ssm(2, 130, 8, 16), {}, True),
], causal=[(_ssm(2, 40, 3, 4), "d_dst", 35, float("nan"))])
