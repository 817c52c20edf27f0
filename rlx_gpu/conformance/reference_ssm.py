"""Float64 step-by-step references for the ops of ABI.md §4, written straight from its text.

Deliberately plain: one batch row and one head at a time, one step at a time, no chunking and no
shared code with ``host_fallback``. Inputs are any float arrays (rounded storage values are
passed as they are stored); results are float64.
"""
from __future__ import annotations

import numpy as np


def selective_scan(x, delta, a, b, c):
    """``x, delta [B,S,H]``, ``a [H,N]``, ``b, c [B,S,N]`` -> ``y [B,S,H]``."""
    x, delta, a, b, c = (np.asarray(t, np.float64) for t in (x, delta, a, b, c))
    bsz, seq, hidden = x.shape
    y = np.zeros((bsz, seq, hidden))
    for i in range(bsz):
        h = np.zeros(a.shape)
        for t in range(seq):
            for ch in range(hidden):
                h[ch] = np.exp(delta[i, t, ch] * a[ch]) * h[ch] + delta[i, t, ch] * b[i, t] * x[i, t, ch]
                y[i, t, ch] = np.dot(c[i, t], h[ch])
    return y


def mamba2(x, dt, a, b, c):
    """``x [B,S,H,P]``, ``dt [B,S,H]``, ``a [H]``, ``b, c [B,S,H,N]`` -> ``y [B,S,H,P]``."""
    x, dt, a, b, c = (np.asarray(t, np.float64) for t in (x, dt, a, b, c))
    bsz, seq, heads, p = x.shape
    y = np.zeros(x.shape)
    for i in range(bsz):
        for hd in range(heads):
            s = np.zeros((p, b.shape[-1]))
            for t in range(seq):
                d = dt[i, t, hd]
                s = np.exp(d * a[hd]) * s + np.outer(d * x[i, t, hd], b[i, t, hd])
                y[i, t, hd] = s @ c[i, t, hd]
    return y


def gated_delta_net(q, k, v, g, beta, state=None):
    """``q, k, v [B,S,H,N]``, ``g [B,S,H]`` or ``[B,S,H,N]``, ``beta [B,S,H]``, ``state [B,H,N,N]``.

    Returns ``(out [B,S,H,N], final state [B,H,N,N])``; ``state=None`` starts every head at zero.
    """
    q, k, v, g, beta = (np.asarray(t, np.float64) for t in (q, k, v, g, beta))
    bsz, seq, heads, n = q.shape
    per_channel = g.ndim == 4
    scale = 1.0 / np.sqrt(n)
    final = np.zeros((bsz, heads, n, n)) if state is None else np.array(state, np.float64)
    out = np.zeros(q.shape)
    for i in range(bsz):
        for hd in range(heads):
            s = final[i, hd]  # s[key i, value j]
            for t in range(seq):
                if per_channel:
                    s = s * np.exp(g[i, t, hd])[:, None]
                else:
                    s = s * np.exp(g[i, t, hd])
                u = (v[i, t, hd] - k[i, t, hd] @ s) * beta[i, t, hd]
                s = s + np.outer(k[i, t, hd], u)
                out[i, t, hd] = scale * (q[i, t, hd] @ s)
            final[i, hd] = s
    return out, final


# --- arena harness shared by the ssm/gdn tests and benchmarks/ssm.py -----------------------------

def lay_out(op: str, dtype: str, params: dict, tensors: dict):
    """Place ``tensors`` (field -> array) in a fresh arena for one thunk of ``op``.

    Returns ``(thunk, arena)``. Offsets come from ``rlx_gpu.conformance.cases.lay_out``; each input is rounded
    into ``dtype`` storage on the way in, outputs start zeroed.
    """
    from host_fallback.arena import store
    from host_fallback.layout import regions
    from .cases import lay_out as place

    thunk, arena_bytes = place(op, dtype, params)
    arena = np.zeros(arena_bytes, np.uint8)
    for region in regions(thunk):
        if region.field in tensors:
            store(arena, region.offset, dtype, np.asarray(tensors[region.field]).reshape(region.shape))
    return thunk, arena


def read(thunk, arena, field: str) -> np.ndarray:
    """A tensor of a laid-out thunk as float64 (the stored, rounded values)."""
    from host_fallback.arena import load
    from host_fallback.layout import regions

    region = next(r for r in regions(thunk) if r.field == field)
    return load(arena, region.offset, thunk["dtype"], region.shape).astype(np.float64)
