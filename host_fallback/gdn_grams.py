"""``gated_delta_net``'s per-channel decayed products inside a chunk (``x_s · k_r`` scaled by
``exp(cum_s - cum_r)`` per key channel), shared by the chunked forward and backward, and the triangle masks."""
from __future__ import annotations

import numpy as np

from .chunked import scratch
from .gdn_step import _swap

#: Per-channel gates: block size below which decayed K.K^T entries are formed pair by pair.
LEAF = 2


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


#: Per-channel gates: the largest ``|cum - m|`` inside a chunk (``m`` the cumulative log-decay at
#: the chunk's midpoint) for which decayed products are one GEMM of ``x exp(cum - m)`` by
#: ``k exp(m - cum)``: both factors stay within ``exp(±CHANNEL_SPREAD)``, far from f32 overflow and
#: underflow. Chunks with a wider spread take ``_channel_grams``.
CHANNEL_SPREAD = 30.0


def _channel_grams_fast(q, k, kt, cum, cumt, bounded):
    """``_channel_grams`` by one GEMM per product wherever the chunk's decays allow.

    ``kt [..., N, L]`` is ``k`` transposed; ``cum [..., L, N]`` the cumulative log-decays and
    ``cumt`` the same transposed. Each ratio ``exp(cum_s - cum_r)`` factors through the chunk's
    midpoint ``m`` as ``exp(cum_s - m) * exp(m - cum_r)``, so ``QK = (q exp(cum - m)) (k
    exp(m - cum))^T`` masked to ``r <= s`` (``KK`` likewise, ``r < s``); chunks where some
    ``|cum - m|`` exceeds ``CHANNEL_SPREAD`` are redone by ``_channel_grams`` (``bounded``: the
    caller knows no chunk does). Masking selects, so an overflowed entry above the diagonal is
    dropped, never multiplied by zero.
    """
    *lead, length, n = q.shape
    mid = slice((length - 1) // 2, (length + 1) // 2)
    difft = np.subtract(cumt, cumt[..., mid], out=scratch("gdn.difft", cumt.shape, cumt.dtype))
    unsafe = None if bounded else np.max(np.abs(difft), axis=(-2, -1)) > CHANNEL_SPREAD
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        later = np.subtract(cum, cum[..., mid, :], out=scratch("gdn.later", cum.shape, cum.dtype))
        np.exp(later, out=later)
        np.negative(difft, out=difft)
        earlier = np.exp(difft, out=difft)
        earlier *= kt  # k_r exp(m - cum_r), [..., N, L]
        rows = np.multiply(q, later, out=scratch("gdn.rows", q.shape, q.dtype))
        qk = np.matmul(rows, earlier, out=scratch("gdn.qk", (*lead, length, length), q.dtype))
        np.multiply(k, later, out=rows)
        kk = np.matmul(rows, earlier, out=scratch("gdn.kk", (*lead, length, length), q.dtype))
    np.copyto(qk, 0, where=_upper(length, 1))
    np.copyto(kk, 0, where=_upper(length, 0))
    if unsafe is not None and unsafe.any():
        pick = np.nonzero(unsafe.reshape(-1))[0]
        sub = [t.reshape(-1, length, n)[pick] for t in (q, k, cum)]
        qk.reshape(-1, length, length)[pick], kk.reshape(-1, length, length)[pick] = _channel_grams(*sub)
    return qk, kk


_MASKS: dict[tuple[int, int], np.ndarray] = {}


def _upper(length: int, offset: int) -> np.ndarray:
    """``[L, L]``: True on and above diagonal ``offset``, the entries a lower triangle drops."""
    if (length, offset) not in _MASKS:
        _MASKS[length, offset] = np.triu(np.ones((length, length), bool), offset)
    return _MASKS[length, offset]
