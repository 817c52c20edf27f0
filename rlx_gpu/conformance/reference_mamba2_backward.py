"""Float64 reference of ``mamba2_backward`` (ABI.md §9 over §4's mamba2 and its §8 fields), written
from the ABI's formulas (no host_fallback code, no finite differences).

Deliberately plain: one sequence (a batch row, or a packed sequence), one head and one step at a
time. The forward keeps the state after every step; the reverse walks the steps back, carrying the
gradient of the state, and adds up every parameter gradient step by step. The kinks take the
derivative of the branch the forward's formula takes (ABI.md §9): softplus above 20 is the
identity, and ``dt_limit``'s clamp passes the gradient at its bounds, as ``torch.clamp`` does.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from .reference_ssm import _mamba2
from .registry import declare_cases, register

Load = Callable[[str], np.ndarray]

#: The §8 fields of mamba2 this reference implements (all of them), with the gradients of the optional inputs.
V2_FIELDS = {
    "mamba2_backward": frozenset({"groups", "dt_bias", "dt_softplus", "dt_limit", "d", "z", "carry_state", "state",
                                  "state_dtype", "param_dtype", "cu_seqlens", "num_seqs", "state_slots", "num_slots",
                                  "d_dt_bias", "d_d", "d_z", "d_state", "reserve", "reserve_bytes"}),
}  # (a saved forward, ``reserve``, changes no gradient: the reference recomputes its forward either way)


def _sigmoid(u: np.ndarray) -> np.ndarray:
    return 0.5 * (1 + np.tanh(0.5 * u))


def _step_sizes(t: Mapping[str, Any], raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ABI.md §8's ``dt`` (bias added by the caller, softplus, clamp) and its derivative by the raw value."""
    slope = np.ones_like(raw)
    dt = raw
    if t["dt_softplus"]:
        linear = raw > 20
        dt = np.where(linear, raw, np.log1p(np.exp(np.minimum(raw, 20))))
        slope = np.where(linear, 1.0, _sigmoid(raw))
    if t["dt_limit"] is not None:
        low, high = t["dt_limit"]
        high = np.inf if high is None else high
        slope = slope * ((dt >= low) & (dt <= high))
        dt = np.minimum(np.maximum(dt, low), high)
    return dt, slope


def _sequences(t: Mapping[str, Any], load: Load) -> list[tuple[int, int, range]]:
    """``(batch row, state row, tokens)`` of every recurrence."""
    if t["cu_seqlens"] is None:
        return [(i, i, range(t["seq"])) for i in range(t["batch"])]
    cu = [int(v) for v in load("cu_seqlens")]
    return [(0, r, range(cu[r], cu[r + 1])) for r in range(len(cu) - 1)]


def backward(t: Mapping[str, Any], load: Load) -> dict[str, np.ndarray]:
    """The gradients of a mamba2_backward thunk ``t`` (completed), its tensors through ``load``."""
    x, raw, a, b, c, d_out = (load(f) for f in ("x", "dt", "a", "b", "c", "d_dst"))
    heads, p, n = t["heads"], t["head_dim"], t["state_size"]
    per_group = heads // t["groups"]
    if t["dt_bias"] is not None:
        raw = raw + load("dt_bias")
    dt, slope = _step_sizes(t, raw)
    d_skip = load("d") if t["d"] is not None else np.zeros(heads)
    grads = {f: np.zeros_like(v) for f, v in (("x", x), ("dt", raw), ("a", a), ("b", b), ("c", c))}
    grads["d"] = np.zeros(heads)
    gate = load("z") if t["z"] is not None else None
    grads["z"] = np.zeros_like(x)
    carried = t["carry_state"]
    pool = load("state") if carried else None
    d_pool = np.array(load("d_state")) if carried else None
    slots = [int(s) for s in load("state_slots")] if t["state_slots"] is not None else None
    for row, state_row, tokens in _sequences(t, load):
        entry = state_row if slots is None else slots[state_row]
        for h in range(heads):
            g = h // per_group
            s = pool[entry, h].copy() if carried else np.zeros((p, n))
            states, ys = {}, {}  # the state before each step, and each step's y before the skip and gate
            for i in tokens:
                states[i] = s
                s = np.exp(dt[row, i, h] * a[h]) * s + np.outer(dt[row, i, h] * x[row, i, h], b[row, i, g])
                ys[i] = s @ c[row, i, g]
            ds = d_pool[entry, h].copy() if carried else np.zeros((p, n))  # the gradient of the state after a step
            for i in reversed(tokens):
                s_prev, step = states[i], dt[row, i, h]
                decay = np.exp(step * a[h])
                s_new = decay * s_prev + np.outer(step * x[row, i, h], b[row, i, g])
                gy = d_out[row, i, h].copy()
                if gate is not None:  # out = (y + d*x) * silu(z), silu(z) = z*sigmoid(z)
                    z, sig = gate[row, i, h], _sigmoid(gate[row, i, h])
                    gated = ys[i] + d_skip[h] * x[row, i, h]
                    grads["z"][row, i, h] = gy * gated * sig * (1 + z * (1 - sig))
                    gy = gy * z * sig
                grads["d"][h] += gy @ x[row, i, h]
                grads["x"][row, i, h] += d_skip[h] * gy
                ds = ds + np.outer(gy, c[row, i, g])
                grads["c"][row, i, g] += s_new.T @ gy
                du = ds @ b[row, i, g]  # the gradient of dt*x
                grads["b"][row, i, g] += ds.T @ (step * x[row, i, h])
                d_logd = decay * np.sum(s_prev * ds)  # the gradient of dt*a
                grads["x"][row, i, h] += step * du
                d_step = d_logd * a[h] + du @ x[row, i, h]
                grads["a"][h] += d_logd * step
                grads["dt"][row, i, h] = d_step * slope[row, i, h]
                ds = decay * ds
            if carried:
                d_pool[entry, h] = ds
    out = {f"d_{f}": grads[f] for f in ("x", "dt", "a", "b", "c")}
    if t["dt_bias"] is not None:
        out["d_dt_bias"] = grads["dt"].sum(axis=(0, 1))
    if t["d"] is not None:
        out["d_d"] = grads["d"]
    if t["z"] is not None:
        out["d_z"] = grads["z"]
    if carried:
        out["d_state"] = d_pool
    return out


register(V2_FIELDS.keys(), backward, V2_FIELDS)

# the host's step path (seq <= 10); then chunked (chunks of 64, the last partial) with every version-2 field at
# once, packed sequences (one empty, one starting inside the second chunk) through slots. Causality: a NaN
# gradient reaches only earlier steps, in the host's second chunk of 64 steps too.
declare_cases("mamba2_backward", thunks=[
    (_mamba2(2, 9, 2, 3, 8), {}, False),
    (dict(_mamba2(1, 150, 4, 3, 4), groups=2, cu_seqlens=[0, 20, 20, 100, 150], state_slots=[3, 0, 4, 1],
          num_slots=5, carry_state=True, state=True, d_state=True, dt_bias=True, d_dt_bias=True, dt_softplus=True,
          dt_limit=[0.0, None], d=True, d_d=True, z=True, d_z=True), {}, False),
    (_mamba2(2, 150, 2, 17, 20), {}, True),
], causal=[(_mamba2(2, 9, 2, 3, 8), "d_dst", 5, float("nan")), (_mamba2(2, 80, 1, 2, 4), "d_dst", 70, float("nan"))])
