"""State-space ops of ABI.md §4 and §8: ``selective_scan`` (Mamba-1) and ``mamba2`` (SSD).

Each op has a step path (the recurrence, vectorized over batch, channels/heads and state) for
short sequences, and a fast path for long ones: ``selective_scan`` precomputes the decays and
inputs of a block of steps in bulk and runs a two-operation loop over it; ``mamba2`` uses the
chunked state-space-duality form. Long sequences run blocks of batch items and channels (heads) on
several threads (``threads.run_split``). ``path_for(thunk)`` names the path a thunk gets.

Version 2's fields live in both paths: the ``delta``/``dt`` bias, softplus and limit are applied
to the loaded block as it is read, ``d`` and ``z`` to the block's output before it is stored; the
rows' starting states are gathered once per block and their final states scattered once
(``sequences.StatePool``); packed sequences (``cu_seqlens``) restart the state inside the step
loops and inside a chunk of the SSD form. 16-bit storage computes in f32, widened to
``state_dtype``/``param_dtype`` where they are wider (``compute_type``), and rounds once on store.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from . import compiled_step, threads
from .arena import COMPUTE
from .chunked import (chunk_view, decay_ratios, floor_log_decays, from_chunks, pick_path, redo_nonfinite, scratch,
                      to_chunks, to_chunks_t)
from .fields import complete
from .implementations import KERNELS, PATHS, PREPARE
from .layout import Bound, Region, regions
from .sequences import Piece, Sequences, StatePool

Thunk = Mapping[str, Any]

#: Steps per block of the blocked selective scan (its working set is two ``[T, B, H, N]`` arrays).
SCAN_BLOCK = 32
#: Longest sequence that takes the step path, measured with ``benchmarks/ssm.py --crossover``.
SCAN_STEP_MAX = 16
#: Default chunk length of the SSD form of mamba2.
MAMBA2_CHUNK = 64
#: Largest ``|cum - m|`` (log-decay from a chunk's midpoint) for which the SSD scores factor into
#: one GEMM of ``c exp(cum - m)`` by ``b exp(m - cum)``, well inside f32 range either way.
MAMBA2_SPREAD = 30.0
#: Longest sequence that takes the mamba2 step path.
MAMBA2_STEP_MAX = 10
#: The padding a packed selective_scan may add to run its sequences in lanes side by side (a fraction of
#: its tokens): each lane step costs about its share of the work, so lanes pay only where they pad little.
LANE_PADDING = 0.1
#: Channels x state size of a block below which packed sequences run in lanes (see ``_scan_blocked``).
LANE_STATE = 4096
#: ABI.md §8's softplus is the identity above this input.
SOFTPLUS_LINEAR = 20.0


def _swap(x: np.ndarray) -> np.ndarray:
    return np.swapaxes(x, -1, -2)


def _runs(seq: int, seqs: Sequences | None) -> list[tuple[int | None, int, int]]:
    """``(row, lo, hi)``: the token spans a step path walks. Without varlen one span, every batch row at
    once (``row`` None: the state rows are the batch rows); with it one per non-empty sequence."""
    return [(None, 0, seq)] if seqs is None else list(seqs.runs())


def _scan_step(x, delta, a, b, c, state, seqs, block):
    """The recurrence step by step: ``x, delta [B, S, H]``, ``a [H, N]``, ``b, c [B, S, G, N]``, ``state
    [R, H, N]`` (the rows' starting states, updated in place to their final ones); returns ``y``."""
    bsz, seq, hidden = x.shape
    groups, n = b.shape[2], a.shape[-1]
    lanes = (bsz, groups, hidden // groups, 1)
    a = a.reshape(groups, -1, n)  # [G, H/G, N]: channel ch reads group ch // (H/G)
    rows = state.reshape(state.shape[0], groups, -1, n)
    y = np.empty_like(x)
    term = scratch("ss.term", (bsz, *rows.shape[1:]), x.dtype)  # reused: a fresh state-sized array page-faults
    for row, lo, hi in _runs(seq, seqs):
        h = rows if row is None else rows[row : row + 1].copy()
        for t in range(lo, hi):
            d = delta[:, t].reshape(lanes)
            h *= np.exp(np.multiply(d, a, out=term), out=term)
            h += np.multiply(d * x[:, t].reshape(lanes), b[:, t, :, None, :], out=term)
            y[:, t] = (h @ c[:, t, :, :, None]).reshape(bsz, hidden)
        if row is not None:
            rows[row] = h[0]
    if not np.shares_memory(rows, state):  # the reshape copied a strided block: hand the states back
        np.copyto(state, rows.reshape(state.shape))
    return y


def _scan_blocked(x, delta, a, b, c, state, seqs, block):
    """``_scan_step`` with the decays and inputs of ``block`` steps formed in bulk, then a two-operation
    loop per step over every lane at once. Packed sequences are dealt into lanes run side by side
    (``Sequences.lanes``), each lane restarting at its sequences' starts, so a packed batch takes about
    as many steps as a batch of equal rows of as many tokens (one long row would take them all)."""
    if seqs is None:
        return _scan_lanes(x, delta, a, b, c, state, block, {}, {})
    # lanes pay for their padding and copies only where a step's arrays are small enough for the per-step
    # overhead to matter (a thread's block of channels: 2x1024 tokens H256 N16, packed / equal batch, one
    # thread 1.01 without lanes and 1.16 with; two threads, 128 channels each, 1.31 and 1.07)
    small = x.shape[2] * a.shape[-1] < LANE_STATE
    lanes = seqs.lanes(LANE_PADDING) if small else [list(seqs.runs())]
    width = max(sum(hi - lo for _, lo, hi in lane) for lane in lanes)
    starts: dict[int, list[tuple[int, int]]] = {}
    ends: dict[int, list[tuple[int, int]]] = {}
    spans = []  # (lane, lane step, token lo, token hi): where each sequence's tokens go
    for k, lane in enumerate(lanes):
        step = 0
        for row, lo, hi in lane:
            spans.append((k, step, lo, hi))
            starts.setdefault(step, []).append((k, row))
            step += hi - lo
            ends.setdefault(step - 1, []).append((k, row))
    if len(lanes) == 1:  # the row itself, its tokens in order
        return _scan_lanes(x, delta, a, b, c, state, block, starts, ends)

    def pack(t: np.ndarray) -> np.ndarray:  # [1, S, ...] -> [lanes, width, ...], zero past a lane's end
        out = np.zeros((len(lanes), width, *t.shape[2:]), t.dtype)
        for k, step, lo, hi in spans:
            out[k, step : step + hi - lo] = t[0, lo:hi]
        return out

    y = _scan_lanes(pack(x), pack(delta), a, pack(b), pack(c), state, block, starts, ends)
    out = np.empty_like(x)
    for k, step, lo, hi in spans:
        out[0, lo:hi] = y[k, step : step + hi - lo]
    return out


def _scan_lanes(x, delta, a, b, c, state, block, starts, ends):
    """The blocked scan of ``_scan_blocked`` over lanes ``x [K, S, H]``. Without ``starts`` the lanes are
    the state rows (``state [K, H, N]`` in and out); else ``starts``/``ends`` map a step to the
    ``(lane, state row)`` pairs whose sequence starts (from that row's state) or ends (into it) there.

    The states are group- and state-major, ``[K, G, N, H/G]``, so every broadcast runs along the
    contiguous channels of a group (with H innermost a multiply broadcasts over only N values per
    inner loop)."""
    count, seq, hidden = x.shape
    groups, n = b.shape[2], a.shape[-1]
    width = hidden // groups
    at = np.ascontiguousarray(_swap(a.reshape(groups, width, n)))  # [G, N, H/G]
    dt = np.ascontiguousarray(np.moveaxis(delta, 1, 0)).reshape(seq, count, groups, 1, width)
    dx = dt * np.moveaxis(x, 1, 0).reshape(seq, count, groups, 1, width)  # delta * x
    bt = np.moveaxis(b, 1, 0)[..., None]  # [S, K, G, N, 1]
    ct = np.moveaxis(c, 1, 0)[:, :, :, None, :]  # [S, K, G, 1, N]
    rows = np.ascontiguousarray(_swap(state.reshape(state.shape[0], groups, width, n)))  # [R, G, N, H/G]
    prev = rows if not starts else np.zeros((count, groups, n, width), x.dtype)
    y = np.empty((seq, count, groups, 1, width), x.dtype)
    for t0 in range(0, seq, block):
        steps = slice(t0, min(seq, t0 + block))
        decay = np.multiply(dt[steps], at)
        np.exp(decay, out=decay)
        states = dx[steps] * bt[steps]  # [T, K, G, N, H/G]
        for i in range(decay.shape[0]):
            if starts and t0 + i in starts:  # sequences start here, each from its own row's state
                prev = prev.copy()  # the last step's states stay as they are for its outputs
                for lane, row in starts[t0 + i]:
                    prev[lane] = rows[row]
            np.multiply(decay[i], prev, out=decay[i])
            np.add(states[i], decay[i], out=states[i])
            prev = states[i]
            if ends and t0 + i in ends:
                for lane, row in ends[t0 + i]:
                    rows[row] = prev[lane]
        y[steps] = ct[steps] @ states
    np.copyto(state, _swap(rows if starts else prev).reshape(state.shape))
    return np.moveaxis(y.reshape(seq, count, hidden), 0, 1)


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
    for row, lo, hi in _runs(x.shape[1], seqs):
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
    np.multiply(_swap(b), np.exp(mid - cum)[..., None, :], out=bt)
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


def _mamba2_chunked(x, dt, a, b, c, state, seqs, length):
    """The chunked SSD form: ``_mamba2_step``'s arguments, ``state`` updated in place likewise.

    With varlen (batch 1) a sequence may start inside a chunk: its log-decays are summed from its
    start (``cum`` restarts there), the scores between it and the earlier sequences are dropped, its
    first steps read its own starting state rather than the one entering the chunk, and the chunk
    hands on only what its last sequence built. So every chunk stays one set of GEMMs; the sequences
    cost a few small products each (their starts, their final states)."""
    # the big intermediates live in reused scratch arrays (see chunked.scratch)
    seq, p, n = x.shape[1], x.shape[-1], b.shape[-1]
    logd = floor_log_decays(dt * a)
    xdt = np.multiply(x, dt[..., None], out=scratch("m2.xdt", x.shape, x.dtype))
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
    scores = scratch("m2.scores", (*lead, length, length), x.dtype)
    y = scratch("m2.y", (*lead, length, p), x.dtype)
    local = scratch("m2.local", (*lead, n, p), x.dtype)
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
            bt = np.ascontiguousarray(_swap(cb[pick]))
            cs[pick] = _ssd_masked(xs[pick], cum[pick], cc[pick], bt, *part, None if not inner else drop[:, 0, 0][pick[0]])
            y[pick], local[pick] = part[1], part[2]
    init = _swap(state)  # [R, H, N, P]: each row's starting state, in the layout of the chunk states
    last = {q.chunk: q for q in inner}  # the last sequence starting inside each chunk
    for k, q in last.items():  # such a chunk hands on only what that sequence built, from its start
        span = slice(q.lo, None)
        ratio = np.exp(cum[k, ..., -1:] - cum[k, ..., span])
        np.matmul(_swap(cb[k][..., span, :]) * ratio[..., None, :], xs[k][..., span, :], out=local[k])
    for q in inner:  # its first steps read its own starting state, not the chunk's
        rows = cs[q.chunk, ..., q.lo : q.hi, :]
        y[q.chunk, ..., q.lo : q.hi, :] += rows @ init[q.row]
        rows[...] = 0
    through = np.exp(cum[..., -1])[..., None, None]
    starts = scratch("m2.starts", local.shape, x.dtype)  # the state entering each chunk, [N, P]
    begins = {q.chunk: q.row for q in pieces if q.first and q.lo == 0}  # chunks a sequence starts at
    if seqs is None:
        starts[0] = init
    for k in range(count):
        if k in begins:
            starts[k] = init[begins[k]]
        if k + 1 < count and k + 1 not in begins:
            np.multiply(through[k], starts[k] if k not in last else init[last[k].row], out=starts[k + 1])
            starts[k + 1] += local[k]
    # state-to-output: the state entering the chunk, decayed to each step and read by c
    y += np.matmul(cs, starts, out=scores if length == p else None)
    steps_of = lambda: [steps, xs, cb, cc]  # noqa: E731  (the per-step inputs as chunks, for the redos)
    if seqs is None:
        redo_nonfinite(y, starts, _ssd_steps_transposed, steps_of)
        final = through[-1] * starts[-1] + local[-1]
        _redo_nonfinite_state(final, starts[-1], [t[-1] for t in steps_of()])
        np.copyto(state, _swap(final))
    else:
        _varlen_finals(state, pieces, cum, starts, cb, xs, init, y, steps_of())
    return from_chunks(y, seq)


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
        built = np.matmul(_swap(cb[k][..., span, :]) * ratio[..., None, :], xs[k][..., span, :])
        finals[q.row] = _swap(np.exp(cum[k, ..., end])[..., None, None] * entering + built)[0]
    bad = ~np.isfinite(y).reshape(y.shape[0], -1).all(-1)
    for q in pieces:
        if not bad[q.chunk]:
            continue
        k, span = q.chunk, slice(q.lo, q.hi)
        s = np.ascontiguousarray(_swap(starts[k])) if q.lo == 0 else state[q.row][None].copy()
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
    s = np.ascontiguousarray(_swap(entering[pick]))[:, None]  # [K, 1, P, N]
    logd, xs, b, c = (t[pick][:, :, None] for t in inputs)
    _ssd_steps(logd, xs, b, c, s, np.empty((len(s), logd.shape[1], 1, xs.shape[-1]), final.dtype))
    final[pick] = _swap(s[:, 0])


def _ssd_steps_transposed(logd, xs, b, c, s, y):
    """``_ssd_steps`` from a state given transposed, ``[..., N, P]`` (the chunked path's layout)."""
    _ssd_steps(logd, xs, b, c, np.ascontiguousarray(_swap(s)), y)


_UPPER: dict[int, np.ndarray] = {}


def _strict_upper(length: int) -> np.ndarray:
    if length not in _UPPER:
        _UPPER[length] = np.triu(np.ones((length, length), bool), 1)
    return _UPPER[length]


_SCAN_PATHS: dict[str, Callable[..., np.ndarray]] = {"step": _scan_step, "blocked": _scan_blocked}
_MAMBA2_PATHS: dict[str, Callable[..., np.ndarray]] = {"step": _mamba2_step, "chunked": _mamba2_chunked}


def _choose(thunk: Thunk, path: str | None, chunk: int | None) -> tuple[str, int]:
    if thunk["op"] == "selective_scan":
        return pick_path("selective_scan", path, thunk["seq"], SCAN_STEP_MAX, "blocked"), chunk or SCAN_BLOCK
    return pick_path("mamba2", path, thunk["seq"], MAMBA2_STEP_MAX, "chunked"), chunk or MAMBA2_CHUNK


#: Weight of one selective_scan state element against a multiply-add in ``threads.SPLIT_MIN_WORK``:
#: each costs an exp and passes over strided bulk arrays (B=2 H=256 N=16, one thread / two: seq 128
#: 2.3 / 2.7 ms, seq 256 4.2 / 3.8 ms).
SCAN_ELEMENT_WORK = 8


def _units(t: Thunk) -> tuple[int, int]:
    """``(units, width)``: the independent blocks a thunk splits into across threads and the channels
    (heads) in each. selective_scan with ``groups`` splits by group, so that a block's channels share
    whole groups of ``b`` and ``c``."""
    if t["op"] == "selective_scan":
        groups = t.get("groups", 1)  # path_for may be asked about a thunk not completed
        return (t["hidden"], 1) if groups == 1 else (groups, t["hidden"] // groups)
    return t["heads"], 1


def _parts(t: Thunk, name: str, workers: int | None) -> int:
    # the step paths stay on one thread unless forced: their per-step arrays are too small to split
    # (B=2 S=1024: selective_scan 27 ms on one thread, 38 on two; mamba2 66 ms, 84)
    b, n = t["batch"], t["state_size"]
    per_channel = n * SCAN_ELEMENT_WORK if t["op"] == "selective_scan" else t["head_dim"] * n
    units, width = _units(t)
    work = 0 if name == "step" else b * t["seq"] * units * width * per_channel
    return threads.parts_for(t["op"], work, b, units, workers)


def path_for(thunk: Thunk, *, path: str | None = None, chunk: int | None = None, workers: int | None = None) -> str:
    """Name the path ``selective_scan``/``mamba2`` runs ``thunk`` on: ``step``, ``blocked T=64``,
    ``chunked L=64``, with ``, N threads`` when split across cores."""
    name, length = _choose(thunk, path, chunk)
    parts = _parts(thunk, name, workers)
    label = name if name == "step" else f"{name} {'T' if name == 'blocked' else 'L'}={length}"
    return label + (f", {parts} threads" if parts > 1 else "")


def compute_type(t: Thunk) -> np.dtype:
    """The type a thunk computes in: its dtype's, widened to its state's and parameters' (ABI.md §8:
    the recurrence is carried at ``state_dtype``'s precision or wider)."""
    return np.result_type(*(COMPUTE[t[f]] for f in ("dtype", "state_dtype", "param_dtype")))


def softplus(u: np.ndarray) -> np.ndarray:
    """ABI.md §8's softplus: ``u`` where ``u > 20``, else ``log1p(exp(u))``."""
    # log1p(e) as log(w) * e / (w - 1), w = 1 + e, exact to a few ulps (Goldberg's rewrite): NumPy's
    # f32 log1p has no vector loop and costs 15x an exp (2x1024x256: 23 ms against 1.5)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        e = np.exp(u)
        w = e + 1
        soft = np.log(w)
        w -= 1
        soft *= np.divide(e, w, out=w)
    np.copyto(soft, e, where=e + 1 == 1)  # e below half an ulp of 1: log1p(e) is e
    np.copyto(soft, u, where=u > SOFTPLUS_LINEAR)
    return soft


def _gate(y: np.ndarray, x: np.ndarray, d: np.ndarray | None, z: np.ndarray | None) -> None:
    """ABI.md §8's skip and gate, in place: ``y += d * x``, then ``y *= silu(z) = z / (1 + exp(-z))``.

    The terms go through one reused scratch array: a fresh one per call would page-fault on first touch."""
    if d is None and z is None:
        return
    term = scratch("ssm.gate", y.shape, y.dtype)
    if d is not None:
        y += np.multiply(x, d, out=term)
    if z is not None:
        with np.errstate(over="ignore"):
            np.exp(np.negative(z, out=term), out=term)
        term += 1
        y *= np.divide(z, term, out=term)


def _read(bound: Bound, field: str, index: Any, dtype: np.dtype) -> np.ndarray:
    """A block of ``field`` in ``dtype``: a view of the arena where it is stored so (the kernels only read
    their inputs), else a converted copy."""
    block = bound.view(field)[index]
    return block if block.dtype == dtype else block.astype(dtype)


def _inputs(t: Thunk, bound: Bound, rows: tuple, hs: slice, ctype: np.dtype, step: str) -> tuple[np.ndarray, np.ndarray]:
    """A block's ``x`` and step sizes (``step``: ``delta`` or ``dt``), the step sizes plus ``{step}_bias``
    and softplus-ed with ``{step}_softplus`` where the thunk asks."""
    x, steps = (_read(bound, f, rows, ctype) for f in ("x", step))
    if t[f"{step}_bias"] is not None:
        steps = steps + _read(bound, f"{step}_bias", hs, ctype)
    if t[f"{step}_softplus"]:
        steps = softplus(steps)
    return x, steps


def _run(t: Thunk, arena: np.ndarray, name: str, state_shape: tuple[int, ...],
         compute: Callable[[Bound, slice, slice, StatePool], np.ndarray], workers: int | None,
         by_field: Mapping[str, Region] | None) -> None:
    """Run ``compute(bound, batch_rows, channels, pool) -> y`` over blocks of batch rows x channels
    (heads) on threads (``threads.run_split``); each block's starting states come from ``pool`` and
    its ``y`` and final states are stored after every block has computed."""
    bound = Bound(t, arena, by_field)
    pool = StatePool(t, bound, compute_type(t), state_shape)
    units, width = _units(t)
    channels = lambda us: slice(us.start * width, us.stop * width)  # noqa: E731
    states: dict[tuple[int, int], np.ndarray] = {}

    def block(bs: slice, us: slice) -> np.ndarray:
        hs = channels(us)
        state = states[bs.start, us.start] = pool.initial(bs, hs)
        return compute(bound, bs, hs, state)

    def store(bs: slice, us: slice, y: np.ndarray) -> None:
        hs = channels(us)
        target = bound.view("dst")[bs, :, hs]
        if y.dtype == target.dtype:  # one copy, where a store's reshape and astype would copy twice more
            np.copyto(target, y)
        else:
            bound.store("dst", y, (bs, slice(None), hs))
        pool.store(bs, hs, states[bs.start, us.start])

    threads.run_split(block, store, t["batch"], units, _parts(t, name, workers))


def selective_scan(thunk: Thunk, arena: np.ndarray, *, path: str | None = None, chunk: int | None = None,
                   workers: int | None = None) -> None:
    """Mamba-1 (ABI.md §4, §8): per channel, ``delta`` biased and softplus-ed where asked,
    ``h = exp(delta*a)*h + delta*b*x`` and ``y = c . h`` from the row's starting state, then
    ``y = (y + d*x) * silu(z)``.

    ``path`` (``"step"`` or ``"blocked"``), ``chunk`` (steps per block) and ``workers`` (threads
    over the batch x channel recurrences) override the choice.
    """
    prepare(thunk)(arena, path=path, chunk=chunk, workers=workers)


def _selective_scan(t: Thunk, arena: np.ndarray, path: str | None, chunk: int | None, workers: int | None,
                    by_field: Mapping[str, Region] | None) -> None:
    name, length = _choose(t, path, chunk)
    ctype, grouped, n = compute_type(t), t["groups"] > 1, t["state_size"]

    def compute(bound: Bound, bs: slice, hs: slice, state: np.ndarray) -> np.ndarray:
        rows = (bs, slice(None), hs)
        x, delta = _inputs(t, bound, rows, hs, ctype, "delta")
        width = t["hidden"] // t["groups"]
        gs = (bs, slice(None), slice(hs.start // width, hs.stop // width)) if grouped else bs
        b, c = (_read(bound, f, gs, ctype).reshape(*x.shape[:2], -1, n) for f in "bc")
        y = _SCAN_PATHS[name](x, delta, _read(bound, "a", hs, ctype), b, c, state, Sequences.of(t, bound), length)
        _gate(y, x, None if t["d"] is None else _read(bound, "d", hs, ctype),
              None if t["z"] is None else _read(bound, "z", rows, ctype))
        return y

    _run(t, arena, name, (n,), compute, workers, by_field)


def mamba2(thunk: Thunk, arena: np.ndarray, *, path: str | None = None, chunk: int | None = None,
           workers: int | None = None) -> None:
    """Mamba-2 (SSD, ABI.md §4, §8): per head, ``dt`` biased, softplus-ed and clamped to ``dt_limit``
    where asked, ``S = exp(dt*a)*S + (dt*x) (x) b`` and ``y = S c`` from the row's starting state, then
    ``y = (y + d*x) * silu(z)``.

    ``path`` (``"step"`` or ``"chunked"``), ``chunk`` (chunk length) and ``workers`` (threads over
    the batch x heads recurrences) override the choice.
    """
    prepare(thunk)(arena, path=path, chunk=chunk, workers=workers)


def _mamba2(t: Thunk, arena: np.ndarray, path: str | None, chunk: int | None, workers: int | None,
            by_field: Mapping[str, Region] | None) -> None:
    name, length = _choose(t, path, chunk)
    ctype, heads, groups = compute_type(t), t["heads"], t["groups"]
    group_of = np.arange(heads) // (heads // groups)

    def compute(bound: Bound, bs: slice, hs: slice, state: np.ndarray) -> np.ndarray:
        rows = (bs, slice(None), hs)
        x, dt = _inputs(t, bound, rows, hs, ctype, "dt")
        if t["dt_limit"] is not None:
            low, high = t["dt_limit"]
            dt = np.maximum(dt, low)
            if high is not None:
                np.minimum(dt, high, out=dt)
        gs = rows if groups == heads else (bs, slice(None), group_of[hs])
        b, c = (_read(bound, f, gs, ctype) for f in "bc")
        y = _MAMBA2_PATHS[name](x, dt, _read(bound, "a", hs, ctype), b, c, state, Sequences.of(t, bound), length)
        _gate(y, x, None if t["d"] is None else _read(bound, "d", hs, ctype)[:, None],
              None if t["z"] is None else _read(bound, "z", rows, ctype))
        return y

    _run(t, arena, name, (t["head_dim"], t["state_size"]), compute, workers, by_field)


def _scan_arguments(t: Thunk) -> compiled_step.Arguments:
    """``jit_kernels.selective_scan_step``'s arguments from a thunk's arena views."""
    def arguments(bound: Bound) -> tuple:
        b, c = bound.view("b"), bound.view("c")
        if t["groups"] == 1:  # [B, S, N]: one group
            b, c = (v.reshape(*v.shape[:2], 1, -1) for v in (b, c))
        optional = [compiled_step.view(bound, f, rank, t[f] is not None) for f, rank in
                    (("delta_bias", 1), ("d", 1), ("z", 3))]
        return (bound.view("x"), bound.view("delta"), bound.view("a"), b, c, *optional,
                compiled_step.view(bound, "state", 3, t["carry_state"]), bound.view("dst"),
                *compiled_step.rows(t, bound), t["cu_seqlens"] is not None, bool(t["delta_softplus"]))
    return arguments


def _mamba2_arguments(t: Thunk) -> compiled_step.Arguments:
    """``jit_kernels.mamba2_step``'s arguments from a thunk's arena views."""
    low, high = t["dt_limit"] if t["dt_limit"] is not None else (-np.inf, np.inf)
    limit = (np.float32(low), np.float32(np.inf if high is None else high))

    def arguments(bound: Bound) -> tuple:
        optional = [compiled_step.view(bound, f, rank, t[f] is not None) for f, rank in
                    (("dt_bias", 1), ("d", 1), ("z", 4))]
        return (*(bound.view(f) for f in ("x", "dt", "a", "b", "c")), *optional,
                compiled_step.view(bound, "state", 4, t["carry_state"]), bound.view("dst"),
                *compiled_step.rows(t, bound), t["cu_seqlens"] is not None, bool(t["dt_softplus"]), *limit)
    return arguments


#: op -> its NumPy body, and its compiled step's kernel and arguments.
_BODIES = {"selective_scan": _selective_scan, "mamba2": _mamba2}
_STEPS = {"selective_scan": ("selective_scan_step", _scan_arguments), "mamba2": ("mamba2_step", _mamba2_arguments)}


def prepare(thunk: Thunk) -> Callable[..., None]:
    """The thunk-only setup of ``selective_scan``/``mamba2``, once (``host_fallback.PREPARE``): the thunk
    completed and its regions laid out, which cost about as much as a decode step's arithmetic
    (B1 H1536 N16: ~60 of ~230 µs), and its compiled step bound (``compiled_step``), which runs the step
    path on one thread where it applies. Returns ``run(arena, *, path, chunk, workers)``."""
    t = complete(thunk)
    by_field = {r.field: r for r in regions(t)}
    body = _BODIES[t["op"]]
    kernel, arguments = _STEPS[t["op"]]
    compiled = compiled_step.CompiledStep.of(t, by_field, kernel, arguments(t))

    def run(arena: np.ndarray, *, path: str | None = None, chunk: int | None = None,
            workers: int | None = None) -> None:
        # the step path runs on one thread unless workers are forced (``_parts``)
        if (compiled is not None and _choose(t, path, chunk)[0] == "step"
                and (workers is None or _parts(t, "step", workers) == 1) and compiled.run(arena)):
            return
        body(t, arena, path, chunk, workers, by_field)
    return run


KERNELS.add("selective_scan", selective_scan)
KERNELS.add("mamba2", mamba2)
PREPARE.add(("selective_scan", "mamba2"), prepare)
PATHS.add(("selective_scan", "mamba2"), path_for)
