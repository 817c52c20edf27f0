"""Float64 step-by-step references for the ops of ABI.md §4 and §8, written straight from its text.

Deliberately plain: one batch row and one head at a time, one step at a time, no chunking and no
shared code with ``host_fallback``. Inputs are any float arrays (rounded storage values are
passed as they are stored); results are float64. The ops' conformance shapes are declared at the end.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .registry import CARRIED, PACKED, SLOTS, declare_cases


#: op -> the version-2 fields (ABI.md §8) these references implement (gated_delta_net's below).
V2_FIELDS = {
    "selective_scan": frozenset({"groups", "delta_bias", "delta_softplus", "d", "z", "carry_state", "state",
                                 "state_dtype", "param_dtype", "cu_seqlens", "num_seqs", "state_slots", "num_slots",
                                 "reserve", "reserve_bytes"}),
    "mamba2": frozenset({"groups", "dt_bias", "dt_softplus", "dt_limit", "d", "z", "carry_state", "state",
                         "state_dtype", "param_dtype", "cu_seqlens", "num_seqs", "state_slots", "num_slots",
                         "reserve", "reserve_bytes"}),  # a saved forward changes no output: implemented
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
                           "num_seqs", "state_slots", "num_slots", "reserve", "reserve_bytes"})
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


def _ssm(b: int, s: int, h: int, n: int) -> dict:
    return dict(batch=b, seq=s, hidden=h, state_size=n)


def _mamba2(b: int, s: int, heads: int, p: int, n: int) -> dict:
    return dict(batch=b, seq=s, heads=heads, head_dim=p, state_size=n)


def _gdn(b: int, s: int, heads: int, n: int, per_channel: bool, carry: bool, **v2: Any) -> dict:
    """A gated_delta_net case; ``v2`` adds ABI.md §8 fields (``state=True`` is implied by ``carry``)."""
    return dict(batch=b, seq=s, heads=heads, state_size=n, gate_per_channel=per_channel, carry_state=carry, **v2)


NAN, INF = float("nan"), float("inf")
#: The params giving selective_scan's and mamba2's small cases the version-2 fields they share.
_PRESENT = {"carry_state": CARRIED, "state": CARRIED, "param_dtype": {"param_dtype": "f32"},
            "state_dtype": {**CARRIED, "state_dtype": "f32"}, "cu_seqlens": PACKED, "num_seqs": PACKED,
            "state_slots": {**CARRIED, **SLOTS}, "num_slots": {**CARRIED, **SLOTS}}
# Thunk cases: state_size 16 (the fixed-width register path of ssm.cl) and the gpu target's state-size variants
# 32..256 and decode (seq 1); seq >= 64 runs chunked on the gpu target (selective_scan: chunks of 256 steps, 300
# takes two; mamba2: chunks of 64, 70 takes two, one partial); every version-2 field at once: packed sequences
# (one empty, one starting inside the second chunk of either target) through state slots, grouped b/c, the
# delta/dt knobs, d and z; a decode step of each through slots (rows 2 of a pool of 3) with d and z; the cpu
# target's selective_scan decode kernel without a carried state, with two groups, at an odd state_size and at 16
# (its vectorized row), and with a carried state at both, hidden not a multiple of its SS_TC = 8 channels an item
# (whole items and a last one partial).
# Causality: a NaN in the second chunk (gpu target); version 2: the gate reaches only its own step; a packed
# sequence after a poisoned one starts clean, in the chunk they share too (mamba2: 68 starts inside the second
# chunk of 64, selective_scan: 260 inside the second of 256); an Inf: every device keeps the ABI's operation
# order on the step forms, so NaN and each signed Inf land alike (the gpu target's chunked forms may differ in
# the class, see the ABI's non-finite rule).
#: A saved forward (ABI.md §9.1) over four chunks of 32 (the backward reads it), 4 KiB: more than the small
#: case needs at seq 100 in any dtype (rlx_gpu.reserve_bytes: f64's 1536 bytes).
_SS_RESERVE = {"reserve": True, "reserve_bytes": 1 << 12, "seq": 100}
declare_cases(
    "selective_scan", small=_ssm(2, 7, 6, 4),
    thunks=[
        (_ssm(2, 5, 5, 4), {}, False),
        (_ssm(2, 9, 7, 16), {}, False),
        (_ssm(1, 3, 3, 32), {}, False),
        (_ssm(1, 2, 2, 200), {}, False),
        (_ssm(2, 300, 5, 3), {}, False),
        (dict(_ssm(1, 300, 4, 3), groups=2, cu_seqlens=[0, 40, 40, 270, 300], state_slots=[3, 0, 4, 1],
              num_slots=5, carry_state=True, state=True, delta_bias=True, delta_softplus=True, d=True,
              z=True), {}, False),
        (dict(_ssm(2, 1, 5, 16), state_slots=[2, 0], num_slots=3, carry_state=True, state=True,
              d=True, z=True, delta_bias=True, delta_softplus=True), {}, False),
        (dict(_ssm(2, 1, 20, 5), groups=2, d=True, z=True), {}, False),
        (dict(_ssm(2, 1, 20, 16), groups=2, delta_softplus=True, z=True), {}, False),
        (dict(_ssm(2, 1, 21, 16), carry_state=True, state=True, d=True, z=True, delta_bias=True), {}, False),
        (dict(_ssm(1, 1, 13, 5), carry_state=True, state=True), {}, False),
        (_ssm(2, 24, 16, 256), {}, True),
    ],
    causal=[
        (_ssm(2, 9, 3, 16), "x", 5, NAN),
        (_ssm(2, 300, 3, 4), "x", 270, NAN),
        (dict(_ssm(2, 10, 3, 16), z=True, d=True), "z", 5, NAN),  # seq 10: an id of its own
        (dict(_ssm(1, 300, 3, 4), cu_seqlens=[0, 100, 260, 300], carry_state=True, state=True), "x", 150, NAN),
        (_ssm(2, 9, 3, 16), "x", 5, INF),
        (_ssm(2, 300, 3, 4), "delta", 270, -INF),
    ],
    present={**_PRESENT, "groups": {"groups": 2}, "reserve": _SS_RESERVE, "reserve_bytes": _SS_RESERVE},
    refused=[({**PACKED, "cu_seqlens": [0, 3, 3, 8]}, "cu_seqlens", "last_past_seq")])
#: A saved forward (ABI.md §9.1) over three chunks of 64 (the backward reads it on its chunked path), 512 KiB:
#: more than the small case needs at seq 150 in any dtype (rlx_gpu.reserve_bytes: f64's 413952 bytes).
_M2_RESERVE = {"reserve": True, "reserve_bytes": 1 << 19, "seq": 150}
declare_cases(
    "mamba2", small=_mamba2(2, 7, 2, 4, 4),
    thunks=[
        (_mamba2(2, 4, 3, 4, 6), {}, False),
        (_mamba2(1, 3, 2, 3, 64), {}, False),
        (_mamba2(1, 70, 1, 3, 4), {}, False),
        (dict(_mamba2(1, 150, 4, 3, 4), groups=2, cu_seqlens=[0, 20, 20, 100, 150], state_slots=[3, 0, 4, 1],
              num_slots=5, carry_state=True, state=True, dt_bias=True, dt_softplus=True, dt_limit=[0.0, None],
              d=True, z=True), {}, False),
        (dict(_mamba2(2, 1, 3, 4, 16), state_slots=[2, 0], num_slots=3, carry_state=True, state=True,
              d=True, z=True, dt_bias=True, dt_softplus=True), {}, False),
        (_mamba2(1, 20, 2, 16, 64), {}, True),
        (_mamba2(2, 150, 2, 17, 20), {}, True),  # gpu target: three chunks, two tiles of 16 rows
    ],
    causal=[
        (_mamba2(2, 9, 2, 3, 8), "x", 5, NAN),
        (_mamba2(2, 80, 1, 2, 4), "x", 70, NAN),
        (dict(_mamba2(2, 10, 2, 3, 8), z=True), "z", 5, -INF),
        # (a NaN: past an Inf in dt the gpu target's chunked sums may give NaN where the step order gives ±Inf)
        (dict(_mamba2(1, 80, 1, 2, 4), cu_seqlens=[0, 30, 68, 80], dt_bias=True, dt_softplus=True), "dt", 40,
         NAN),
        (_mamba2(2, 9, 2, 3, 8), "x", 5, -INF),
    ],
    present={**_PRESENT, "groups": {"groups": 1}, "dt_limit": {"dt_limit": [0.05, 0.5]},
             "reserve": _M2_RESERVE, "reserve_bytes": _M2_RESERVE},
    refused=[({**PACKED, "cu_seqlens": [0, 3, 2, 7]}, "cu_seqlens", "decreasing"),
             ({**CARRIED, "state_slots": [0, 3], "num_slots": 3}, "state_slots", "past_the_pool")])
# Thunk cases: chunked (host L=32, gpu 64) with both gate kinds, three chunks (20 is no multiple of a tile),
# the cpu target's decode step kernel (one work-item per 32 value columns, the last one partial); version 2:
# grouped value heads with K != V, L2-norm and a scale over packed sequences whose starts fall inside chunks
# (one empty), per-channel gates; then a decode step of three rows into slots. Causality: in the second chunk
# of 64 steps (gpu target) one value column, every column from a key or a gate; an Inf; packed sequences: a
# NaN in one sequence reaches no other (in the first, and mid-chunk in the last).
#: A saved forward (ABI.md §9.1) over three chunks of 32 (the backward reads it), 512 KiB: more than the small
#: case needs at seq 70 in any dtype (rlx_gpu.reserve_bytes: f64's 325632 bytes).
_GDN_RESERVE = {"reserve": True, "reserve_bytes": 1 << 19, "seq": 70}
declare_cases(
    "gated_delta_net", small=_gdn(2, 7, 2, 8, False, True),
    thunks=[
        (_gdn(2, 4, 2, 8, False, True), {}, False),
        (_gdn(1, 3, 2, 5, True, False), {}, False),
        (_gdn(1, 70, 2, 16, True, True), {}, False),
        (_gdn(2, 130, 1, 20, False, False), {}, False),
        (_gdn(1, 2, 1, 128, True, True), {}, False),
        (_gdn(3, 1, 2, 8, False, True), {}, False),
        (_gdn(2, 1, 3, 40, True, True), {}, False),
        (_gdn(1, 1, 2, 70, False, False), {}, False),
        (_gdn(1, 70, 2, 16, True, True, value_heads=4, value_size=12, qk_l2norm=True, scale=0.3,
              cu_seqlens=[0, 20, 20, 45, 70]), {}, False),
        (_gdn(1, 9, 1, 8, False, False, value_heads=3, cu_seqlens=[0, 4, 9]), {}, False),
        (_gdn(3, 1, 2, 8, False, True, value_heads=4, value_size=6, state_slots=[4, 0, 2], num_slots=5), {}, False),
        (_gdn(1, 16, 2, 256, True, True), {}, True),
        (_gdn(2, 24, 3, 64, False, False), {}, True),
        (_gdn(1, 100, 1, 256, True, True), {}, True),  # gpu target: chunked, the largest state
    ],
    causal=[
        (_gdn(2, 9, 2, 8, False, True), "v", 5, NAN),
        (_gdn(2, 9, 2, 8, True, False), "v", 5, NAN),
        (_gdn(2, 80, 2, 8, False, True), "v", 70, NAN),
        (_gdn(2, 80, 1, 8, True, True), "k", 70, NAN),
        (_gdn(1, 140, 2, 8, False, False), "g", 100, NAN),
        (_gdn(2, 9, 2, 8, False, True), "v", 5, INF),
        (_gdn(2, 9, 2, 8, True, False), "beta", 5, -INF),
        (_gdn(2, 1, 3, 40, True, True), "k", 0, INF),  # the cpu target's decode step kernel
        (_gdn(1, 80, 1, 8, False, True, value_heads=2, cu_seqlens=[0, 30, 30, 80]), "v", 5, NAN),
        (_gdn(1, 80, 2, 8, True, True, value_heads=4, value_size=5, cu_seqlens=[0, 30, 30, 80]), "k", 70, NAN),
    ],
    present={"value_heads": {"value_heads": 4}, "value_size": {"value_size": 6}, "scale": {"scale": 0.5},
             "state_dtype": {"state_dtype": "f32"}, "cu_seqlens": PACKED, "num_seqs": PACKED,
             "state_slots": SLOTS, "num_slots": SLOTS, "reserve": _GDN_RESERVE, "reserve_bytes": _GDN_RESERVE},
    refused=[({**PACKED, "cu_seqlens": [1, 3, 3, 7]}, "cu_seqlens", "first_not_0"),
             ({"state_slots": [1, 1], "num_slots": 3}, "state_slots", "used_twice")])
