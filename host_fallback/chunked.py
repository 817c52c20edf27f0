"""Pieces shared by the chunked state-space kernels (``ssm.mamba2``, ``gdn.gated_delta_net``).

The chunked forms split the sequence into chunks of ``length`` steps, do the work inside a chunk
as GEMMs over every (chunk, batch, head) at once, and carry the state across chunks with a short
sequential loop. Decay ratios are always built as ``exp(cum[i] - cum[j])`` with ``i >= j`` (a later
cumulative log-decay minus an earlier one), masked before the exp: such a ratio is the product of
the step decays between ``j`` and ``i``, so it is finite wherever the step recurrence is.

Non-finite values: a NaN or inf at step ``t`` of a lane must leave that lane's outputs before
``t`` as the step recurrence gives them, but the bulk forms are not causal for such values (a
triangular GEMM multiplies the later steps by exact zeros, and ``0 * inf`` is NaN). The bulk
output at step ``t`` itself is then non-finite, so ``redo_nonfinite`` reruns every chunk of a lane
whose output holds a non-finite value with the step recurrence, from the state entering it; and
``floor_log_decays`` keeps a ``-inf`` log-decay (a state reset) out of the cumulative sums.
"""
from __future__ import annotations

import threading
from typing import Callable

import numpy as np


#: Bytes of scratch arrays ``scratch`` keeps per thread between calls. A fresh multi-megabyte
#: array costs a page fault per 4 KiB on first touch (glibc hands big freed blocks back to the
#: OS), which is a large share of a chunked kernel's time at sequence lengths in the thousands.
SCRATCH_BYTES = 64 << 20

_POOL = threading.local()

#: Rows of the diagonal blocks that ``unit_lower_inverse`` inverts by substitution.
INVERSE_BLOCK = 16


def swap(x: np.ndarray) -> np.ndarray:
    """``x`` with its last two axes swapped (a view)."""
    return np.swapaxes(x, -1, -2)


