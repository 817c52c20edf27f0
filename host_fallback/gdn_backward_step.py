"""``gated_delta_net_backward``'s step path: the recurrence walked back one step at a time over lanes
(batch row x value head), for decode-sized sequences and for the lanes the chunked path redoes."""
from __future__ import annotations

import numpy as np

Array = np.ndarray


def _step(q, k, v, g, beta, s0, ds, d_out, scale):
    """The per-step reverse over lanes: ``q, k [N, T, K]``; ``v, d_out [N, T, V]``; ``g [N, T]`` or
    ``[N, T, K]``; ``beta [N, T]``; ``s0`` the state entering step 0 and ``ds`` the gradient of the state
    after the last step, ``[N, K, V]``. Returns ``(dq, dk, dv, dg, dbeta, ds0)``.

    The forward keeps the state entering every step (``T + 1`` states: callers pass at most a chunk or
    ``STEP_MAX`` steps); the reverse takes each step's gradients in the order of ABI.md's formulas."""
    n, steps = q.shape[:2]
    per_channel = g.ndim == 3
    decay = np.exp(g)
    states = np.empty((steps + 1, *s0.shape), s0.dtype)
    states[0] = s0
    us = np.empty((steps, n, v.shape[2]), s0.dtype)

    def decayed(t: int) -> Array:
        return states[t] * (decay[:, t, :, None] if per_channel else decay[:, t, None, None])

    def row(x: Array, s: Array) -> Array:  # x^T S for each lane: [N, K] x [N, K, V] -> [N, V]
        return np.matmul(x[:, None, :], s)[:, 0]

    def col(s: Array, y: Array) -> Array:  # S y for each lane: [N, K, V] x [N, V] -> [N, K]
        return np.matmul(s, y[:, :, None])[..., 0]

    for t in range(steps):
        sa = decayed(t)
        us[t] = (v[:, t] - row(k[:, t], sa)) * beta[:, t, None]
        states[t + 1] = sa + k[:, t, :, None] * us[t][:, None, :]
    grads = [np.empty_like(x) for x in (q, k, v, g, beta)]
    dq, dk, dv, dg, dbeta = grads
    ds = ds.copy()
    for t in range(steps - 1, -1, -1):
        sa, dy, kt = decayed(t), d_out[:, t], k[:, t]
        dq[:, t] = scale * col(states[t + 1], dy)
        ds += scale * q[:, t, :, None] * dy[:, None, :]
        du = row(kt, ds)
        dbeta[:, t] = np.sum(du * (v[:, t] - row(kt, sa)), axis=-1)
        dr = du * beta[:, t, None]
        dv[:, t] = dr
        dk[:, t] = col(ds, us[t]) - col(sa, dr)
        ds -= kt[:, :, None] * dr[:, None, :]
        product = ds * sa
        dg[:, t] = product.sum(axis=-1) if per_channel else product.sum(axis=(-2, -1))
        ds *= decay[:, t, :, None] if per_channel else decay[:, t, None, None]
    return (*grads, ds)


def _lanes(x: Array, group: int) -> Array:
    """``[B, S, H, ...]`` of key heads (``group`` > 0: repeated per value head) or value heads as
    ``[B * HV, S, ...]`` lanes."""
    if group:
        x = np.repeat(x, group, axis=2)
    return np.ascontiguousarray(np.swapaxes(x, 1, 2)).reshape(-1, x.shape[1], *x.shape[3:])


def _unlanes(x: Array, batch: int, group: int) -> Array:
    """Inverse of ``_lanes``; ``group`` > 0 sums the value heads of each key head."""
    x = np.swapaxes(x.reshape(batch, -1, *x.shape[1:]), 1, 2)
    return x.reshape(*x.shape[:2], -1, group, *x.shape[3:]).sum(axis=3) if group else x


def _step_path(q, k, v, g, beta, s0, ds, d_out, scale, out):
    """``_step`` over every lane of ``[B, S, H, ...]`` arrays: their gradients written into ``out`` (five arrays of
    the same layout), the initial state's returned."""
    b, group = q.shape[0], v.shape[2] // q.shape[2]
    lanes = [_lanes(x, group) for x in (q, k)] + [_lanes(x, 0) for x in (v, g, beta)]
    flat = (-1, *s0.shape[2:])
    *grads, ds0 = _step(*lanes, s0.reshape(flat), ds.reshape(flat), _lanes(d_out, 0), scale)
    for f, (x, dest) in enumerate(zip(grads, out)):
        dest[...] = _unlanes(x, b, group if f < 2 else 0)
    return ds0.reshape(s0.shape)
