"""``gated_delta_net_backward``'s chunked path: the backward of the WY / UT-transform form (``gdn_backward``'s
docstring gives its formulas), lanes whose gradients come out non-finite redone by the step path."""
from __future__ import annotations

import numpy as np

from . import jit
from .chunked import chunk_view, decay_ratios, floor_log_decays, from_chunks, to_chunks, unit_lower_inverse
from .gdn_backward_step import _step
from .gdn_grams import CHANNEL_SPREAD, _channel_grams_fast, _upper
from .gdn_step import _split, _swap

Array = np.ndarray
#: The float types the compiled kernels (``jit_gdn_backward``) are built for.
_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


class _Decayed:
    """Products that pair a later step ``r`` with an earlier step ``s`` of a chunk through the per-key-channel
    decay ``exp(cum_r - cum_s)`` (``cum [..., L, K]``), for ``P [..., L, L]`` lower triangular:
    ``later(P, x)[r] = sum_s P[r, s] x_s exp(cum_r - cum_s)`` and
    ``earlier(P, y)[s] = sum_r P[r, s] y_r exp(cum_r - cum_s)``.

    Each ratio factors through the chunk's midpoint ``m`` (``exp(cum_r - m) exp(m - cum_s)``, both within
    ``exp(CHANNEL_SPREAD)`` where ``bounded``); chunks whose spread is wider are formed pair by pair.
    """

    def __init__(self, cum: Array, bounded: bool, factors: tuple[Array, Array] | None = None):
        """``factors``: ``(up, down)``, ``exp(cum - m)`` and ``exp(m - cum)``, where the caller has them."""
        self.cum = cum
        length = cum.shape[-2]
        mid = cum[..., (length - 1) // 2: (length + 1) // 2, :]
        if factors is None:
            with np.errstate(over="ignore", under="ignore"):
                factors = np.exp(cum - mid), np.exp(mid - cum)
        self.up, self.down = factors
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


def _chunked(q, k, v, g, beta, s0, dsf, d_out, scale, length, saved=None):
    """The chunked backward over ``[B, S, H, ...]`` arrays (``_step_path``'s layout and results). ``saved``: a
    saved forward's views by slot name (``abi.gdn.reserve_slots``, ``[B, C, HV, ...]``, chunks of ``length``),
    read instead of forming the decayed products, the inverses, the states entering each chunk and ``U``."""
    seq, heads, n = q.shape[1:]
    b, group = q.shape[0], v.shape[2] // heads
    per_channel = g.ndim == 4
    low, high = float(g.min(initial=0.0)), float(g.max(initial=0.0))
    g = floor_log_decays(g, low)
    qc, kc = (to_chunks(x, length)[:, :, :, None] for x in (q, k))  # [C, B, H, 1, L, K]
    vc, oc = (_split(chunk_view(x, length), group, 2) for x in (v, d_out))  # [C, B, H, G, L, V]
    gc, bc = (_split(to_chunks(x, length), group, 2) for x in (g, beta))  # [C, B, H, G, L(, K)]
    count = qc.shape[0]
    kt = np.ascontiguousarray(_swap(kc))  # [C, B, H, 1, K, L]
    read = None if saved is None else _chunk_major(saved, group)
    products = None if read is None else (read["qk"], read["kk"])
    qk, kk, gamma, to_end, through, pairs = _decays(qc, kc, kt, gc, per_channel, max(-low, high), products)
    inverse = unit_lower_inverse(kk * bc[..., None]) if read is None else read["inverse"]  # (I + A)^-1
    inverse_t = np.ascontiguousarray(_swap(inverse))
    gk = gamma * kc  # [..., L, K]
    gk_t = np.ascontiguousarray(_swap(gk))
    kd = kc * to_end  # KD, [..., L, K]
    u, starts = _forward(vc, gk, inverse, bc, kd, through, _split(s0, group, 1), read)

    # the reverse over chunks: dU = scale M^T dO + KD dS_L, Y = (I + A)^-T dU, dV = beta Y and
    # dS0 = gamma_L dS_L + scale (gamma Q)^T dO - (gamma K)^T dV
    du = np.matmul(_swap(qk), oc)
    du *= scale
    carried = np.matmul(_swap(gamma * qc), oc)  # [C, ..., K, V]; then each chunk's dS_L in its place
    carried *= scale
    y, dv, ds = _reverse(du, kd, inverse_t, bc, through, carried, gk_t, _split(dsf, group, 1).copy())
    d_leave = carried

    # every other gradient, all chunks at once
    # beta's through R = V - (gamma K) S0 as Y.V - (Y S0^T).(gamma K), no R kept; Y S0^T (beta gamma) is minus
    # the gradient of gamma K
    s0t = _swap(starts)
    dgk = np.matmul(y, s0t)
    dbeta = _rowdot(y, vc)
    dbeta -= _rowdot(dgk, gk)
    da = np.matmul(y, _swap(u))  # minus the gradient of A, strictly lower
    np.copyto(da, 0, where=_upper(length, 0))
    dbeta -= np.sum(da * kk, axis=-1)
    dqg = np.matmul(oc, s0t)  # of gamma Q, over scale and gamma
    dqk = np.matmul(oc, _swap(u))  # over scale
    dkd = np.matmul(u, _swap(d_leave))  # of KD, over to_end
    # the cumulative log-decays: + x dx where x carries exp(cum_r), - where it carries exp(-cum_s); the chunk's
    # last one also through the decayed entering state, gamma_L S0
    entering = np.einsum("...kv,...kv->...k", starts, d_leave) * through[..., 0]  # [..., K]
    raw = (da, dqg, dgk, dkd, gamma, to_end, bc, scale)
    if per_channel:
        dq, dk, dg = _channel_gradients(pairs, qc, kc, dqk, *raw, entering)
    else:
        dq, dk, dcum = _head_gradients(pairs, qc, kc, qk, kk, *_scaled(dqk, *raw), entering)
        dg = _from_end(dcum, -1)

    grads = [dq, dk, dv, dg, dbeta]
    _redo_nonfinite(grads, ds, (qc, kc, vc, gc, bc, oc), starts, _split(dsf, group, 1), scale)
    dq, dk = (from_chunks(x[:, :, :, 0] if group == 1 else x.sum(axis=3), seq) for x in (dq, dk))
    dv, dg, dbeta = (from_chunks(x.reshape(count, b, heads * group, *x.shape[4:]), seq) for x in (dv, dg, dbeta))
    return dq, dk, dv, dg, dbeta, ds.reshape(s0.shape)


def _chunk_major(saved, group):
    """A saved forward's slots ``[B, C, HV, ...]`` chunk-major, ``[C, B, H, G, ...]``, contiguous copies but the
    states (a view: ``_forward`` copies them once, into the states entering each chunk)."""
    moved = {f: np.moveaxis(_split(x, group, 2), 1, 0) for f, x in saved.items()}
    return {f: x if f == "states" else np.ascontiguousarray(x) for f, x in moved.items()}


def _forward(vc, gk, inverse, bc, kd, through, s0, saved):
    """The forward again: ``(U, starts)``, ``U = T R`` (``T = (I + A)^-1 beta``, ``R = V - (gamma K) S0``) and
    the state entering each chunk, one chunk after another from ``s0``; or read from a saved forward (``saved``:
    ``u`` and the states leaving each chunk, ``[C, ...]``)."""
    starts = np.empty((len(vc), *s0.shape), s0.dtype)
    starts[0] = s0
    if saved is not None:
        starts[1:] = saved["states"][:-1]
        return saved["u"], starts
    t = inverse * bc[..., None, :]
    kd_t = np.ascontiguousarray(_swap(kd))
    u, rest = np.empty(vc.shape, vc.dtype), np.empty(vc.shape[1:], vc.dtype)
    state = s0
    for c in range(len(vc)):
        starts[c] = state
        np.subtract(vc[c], np.matmul(gk[c], state), out=rest)
        np.matmul(t[c], rest, out=u[c])
        state = starts[c] * through[c] + np.matmul(kd_t[c], u[c])
    return u, starts


def _reverse(du, kd, inverse_t, bc, through, carried, gk_t, ds):
    """The loop over chunks from the last, ``ds`` the gradient of the state leaving it: ``du += KD dS_L``,
    ``Y = (I + A)^-T dU``, ``dV = beta Y``, ``dS0 = gamma_L dS_L + carried - (gamma K)^T dV``; ``carried``
    (``scale (gamma Q)^T dO``) becomes each chunk's ``dS_L``. Returns ``(y, dv, ds0)``."""
    y, dv = np.empty_like(du), np.empty_like(du)
    for c in range(du.shape[0] - 1, -1, -1):
        du[c] += np.matmul(kd[c], ds)
        np.matmul(inverse_t[c], du[c], out=y[c])
        np.multiply(y[c], bc[c][..., None], out=dv[c])
        nxt = ds * through[c]
        nxt += carried[c]
        nxt -= np.matmul(gk_t[c], dv[c])
        carried[c] = ds
        ds = nxt
    return y, dv, ds


def _decays(qc, kc, kt, gc, per_channel, steepest, products=None):
    """The decays inside each chunk, from the (floored) log-decays ``gc``: ``(qk, kk, gamma, to_end, through,
    pairs)``, the decayed products ``Q K^T`` (``r <= s``) and ``K K^T`` (``r < s``), the decay from the chunk's
    start through each step (``gamma``) and from each step to its end (``to_end``), both ``[..., L, K or 1]``,
    the chunk's decay ``through`` (``[..., K or 1, 1]``) and what pairs a later step with an earlier one: a
    ``_Decayed`` (per-channel gates) or the ratios ``[..., L, L]`` (per head). ``steepest``: the largest
    ``|g|``; ``products``: the decayed products ``(qk, kk)`` a saved forward holds, used as they are."""
    length, n = kc.shape[-2:]
    with np.errstate(over="ignore", invalid="ignore"):
        if per_channel:
            compiled = _compiled_decays(gc)
            cum = np.cumsum(gc, axis=-2) if compiled is None else compiled[0]  # [C, B, H, G, L, K]
            bounded = steepest * (length // 2 + 1) <= CHANNEL_SPREAD
            lead = cum.shape[:-2]
            if products is None:
                qk, kk = _channel_grams_fast(np.broadcast_to(qc, (*lead, length, n)),
                                             np.broadcast_to(kc, (*lead, length, n)), kt, cum,
                                             np.ascontiguousarray(_swap(cum)), bounded)
                products = qk.copy(), kk.copy()  # scratch arrays of gdn's: kept here past other calls
            pairs = _Decayed(cum, bounded, None if compiled is None else compiled[1:3])
        else:
            compiled = None
            cum = np.cumsum(gc, axis=-1)[..., None]  # [C, B, H, G, L, 1]
            pairs = decay_ratios(cum[..., 0])
            if products is None:
                products = np.multiply(np.matmul(qc, kt), pairs), np.multiply(np.matmul(kc, kt), pairs)
                np.copyto(products[1], 0, where=_upper(length, 0))
        qk, kk = products
        if compiled is None:
            last = cum[..., -1:, :]
            gamma, to_end = np.exp(cum), np.exp(last - cum)  # [..., L, K or 1]
            through = np.exp(last[..., 0, :])[..., None]  # [..., K or 1, 1]: the chunk's decay
        else:
            gamma, to_end, through = compiled[3:]
    return qk, kk, gamma, to_end, through, pairs


def _compiled_decays(gc: Array) -> tuple[Array, ...] | None:
    """Per-channel gates: ``(cum, up, down, gamma, to_end, through)`` of ``gc [..., L, K]`` in one compiled pass
    (``jit``'s ``gdn_channel_decays``; ``through [..., K, 1]``), or None where it does not apply (no Numba,
    ``RLX_HOST_JIT=0``, neither f32 nor f64): ``_decays`` then forms them with NumPy."""
    kernel = jit.kernel("gdn_channel_decays")
    if kernel is None or gc.dtype not in _FLOATS:
        return None
    lanes = gc.shape[-2:]
    outs = [np.empty(gc.shape, gc.dtype) for _ in range(5)]
    through = np.empty((*gc.shape[:-2], lanes[1], 1), gc.dtype)
    kernel(np.ascontiguousarray(gc).reshape(-1, *lanes), *(x.reshape(-1, *lanes) for x in outs),
           through.reshape(-1, lanes[1]))
    return (*outs, through)


def _from_end(dcum: Array, axis: int) -> Array:
    """The log-decays' gradient from the cumulative ones': ``dcum`` summed from each chunk's end along ``axis``."""
    return np.flip(np.cumsum(np.flip(dcum, axis), axis), axis)


def _scaled(dqk, da, dqg, dgk, dkd, gamma, to_end, bc, scale):
    """The GEMMs' products ``O U^T``, ``Y U^T`` (``da``, strictly lower), ``O S0^T``, ``Y S0^T`` and ``U dS_L^T``
    scaled in place into the gradients of the decayed products ``dqk`` (``scale``, lower triangular) and ``dkk``
    (``-beta``), of ``gamma Q`` (``dqg``), minus that of ``gamma K`` (``dgk``) and of ``KD`` (``dkd``)."""
    dqk *= scale
    np.copyto(dqk, 0, where=_upper(dqk.shape[-1], 1))
    dkk = da
    dkk *= bc[..., None]
    dkk *= -1
    dqg *= gamma
    dqg *= scale
    dgk *= bc[..., None]
    dgk *= gamma
    dkd *= to_end
    return dqk, dkk, dqg, dgk, dkd


def _channel_gradients(decayed, qc, kc, dqk, da, dqg, dgk, dkd, gamma, to_end, bc, scale, entering):
    """Per-channel gates: ``(dq, dk, dg)`` from the GEMMs' products ``_scaled`` takes (overwritten); ``dg [..., L,
    K]`` is the log-decays' gradient, ``_from_end`` of the cumulative ones'. One compiled pass (``jit``'s
    ``gdn_channel_gradients``) where it applies: Numba there (not ``RLX_HOST_JIT=0``), f32 or f64, and every chunk's
    decays within ``CHANNEL_SPREAD`` of its midpoint (``decayed`` factored throughout)."""
    kernel = jit.kernel("gdn_channel_gradients")
    raw = (da, dqg, dgk, dkd, gamma, to_end, bc, scale)
    if kernel is not None and qc.dtype in _FLOATS and (decayed.unsafe is None or not len(decayed.unsafe)):
        return _compiled_gradients(kernel, decayed, qc, kc, dqk, *raw, entering)
    dqk, dkk, dqg, dgk, dkd = _scaled(dqk, *raw)
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
    return dq, dk, _from_end(dcum, -2)


def _compiled_gradients(kernel, decayed, qc, kc, dqk, da, dqg, dgk, dkd, gamma, to_end, bc, scale, entering):
    """``_channel_gradients`` by ``kernel`` over lanes ``[N, L, K]`` (``N`` chunks x batch rows x key heads x group
    members; ``qc``, ``kc`` one a key head). ``dq`` and ``dg`` are written over ``dqg`` and ``dkd`` (the GEMMs' own
    arrays, read by nothing after; the kernel reads each step of them before writing it): two arrays fewer to
    allocate and fault in."""
    shape, dtype = dqg.shape, dqg.dtype
    length, n = shape[-2:]
    lanes = [np.ascontiguousarray(x, dtype).reshape(-1, *x.shape[-2:])
             for x in (qc, kc, decayed.up, decayed.down, gamma, to_end, dqk, da, dqg, dgk, dkd)]
    dk = np.empty(shape, dtype)
    kernel(*lanes[:6], np.ascontiguousarray(bc, dtype).reshape(-1, length), *lanes[6:],
           np.ascontiguousarray(entering, dtype).reshape(-1, n), lanes[8], dk.reshape(-1, length, n), lanes[10],
           np.empty((3, length, n), dtype), np.empty((2, n), dtype), dtype.type(scale), shape[-3])
    return lanes[8].reshape(shape), dk, lanes[10].reshape(shape)


def _head_gradients(ratios, qc, kc, qk, kk, dqk, dkk, dqg, dgk, dkd, entering):
    """Per-head gates: ``_channel_gradients``'s, through the decay ``ratios`` of the products ``qk``, ``kk``;
    ``dcum [..., L]``."""
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
    return dq, dk, dcum


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
