"""The query, key and log-decay gradients of ``gated_delta_net_backward``'s chunked path (``gdn_backward``'s docstring
gives the formulas) from its GEMMs' products, by NumPy or by ``jit_gdn_backward``'s compiled kernels (where Numba is
there, ``RLX_HOST_JIT`` is not ``0`` and the type is f32 or f64).

The products come as one array per lane, ``[O; Y] [S0^T | U^T]`` (``[..., 2L, K + L]``: the output gradient over the
chunk, then ``Y``, by the state entering it and ``U``, both transposed): one GEMM with contiguous operands where
four, each with a transposed operand, ran at half OpenBLAS's speed. ``blocks`` gives them: ``dqg = O S0^T``,
``dqk = O U^T`` (lower triangular), ``dgk = Y S0^T``, ``da = Y U^T`` (strictly lower: minus the gradient of ``A``).
"""
from __future__ import annotations

import numpy as np

from . import jit
from .chunked import dot_last, scratch, sum_from_end
from .gdn_grams import CHANNEL_SPREAD, _upper
from .gdn_step import _swap

Array = np.ndarray
#: The float types the compiled kernels (``jit_gdn_backward``) are built for.
_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def blocks(prods: Array, length: int) -> tuple[Array, Array, Array, Array]:
    """The four blocks of ``prods [..., 2L, K + L]`` as views: ``(dqg, dqk, dgk, da)``."""
    n = prods.shape[-1] - length
    top, bottom = prods[..., :length, :], prods[..., length:, :]
    return top[..., :n], top[..., n:], bottom[..., :n], bottom[..., n:]


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


def _scaled(prods, dkd, gamma, to_end, bc, scale):
    """The GEMMs' products (``products``' blocks of ``prods``, and ``dkd = U dS_L^T``) scaled in place into the
    gradients of the decayed products ``dqk`` (``scale``, lower triangular) and ``dkk`` (``-beta``), of ``gamma Q``
    (``dqg``), minus that of ``gamma K`` (``dgk``) and of ``KD`` (``dkd``): ``(dqk, dkk, dqg, dgk, dkd)``."""
    dqg, dqk, dgk, dkk = blocks(prods, dkd.shape[-2])
    dqk *= scale
    np.copyto(dqk, 0, where=_upper(dqk.shape[-1], 1))
    dkk *= bc[..., None]
    dkk *= -1
    dqg *= gamma
    dqg *= scale
    dgk *= bc[..., None]
    dgk *= gamma
    dkd *= to_end
    return dqk, dkk, dqg, dgk, dkd


def channel_gradients(decayed, qc, kc, kk, prods, dkd, gamma, to_end, bc, scale, starts_t, leave_t, through, gk, dbeta,
                      sums, places):
    """Per-channel gates: ``(dq, dk, dg, compiled)`` from the GEMMs' products ``prods`` and ``dkd`` (overwritten); ``dg
    [..., L, K]`` is the log-decays' gradient, ``sum_from_end`` of the cumulative ones', whose last step also takes the
    decayed entering state's term, ``through [..., K, 1]`` times ``S0 . dS_L`` per key channel (``starts_t [..., V, >=
    K]``, ``leave_t [..., V, K]``, both transposed); and ``dbeta_terms`` (``dbeta`` in place; ``gk = gamma K``, ``kk``
    the decayed ``K K^T``). One compiled pass (``jit``'s ``gdn_channel_gradients``, ``compiled`` True) where it applies:
    Numba there (not ``RLX_HOST_JIT=0``), f32 or f64, every chunk's decays within ``CHANNEL_SPREAD`` of its midpoint
    (``decayed`` factored throughout), and ``sums`` given (``head_gradients``' ``sums``); ``dq``, ``dk`` and ``dg`` then
    go where ``places``, three of ``gdn_backward_chunked``'s targets, say, and come back as their ``chunks``."""
    kernel = jit.kernel("gdn_channel_gradients")
    raw = (prods, dkd, gamma, to_end, bc, scale)
    entering = np.einsum("...vk,...vk->...k", starts_t[..., :kc.shape[-1]], leave_t) * through[..., 0]  # [..., K]
    if (kernel is not None and qc.dtype in _FLOATS and sums is not None
            and (decayed.unsafe is None or not len(decayed.unsafe))):
        return (*_compiled_channel(kernel, decayed, qc, kc, kk, *raw, entering, dbeta, sums, places), True)
    dbeta_terms(prods, gk, kk, dbeta)
    dqk, dkk, dqg, dgk, dkd = _scaled(*raw)
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
    return dq, dk, sum_from_end(dcum, -2), False


def _lanes(x: Array, dtype) -> Array:
    """``x [..., A, B]`` as contiguous lanes ``[N, A, B]`` of ``dtype`` (a copy only where it is not already)."""
    return np.ascontiguousarray(x, dtype).reshape(-1, *x.shape[-2:])


def _out(name: str, shape: tuple[int, ...], dtype) -> Array:
    """A compiled kernel's output array: ``chunked.scratch``'s, for ``_chunked`` copies the gradients out of it."""
    return scratch(f"gdnb.{name}", shape, dtype)


