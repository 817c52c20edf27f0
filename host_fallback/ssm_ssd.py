"""``mamba2``'s paths (``ssm`` chooses one): the step recurrence, and the chunked state-space-duality (SSD)
form, its scores one GEMM where the chunk's decays allow (``MAMBA2_SPREAD``) and formed ratio by ratio elsewhere,
packed sequences restarting the state inside a chunk."""
from __future__ import annotations

import numpy as np

from .chunked import (chunk_view, decay_ratios, floor_log_decays, from_chunks, redo_nonfinite, scratch, swap, to_chunks,
                      to_chunks_t)
from .sequences import Piece, step_spans

#: Largest ``|cum - m|`` (log-decay from a chunk's midpoint) for which the SSD scores factor into
#: one GEMM of ``c exp(cum - m)`` by ``b exp(m - cum)``, well inside f32 range either way.
MAMBA2_SPREAD = 30.0


def _ssd_steps(logd, xs, b, c, s, y):
    """The SSD recurrence from the state ``s [B, H, P, N]`` (updated in place): per step ``t`` (axis
    1 of ``logd [B, S, H]``, ``xs [B, S, H, P]`` = dt*x, ``b, c [B, S, H, N]``)
    ``s = exp(logd) s + xs (x) b`` and ``y[:, t] = s c``.

    The outer product goes through one reused scratch array (a fresh state-sized one per step
    page-faults: decode B32 H24 P64 N128 spent half its time there), and a per-head decay scales each
    contiguous ``[P, N]`` state as one row (a ``[B, H, 1, 1]`` broadcast runs an inner loop per row of P)."""
    p, n = s.shape[-2:]
    outer = scratch("m2.outer", s.shape, s.dtype)
    rows = s.reshape(-1, p * n) if s.flags.c_contiguous else None
    for t in range(logd.shape[1]):
        decay = np.exp(logd[:, t])
        if rows is not None:
            rows *= decay.reshape(-1, 1)
        else:
            s *= decay[..., None, None]
        s += np.multiply(xs[:, t, ..., None], b[:, t, ..., None, :], out=outer)
        y[:, t] = (s @ c[:, t, ..., None])[..., 0]


def _mamba2_step(x, dt, a, b, c, state, seqs, length):
    """The SSD recurrence step by step: ``x [B, S, H, P]``, ``dt [B, S, H]``, ``a [H]``, ``b, c [B, S, H,
    N]``, ``state [R, H, P, N]`` (updated in place to the rows' final states); returns ``y``."""
    y = np.empty_like(x)
    logd, xs = dt * a, dt[..., None] * x
    for row, lo, hi in step_spans(x.shape[1], seqs):
        s = state if row is None else state[row : row + 1].copy()
        span = slice(lo, hi)
        _ssd_steps(logd[:, span], xs[:, span], b[:, span], c[:, span], s, y[:, span])
        if row is not None:
            state[row] = s[0]
    return y


