"""``gated_delta_net_backward`` of ABI.md §9: the gradients of the gated delta rule (§4, every field
of §8) with respect to ``q, k, v, g, beta`` and the initial state.

The chunked path is the backward of the WY / UT-transform form that ``gdn`` runs forward. Inside a
chunk of ``L`` steps entered with state ``S0`` (``gamma_r`` the decay from the chunk start through
step ``r``, per head or per key channel):

    (I + A) U = beta (V - (gamma K) S0),   A = beta * strictly-lower decayed K K^T,
    O = scale ((gamma Q) S0 + M U),        M = lower decayed Q K^T,
    S_L = gamma_L S0 + KD^T U,             KD_s = k_s gamma_L / gamma_s.

The forward is recomputed chunk-parallel (``gdn``'s decayed Gram products), and one sequential loop
over chunks forms ``R = V - (gamma K) S0`` and ``U`` and keeps the state entering each chunk: the
only per-chunk checkpoint, so the extra memory is ``O(S / L * state)`` (long sequences also run
fewer lanes at a time, ``BLOCK_STEPS``). The reverse loop over chunks carries the state's gradient
back: ``dU = scale M^T dO + KD dS_L``, ``Y = (I + A)^-T dU``, ``dV = beta Y`` and
``dS0 = gamma_L dS_L + scale (gamma Q)^T dO - (gamma K)^T dV``; every other gradient is a handful
of GEMMs over all chunks at once. Decayed products with per-channel gates factor through the
chunk's midpoint as ``gdn`` does (``CHANNEL_SPREAD``), and chunks whose decays spread further take
an exact pairwise form. A log-decay's gradient is the reverse cumulative sum over the chunk of the
cumulative log-decays' gradients, which are ``x * dx`` summed over the terms in which ``x`` carries
that decay (minus for the terms that divide by it); per head, those of the ``[L, L]`` products are
their row sums minus their column sums.

The step path walks the recurrence back one step at a time (decode-sized sequences, up to
``STEP_MAX``). It also redoes every lane (batch row x value head) whose chunked gradients hold a NaN
or Inf, chunk by chunk from the checkpoints: the chunked GEMMs multiply later steps by exact zeros
(``0 * nan`` is NaN), the step order keeps a non-finite ``d_dst`` causal. Packed sequences run as
zero-padded batch rows (a padded step leaves the state and its gradient unchanged); state slots
gather the rows once and scatter the initial state's gradient once. 16-bit storage computes in f32,
a wider ``state_dtype`` widens the whole thunk; every sum has a fixed order.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from . import threads
from .arena import COMPUTE
from .chunked import (chunk_view, decay_ratios, floor_log_decays, from_chunks, pick_path, to_chunks,
                      unit_lower_inverse)
from .fields import complete, gdn_scale
from .gdn import CHANNEL_SPREAD, L2_EPS, _channel_grams_fast, _split, _swap, _upper
from .implementations import KERNELS
from .layout import Bound

Thunk = Mapping[str, Any]
Array = np.ndarray

#: Chunk length of the chunked path (a power of two, at least ``unit_lower_inverse``'s block).
CHUNK = 32
#: Longest sequence (a packed one: the longest sequence) that takes the step path. Measured (B2 H8 K=V=64 f32,
#: one thread, either gate kind): step 4.3 / chunked 8.4 ms at seq 1, 11 / 8 ms at seq 4, 61 / 9 ms at seq 32.
STEP_MAX = 2
#: Lanes (batch row x key head) times steps the chunked path takes at once: longer sequences run fewer lanes
#: at a time, so the per-chunk intermediates stay bounded (B2 H8 S4096 f32: four blocks of two lanes).
BLOCK_STEPS = 8192


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


def _step_path(q, k, v, g, beta, s0, ds, d_out, scale):
    """``_step`` over every lane of ``[B, S, H, ...]`` arrays; returns their gradients in the same layout."""
    b, group = q.shape[0], v.shape[2] // q.shape[2]
    lanes = [_lanes(x, group) for x in (q, k)] + [_lanes(x, 0) for x in (v, g, beta)]
    flat = (-1, *s0.shape[2:])
    *grads, ds0 = _step(*lanes, s0.reshape(flat), ds.reshape(flat), _lanes(d_out, 0), scale)
    out = [_unlanes(x, b, group) for x in grads[:2]] + [_unlanes(x, b, 0) for x in grads[2:]]
    return (*out, ds0.reshape(s0.shape))


class _Decayed:
    """Products that pair a later step ``r`` with an earlier step ``s`` of a chunk through the per-key-channel
    decay ``exp(cum_r - cum_s)`` (``cum [..., L, K]``), for ``P [..., L, L]`` lower triangular:
    ``later(P, x)[r] = sum_s P[r, s] x_s exp(cum_r - cum_s)`` and
    ``earlier(P, y)[s] = sum_r P[r, s] y_r exp(cum_r - cum_s)``.

    Each ratio factors through the chunk's midpoint ``m`` (``exp(cum_r - m) exp(m - cum_s)``, both within
    ``exp(CHANNEL_SPREAD)`` where ``bounded``); chunks whose spread is wider are formed pair by pair.
    """

    def __init__(self, cum: Array, bounded: bool):
        self.cum = cum
        length = cum.shape[-2]
        mid = cum[..., (length - 1) // 2: (length + 1) // 2, :]
        with np.errstate(over="ignore", under="ignore"):
            self.up, self.down = np.exp(cum - mid), np.exp(mid - cum)
        self.unsafe = None
        if not bounded:
            spread = np.max(np.abs(cum - mid), axis=(-2, -1))
            self.unsafe = np.nonzero((spread > CHANNEL_SPREAD).reshape(-1))[0]

    def later(self, p: Array, x: Array) -> Array:
        out = self.up * np.matmul(p, x * self.down)
        return self._exact(out, p, x, "rs,rsi,si->ri")

    def earlier(self, p: Array, y: Array) -> Array:
        out = self.down * np.matmul(_swap(p), y * self.up)
        return self._exact(out, p, y, "rs,rsi,ri->si")

    def _exact(self, out: Array, p: Array, x: Array, spec: str) -> Array:
        """``out`` with its unsafe chunks formed from every ratio ``exp(cum_r - cum_s)``, ``r >= s``."""
        if self.unsafe is None or not len(self.unsafe):
            return out
        length, n = self.cum.shape[-2:]
        lead = out.shape[:-2]
        pick = self.unsafe
        cum = self.cum.reshape(-1, length, n)[pick]
        diff = cum[:, :, None, :] - cum[:, None, :, :]  # [.., r, s, i]
        diff[:, ~np.tril(np.ones((length, length), bool))] = -np.inf
        ratios = np.exp(diff)
        flat = out.reshape(-1, length, n)
        ps = np.broadcast_to(p, (*lead, length, length)).reshape(-1, length, length)[pick]
        xs = np.broadcast_to(x, (*lead, length, n)).reshape(-1, length, n)[pick]
        flat[pick] = np.einsum("n" + spec.replace(",", ",n").replace("->", "->n"), ps, ratios, xs)
        return flat.reshape(out.shape)


def _rowdot(x: Array, y: Array) -> Array:
    """``sum_i x[..., i] y[..., i]``."""
    return np.einsum("...i,...i->...", x, y)


def _chunked(q, k, v, g, beta, s0, dsf, d_out, scale, length):
    """The chunked backward over ``[B, S, H, ...]`` arrays (``_step_path``'s layout and results)."""
    seq, heads, n = q.shape[1:]
    b, group, width = q.shape[0], v.shape[2] // heads, v.shape[3]
    per_channel = g.ndim == 4
    low, high = float(g.min(initial=0.0)), float(g.max(initial=0.0))
    g = floor_log_decays(g, low)
    qc, kc = (to_chunks(x, length)[:, :, :, None] for x in (q, k))  # [C, B, H, 1, L, K]
    vc, oc = (_split(chunk_view(x, length), group, 2) for x in (v, d_out))  # [C, B, H, G, L, V]
    gc, bc = (_split(to_chunks(x, length), group, 2) for x in (g, beta))  # [C, B, H, G, L(, K)]
    count = qc.shape[0]
    kt = np.ascontiguousarray(_swap(kc))  # [C, B, H, 1, K, L]
    with np.errstate(over="ignore", invalid="ignore"):
        if per_channel:
            cum = np.cumsum(gc, axis=-2)  # [C, B, H, G, L, K]
            bounded = max(-low, high) * (length // 2 + 1) <= CHANNEL_SPREAD
            lead = cum.shape[:-2]
            qk, kk = _channel_grams_fast(np.broadcast_to(qc, (*lead, length, n)), np.broadcast_to(kc, (*lead, length, n)),
                                         kt, cum, np.ascontiguousarray(_swap(cum)), bounded)
            qk, kk = qk.copy(), kk.copy()  # scratch arrays of gdn's: kept here past other calls
            decayed = _Decayed(cum, bounded)
        else:
            cum = np.cumsum(gc, axis=-1)[..., None]  # [C, B, H, G, L, 1]
            ratios = decay_ratios(cum[..., 0])
            qk = np.multiply(np.matmul(qc, kt), ratios)
            kk = np.multiply(np.matmul(kc, kt), ratios)
            np.copyto(kk, 0, where=_upper(length, 0))
        last = cum[..., -1:, :]
        gamma, to_end = np.exp(cum), np.exp(last - cum)  # [..., L, K or 1]
        through = np.exp(last[..., 0, :])[..., None]  # [..., K or 1, 1]: the chunk's decay
    inverse = unit_lower_inverse(kk * bc[..., None])  # (I + A)^-1
    inverse_t = np.ascontiguousarray(_swap(inverse))
    t = inverse * bc[..., None, :]  # T = (I + A)^-1 beta
    gk = gamma * kc  # [..., L, K]
    gk_t = np.ascontiguousarray(_swap(gk))
    kd = kc * to_end  # KD, [..., L, K]
    kd_t = np.ascontiguousarray(_swap(kd))

    # the forward again, keeping R = V - (gamma K) S0, U = T R and the state entering each chunk
    rest, u = np.empty(vc.shape, q.dtype), np.empty(vc.shape, q.dtype)
    starts = np.empty((count, b, heads, group, n, width), s0.dtype)
    state = _split(s0, group, 1)
    for c in range(count):
        starts[c] = state
        np.subtract(vc[c], np.matmul(gk[c], state), out=rest[c])
        np.matmul(t[c], rest[c], out=u[c])
        state = starts[c] * through[c] + np.matmul(kd_t[c], u[c])

    # the reverse over chunks: dU = scale M^T dO + KD dS_L, Y = (I + A)^-T dU, dV = beta Y and
    # dS0 = gamma_L dS_L + scale (gamma Q)^T dO - (gamma K)^T dV
    du = np.matmul(_swap(qk), oc)
    du *= scale
    carried = np.matmul(_swap(gamma * qc), oc)  # [C, ..., K, V]; then each chunk's dS_L in its place
    carried *= scale
    y, dv = np.empty_like(du), np.empty_like(du)
    ds = _split(dsf, group, 1).copy()
    for c in range(count - 1, -1, -1):
        du[c] += np.matmul(kd[c], ds)
        np.matmul(inverse_t[c], du[c], out=y[c])
        np.multiply(y[c], bc[c][..., None], out=dv[c])
        nxt = ds * through[c]
        nxt += carried[c]
        nxt -= np.matmul(gk_t[c], dv[c])
        carried[c] = ds
        ds = nxt
    d_leave = carried

    # every other gradient, all chunks at once
    dbeta = _rowdot(y, rest)
    da = np.matmul(y, _swap(u))  # minus the gradient of A, strictly lower
    np.copyto(da, 0, where=_upper(length, 0))
    dbeta -= np.sum(da * kk, axis=-1)
    dkk = da
    dkk *= bc[..., None]
    dkk *= -1
    s0t = _swap(starts)
    dgk = np.matmul(dv, s0t)  # minus the gradient of gamma K
    dgk *= gamma
    dqg = np.matmul(oc, s0t)  # of gamma Q, over scale
    dqg *= gamma
    dqg *= scale
    dqk = np.matmul(oc, _swap(u))
    dqk *= scale
    np.copyto(dqk, 0, where=_upper(length, 1))
    dkd = np.matmul(u, _swap(d_leave))  # of KD
    dkd *= to_end
    # the cumulative log-decays: + x dx where x carries exp(cum_r), - where it carries exp(-cum_s); the chunk's
    # last one also through the decayed entering state, gamma_L S0
    entering = np.einsum("...kv,...kv->...k", starts, d_leave) * through[..., 0]  # [..., K]
    if per_channel:
        rows_q, cols_q = decayed.later(dqk, kc), decayed.earlier(dqk, qc)
        rows_k, cols_k = decayed.later(dkk, kc), decayed.earlier(dkk, kc)
        dq = dqg + rows_q
        dk = rows_k + cols_q
        dk += cols_k
        dk += dkd
        dk -= dgk
        dcum = qc * dq
        cols_q += cols_k
        cols_q += dgk
        cols_q += dkd
        cols_q -= rows_k
        cols_q *= kc
        dcum -= cols_q
        dcum[..., -1, :] += np.sum(kc * dkd, axis=-2) + entering
        axis = -2
    else:
        p_q, p_k = dqk * ratios, dkk * ratios
        dq = np.matmul(p_q, kc)
        dq += dqg
        dk = np.matmul(_swap(p_q), qc)
        dk += np.matmul(p_k + _swap(p_k), kc)
        dk += dkd
        dk -= dgk
        e = dqk * qk
        e += dkk * kk  # products of a later row r and an earlier column s: + at r, - at s
        dcum = e.sum(axis=-1) - e.sum(axis=-2)
        dcum += _rowdot(qc, dqg) - _rowdot(kc, dgk + dkd)
        dcum[..., -1] += _rowdot(kc, dkd).sum(axis=-1) + entering.sum(axis=-1)
        axis = -1
    dg = np.flip(np.cumsum(np.flip(dcum, axis), axis), axis)

    grads = [dq, dk, dv, dg, dbeta]
    _redo_nonfinite(grads, ds, (qc, kc, vc, gc, bc, oc), starts, _split(dsf, group, 1), scale)
    dq, dk = (from_chunks(x[:, :, :, 0] if group == 1 else x.sum(axis=3), seq) for x in (dq, dk))
    dv, dg, dbeta = (from_chunks(x.reshape(count, b, heads * group, *x.shape[4:]), seq) for x in (dv, dg, dbeta))
    return dq, dk, dv, dg, dbeta, ds.reshape(s0.shape)


def _redo_nonfinite(grads, ds0, chunks, starts, dsf, scale) -> None:
    """Redo with ``_step``, chunk by chunk from the checkpoints ``starts``, every lane (batch row, key
    head, group member) whose chunked gradients hold a NaN or Inf; writes into ``grads`` and ``ds0``."""
    lead = ds0.shape[:3]
    bad = ~np.isfinite(ds0).all(axis=(-2, -1))
    for x in grads:
        bad |= ~np.isfinite(x).reshape(x.shape[0], *lead, -1).all(axis=(0, -1))
    if not bad.any():
        return
    pick = np.nonzero(bad)
    qc, kc, vc, gc, bc, oc = chunks
    key = (pick[0], pick[1], np.zeros_like(pick[2]))
    ds = dsf[pick]
    for c in range(starts.shape[0] - 1, -1, -1):
        *step, ds = _step(qc[c][key], kc[c][key], vc[c][pick], gc[c][pick], bc[c][pick], starts[c][pick], ds,
                          oc[c][pick], scale)
        for x, redone in zip(grads, step):
            x[c][pick] = redone
    ds0[pick] = ds


def _normed(x: Array) -> tuple[Array, Array]:
    """``(x / norm, norm)`` with ``norm = sqrt(sum x^2 + L2_EPS)`` over each head vector."""
    norm = np.sqrt(np.einsum("...i,...i->...", x, x)[..., None] + L2_EPS)
    return x / norm, norm


def _unnormed(x_hat: Array, norm: Array, d_hat: Array) -> Array:
    """The gradient of ``x`` from that of ``x_hat = x / norm``: ``(d_hat - x_hat (x_hat . d_hat)) / norm``."""
    return (d_hat - x_hat * np.einsum("...i,...i->...", x_hat, d_hat)[..., None]) / norm


def _blocks(bs: slice, hs: slice, lanes: int) -> list[tuple[slice, slice]]:
    """``bs x hs`` (batch rows x key heads) cut into blocks of at most ``lanes`` lanes (at least one lane),
    whole rows of heads where they fit."""
    rows, heads = bs.stop - bs.start, hs.stop - hs.start
    if rows * heads <= lanes:
        return [(bs, hs)]
    if heads <= lanes:
        per = lanes // heads
        return [(slice(r, min(r + per, bs.stop)), hs) for r in range(bs.start, bs.stop, per)]
    return [(slice(r, r + 1), slice(h, min(h + lanes, hs.stop))) for r in range(bs.start, bs.stop)
            for h in range(hs.start, hs.stop, lanes)]


def _choose(t: Thunk, longest: int, path: str | None, chunk: int | None) -> tuple[str, int]:
    length = chunk or CHUNK
    if length < 16 or length & (length - 1):
        raise ValueError(f"gated_delta_net_backward: chunk length must be a power of two >= 16, got {length}")
    return pick_path("gated_delta_net_backward", path, longest, STEP_MAX, "chunked"), length


def gated_delta_net_backward(thunk: Thunk, arena: np.ndarray, *, path: str | None = None, chunk: int | None = None,
                             workers: int | None = None) -> None:
    """Gradients of the gated delta rule: ``d_q d_k d_v d_g d_beta`` and, with ``carry_state``, ``d_state``
    (read as the final state's gradient, written back as the initial state's).

    ``path`` (``"step"`` or ``"chunked"``), ``chunk`` (a power-of-two chunk length, at least 16) and
    ``workers`` (threads over the batch x key-head lanes) override the choice.
    """
    t = complete(thunk)
    bound = Bound(t, arena)
    work = np.result_type(COMPUTE[t["dtype"]], COMPUTE[t["state_dtype"]])
    heads, hv, n, width = t["heads"], t["value_heads"], t["state_size"], t["value_size"]
    group, scale = hv // heads, gdn_scale(t)
    fields = ("q", "k", "v", "g", "beta", "d_dst")
    inputs = {f: bound.view(f) for f in fields}  # read where they lie when stored in the work type
    inputs.update({f: x.astype(work) for f, x in inputs.items() if x.dtype != work})
    if t["qk_l2norm"]:
        (inputs["q"], q_norm), (inputs["k"], k_norm) = _normed(inputs["q"]), _normed(inputs["k"])
    normed = {f: inputs[f] for f in ("q", "k")}  # as the thunk lays them out, for the normalisation's gradient
    varlen = t["cu_seqlens"] is not None
    rows = t["num_seqs"] if varlen else t["batch"]
    if varlen:  # each sequence a zero-padded batch row
        cu = bound.view("cu_seqlens").astype(np.int64)
        lengths = np.diff(cu)
        pad = np.arange(max(1, int(lengths.max(initial=0))))
        valid = pad[None, :] < lengths[:, None]  # [R, longest]
        tokens = (cu[:-1, None] + pad[None, :])[valid]
        for f in fields:
            padded = np.zeros((rows, valid.shape[1], *inputs[f].shape[2:]), work)
            padded[valid] = inputs[f][0, tokens]
            inputs[f] = padded
    slots = bound.view("state_slots").astype(np.intp) if t["state_slots"] is not None else slice(None)
    shape = (rows, hv, n, width)
    if t["carry_state"]:
        s0, dsf = bound.view("state")[slots].astype(work), bound.view("d_state")[slots].astype(work)
    else:
        s0, dsf = np.zeros(shape, work), np.zeros(shape, work)
    name, length = _choose(t, inputs["q"].shape[1], path, chunk)
    # the gradients go straight into the arena where nothing is left to do to them (ABI.md: no output
    # overlaps an input)
    direct = not varlen and bound.view("d_q").dtype == work
    grads = {f: bound.view(f"d_{f}") if direct else np.empty_like(inputs[f]) for f in ("q", "k", "v", "g", "beta")}
    d_init = np.empty(shape, work)
    seq = inputs["q"].shape[1]

    def compute(bs: slice, hs: slice) -> list[tuple[slice, slice, tuple[Array, ...]]]:
        done = []
        for sub_bs, sub_hs in _blocks(bs, hs, 1 if name == "step" else max(1, BLOCK_STEPS // seq)):
            vs = slice(sub_hs.start * group, sub_hs.stop * group)
            q, k, v, g, beta, d_out = (inputs[f][sub_bs, :, sub_hs if f in ("q", "k") else vs] for f in fields)
            run = _step_path if name == "step" else lambda *args: _chunked(*args, length)
            done.append((sub_bs, sub_hs, run(q, k, v, g, beta, s0[sub_bs, vs], dsf[sub_bs, vs], d_out, scale)))
        return done

    def store(bs: slice, hs: slice, done: list[tuple[slice, slice, tuple[Array, ...]]]) -> None:
        for sub_bs, sub_hs, result in done:
            vs = slice(sub_hs.start * group, sub_hs.stop * group)
            for f, x in zip(("q", "k", "v", "g", "beta"), result):
                grads[f][sub_bs, :, sub_hs if f in ("q", "k") else vs] = x
            d_init[sub_bs, vs] = result[-1]

    lanes_work = rows * seq * hv * n * width
    threads.run_split(compute, store, rows, heads,
                      threads.parts_for("gated_delta_net_backward", lanes_work, rows, heads, workers))
    if varlen:
        grads = {f: x[valid][None] for f, x in grads.items()}
    if t["qk_l2norm"]:
        for f, norm in (("q", q_norm), ("k", k_norm)):
            grads[f][...] = _unnormed(normed[f], norm, grads[f])
    for f, x in grads.items() if not direct else ():
        bound.store(f"d_{f}", x)
    if t["carry_state"]:
        if isinstance(slots, slice):
            bound.store("d_state", d_init)
        else:
            pool = bound.view("d_state")
            pool[slots] = d_init.astype(pool.dtype)


KERNELS.add("gated_delta_net_backward", gated_delta_net_backward)
