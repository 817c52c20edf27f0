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


#: The version-2 fields (ABI.md §8) of gated_delta_net that its reference below implements.
GDN_V2_FIELDS = frozenset({"value_heads", "value_size", "scale", "qk_l2norm", "state_dtype", "cu_seqlens",
                           "num_seqs", "state_slots", "num_slots"})
V2_FIELDS = {"gated_delta_net": GDN_V2_FIELDS}


def gated_delta_net(q, k, v, g, beta, state=None, *, scale=None, qk_l2norm=False, cu_seqlens=None,
                    state_slots=None):
    """ABI.md §4 and §8, one sequence, one value head and one step at a time.

    ``q, k [B,S,H,K]``; ``v [B,S,HV,V]``; ``g [B,S,HV]`` or ``[B,S,HV,K]``; ``beta [B,S,HV]``;
    ``state`` the carried state ``[R,HV,K,V]`` (the slot pool with ``state_slots``), ``None`` for
    every sequence starting at zero. ``cu_seqlens`` packs sequences into the one batch row; row ``r``
    (a batch row, or sequence ``r``) reads and writes pool entry ``state_slots[r]``. ``scale`` None
    means ``1/sqrt(K)``. Returns ``(out [B,S,HV,V], final)``: ``final`` is the state given with each
    row's final state written in (entries no row names as they were), or without ``state`` the final
    state of each row from zero.
    """
    q, k, v, g, beta = (np.asarray(t, np.float64) for t in (q, k, v, g, beta))
    bsz, seq, heads, n = q.shape
    value_heads, width = v.shape[2:]
    group = value_heads // heads
    per_channel = g.ndim == 4
    scale = 1.0 / np.sqrt(n) if scale is None else float(scale)
    if cu_seqlens is None:
        spans = [(b, 0, seq) for b in range(bsz)]
    else:
        cu = [int(c) for c in cu_seqlens]
        spans = [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]
    rows = [int(r) for r in state_slots] if state_slots is not None else list(range(len(spans)))
    final = np.zeros((len(spans), value_heads, n, width)) if state is None else np.array(state, np.float64)
    out = np.zeros((bsz, seq, value_heads, width))
    for (b, lo, hi), row in zip(spans, rows):
        for j in range(value_heads):
            hd = j // group  # the key head of value head j
            s = final[row, j]  # s[key i, value j]
            for t in range(lo, hi):
                qt, kt = q[b, t, hd], k[b, t, hd]
                if qk_l2norm:
                    qt, kt = qt / np.sqrt(np.sum(qt * qt) + 1e-6), kt / np.sqrt(np.sum(kt * kt) + 1e-6)
                if per_channel:
                    s = s * np.exp(g[b, t, j])[:, None]
                else:
                    s = s * np.exp(g[b, t, j])
                u = (v[b, t, j] - kt @ s) * beta[b, t, j]
                s = s + np.outer(kt, u)
                out[b, t, j] = scale * (qt @ s)
            final[row, j] = s
    return out, final


# --- arena harness shared by the ssm/gdn tests and benchmarks/ssm.py -----------------------------

def lay_out(op: str, dtype: str, params: dict, tensors: dict):
    """Place ``tensors`` (field -> array) in a fresh arena for one thunk of ``op``.

    Returns ``(thunk, arena)``. Offsets come from ``rlx_gpu.conformance.cases.lay_out``; each input is rounded
    into its region's storage (``dtype``, a ``state_dtype``, ``i32``) on the way in, outputs start zeroed.
    """
    from host_fallback.arena import store
    from host_fallback.layout import regions
    from .cases import lay_out as place

    thunk, arena_bytes = place(op, dtype, params)
    arena = np.zeros(arena_bytes, np.uint8)
    for region in regions(thunk):
        if region.field in tensors:
            store(arena, region.offset, region.dtype, np.asarray(tensors[region.field]).reshape(region.shape))
    return thunk, arena


def read(thunk, arena, field: str) -> np.ndarray:
    """A tensor of a laid-out thunk as float64 (the stored, rounded values)."""
    from host_fallback.arena import view
    from host_fallback.layout import regions

    region = next(r for r in regions(thunk) if r.field == field)
    return view(arena, region.offset, region.dtype, region.shape).astype(np.float64)