def _ssd_factored(xs, cum, b, c, scores, y, local, drop):
    """The SSD terms of each chunk with its decay ratios factored through its midpoint ``m``:
    ``exp(cum_l - cum_s) = exp(cum_l - m) exp(m - cum_s)``, so the decayed scores are one GEMM of
    ``c exp(cum - m)`` by ``b exp(m - cum)``, with the pairs ``drop`` selects (a later step, another
    sequence) set to zero. Writes the intra-chunk outputs ``y``, and ``local``, the state each chunk
    builds from zero decayed to its end, transposed (``[..., N, P]``); returns ``c exp(cum)``, with
    which ``c`` reads the state entering the chunk.

    ``b`` is chunked ``[..., L, N]`` and read transposed; every GEMM operand is laid out as the GEMM
    reads it (OpenBLAS runs transposed small GEMMs far slower)."""
    length, n = cum.shape[-1], b.shape[-1]
    mid = cum[..., (length - 1) // 2 : (length + 1) // 2]
    cs = np.multiply(c, np.exp(cum - mid)[..., None], out=scratch("m2.cs", c.shape, c.dtype))
    bt = scratch("m2.bt", (*cum.shape[:-1], n, length), b.dtype)
    np.multiply(swap(b), np.exp(mid - cum)[..., None, :], out=bt)
    np.matmul(cs, bt, out=scores)
    np.copyto(scores, 0, where=drop)
    np.matmul(scores, xs, out=y)
    np.matmul(bt, xs, out=local)
    local *= np.exp(cum[..., -1:] - mid)[..., None]
    cs *= np.exp(mid)[..., None]
    return cs


def _ssd_masked(xs, cum, cs, bt, scores, y, local, drop=None):
    """``_ssd_factored`` with every decay ratio formed on its own (``chunked.decay_ratios``), for
    chunks whose decays span too wide a range to factor; ``cs [..., L, N]`` (``c``, scaled in place
    and returned) and ``bt [..., N, L]`` (``b`` transposed) are contiguous. ``drop``, where given,
    also zeroes the pairs of steps of different sequences (selected after the product, so a ratio
    across a restart that overflowed leaves no NaN)."""
    np.matmul(cs, bt, out=scores)
    scores *= decay_ratios(cum)
    if drop is not None:
        np.copyto(scores, 0, where=drop)
    np.matmul(scores, xs, out=y)
    np.matmul(bt, xs * np.exp(cum[..., -1:] - cum)[..., None], out=local)
    cs *= np.exp(cum)[..., None]
    return cs


def _drop_pairs(length: int, count: int, inner: list[Piece]) -> np.ndarray:
    """The score pairs ``(l, s)`` of each chunk that no output reads: ``s`` after ``l``, and with varlen
    ``s`` in an earlier sequence than ``l`` (``inner``: the sequences that start inside a chunk).
    ``[L, L]``, or ``[C, 1, 1, L, L]`` per chunk when some sequence starts inside one."""
    if not inner:
        return _strict_upper(length)
    segment = np.zeros((count, length), np.int32)
    for q in inner:
        segment[q.chunk, q.lo :] += 1
    drop = segment[:, :, None] != segment[:, None, :]
    drop |= _strict_upper(length)
    return drop[:, None, None]


def _mamba2_chunked(x, dt, a, b, c, state, seqs, length, keep=None):
    """The chunked SSD form: ``_mamba2_step``'s arguments, ``state`` updated in place likewise (``ssd_chunked``
    on mamba2's decays ``dt·a`` and inputs ``dt·x``)."""
    xdt = np.multiply(x, dt[..., None], out=scratch("m2.xdt", x.shape, x.dtype))
    return ssd_chunked(floor_log_decays(dt * a), xdt, b, c, state, seqs, length, keep)


def ssd_chunked(logd, xdt, b, c, state, seqs, length, keep=None):
    """The chunked SSD form of ``s = exp(logd) s + xdt (x) b``, ``y = s c`` (``_ssd_steps``' recurrence; ``logd
    [B, S, H]`` floored by ``chunked.floor_log_decays``, ``xdt [B, S, H, P]``, ``b, c [B, S, H, N]``, ``state
    [R, H, P, N]`` updated in place); returns ``y [B, S, H, P]``. ``keep`` (no packed sequences, ``length`` 64):
    a saved forward's ``states`` (leaving every chunk) and ``scores`` (``abi.ssm.mamba2_reserve_slots``).

    With varlen (batch 1) a sequence may start inside a chunk: its log-decays are summed from its
    start (``cum`` restarts there), the scores between it and the earlier sequences are dropped, its
    first steps read its own starting state rather than the one entering the chunk, and the chunk
    hands on only what its last sequence built. So every chunk stays one set of GEMMs; the sequences
    cost a few small products each (their starts, their final states)."""
    # the big intermediates live in reused scratch arrays (see chunked.scratch)
    seq, p, n = xdt.shape[1], xdt.shape[-1], b.shape[-1]
    xs = chunk_view(xdt, length)  # [C, B, H, L, P]: the input each step adds, dt*x
    steps = to_chunks(logd, length)  # [C, B, H, L]
    cum = np.cumsum(steps, axis=-1)  # log-decay from the chunk start (or the sequence's), inclusive
    count, lead = steps.shape[0], steps.shape[:3]
    pieces = [] if seqs is None else seqs.pieces(length)
    inner = [q for q in pieces if q.first and q.lo > 0]
    for q in inner:  # in token order: a later start in the same chunk sums afresh from there
        np.cumsum(steps[q.chunk, ..., q.lo :], axis=-1, out=cum[q.chunk, ..., q.lo :])
    split = sorted({q.chunk for q in inner})
    drop = _drop_pairs(length, count, inner)
    # a saved forward's scores are computed where they are kept (ABI.md §9.1's [B, C, H, L, L])
    scores = scratch("m2.scores", (*lead, length, length), xdt.dtype) if keep is None else \
        np.moveaxis(keep["scores"], 1, 0)
    y = scratch("m2.y", (*lead, length, p), xdt.dtype)
    local = scratch("m2.local", (*lead, n, p), xdt.dtype)
    # a chunk factors where |cum - m| <= max|logd| (L/2 + 1) <= MAMBA2_SPREAD (NaN: it does not);
    # decided chunk by chunk, so one lane's values never change another lane's arithmetic. A chunk in
    # which a sequence restarts its sum is measured instead.
    factored = np.max(np.abs(steps), axis=-1) * (length // 2 + 1) <= MAMBA2_SPREAD
    if split:
        within = cum[split]
        factored[split] = np.max(np.abs(within - within[..., (length - 1) // 2 : (length + 1) // 2]), axis=-1) \
            <= MAMBA2_SPREAD
    cb, cc = chunk_view(b, length), chunk_view(c, length)
    if not factored.any():
        # c into a scratch copy: _ssd_masked scales it in place, and c may be the arena's own bytes
        cs = _ssd_masked(xs, cum, to_chunks(c, length, "m2.cs"), to_chunks_t(b, length), scores, y, local,
                         None if not inner else drop)
    else:
        with np.errstate(over="ignore", invalid="ignore"):  # the chunks that do not factor are redone
            cs = _ssd_factored(xs, cum, to_chunks(b, length), cc, scores, y, local, drop)
        if not factored.all():
            pick = np.nonzero(~factored)
            part = [np.empty_like(t[pick]) for t in (scores, y, local)]
            bt = np.ascontiguousarray(swap(cb[pick]))
            cs[pick] = _ssd_masked(xs[pick], cum[pick], cc[pick], bt, *part, None if not inner else drop[:, 0, 0][pick[0]])
            scores[pick], y[pick], local[pick] = part
    init = swap(state)  # [R, H, N, P]: each row's starting state, in the layout of the chunk states
    last = {q.chunk: q for q in inner}  # the last sequence starting inside each chunk
    for k, q in last.items():  # such a chunk hands on only what that sequence built, from its start
        span = slice(q.lo, None)
        ratio = np.exp(cum[k, ..., -1:] - cum[k, ..., span])
        np.matmul(swap(cb[k][..., span, :]) * ratio[..., None, :], xs[k][..., span, :], out=local[k])
    for q in inner:  # its first steps read its own starting state, not the chunk's
        rows = cs[q.chunk, ..., q.lo : q.hi, :]
        y[q.chunk, ..., q.lo : q.hi, :] += rows @ init[q.row]
        rows[...] = 0
    through = np.exp(cum[..., -1])[..., None, None]
    kept = None if keep is None else keep["states"]
    starts = _chunk_starts(init, local, through, seqs is not None, pieces, last, kept)  # [C, B, H, N, P]
    # state-to-output: the state entering the chunk, decayed to each step and read by c
    y += np.matmul(cs, starts, out=scores if length == p and keep is None else scratch("m2.read", y.shape, y.dtype))
    steps_of = lambda: [steps, xs, cb, cc]  # noqa: E731  (the per-step inputs as chunks, for the redos)
    if seqs is None:
        redo_nonfinite(y, starts, _ssd_steps_transposed, steps_of)
        _finals(state, starts, through[-1] * starts[-1] + local[-1], steps_of, keep)
    else:
        _varlen_finals(state, pieces, cum, starts, cb, xs, init, y, steps_of())
    return from_chunks(y, seq)


def _chunk_starts(init, local, through, packed, pieces, last, kept):
    """The state entering each chunk (``[C, B, H, N, P]``, a scratch array): ``init [R, H, N, P]``'s row where a
    sequence of ``pieces`` starts (the first chunk's unless ``packed``), else the one before's decayed by ``through``
    plus what it built, ``local`` (from the start of its ``last`` sequence where one starts inside it). ``kept``:
    a saved forward's ``states [B, C, H, P, N]``, into which the states leaving all chunks but the last are written
    as they are made, transposed while in cache (``_finals`` writes the last)."""
    count = len(local)
    starts = scratch("m2.starts", local.shape, local.dtype)
    begins = {q.chunk: q.row for q in pieces if q.first and q.lo == 0}  # chunks a sequence starts at
    if not packed:
        starts[0] = init
    for k in range(count):
        if k in begins:
            starts[k] = init[begins[k]]
        if k + 1 < count and k + 1 not in begins:
            np.multiply(through[k], starts[k] if k not in last else init[last[k].row], out=starts[k + 1])
            starts[k + 1] += local[k]
            if kept is not None:
                np.copyto(kept[:, k], swap(starts[k + 1]))
    return starts


def _finals(state, starts, final, inputs, keep):
    """The bulk ``final`` states (``[B, H, N, P]``, its non-finite lanes redone from ``starts[-1]``, the states
    entering the last chunk) into ``state``; with ``keep`` also into the last of its ``states [B, C, H, P, N]``
    (``ssd_chunked``'s loop over the chunks writes the others)."""
    _redo_nonfinite_state(final, starts[-1], [t[-1] for t in inputs()])
    np.copyto(state, swap(final))
    if keep is not None:
        np.copyto(keep["states"][:, -1], swap(final))


def _varlen_finals(state, pieces, cum, starts, cb, xs, init, y, inputs):
    """Write each sequence's final state into ``state`` (rows not named keep theirs: an empty sequence
    ends where it started), and redo with the recurrence every chunk whose outputs hold a non-finite
    value, sequence piece by sequence piece (which also gives the final states of the pieces that end
    there)."""
    finals = state.copy()
    for q in pieces:
        if not q.last:
            continue
        k, span, end = q.chunk, slice(q.lo, q.hi), q.hi - 1
        entering = starts[k] if q.lo == 0 else init[q.row]
        ratio = np.exp(cum[k, ..., end : end + 1] - cum[k, ..., span])
        built = np.matmul(swap(cb[k][..., span, :]) * ratio[..., None, :], xs[k][..., span, :])
        finals[q.row] = swap(np.exp(cum[k, ..., end])[..., None, None] * entering + built)[0]
    bad = ~np.isfinite(y).reshape(y.shape[0], -1).all(-1)
    for q in pieces:
        if not bad[q.chunk]:
            continue
        k, span = q.chunk, slice(q.lo, q.hi)
        s = np.ascontiguousarray(swap(starts[k])) if q.lo == 0 else state[q.row][None].copy()
        logd, xs_k, b_k, c_k = (np.moveaxis(t[k][:, :, span], 2, 1) for t in inputs)
        out = np.empty((1, q.hi - q.lo, *y.shape[2:3], y.shape[-1]), y.dtype)
        _ssd_steps(logd, xs_k, b_k, c_k, s, out)
        y[k][:, :, span] = np.moveaxis(out, 1, 2)
        if q.last:
            finals[q.row] = s[0]
    np.copyto(state, finals)


def _redo_nonfinite_state(final, entering, inputs):
    """Recompute with the recurrence, over the last chunk, each lane of the bulk ``final`` state
    (``[B, H, N, P]``) holding a non-finite value, from the state ``entering`` that chunk; so every
    NaN and signed Inf of a final state lands where the recurrence puts it. ``inputs`` are the
    last chunk's per-step inputs (``[B, H, L, ...]``)."""
    bad = ~np.isfinite(final).all(axis=(-2, -1))
    if not bad.any():
        return
    pick = np.nonzero(bad)
    s = np.ascontiguousarray(swap(entering[pick]))[:, None]  # [K, 1, P, N]
    logd, xs, b, c = (t[pick][:, :, None] for t in inputs)
    _ssd_steps(logd, xs, b, c, s, np.empty((len(s), logd.shape[1], 1, xs.shape[-1]), final.dtype))
    final[pick] = swap(s[:, 0])


def _ssd_steps_transposed(logd, xs, b, c, s, y):
    """``_ssd_steps`` from a state given transposed, ``[..., N, P]`` (the chunked path's layout)."""
    _ssd_steps(logd, xs, b, c, np.ascontiguousarray(swap(s)), y)


_UPPER: dict[int, np.ndarray] = {}


def _strict_upper(length: int) -> np.ndarray:
    if length not in _UPPER:
        _UPPER[length] = np.triu(np.ones((length, length), bool), 1)
    return _UPPER[length]
