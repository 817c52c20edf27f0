"""``gated_delta_net`` of ABI.md §4: the gated delta rule, with per-head or per-channel gates.

Two paths. The step path runs the recurrence, vectorized over batch and heads; it serves short
sequences (decode). The chunked path is the WY / UT-transform form: inside a chunk of ``L`` steps
the updates ``u`` solve a unit lower triangular system ``(I + A) u = beta*v - beta*gamma*k S0``
(``A`` the strictly lower ``beta K K^T`` scaled by decay ratios), so a chunk costs a handful of
GEMMs, and a sequential loop over chunks carries the state. ``path_for(thunk)`` names the path.

16-bit storage computes in f32 (the f16 path is what GPU runtimes without a native kernel fall
back to); ``state`` is read and the final state written back, rounded once, when ``carry_state``.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from .chunked import decay_ratios, from_chunks, pick_path, unit_lower_inverse, to_chunks
from .layout import Bound

Thunk = Mapping[str, Any]

#: Default chunk length of the chunked path (a power of two, at least ``LEAF``).
CHUNK = 32
#: Longest sequence that takes the step path, measured with ``benchmarks/ssm.py --crossover``.
STEP_MAX = 12
#: Per-channel gates: block size below which decayed K.K^T entries are formed pair by pair.
LEAF = 2


def _swap(x: np.ndarray) -> np.ndarray:
    return np.swapaxes(x, -1, -2)


def _step(q, k, v, g, beta, s, length):
    """The recurrence of ABI.md §4, step by step; ``s [B, H, N, N]`` is updated in place."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = np.empty_like(q)
    for t in range(q.shape[1]):
        decay = np.exp(g[:, t])
        s *= decay[..., :, None] if g.ndim == 4 else decay[..., None, None]
        kt = k[:, t, :, None, :]
        u = (v[:, t] - (kt @ s)[..., 0, :]) * beta[:, t, :, None]
        s += _swap(kt) * u[..., None, :]
        out[:, t] = scale * (q[:, t, :, None, :] @ s)[..., 0, :]
    return out


