"""Float64 reference of ``gated_delta_net_backward`` (ABI.md §9 over §4's gated delta rule and §8's
fields), written from ABI.md's formulas (no host_fallback code, no finite differences).

Deliberately plain: one sequence, one value head and one step at a time. The forward keeps the
state entering every step; then the chain rule walks the steps in reverse, the state's gradient
carried from the final state's (``d_state``) back to the initial state's. The gradients of a key
head's ``q`` and ``k`` sum over the value heads that read it; with ``qk_l2norm`` they go back
through the normalisation.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from .reference_ssm import _gdn
from .registry import declare_cases, register

Load = Callable[[str], np.ndarray]

#: The version-2 fields (ABI.md §8) of gated_delta_net_backward this reference implements (all of them).
V2_FIELDS: dict[str, frozenset[str]] = {
    "gated_delta_net_backward": frozenset({"value_heads", "value_size", "scale", "qk_l2norm", "state_dtype",
                                           "cu_seqlens", "num_seqs", "state_slots", "num_slots", "reserve",
                                           "reserve_bytes"}),
}  # (a saved forward, ``reserve``, changes no gradient: the reference recomputes its forward either way)

#: The ``eps`` of ``qk_l2norm`` (ABI.md §8).
EPS = 1e-6


def _normed(x: np.ndarray) -> tuple[np.ndarray, float]:
    """``(x / sqrt(sum x^2 + eps), sqrt(sum x^2 + eps))``."""
    norm = float(np.sqrt(np.sum(x * x) + EPS))
    return x / norm, norm


def _unnormed(x_hat: np.ndarray, norm: float, d_hat: np.ndarray) -> np.ndarray:
    """The gradient of ``x`` from that of ``x_hat = x / norm``."""
    return (d_hat - x_hat * np.sum(x_hat * d_hat)) / norm


def backward(t: Mapping[str, Any], load: Load) -> dict[str, np.ndarray]:
    """The gradients of a gated_delta_net_backward thunk ``t`` (completed), its tensors through ``load``."""
    q, k, v, g, beta, d_out = (load(f) for f in ("q", "k", "v", "g", "beta", "d_dst"))
    bsz, seq, heads, n = q.shape
    value_heads = v.shape[2]
    group = value_heads // heads
    per_channel = bool(t["gate_per_channel"])
    scale = 1.0 / np.sqrt(n) if t["scale"] is None else float(t["scale"])
    if t["cu_seqlens"] is None:
        spans = [(b, 0, seq) for b in range(bsz)]
    else:
        cu = [int(c) for c in load("cu_seqlens")]
        spans = [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]
    rows = [int(r) for r in load("state_slots")] if t["state_slots"] is not None else list(range(len(spans)))
    carried = bool(t["carry_state"])
    pool = load("state") if carried else None
    d_pool = np.array(load("d_state"), np.float64) if carried else None
    out = {f"d_{f}": np.zeros_like(x) for f, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta))}
    for (b, lo, hi), row in zip(spans, rows):
        for j in range(value_heads):
            hd = j // group  # the key head of value head j
            s = pool[row, j].copy() if carried else np.zeros((n, v.shape[3]))
            kept = []  # per step: q, k (normalised), their norms, the state entering the step, u
            for step in range(lo, hi):
                qt, qn = _normed(q[b, step, hd]) if t["qk_l2norm"] else (q[b, step, hd], 1.0)
                kt, kn = _normed(k[b, step, hd]) if t["qk_l2norm"] else (k[b, step, hd], 1.0)
                decay = np.exp(g[b, step, j])
                decayed = s * (decay[:, None] if per_channel else decay)
                u = (v[b, step, j] - kt @ decayed) * beta[b, step, j]
                kept.append((qt, qn, kt, kn, s, u))
                s = decayed + np.outer(kt, u)
            ds = d_pool[row, j].copy() if carried else np.zeros_like(s)  # the gradient of the state after the step
            for step in range(hi - 1, lo - 1, -1):
                qt, qn, kt, kn, s_in, u = kept[step - lo]
                decay = np.exp(g[b, step, j])
                decayed = s_in * (decay[:, None] if per_channel else decay)
                s_out = decayed + np.outer(kt, u)
                dy = d_out[b, step, j]
                # out = scale * s_out^T q
                dq = scale * (s_out @ dy)
                ds = ds + scale * np.outer(qt, dy)
                # s_out = decayed + k u^T
                dk = ds @ u
                du = kt @ ds
                # u = (v - decayed^T k) * beta
                out["d_beta"][b, step, j] = np.sum(du * (v[b, step, j] - kt @ decayed))
                dr = du * beta[b, step, j]
                out["d_v"][b, step, j] = dr
                dk = dk - decayed @ dr
                d_decayed = ds - np.outer(kt, dr)
                # decayed = s_in * exp(g): d g = sum over the decayed entries of (their gradient * their value)
                if per_channel:
                    out["d_g"][b, step, j] = np.sum(d_decayed * decayed, axis=1)
                    ds = d_decayed * decay[:, None]
                else:
                    out["d_g"][b, step, j] = np.sum(d_decayed * decayed)
                    ds = d_decayed * decay
                if t["qk_l2norm"]:
                    dq, dk = _unnormed(qt, qn, dq), _unnormed(kt, kn, dk)
                out["d_q"][b, step, hd] += dq
                out["d_k"][b, step, hd] += dk
            if carried:
                d_pool[row, j] = ds
    if carried:
        out["d_state"] = d_pool
    return out


register(V2_FIELDS.keys(), backward, V2_FIELDS)

# both gate kinds on the host's step path (decode) and in one partial chunk, then three chunks of 32 (the last
# partial) with grouped value heads, K != V and L2-norm, and a packed row through slots. Causality: in one short
# chunk, and in the second of two chunks (both gate kinds).
declare_cases("gated_delta_net_backward", thunks=[
    (_gdn(2, 2, 2, 8, False, True), {}, False),
    (_gdn(1, 1, 2, 5, True, False), {}, False),
    (_gdn(2, 5, 2, 8, True, True), {}, False),
    (_gdn(1, 70, 2, 16, True, True, value_heads=4, value_size=12, qk_l2norm=True), {}, False),
    (_gdn(1, 40, 1, 8, False, True, cu_seqlens=[0, 15, 15, 40], state_slots=[1, 2, 0], num_slots=3, scale=0.4),
     {}, False),
], causal=[(_gdn(2, 9, 2, 8, False, True), "d_dst", 5, float("nan")),
           (_gdn(2, 40, 1, 8, True, True, value_heads=2), "d_dst", 35, float("nan"))])