def dot_last(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``Σ a*b`` over the last axis, without the product's temporary."""
    return np.einsum("...i,...i->...", a, b)


def sum_from_end(x: np.ndarray, axis: int) -> np.ndarray:
    """``x`` summed from the end of ``axis`` (a reverse cumulative sum: a log-decay's gradient from the cumulative
    log-decays')."""
    return np.flip(np.cumsum(np.flip(x, axis), axis), axis)


def scratch(key: str, shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialized array kept for reuse under ``key`` (per thread, least recently used
    evicted past ``SCRATCH_BYTES``; a fresh one if it alone is larger). The caller must not return
    it or hold it past a call."""
    pool = _POOL.__dict__.setdefault("arrays", {})
    arr = pool.pop(key, None)
    if arr is None or arr.shape != shape or arr.dtype != dtype:  # a tuple ``shape`` matches a kept array's only
        dtype, shape = np.dtype(dtype), tuple(shape)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        if nbytes > SCRATCH_BYTES:
            return np.empty(shape, dtype)
        while pool and sum(a.nbytes for a in pool.values()) + nbytes > SCRATCH_BYTES:
            del pool[next(iter(pool))]
        arr = np.empty(shape, dtype)
    pool[key] = arr  # (re)inserted last: the most recently used
    return arr


def to_chunks(x: np.ndarray, length: int, key: str | None = None) -> np.ndarray:
    """Reshape ``x [B, S, H, ...]`` into ``[C, B, H, length, ...]`` chunks, zero-padding ``S`` up.

    A padded step has zero inputs and zero log-decay, so it leaves every state unchanged. With
    ``key`` the chunks are written into that ``scratch`` array.
    """
    b, s, h, *rest = x.shape
    count = -(-s // length)
    if count * length != s:
        x = np.concatenate([x, np.zeros((b, count * length - s, h, *rest), x.dtype)], axis=1)
    x = chunk_major(x.reshape(b, count, length, h, *rest))
    if key is None:
        return np.ascontiguousarray(x)
    out = scratch(key, x.shape, x.dtype)
    np.copyto(out, x)
    return out


def chunk_major(x: np.ndarray) -> np.ndarray:
    """``x [B, C, L, H, ...]`` as ``[C, B, H, L, ...]``, a view: ``np.moveaxis(x, (1, 3), (0, 2))`` without its
    argument checks (a tenth of its time, which counts in the calls a chunked backward makes per segment)."""
    return x.transpose(1, 0, 3, 2, *range(4, x.ndim))


def chunk_view(x: np.ndarray, length: int) -> np.ndarray:
    """``to_chunks`` without the copy where ``S`` divides evenly: a strided ``[C, B, H, L, ...]``
    view (GEMMs and elementwise ops read it in place)."""
    b, s, h, *rest = x.shape
    if s % length:
        return to_chunks(x, length)
    return chunk_major(x.reshape(b, s // length, length, h, *rest))


def _padded(x: np.ndarray, length: int) -> np.ndarray:
    """``x [B, S, ...]`` zero-padded along ``S`` to a multiple of ``length``, as ``[B, C, length, ...]``."""
    b, s, *rest = x.shape
    count = -(-s // length)
    if count * length != s:
        x = np.concatenate([x, np.zeros((b, count * length - s, *rest), x.dtype)], axis=1)
    return x.reshape(b, count, length, *rest)


def chunk_cumsum(x: np.ndarray, length: int) -> np.ndarray:
    """``x [B, S, ...]`` zero-padded and cumulatively summed inside each chunk: ``[B, C, length, ...]``.

    One add per step over contiguous ``[B, C, ...]`` slabs, far cheaper than a cumsum along a
    short strided axis.
    """
    x = _padded(x, length).copy()
    for step in range(1, length):
        np.add(x[:, :, step - 1], x[:, :, step], out=x[:, :, step])
    return x


def to_chunks_t(x: np.ndarray, length: int) -> np.ndarray:
    """``x [B, S, H, N]`` as ``[C, B, H, N, length]`` chunks (``to_chunks`` with the last two axes
    swapped), contiguous: the layout a GEMM wants for an operand that is used transposed.

    Chunked first, then each ``[L, N]`` block transposed: a direct transposing copy reads with the
    whole ``H*N`` row as its stride and runs several times slower.
    """
    return np.ascontiguousarray(np.swapaxes(to_chunks(x, length), -1, -2))


def from_chunks(y: np.ndarray, seq: int) -> np.ndarray:
    """Inverse of ``to_chunks``: ``[C, B, H, L, ...]`` back to ``[B, seq, H, ...]``."""
    count, b, h, length, *rest = y.shape
    return np.moveaxis(y, (0, 2), (1, 3)).reshape(b, count * length, h, *rest)[:, :seq]


def floor_log_decays(logd: np.ndarray, low: float | None = None) -> np.ndarray:
    """``logd`` with every log-decay below ``log(smallest subnormal) - 1`` of its type raised to it.

    The step recurrence multiplies by ``exp`` of either, exactly 0, so nothing changes there; the
    chunked forms gain twice: a ``-inf`` (a state reset) becomes finite and so never meets another
    ``-inf`` in a cumulative difference (``-inf - -inf`` is NaN), and a huge finite one (``-1e6``)
    does not drown the digits of every later cumulative log-decay of its chunk. ``low`` is
    ``logd``'s minimum where the caller has it (no pass over ``logd`` then when nothing is below).
    NaN stays NaN.
    """
    floor = float(np.log(np.finfo(logd.dtype).smallest_subnormal.astype(np.float64))) - 1.0
    low = float(logd.min(initial=0.0)) if low is None else low
    return logd if low >= floor else np.maximum(logd, floor)


def decay_ratios(cum: np.ndarray) -> np.ndarray:
    """``[..., L] -> [..., L, L]``: ``exp(cum[i] - cum[j])`` where ``i >= j``, else 0."""
    length = cum.shape[-1]
    diff = cum[..., :, None] - cum[..., None, :]
    # -inf before the exp, not a mask after it: exp of an upper entry may overflow, and inf*0 is NaN
    diff += np.triu(np.full((length, length), -np.inf, cum.dtype), 1)
    return np.exp(diff, out=diff)


def unit_lower_inverse(a: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``(I + a)^-1`` for a strictly lower triangular ``a [..., L, L]``, into ``out`` where given (an array of
    ``a``'s shape, which may be a strided view) or a new array.

    Each ``INVERSE_BLOCK``-row diagonal block is inverted by row substitution, vectorized over
    every leading index and block; the blocks below the diagonal then follow block row by block
    row with GEMMs: ``T[I, :I] = -T[I, I] (A[I, :I] T[:I, :I])``.
    """
    length = a.shape[-1]
    block = min(INVERSE_BLOCK, length)
    if length % block:
        raise ValueError(f"unit_lower_inverse needs L a multiple of {block}, got L={length}")
    count = length // block
    lead = a.shape[:-2]
    idx = np.arange(count)
    # advanced indices split by a slice put the block index first; move it back beside its rows
    diag = np.moveaxis(a.reshape(*lead, count, block, count, block)[..., idx, :, idx, :], 0, -3)
    inv = np.zeros_like(diag)
    inv[..., 0, 0] = 1
    for i in range(1, block):
        # row i of (I + D)^-1 is e_i minus D[i, :i] times the rows above it
        inv[..., i : i + 1, :i] = -(diag[..., i : i + 1, :i] @ inv[..., :i, :i])
        inv[..., i, i] = 1
    if count == 1 and out is None:
        return inv[..., 0, :, :]
    full = np.zeros_like(a) if out is None else out
    if out is not None:
        full[...] = 0
    for blk in range(count):
        rows = slice(blk * block, (blk + 1) * block)
        full[..., rows, rows] = inv[..., blk, :, :]
        if blk:
            full[..., rows, : blk * block] = -(inv[..., blk, :, :] @ (a[..., rows, : blk * block] @ full[..., : blk * block, : blk * block]))
    return full


def redo_nonfinite(out: np.ndarray, starts: np.ndarray | Callable[[], np.ndarray], step: Callable[..., None],
                   inputs: Callable[[], list[np.ndarray]]) -> None:
    """Rerun with ``step`` each chunk of a lane whose output ``out [C, B, H, L, P]`` holds a
    non-finite value, from the state ``starts [C, B, H, ...]`` entering it (or a callable giving
    them, called only when a chunk is redone), into ``out``.

    ``inputs()`` gives the per-step inputs as ``[C, B, H, L, ...]`` chunks (called only when a
    chunk is redone); ``step(*inputs, state, result)`` gets those of ``K`` chunks as ``K`` batch
    items of one head (``[K, L, 1, ...]``), their entering states as ``[K, 1, ...]`` (a copy it may
    update) and writes ``result [K, L, 1, P]``.

    The bulk states are exact wherever the recurrence's are finite and non-finite where they are
    not (a NaN in one input channel spoils only the state entries it reaches), so a chunk entered
    with a partly non-finite state is redone too. One entered with no finite entry is left as it
    is: there, as in the recurrence, every output is non-finite. Costs one ``isfinite`` pass over
    ``out`` when every value is finite.
    """
    bad = ~np.isfinite(out).all(axis=(-2, -1))
    if not bad.any():
        return
    pick = np.nonzero(bad)
    entering = (starts() if callable(starts) else starts)[pick]
    usable = np.isfinite(entering).reshape(len(entering), -1).any(-1)
    pick, entering = tuple(i[usable] for i in pick), entering[usable]
    if not len(entering):
        return
    result = np.empty((len(entering), out.shape[-2], 1, out.shape[-1]), out.dtype)
    step(*(x[pick][:, :, None] for x in inputs()), entering[:, None], result)
    out[pick] = result[:, :, 0]


def pick_path(op: str, forced: str | None, seq: int, step_max: int, fast: str) -> str:
    """Choose ``"step"`` for sequences of at most ``step_max`` steps, else ``fast``; ``forced`` wins."""
    if forced is None:
        return "step" if seq <= step_max else fast
    if forced not in ("step", fast):
        raise ValueError(f"{op}: unknown path {forced!r}; expected 'step' or {fast!r}")
    return forced
