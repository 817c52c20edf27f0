"""``gated_delta_net``'s step path: the recurrence of ABI.md §4/§8 step by step, vectorized over batch and
heads (it serves short sequences: decode), and the view of the value-head axis as ``[heads, group]`` every
path reads q and k through."""
from __future__ import annotations

import math

import numpy as np

from .chunked import scratch


def _swap(x: np.ndarray) -> np.ndarray:
    return np.swapaxes(x, -1, -2)


def _split(x: np.ndarray, group: int, axis: int) -> np.ndarray:
    """``x`` with its value-head axis ``axis`` viewed as ``[heads, group]`` (splitting one axis is always a view)."""
    return x.reshape(*x.shape[:axis], x.shape[axis] // group, group, *x.shape[axis + 1:])


def _step(q, k, v, g, beta, s, out, scale, active=None):
    """The recurrence of ABI.md §4/§8, step by step, into ``out``; ``s`` is updated in place.

    ``q, k [B, S, H, K]``; ``v, out [B, S, HV, V]``; ``g [B, S, HV]`` or ``[B, S, HV, K]``;
    ``beta [B, S, HV]``; ``s [B, HV, K, V]``. Value head ``j`` reads key head ``j // (HV / H)``: the
    value-head axis is viewed as ``[H, G]`` and q, k broadcast over ``G``, never copied.
    ``active[t]`` (rows sorted longest first) is how many leading batch rows step ``t`` runs: the
    rows of sequences shorter than ``t + 1`` steps are left alone (a zero step is no exact no-op on
    a state holding an Inf: ``0 * inf`` is NaN).

    Per step the state is decayed, then read ONCE for both ``k^T S`` and ``q^T S`` (one batched matmul
    of the rows [k; q]); the output is ``q^T S_new = q^T S + (q.k) u``, so the updated state is not read
    again. A step whose output that way is not finite takes ``q^T S_new`` from the updated state, the
    ABI's order, so NaN and each signed Inf land where they do on every device. The rank-1 update
    ``k u^T`` is a matmul of depth 2 (the second column and row zero): NumPy runs depth 1 in its own
    loop, 20x slower (B8 H8 N64: 780 vs 38 µs), and the einsum 3x slower.
    """
    group = v.shape[2] // q.shape[2]
    per_channel = g.ndim == 4
    q, k = q[:, :, :, None], k[:, :, :, None]  # [B, S, H, 1, K]
    v, out, g, beta = _split(v, group, 2), _split(out, group, 2), _split(g, group, 2), _split(beta, group, 2)
    s = _split(s, group, 1)  # [B, H, G, K, V]
    lead, (n, width) = s.shape[:-2], s.shape[-2:]
    outer = scratch("gdn.outer", s.shape, s.dtype)  # k u^T: a state-sized buffer kept, not allocated per step
    rows = scratch("gdn.rows", (*lead, 2, n), s.dtype)  # [k; q] of one step
    kcol = scratch("gdn.kcol", (*lead, n, 2), s.dtype)  # [k, 0]
    urow = scratch("gdn.urow", (*lead, 2, width), s.dtype)  # [u; 0]
    kcol[..., 1] = 0
    urow[..., 1, :] = 0
    # a per-head decay scales each (batch, head) state as one row of K*V: NumPy's broadcast of a
    # [B, H, 1, 1] factor runs an inner loop per state row, 3x slower (B8 H8 N64: 95 vs 30 µs)
    flat = s.reshape(lead[0], -1, n * width) if not per_channel and s.flags.c_contiguous else None
    for t in range(q.shape[1]):
        m = lead[0] if active is None else active[t]
        if m == 0:
            break
        st, qt, kt, vt, ot = s[:m], q[:m, t], k[:m, t], v[:m, t], out[:m, t]
        decay = np.exp(g[:m, t])
        if flat is not None:
            flat[:m] *= decay.reshape(m, -1, 1)
        else:
            st *= decay[..., :, None] if per_channel else decay[..., None, None]
        rows[:m, ..., 0, :], rows[:m, ..., 1, :] = kt, qt
        read = np.matmul(rows[:m], st)  # [k^T S; q^T S]
        u = urow[:m, ..., 0, :]
        np.multiply(np.subtract(vt, read[..., 0, :], out=u), beta[:m, t, ..., None], out=u)
        kcol[:m, ..., 0] = kt
        st += np.matmul(kcol[:m], urow[:m], out=outer[:m])
        qk = np.einsum("...i,...i->...", qt, kt)
        ot[...] = scale * (read[..., 1, :] + qk[..., None] * u)
        if not math.isfinite(ot.sum()):  # a NaN or Inf: the classes of S_new's products, not the rewrite's
            ot[...] = scale * np.matmul(qt[..., None, :], st)[..., 0, :]
