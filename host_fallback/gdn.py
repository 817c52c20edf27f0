"""``gated_delta_net`` of ABI.md §4 and §8: the gated delta rule, with per-head or per-channel gates,
grouped value heads, a value width of its own, a scale, q/k L2-norm, packed sequences and state slots.

Two paths. The step path runs the recurrence, vectorized over batch and heads; it serves short
sequences (decode). The chunked path is the WY / UT-transform form: inside a chunk of ``L`` steps
the updates ``u`` solve a unit lower triangular system ``(I + A) u = beta*v - beta*gamma*k S0``
(``A`` the strictly lower ``beta K K^T`` scaled by decay ratios), so a chunk costs a handful of
GEMMs, and a sequential loop over chunks carries the state. Long sequences run blocks of batch
items or key heads on several threads (``threads.run_split``). ``path_for(thunk)`` names the path.

Grouped value heads (``value_heads = G * heads``) never copy q or k per value head: both paths view
the value-head axis as ``[heads, G]`` and let q and k broadcast over ``G``. Packed sequences
(``cu_seqlens``) run where they lie. The step path gives each sequence a batch row of its own (it
serves at most ``STEP_MAX`` tokens, so the padding is short; a padded step has zero inputs and
leaves the state exactly as it was). The chunked path restarts the state inside a chunk: the
cumulative log-decays restart at every sequence start and a same-sequence mask zeroes every
product across a boundary, a sequence that begins inside a chunk enters with its own initial state,
and each sequence's final state is formed at its last token. State slots gather the carried rows
once before the thunk and scatter them once after it.

16-bit storage computes in f32 (the f16 path is what GPU runtimes without a native kernel fall
back to); a state stored wider (``state_dtype``) is carried at its own precision, and the whole
thunk computes at the wider of the two. ``state`` is read and the final state written back,
rounded once, when ``carry_state``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from . import compiled_step, threads
from .arena import COMPUTE
from .chunked import (chunk_cumsum, chunk_view, decay_ratios, floor_log_decays, from_chunks, pick_path,
                      redo_nonfinite, scratch, to_chunks, unit_lower_inverse)
from .fields import complete, gdn_scale
from .implementations import KERNELS, PATHS, PREPARE
from .layout import Bound, regions

Thunk = Mapping[str, Any]

#: Default chunk length of the chunked path (a power of two, at least ``LEAF``).
CHUNK = 32
#: Longest sequence that takes the step path, measured with ``benchmarks/ssm.py --crossover``.
STEP_MAX = 12
#: Per-channel gates: block size below which decayed K.K^T entries are formed pair by pair.
LEAF = 2
#: The ``eps`` of ``qk_l2norm`` (ABI.md §8): ``x / sqrt(sum x^2 + L2_EPS)``.
L2_EPS = 1e-6


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




@dataclass(frozen=True)
class Packed:
    """Where the sequences of a packed (varlen) thunk lie in chunks of ``length`` tokens.

    ``cu`` is ``cu_seqlens``; ``seg [C, L]`` the sequence of every token (a padding token at the end
    counts as the last token's, which it leaves unchanged); ``restart [C, L]`` is true where the
    cumulative log-decay starts afresh (every chunk start and every sequence start).
    """

    cu: np.ndarray
    length: int
    seg: np.ndarray
    restart: np.ndarray

    @property
    def count(self) -> int:
        return self.seg.shape[0]

    def same(self) -> np.ndarray:
        """``[C, L, L]``: True where both tokens belong to one sequence."""
        return self.seg[:, :, None] == self.seg[:, None, :]

    def first(self) -> np.ndarray:
        """``[C, L]``: True on the tokens of the sequence a chunk starts with (it enters with the carried state)."""
        return self.seg == self.seg[:, :1]

    def last(self) -> np.ndarray:
        """``[C, L]``: True on the tokens of the sequence a chunk ends with (it leaves with the chunk's state)."""
        return self.seg == self.seg[:, -1:]

    def opens(self, c: int) -> bool:
        """Whether chunk ``c`` begins with the first token of its sequence."""
        return c == 0 or self.seg[c, 0] != self.seg[c - 1, -1]

    def entries(self) -> list[tuple[int, int, int, int]]:
        """``(sequence, chunk, first row, end row)`` of every non-empty sequence that begins inside a chunk
        (not at its start): rows ``first .. end-1`` of that chunk enter from the sequence's own state."""
        out = []
        for i, (lo, hi) in enumerate(zip(self.cu[:-1], self.cu[1:])):
            if hi > lo and lo % self.length:
                c, p = divmod(int(lo), self.length)
                out.append((i, c, p, min(self.length, int(hi) - c * self.length)))
        return out

    def ends(self) -> list[tuple[int, int, int, int]]:
        """``(sequence, chunk, first row, last row)`` of the last chunk of every non-empty sequence: the
        rows of that chunk it holds, whose last one leaves the sequence's final state."""
        out = []
        for i, (lo, hi) in enumerate(zip(self.cu[:-1], self.cu[1:])):
            if hi > lo:
                c, e = divmod(int(hi) - 1, self.length)
                out.append((i, c, max(0, int(lo) - c * self.length), e))
        return out


def packed(cu: np.ndarray, seq: int, length: int) -> Packed:
    """The ``Packed`` layout of ``cu_seqlens`` ``cu`` over ``seq`` tokens in chunks of ``length``."""
    cu = np.asarray(cu, np.int64)
    count = max(1, -(-seq // length))
    tokens = np.minimum(np.arange(count * length), max(seq - 1, 0))
    seg = (np.searchsorted(cu, tokens, side="right") - 1).reshape(count, length)
    restart = np.zeros_like(seg, bool)
    restart[:, 0] = True
    restart[:, 1:] = seg[:, 1:] != seg[:, :-1]
    return Packed(cu, length, seg, restart)


def _segment_cumsum(g: np.ndarray, layout: Packed) -> np.ndarray:
    """``g [1, S, HV, ...]`` cumulatively summed in chunks, restarting at each ``layout.restart``:
    ``[C, 1, HV, L, ...]`` (``chunk_cumsum`` with sequence starts inside a chunk)."""
    rest = g.shape[2:]
    x = np.zeros((layout.count * layout.length, *rest), g.dtype)
    x[: g.shape[1]] = g[0]
    x = x.reshape(layout.count, layout.length, *rest)
    keep = ~layout.restart
    for step in range(1, layout.length):
        np.add(x[:, step - 1], x[:, step], out=x[:, step], where=keep[:, step].reshape(-1, *[1] * len(rest)))
    return np.ascontiguousarray(np.moveaxis(x, 1, 2)[:, None])


def _chunked(q, k, v, g, beta, s, dst, scale, length, layout=None, carried=True):
    """The chunked WY form, into ``dst``; ``s`` is updated in place. Shapes as ``_step``.

    With ``layout`` (a ``Packed``) the batch is one packed row of sequences and ``s [R, HV, K, V]``
    holds each sequence's initial state (read only when ``carried``), replaced by its final state.

    Every GEMM operand used transposed (``K^T``, the decayed keys ``kd``) is laid out contiguous
    first: OpenBLAS runs small GEMMs with a transposed operand far slower.
    """
    seq, heads, n = q.shape[1:]
    group, width = v.shape[2] // heads, v.shape[3]
    per_channel = g.ndim == 4
    g_steps = g
    # k is copied into chunks (its transpose is fast from there); q and v are read in place
    qf, kf = chunk_view(q, length), to_chunks(k, length, "gdn.k")  # [C, B, H, L, K]
    count, b = qf.shape[:2]
    lead = (count, b, heads, group)
    qc, kc = qf[:, :, :, None], kf[:, :, :, None]  # [C, B, H, 1, L, K]: broadcast over the group
    vc = _split(chunk_view(v, length), group, 2)  # [C, B, H, G, L, V]
    betac = _split(to_chunks(beta, length), group, 2)  # [C, B, H, G, L]
    kt = scratch("gdn.kt", (count, b, heads, 1, n, length), q.dtype)
    np.copyto(kt, _swap(kc))
    low = float(g.min(initial=0.0))
    g = floor_log_decays(g, low)
    if layout is not None:
        cross = ~layout.same()[:, None, None, None]  # [C, 1, 1, 1, L, L]
        first = layout.first()[:, None, None, None, :, None]  # [C, 1, 1, 1, L, 1]
        last = layout.last()[:, None, None, None, None, :]  # [C, 1, 1, 1, 1, L]
    with np.errstate(over="ignore", invalid="ignore"):  # products across a sequence boundary: selected away
        if per_channel:
            # |cum - m| <= (steps from the midpoint) * max|g|, twice the chunk's sum where sequences restart
            steps = length // 2 + 1 if layout is None else 2 * length
            bounded = max(-low, float(g.max(initial=0.0))) * steps <= CHANNEL_SPREAD
            if layout is None:
                padded = chunk_cumsum(g, length)  # [B, C, L, HV, K], log-decay from the chunk start, inclusive
                cum = scratch("gdn.cum", (padded.shape[1], b, padded.shape[3], length, n), g.dtype)
                np.copyto(cum, padded.transpose(1, 0, 3, 2, 4))  # [C, B, HV, L, K]
            else:
                cum = _segment_cumsum(g, layout)
            cum = _split(cum, group, 2)  # [C, B, H, G, L, K]
            cumt = scratch("gdn.cumt", (*lead, n, length), g.dtype)
            np.copyto(cumt, _swap(cum))  # [C, B, H, G, K, L]
            qk, kk = _channel_grams_fast(np.broadcast_to(qc, (*lead, length, n)),
                                         np.broadcast_to(kc, (*lead, length, n)), kt, cum, cumt, bounded)
            if layout is not None:
                np.copyto(qk, 0, where=cross)
                np.copyto(kk, 0, where=cross)
                kept = cum.copy() if carried else None  # the sequence ends need it after ``gamma`` takes its place
            last_cum = cumt[..., -1:]
            through = np.exp(last_cum[..., 0])  # [C, B, H, G, K]
            to_end = np.exp(np.subtract(last_cum, cumt, out=cumt), out=cumt)  # [C, B, H, G, K, L]
            gamma = np.exp(cum, out=cum)  # [C, B, H, G, L, K]
        else:
            cum = np.cumsum(to_chunks(g, length), axis=-1) if layout is None else _segment_cumsum(g, layout)
            cum = _split(cum, group, 2)  # [C, B, H, G, L]
            ratios = decay_ratios(cum)
            if layout is not None:
                np.copyto(ratios, 0, where=cross)
                kept = cum
            qk = np.multiply(np.matmul(qc, kt), ratios, out=scratch("gdn.qk", ratios.shape, q.dtype))
            kk = np.multiply(np.matmul(kc, kt), ratios, out=ratios)
            np.copyto(kk, 0, where=_upper(length, 0))
            last_cum = cum[..., -1:]
            gamma, through = np.exp(cum)[..., None], np.exp(last_cum)  # [..., L, 1], [..., 1]
            to_end = np.exp(last_cum - cum)[..., None, :]  # [..., 1, L]
        kd = np.multiply(kt, to_end, out=scratch("gdn.kd", (*lead, n, length), q.dtype))  # [..., K, L]
        if layout is not None:
            np.copyto(kd, 0, where=~last)
    # (I + A) u = beta v - beta gamma k S0 with A = beta kk: u = T beta v - (T beta gamma k) S0. The
    # diagonal scalings go on T's columns where they can ([L, L] against [L, K] for k and v)
    kk *= betac[..., None]
    t = unit_lower_inverse(kk)
    t *= betac[..., None, :]
    u = np.matmul(t, vc, out=scratch("gdn.u", (*lead, length, width), q.dtype))
    if per_channel:
        w = np.matmul(t, np.multiply(gamma, kc, out=scratch("gdn.gk", (*lead, length, n), q.dtype)),
                      out=scratch("gdn.w", (*lead, length, n), q.dtype))
    else:
        t *= _swap(gamma)
        w = np.matmul(t, kc, out=scratch("gdn.w", (*lead, length, n), q.dtype))
    qg = np.multiply(qc, gamma, out=scratch("gdn.q", (*lead, length, n), q.dtype))
    qg *= scale
    out = scratch("gdn.out", (*lead, length, width), q.dtype)
    block = _split(s, group, 1) if layout is None else None  # [B, H, G, K, V]
    starts = scratch("gdn.starts", (count, b, heads, group, n, width), s.dtype)  # the state entering each chunk
    if layout is None:
        starts[0] = block
        _carry(u, w, kd, through, starts, block)
    else:
        inits = _split(s, group, 1)[:, None] if carried else None  # [R, 1, H, G, K, V]
        _carry_packed(u, w, kd, through, starts, inits, layout, first)
    np.matmul(qg * first if layout is not None else qg, starts, out=out)
    qk *= scale
    out += np.matmul(qk, u, out=scratch("gdn.qku", out.shape, q.dtype))
    flat = (count, b, heads * group, length, width)
    if layout is None:
        redo_nonfinite(out.reshape(flat), starts.reshape(count, b, heads * group, n, width),
                       lambda *args: _step(*args, scale),
                       lambda: [np.repeat(qf, group, 2), np.repeat(kf, group, 2), chunk_view(v, length),
                                chunk_view(g, length), to_chunks(beta, length)])
        np.copyto(dst, from_chunks(out.reshape(flat), seq))
        return
    for i, c, lo, hi in layout.entries() if carried else ():  # a sequence's own state enters mid-chunk
        out[c, ..., lo:hi, :] += qg[c, ..., lo:hi, :] @ inits[i, 0]
    np.copyto(dst, from_chunks(out.reshape(flat), seq))
    finals = _sequence_ends(kt, u, kept, starts, inits, layout, per_channel) if carried else {}
    _redo_sequences(q, k, v, g_steps, beta, s, dst, scale, layout, finals, carried)


def _carry(u, w, kd, through, starts, block):
    """The loop over chunks of one batch of lanes: ``u`` gets each chunk's entering state, and
    ``starts[c]`` holds that state; the state after the last chunk goes to ``block``."""
    count = u.shape[0]
    step, read = np.empty_like(block), np.empty_like(u[0])
    for c in range(count):
        u[c] -= np.matmul(w[c], starts[c], out=read)
        nxt = starts[c + 1] if c + 1 < count else block
        # the chunk's total decay: per head, or per key row of S
        np.multiply(starts[c], through[c][..., None], out=nxt)
        nxt += np.matmul(kd[c], u[c], out=step)


def _carry_packed(u, w, kd, through, starts, inits, layout, first):
    """``_carry`` over a packed row: a chunk that opens a sequence enters with that sequence's own
    state (``inits``, zero when ``None``), and the rows of a sequence that begins inside a chunk
    take theirs (never the chunk's entering state), so the state restarts without leaving the chunks."""
    if inits is not None:
        for i, c, lo, hi in layout.entries():
            u[c, ..., lo:hi, :] -= w[c, ..., lo:hi, :] @ inits[i]
    w_first = np.multiply(w, first, out=w)
    step, read = np.empty_like(starts[0]), np.empty_like(u[0])
    for c in range(layout.count):
        if layout.opens(c):
            starts[c] = 0 if inits is None else inits[layout.seg[c, 0]]
        u[c] -= np.matmul(w_first[c], starts[c], out=read)
        if c + 1 == layout.count or layout.opens(c + 1):
            continue
        nxt = starts[c + 1]
        lasting = layout.seg[c, -1]  # the sequence the chunk ends with, carried into the next one
        base = starts[c] if lasting == layout.seg[c, 0] else (None if inits is None else inits[lasting])
        if base is None:
            np.matmul(kd[c], u[c], out=nxt)
        else:
            np.multiply(base, through[c][..., None], out=nxt)
            nxt += np.matmul(kd[c], u[c], out=step)


def _sequence_ends(kt, u, cum, starts, inits, layout, per_channel):
    """Each non-empty sequence's final state: the state at its last token ``e`` of chunk ``c``,
    ``gamma_e S_enter + sum_r exp(cum_e - cum_r) k_r u_r^T`` over its rows ``r <= e`` of that chunk.
    Returns ``{sequence: [1, H, G, K, V]}``."""
    finals = {}
    for i, c, lo, e in layout.ends():
        enter = starts[c] if layout.seg[c, 0] == i else inits[i]
        if per_channel:  # cum [C, B, H, G, L, K]
            at = cum[c, ..., e, :]
            keys = kt[c, ..., lo:e + 1] * _swap(np.exp(at[..., None, :] - cum[c, ..., lo:e + 1, :]))
            finals[i] = enter * np.exp(at)[..., None] + keys @ u[c, ..., lo:e + 1, :]
        else:  # cum [C, B, H, G, L]
            at = cum[c, ..., e]
            keys = kt[c, ..., lo:e + 1] * np.exp(at[..., None] - cum[c, ..., lo:e + 1])[..., None, :]
            finals[i] = enter * np.exp(at)[..., None, None] + keys @ u[c, ..., lo:e + 1, :]
    return finals


def _redo_sequences(q, k, v, g, beta, s, dst, scale, layout, finals, carried):
    """Store each packed sequence's final state into ``s``, rerunning with the step recurrence, from
    its initial state, every sequence whose outputs or final state hold a NaN or Inf (the chunked
    sums are not causal for those: see ``chunked``). Costs one ``isfinite`` pass over ``dst``."""
    bad = ~np.isfinite(dst[0]).reshape(dst.shape[1], -1).all(axis=1)
    for i, (lo, hi) in enumerate(zip(layout.cu[:-1].tolist(), layout.cu[1:].tolist())):
        if hi == lo:
            continue
        final = finals.get(i)
        if bad[lo:hi].any() or (final is not None and not np.isfinite(final).all()):
            state = s[i:i + 1].copy() if carried else np.zeros((1, *s.shape[1:]), s.dtype)
            _step(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi], state, dst[:, lo:hi], scale)
            final = state
        if carried:
            s[i] = final.reshape(s.shape[1:])


def _choose(thunk: Thunk, path: str | None, chunk: int | None) -> tuple[str, int]:
    length = chunk or CHUNK
    if length < LEAF or length & (length - 1):
        raise ValueError(f"gated_delta_net: chunk length must be a power of two >= {LEAF}, got {length}")
    return pick_path("gated_delta_net", path, thunk["seq"], STEP_MAX, "chunked"), length


def _parts(thunk: Thunk, name: str, workers: int | None) -> int:
    # the step path stays on one thread unless forced: its per-step arrays are too small to split
    # (B=2 S=1024 H=8 N=64: 73 ms on one thread, 105 ms on two)
    h, n = thunk["heads"], thunk["state_size"]
    hv, width = thunk.get("value_heads") or h, thunk.get("value_size") or n
    rows = thunk["batch"] if thunk.get("cu_seqlens") is None else (thunk["num_seqs"] if name == "step" else 1)
    work = 0 if name == "step" else thunk["batch"] * thunk["seq"] * hv * n * width
    return threads.parts_for("gated_delta_net", work, rows, h, workers)


def path_for(thunk: Thunk, *, path: str | None = None, chunk: int | None = None, workers: int | None = None) -> str:
    """Name the path ``gated_delta_net`` runs ``thunk`` on: ``step`` or ``chunked L=32``, with
    ``, N threads`` when split across cores."""
    name, length = _choose(thunk, path, chunk)
    parts = _parts(thunk, name, workers)
    return (name if name == "step" else f"{name} L={length}") + (f", {parts} threads" if parts > 1 else "")


def _l2norm(x: np.ndarray) -> np.ndarray:
    """``x / sqrt(sum x^2 + L2_EPS)`` over each head vector (the last axis), in a fresh array."""
    return x / np.sqrt(np.einsum("...i,...i->...", x, x)[..., None] + L2_EPS)


class _States:
    """The carried states of a thunk's rows as one array of the work type, and their write-back.

    In place where it can be (the pool is the rows, stored in the work type); else the rows are
    gathered once (``state_slots`` picks pool entries) and scattered once after the thunk, rounded
    into the pool's storage type; entries no slot names are never touched.
    """

    def __init__(self, t: Thunk, bound: Bound, work: np.dtype, rows: int):
        self.bound, self.slots, self.copied = bound, None, False
        if not t["carry_state"]:
            self.rows = np.zeros((rows, t["value_heads"], t["state_size"], t["value_size"]), work)
            return
        pool = bound.view("state")
        if t["state_slots"] is not None:
            self.slots = bound.view("state_slots").astype(np.intp)
            self.rows = pool[self.slots].astype(work)
        else:
            self.rows = pool if pool.dtype == work else pool.astype(work)
        self.copied = self.rows is not pool

    def write_back(self) -> None:
        if not self.copied:
            return
        if self.slots is None:
            self.bound.store("state", self.rows)
        else:
            pool = self.bound.view("state")
            pool[self.slots] = self.rows.astype(pool.dtype)


def _arguments(t: Thunk) -> compiled_step.Arguments:
    """``jit_kernels.gated_delta_net_step``'s arguments from a thunk's arena views (a per-head ``g`` as
    ``[B, S, HV, 1]``)."""
    scale = np.float32(gdn_scale(t))

    def arguments(bound: Bound) -> tuple:
        g = bound.view("g")
        return (*(bound.view(f) for f in ("q", "k", "v")), g if t["gate_per_channel"] else g.reshape(*g.shape, 1),
                bound.view("beta"), compiled_step.view(bound, "state", 4, t["carry_state"]), bound.view("dst"),
                *compiled_step.rows(t, bound), t["cu_seqlens"] is not None, bool(t["qk_l2norm"]), scale)
    return arguments


def prepare(thunk: Thunk) -> Callable[..., None]:
    """The thunk-only setup of ``gated_delta_net``, once (``host_fallback.PREPARE``): where its tensors
    lie, the work type and, for packed sequences, nothing that depends on their (runtime) lengths.

    Returns ``run(arena, *, path, chunk, workers)``. Inputs are read where they lie when stored in the
    work type (ABI.md lets no output overlap an input), a carried state updated in place when it can be
    (``_States``) and a step-path output written straight into ``dst``, so a decode step adds no copy of
    the state to the recurrence's own passes.
    """
    t = complete(thunk)
    by_field = {r.field: r for r in regions(t)}
    work = np.result_type(COMPUTE[t["dtype"]], COMPUTE[t["state_dtype"]])
    heads, group = t["heads"], t["value_heads"] // t["heads"]
    scale, normed, varlen = gdn_scale(t), t["qk_l2norm"], t["cu_seqlens"] is not None

    def load(bound: Bound, field: str, index: Any, copy: bool) -> np.ndarray:
        x = np.array(bound.view(field)[index], work, copy=copy or None)
        return _l2norm(x) if normed and field in ("q", "k") else x

    last: list[Bound] = []  # the views of the last arena: a decode runs on one arena call after call
    compiled = compiled_step.CompiledStep.of(t, by_field, "gated_delta_net_step", _arguments(t))

    def bind(arena: np.ndarray) -> Bound:
        if not last or last[0].arena is not arena:
            last[:] = [Bound(t, arena, by_field)]
        return last[0]

    def run(arena: np.ndarray, *, path: str | None = None, chunk: int | None = None,
            workers: int | None = None) -> None:
        name, length = _choose(t, path, chunk)
        # the step path runs on one thread unless workers are forced (``_parts``)
        if (compiled is not None and name == "step" and (workers is None or _parts(t, name, workers) == 1)
                and compiled.run(arena)):
            return
        bound = bind(arena)
        cu = bound.view("cu_seqlens").astype(np.int64) if varlen else None
        rows = t["num_seqs"] if varlen else t["batch"]
        states = _States(t, bound, work, rows)
        dst = bound.view("dst")
        # inputs read and the output written in place, unless a (malformed) dst overlaps an input
        apart = not any(np.may_share_memory(dst, bound.view(f)) for f in ("q", "k", "v", "g", "beta"))
        direct = apart and dst.dtype == work
        carried = states.rows
        if varlen and name == "step":  # sequences as batch rows, longest first when their lengths differ
            lengths = np.diff(cu)
            order = np.argsort(-lengths, kind="stable") if lengths.min(initial=0) != lengths.max(initial=0) else None
            if order is not None:
                lengths, carried = lengths[order], states.rows[order]
            pad = np.arange(max(1, int(lengths.max(initial=0))))
            valid = pad[None, :] < lengths[:, None]  # [R, longest]
            index = (cu[:-1] if order is None else cu[:-1][order])[:, None] + pad[None, :]  # each step's packed token
            tokens = index[valid]
        layout = packed(cu, t["seq"], length) if varlen and name == "chunked" else None

        def compute(bs: slice, hs: slice) -> np.ndarray | None:
            vs = slice(hs.start * group, hs.stop * group)
            heads_of = {"q": hs, "k": hs}
            if varlen and name == "step":  # each sequence a batch row, padded with steps that change nothing
                inputs = []
                for f in ("q", "k", "v", "g", "beta"):
                    x = load(bound, f, (0, tokens, heads_of.get(f, vs)), False)
                    padded = np.zeros((rows, valid.shape[1], *x.shape[1:]), work)
                    padded[valid] = x
                    inputs.append(padded[bs])
                out = np.empty((*inputs[2].shape[:3], t["value_size"]), work)
                active = None if order is None else valid[bs].sum(axis=0)
                _step(*inputs, carried[bs, vs], out, scale, active)
                return out
            batch = slice(None) if varlen else bs
            inputs = [load(bound, f, (batch, slice(None), heads_of.get(f, vs)), not apart) for f in ("q", "k", "v", "g", "beta")]
            out = dst[batch, :, vs] if direct else np.empty(dst[batch, :, vs].shape, work)
            if name == "step":
                _step(*inputs, states.rows[bs, vs], out, scale)
            elif varlen:
                _chunked(*inputs, states.rows[:, vs], out, scale, length, layout, t["carry_state"])
            else:
                _chunked(*inputs, states.rows[bs, vs], out, scale, length)
            return None if direct else out

        def store(bs: slice, hs: slice, out: np.ndarray | None) -> None:
            vs = slice(hs.start * group, hs.stop * group)
            if varlen and name == "step":
                dst[0, index[bs][valid[bs]], vs] = out[valid[bs]]
            elif out is not None:
                dst[slice(None) if varlen else bs, :, vs] = out

        blocks = 1 if varlen and name == "chunked" else rows
        threads.run_split(compute, store, blocks, heads, _parts(t, name, workers))
        if carried is not states.rows:
            states.rows[order] = carried
        states.write_back()

    return run


def gated_delta_net(thunk: Thunk, arena: np.ndarray, *, path: str | None = None, chunk: int | None = None,
                    workers: int | None = None) -> None:
    """Gated delta rule: ``S = exp(g) S``; ``u = beta (v - S^T k)``; ``S += k u^T``; ``out = scale S^T q``.

    ``path`` (``"step"`` or ``"chunked"``), ``chunk`` (a power-of-two chunk length) and ``workers``
    (threads over the batch x key-head recurrences) override the choice. Any ``state_size`` and
    ``value_size`` are served (memory grows as their product). ``thunk`` holds every field (completed).
    """
    prepare(thunk)(arena, path=path, chunk=chunk, workers=workers)


KERNELS.add("gated_delta_net", gated_delta_net)
PREPARE.add("gated_delta_net", prepare)
PATHS.add("gated_delta_net", path_for)