def _compiled_channel(kernel, decayed, qc, kc, kk, prods, dkd, gamma, to_end, bc, scale, entering, dbeta, sums, places):
    """``channel_gradients`` by ``kernel`` over lanes ``[N, L, K]`` (``N`` chunks x batch rows x key heads x group
    members; ``qc``, ``kc`` one a key head)."""
    shape, dtype = dkd.shape, dkd.dtype
    length, n = shape[-2:]
    lanes = [_lanes(x, dtype) for x in (qc, kc, decayed.up, decayed.down, gamma, to_end)]
    (rows, dq, _, _), (_, dk, _, _), (dg_rows, dg, _, _) = places
    kernel(*lanes, np.ascontiguousarray(bc, dtype).reshape(-1, length), _lanes(prods, dtype), _lanes(dkd, dtype),
           _lanes(kk, dtype), np.ascontiguousarray(entering, dtype).reshape(-1, n), dq, dk, rows, dg, dg_rows,
           dbeta.reshape(-1, length), sums[0].reshape(-1), np.empty((3, length, n), dtype), np.empty((4, n), dtype),
           dtype.type(scale), shape[-3])
    return places[0].chunks, places[1].chunks, places[2].chunks


def dbeta_terms(prods, gk, kk, dbeta):
    """Takes from ``dbeta`` (which holds ``Y.V``) beta's gradient through ``gamma K`` and ``A``: ``dgk.(gamma K)`` and
    ``sum_s da kk`` (``blocks``' ``dgk`` and ``da``, unscaled; ``da`` zeroed on and above its diagonal here)."""
    _, _, dgk, da = blocks(prods, kk.shape[-1])
    dbeta -= dot_last(dgk, gk)
    np.copyto(da, 0, where=_upper(da.shape[-1], 0))
    dbeta -= np.sum(da * kk, axis=-1)


def head_gradients(ratios, qc, kc, qk, kk, prods, dkd, gamma, to_end, bc, scale, starts_t, leave_t, through, dbeta,
                   sums, places):
    """Per-head gates: ``channel_gradients``'s, through the decay ``ratios`` of the products ``qk``, ``kk``; ``dg [...,
    L]``; and ``dbeta_terms`` (``dbeta`` in place). The entering state's term of the last step's ``dcum`` is ``through``
    times ``S0 . dS_L`` (``starts_t [..., V, >= K]``, ``leave_t [..., V, K]``, both transposed). One compiled pass
    (``jit``'s ``gdn_head_gradients``; ``compiled``, the fourth of what it returns, True) where it applies (Numba there,
    not ``RLX_HOST_JIT=0``, f32 or f64, and ``sums`` given: ``gdn_reverse_state``'s ``(check [...], dots [...])``,
    each lane's sum of its gradients so far, to which the others' are added, for ``_redo_nonfinite``, and ``S0 .
    dS_L``; ``dq`` and ``dk`` then go where ``places``, two of ``gdn_backward_chunked``'s targets, say, and come back
    as their ``chunks``)."""
    kernel = jit.kernel("gdn_head_gradients")
    if kernel is not None and qc.dtype in _FLOATS and sums is not None:
        return (*_compiled_head(kernel, ratios, qc, kc, qk, kk, prods, dkd, gamma, to_end, bc, scale, through, dbeta,
                                sums, places), True)
    dbeta_terms(prods, gamma * kc, kk, dbeta)
    n = kc.shape[-1]
    entering = np.einsum("...vk,...vk->...", starts_t[..., :n], leave_t) * through[..., 0, 0]
    dqk, dkk, dqg, dgk, dkd = _scaled(prods, dkd, gamma, to_end, bc, scale)
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
    dcum += dot_last(qc, dqg) - dot_last(kc, dgk + dkd)
    dcum[..., -1] += dot_last(kc, dkd).sum(axis=-1) + entering
    return dq, dk, sum_from_end(dcum, -1), False


def _compiled_head(kernel, ratios, qc, kc, qk, kk, prods, dkd, gamma, to_end, bc, scale, through, dbeta, sums, places):
    """``head_gradients`` by ``kernel`` over lanes (``_compiled_channel``'s): ``gamma``, ``to_end`` ``[..., L, 1]``."""
    shape, dtype = dkd.shape, dkd.dtype
    length = shape[-2]
    steps = [np.ascontiguousarray(x, dtype).reshape(-1, length) for x in (gamma, to_end, bc)]
    dg = _out("dg", shape[:-1], dtype)
    (rows, dq, _, _), (_, dk, _, _) = places
    kernel(_lanes(qc, dtype), _lanes(kc, dtype), *steps, *(_lanes(x, dtype) for x in (ratios, qk, kk, prods, dkd)),
           sums[1].reshape(-1), np.ascontiguousarray(through, dtype).reshape(-1), dq, dk, rows, dg.reshape(-1, length),
           dbeta.reshape(-1, length), sums[0].reshape(-1), dtype.type(scale), shape[-3])
    return places[0].chunks, places[1].chunks, dg
