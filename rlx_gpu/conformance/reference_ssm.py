"""Float64 step-by-step references for the ops of ABI.md §4 and §8, written straight from its text.

Deliberately plain: one batch row and one head at a time, one step at a time, no chunking and no
shared code with ``host_fallback``. Inputs are any float arrays (rounded storage values are
passed as they are stored); results are float64.
"""
from __future__ import annotations

import numpy as np


#: op -> the version-2 fields (ABI.md §8) these references implement (gated_delta_net's below).
V2_FIELDS = {
    "selective_scan": frozenset({"groups", "delta_bias", "delta_softplus", "d", "z", "carry_state", "state",
                                 "state_dtype", "param_dtype", "cu_seqlens", "num_seqs", "state_slots", "num_slots"}),
    "mamba2": frozenset({"groups", "dt_bias", "dt_softplus", "dt_limit", "d", "z", "carry_state", "state",
                         "state_dtype", "param_dtype", "cu_seqlens", "num_seqs", "state_slots", "num_slots"}),
}


def softplus(u):
    """ABI.md §8: ``u`` where ``u > 20``, else ``log1p(exp(u))``."""
    u = np.asarray(u, np.float64)
    return np.where(u > 20, u, np.log1p(np.exp(np.minimum(u, 20))))


def silu(u):
    """ABI.md §8: ``u * sigmoid(u)``."""
    with np.errstate(over="ignore", invalid="ignore"):
        return u * (1.0 / (1.0 + np.exp(-np.asarray(u, np.float64))))


def _rows(bsz, seq, cu_seqlens):
    """``(batch row, state row, tokens)`` of every recurrence: each batch row, or each packed sequence."""
    if cu_seqlens is None:
        return [(i, i, range(seq)) for i in range(bsz)]
    cu = [int(v) for v in cu_seqlens]
    return [(0, r, range(cu[r], cu[r + 1])) for r in range(len(cu) - 1)]


def _pool(state):
    return None if state is None else np.array(state, np.float64)


def selective_scan(x, delta, a, b, c, *, delta_bias=None, delta_softplus=False, d=None, z=None, state=None,
                   cu_seqlens=None, state_slots=None):
    """``x, delta [B,S,H]``, ``a [H,N]``, ``b, c [B,S,N]`` (or ``[B,S,G,N]``: ``groups``) -> ``y [B,S,H]``.

    The §8 fields by their names: ``state`` is the pool ``[R,H,N]`` the rows start from (``None``:
    from zero), ``cu_seqlens`` the packed sequences (batch 1), ``state_slots`` the pool entry of each
    row. With ``state`` the result is ``(y, final pool)``, entries no row names unchanged.
    """
    x, delta, a, b, c = (np.asarray(t, np.float64) for t in (x, delta, a, b, c))
    bsz, seq, hidden = x.shape
    if b.ndim == 3:
        b, c = b[:, :, None], c[:, :, None]
    width = hidden // b.shape[2]
    if delta_bias is not None:
        delta = delta + np.asarray(delta_bias, np.float64)
    if delta_softplus:
        delta = softplus(delta)
    pool = _pool(state)
    y = np.zeros((bsz, seq, hidden))
    for i, r, tokens in _rows(bsz, seq, cu_seqlens):
        entry = r if state_slots is None else int(state_slots[r])
        h = np.zeros(a.shape) if pool is None else pool[entry].copy()
        for t in tokens:
            for ch in range(hidden):
                g = ch // width
                h[ch] = np.exp(delta[i, t, ch] * a[ch]) * h[ch] + delta[i, t, ch] * b[i, t, g] * x[i, t, ch]
                y[i, t, ch] = np.dot(c[i, t, g], h[ch])
        if pool is not None:
            pool[entry] = h
    if d is not None:
        y = y + np.asarray(d, np.float64) * x
    if z is not None:
        y = y * silu(z)
    return y if pool is None else (y, pool)


def mamba2(x, dt, a, b, c, *, dt_bias=None, dt_softplus=False, dt_limit=None, d=None, z=None, state=None,
           cu_seqlens=None, state_slots=None):
    """``x [B,S,H,P]``, ``dt [B,S,H]``, ``a [H]``, ``b, c [B,S,G,N]`` (G = H unless grouped) -> ``y [B,S,H,P]``.

    ``dt_limit`` is ``(lo, hi)`` with ``hi`` None for +inf; the other §8 fields as in ``selective_scan``
    (``state [R,H,P,N]``). With ``state`` the result is ``(y, final pool)``.
    """
    x, dt, a, b, c = (np.asarray(t, np.float64) for t in (x, dt, a, b, c))
    bsz, seq, heads, p = x.shape
    per_group = heads // b.shape[2]
    if dt_bias is not None:
        dt = dt + np.asarray(dt_bias, np.float64)
    if dt_softplus:
        dt = softplus(dt)
    if dt_limit is not None:
        low, high = dt_limit
        dt = np.minimum(np.maximum(dt, low), np.inf if high is None else high)
    pool = _pool(state)
    y = np.zeros(x.shape)
    for i, r, tokens in _rows(bsz, seq, cu_seqlens):
        entry = r if state_slots is None else int(state_slots[r])
        for hd in range(heads):
            g = hd // per_group
            s = np.zeros((p, b.shape[-1])) if pool is None else pool[entry, hd].copy()
            for t in tokens:
                step = dt[i, t, hd]
                s = np.exp(step * a[hd]) * s + np.outer(step * x[i, t, hd], b[i, t, g])
                y[i, t, hd] = s @ c[i, t, g]
            if pool is not None:
                pool[entry, hd] = s
    if d is not None:
        y = y + np.asarray(d, np.float64)[:, None] * x
    if z is not None:
        y = y * silu(z)
    return y if pool is None else (y, pool)


#: The version-2 fields (ABI.md §8) of gated_delta_net that its reference below implements.
GDN_V2_FIELDS = frozenset({"value_heads", "value_size", "scale", "qk_l2norm", "state_dtype", "cu_seqlens",
                           "num_seqs", "state_slots", "num_slots"})
V2_FIELDS["gated_delta_net"] = GDN_V2_FIELDS


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

    Returns ``(thunk, arena)``. Offsets come from ``rlx_gpu.conformance.cases.lay_out`` (an optional
    offset field given as True is placed; an integer tensor given as a list of ints is placed and those
    values written); each input is rounded into its element type (the thunk's ``dtype``, ``state_dtype``,
    ``param_dtype``) on the way in, outputs start zeroed.
    """
    from host_fallback.abi import regions
    from host_fallback.arena import store
    from .cases import lay_out as place

    values = {**tensors, **{f: v for f, v in params.items() if isinstance(v, list) and f in _INT_FIELDS}}
    thunk, arena_bytes = place(op, dtype, params)
    arena = np.zeros(arena_bytes, np.uint8)
    for region in regions(thunk):
        if region.field in values:
            store(arena, region.offset, region.dtype, np.asarray(values[region.field]).reshape(region.shape))
    return thunk, arena


#: The integer tensors of ABI.md §8, which ``lay_out`` takes as lists in ``params``.
_INT_FIELDS = ("seq_lens", "cu_seqlens", "state_slots")


def read(thunk, arena, field: str) -> np.ndarray:
    """A tensor of a laid-out thunk as float64 (the stored, rounded values; integer tensors too)."""
    from host_fallback.abi import regions
    from host_fallback.arena import view

    region = next(r for r in regions(thunk) if r.field == field)
    return view(arena, region.offset, region.dtype, region.shape).astype(np.float64)