def _channel_grams(q, k, cum):
    """Per-channel decayed products ``M[s, r] = sum_i x_s[i] k_r[i] exp(cum_s[i] - cum_r[i])``.

    Returns ``(QK, KK)`` for ``x = q`` (``r <= s``) and ``x = k`` (``r < s``), zero elsewhere.
    A ratio over a long span is never formed as ``exp(cum_s) * exp(-cum_r)`` (which overflows):
    the block of rows ``s`` in the second half of a span against columns ``r`` in its first half
    factors through the half's edge ``e`` as ``exp(cum_s - cum_e) * exp(cum_e - cum_r)``, both
    later-minus-earlier, and is one GEMM; halving recurses down to ``LEAF``-step blocks, whose
    entries are formed pair by pair.
    """
    *lead, length, n = q.shape
    qk = np.zeros((*lead, length, length), q.dtype)
    kk = np.zeros_like(qk)
    half = length // 2
    while half >= LEAF:
        split = (*lead, length // (2 * half), 2, half, n)
        cq, ck, cc = q.reshape(split), k.reshape(split), cum.reshape(split)
        edge = cc[..., 0, half - 1 : half, :]
        later = np.exp(cc[..., 1, :, :] - edge)
        cols = _swap(ck[..., 0, :, :] * np.exp(edge - cc[..., 0, :, :]))
        bq, bk = (cq[..., 1, :, :] * later) @ cols, (ck[..., 1, :, :] * later) @ cols
        for blk in range(split[-4]):
            rows, span = slice((2 * blk + 1) * half, (2 * blk + 2) * half), slice(2 * blk * half, (2 * blk + 1) * half)
            qk[..., rows, span], kk[..., rows, span] = bq[..., blk, :, :], bk[..., blk, :, :]
        half //= 2
    leaf = min(LEAF, length)
    split = (*lead, length // leaf, leaf, n)
    lq, lk, lc = q.reshape(split), k.reshape(split), cum.reshape(split)
    base = np.arange(0, length, leaf)
    for s in range(leaf):
        for r in range(s + 1):
            kr = lk[..., r, :] * np.exp(lc[..., s, :] - lc[..., r, :]) if r < s else lk[..., r, :]
            qk[..., base + s, base + r] = np.einsum("...i,...i->...", lq[..., s, :], kr)
            if r < s:
                kk[..., base + s, base + r] = np.einsum("...i,...i->...", lk[..., s, :], kr)
    return qk, kk


def _chunked(q, k, v, g, beta, s, length):
    """The chunked WY form; ``s [B, H, N, N]`` is updated in place."""
    seq, n = q.shape[1], q.shape[-1]
    per_channel = g.ndim == 4
    q, k, v, g, beta = (to_chunks(t, length) for t in (q, k, v, g, beta))  # [C, B, H, L, ...]
    cum = np.cumsum(g, axis=3)  # log-decay from the chunk start, inclusive
    if per_channel:
        qk, kk = _channel_grams(q, k, cum)
        last = cum[..., -1:, :]
        gamma, to_end, through = np.exp(cum), np.exp(last - cum), np.exp(last[..., 0, :])[..., :, None]
    else:
        ratios = decay_ratios(cum)
        qk = (q @ _swap(k)) * ratios
        kk = np.tril((k @ _swap(k)) * ratios, -1)
        last = cum[..., -1:]
        gamma, to_end, through = np.exp(cum)[..., None], np.exp(last - cum)[..., None], np.exp(last)[..., None]
    # (I + A) u = beta v - beta gamma k S0 with A = beta kk: u = T beta v - (T beta gamma k) S0
    beta = beta[..., None]
    t = unit_lower_inverse(beta * kk)
    w, u = t @ (beta * gamma * k), t @ (beta * v)
    kd = _swap(to_end * k)
    starts = np.empty((*q.shape[:3], n, n), q.dtype)
    for c in range(q.shape[0]):
        starts[c] = s
        u[c] -= w[c] @ s
        s *= through[c]  # the chunk's total decay: per head, or per key row of S
        s += kd[c] @ u[c]
    scale = 1.0 / math.sqrt(n)
    out = (scale * gamma * q) @ starts
    out += (scale * qk) @ u
    return from_chunks(out, seq)


_PATHS = {"step": _step, "chunked": _chunked}


def _choose(thunk: Thunk, path: str | None, chunk: int | None) -> tuple[str, int]:
    length = chunk or CHUNK
    if length < LEAF or length & (length - 1):
        raise ValueError(f"gated_delta_net: chunk length must be a power of two >= {LEAF}, got {length}")
    return pick_path("gated_delta_net", path, thunk["seq"], STEP_MAX, "chunked"), length


def path_for(thunk: Thunk, path: str | None = None, chunk: int | None = None, **_: Any) -> str:
    """Name the path ``gated_delta_net`` runs ``thunk`` on: ``step`` or ``chunked L=32``."""
    name, length = _choose(thunk, path, chunk)
    return name if name == "step" else f"{name} L={length}"


def gated_delta_net(thunk: Thunk, arena: np.ndarray, path: str | None = None, chunk: int | None = None,
                    **_: Any) -> None:
    """Gated delta rule: ``S = exp(g) S``; ``u = beta (v - S^T k)``; ``S += k u^T``; ``out = S^T q / sqrt(N)``.

    ``path`` (``"step"`` or ``"chunked"``) and ``chunk`` (a power-of-two chunk length) override the
    choice. Any ``state_size`` is served (memory grows as ``N^2``).
    """
    bound = Bound(thunk, arena)
    name, length = _choose(thunk, path, chunk)
    q, k, v, g, beta = (bound.load(f) for f in ("q", "k", "v", "g", "beta"))
    b, _, h, n = q.shape
    s = bound.load("state") if thunk["carry_state"] else np.zeros((b, h, n, n), q.dtype)
    bound.store("dst", _PATHS[name](q, k, v, g, beta, s, length))
    if thunk["carry_state"]:
        bound.store("state", s)


KERNELS = {"gated_delta_net": gated_delta_net}
