"""``gated_delta_net``'s chunked path, the WY / UT-transform form (``gdn``'s docstring describes it), over
a batch or over a packed row of sequences (``Packed``)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .chunked import (chunk_cumsum, chunk_view, decay_ratios, floor_log_decays, from_chunks, redo_nonfinite, scratch,
                      to_chunks, unit_lower_inverse)
from .gdn_grams import CHANNEL_SPREAD, _channel_grams_fast, _upper
from .gdn_step import _split, _step, _swap



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


def _chunked(q, k, v, g, beta, s, dst, scale, length, layout=None, carried=True, keep=None):
    """The chunked WY form, into ``dst``; ``s`` is updated in place. Shapes as ``_step``.

    With ``layout`` (a ``Packed``) the batch is one packed row of sequences and ``s [R, HV, K, V]``
    holds each sequence's initial state (read only when ``carried``), replaced by its final state.
    ``keep`` (no ``layout``, ``length`` = ``abi.gdn.RESERVE_CHUNK``): a saved forward's views by slot name
    (``states``, ``qk``, ``kk``, ``inverse``, ``u``: ``abi.gdn.reserve_slots``, ``[B, C, HV, ...]``), written here.

    Every GEMM operand used transposed (``K^T``, the decayed keys ``kd``) is laid out contiguous
    first: OpenBLAS runs small GEMMs with a transposed operand far slower.
    """
    seq, heads, n = q.shape[1:]
    group, width = v.shape[2] // heads, v.shape[3]
    per_channel = g.ndim == 4
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
    g_steps, g = g, floor_log_decays(g, low)
    saved = {f: _slot(keep, f, group) for f in keep} if keep else None  # [C, B, H, G, ...] views
    qk, kk, gamma, through, kd, kept = _decayed(qc, kc, kt, g, low, lead, layout, carried,
                                                None if saved is None else (saved["qk"], saved["kk"]))
    for name, x in (("qk", qk), ("kk", kk)) if keep and per_channel else ():  # (per head _decayed wrote them there)
        np.copyto(saved[name], x)
    # (I + A) u = beta v - beta gamma k S0 with A = beta kk: u = T beta v - (T beta gamma k) S0. The
    # diagonal scalings go on T's columns where they can ([L, L] against [L, K] for k and v)
    a = np.multiply(kk, betac[..., None], out=scratch("gdn.a", kk.shape, kk.dtype) if keep else kk)
    if keep:  # the inverse where the saved forward keeps it, T beside it
        t = np.multiply(unit_lower_inverse(a, saved["inverse"]), betac[..., None, :],
                        out=scratch("gdn.t", a.shape, a.dtype))
    else:
        t = unit_lower_inverse(a)
        t *= betac[..., None, :]
    u = np.matmul(t, vc, out=saved["u"] if saved else scratch("gdn.u", (*lead, length, width), q.dtype))
    if per_channel:
        w = np.matmul(t, np.multiply(gamma, kc, out=scratch("gdn.gk", (*lead, length, n), q.dtype)),
                      out=scratch("gdn.w", (*lead, length, n), q.dtype))
    else:
        t *= _swap(gamma)
        w = np.matmul(t, kc, out=scratch("gdn.w", (*lead, length, n), q.dtype))
    qg = np.multiply(qc, gamma, out=scratch("gdn.q", (*lead, length, n), q.dtype))
    out = scratch("gdn.out", (*lead, length, width), q.dtype)
    flat = (count, b, heads * group, length, width)
    if layout is None:
        block = _split(s, group, 1)  # [B, H, G, K, V]
        first = scratch("gdn.first", block.shape, s.dtype)  # the state entering the first chunk
        np.copyto(first, block)
        # the state leaving each chunk: written where the saved forward keeps it, if there is one
        leaving = saved["states"] if saved else scratch("gdn.states", (count, *block.shape), s.dtype)
        _carry(u, w, kd, through, first, leaving)
        np.copyto(block, leaving[-1])
        np.matmul(qg[:1], first[None], out=out[:1])
        np.matmul(qg[1:], leaving[:-1], out=out[1:])
    else:
        starts = scratch("gdn.starts", (count, b, heads, group, n, width), s.dtype)  # the state entering each chunk
        first = layout.first()[:, None, None, None, :, None]  # [C, 1, 1, 1, L, 1]
        inits = _split(s, group, 1)[:, None] if carried else None  # [R, 1, H, G, K, V]
        _carry_packed(u, w, kd, through, starts, inits, layout, first)
        np.matmul(qg * first, starts, out=out)
    out += np.matmul(qk, u, out=scratch("gdn.qku", out.shape, q.dtype))
    for i, c, lo, hi in layout.entries() if layout is not None and carried else ():  # a state entering mid-chunk
        out[c, ..., lo:hi, :] += qg[c, ..., lo:hi, :] @ inits[i, 0]
    out *= scale  # both products taken before scale: the saved forward keeps qk unscaled
    if layout is None:
        redo_nonfinite(out.reshape(flat), lambda: np.concatenate((first[None], leaving[:-1])).reshape(
                           count, b, heads * group, n, width),
                       lambda *args: _step(*args, scale),
                       lambda: [np.repeat(qf, group, 2), np.repeat(kf, group, 2), chunk_view(v, length),
                                chunk_view(g, length), to_chunks(beta, length)])
        np.copyto(dst, from_chunks(out.reshape(flat), seq))
        return
    np.copyto(dst, from_chunks(out.reshape(flat), seq))
    finals = _sequence_ends(kt, u, kept, starts, inits, layout, per_channel) if carried else {}
    _redo_sequences(q, k, v, g_steps, beta, s, dst, scale, layout, finals, carried)


def _slot(keep, name, group):
    """The saved forward's slot ``name`` (``keep[name] [B, C, HV, ...]``) chunk-major, value heads as ``[heads,
    group]``: ``[C, B, H, G, ...]``, a view (each matrix contiguous, a GEMM's operand or output as it lies)."""
    return np.moveaxis(_split(keep[name], group, 2), 1, 0)


def _decayed(qc, kc, kt, g, low, lead, layout, carried, products=None):
    """The decays inside each chunk: ``(qk, kk, gamma, through, kd, kept)``, the decayed products ``q·k``
    (``r <= s``) and ``k·k`` (``r < s``, zero across a sequence boundary), ``gamma`` the decay from the chunk's
    start to each row, ``through`` the chunk's whole decay, ``kd`` the keys decayed to the chunk's end
    (``[..., K, L]``, zero past the sequence a chunk ends with) and ``kept`` the cumulative log-decays the
    sequence ends need (packed and ``carried`` only, else None). ``g`` is floored (``floor_log_decays``),
    ``low`` its minimum before; ``products``: per head, the arrays ``(qk, kk)`` are written into (else scratch ones)."""
    length, n = kc.shape[-2:]
    per_channel, kept = g.ndim == 4, None
    if layout is not None:
        cross = ~layout.same()[:, None, None, None]  # [C, 1, 1, 1, L, L]
        last = layout.last()[:, None, None, None, None, :]  # [C, 1, 1, 1, 1, L]
    with np.errstate(over="ignore", invalid="ignore"):  # products across a sequence boundary: selected away
        if per_channel:
            # |cum - m| <= (steps from the midpoint) * max|g|, twice the chunk's sum where sequences restart
            steps = length // 2 + 1 if layout is None else 2 * length
            bounded = max(-low, float(g.max(initial=0.0))) * steps <= CHANNEL_SPREAD
            if layout is None:
                padded = chunk_cumsum(g, length)  # [B, C, L, HV, K], log-decay from the chunk start, inclusive
                cum = scratch("gdn.cum", (padded.shape[1], lead[1], padded.shape[3], length, n), g.dtype)
                np.copyto(cum, padded.transpose(1, 0, 3, 2, 4))  # [C, B, HV, L, K]
            else:
                cum = _segment_cumsum(g, layout)
            cum = _split(cum, lead[3], 2)  # [C, B, H, G, L, K]
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
            cum = _split(cum, lead[3], 2)  # [C, B, H, G, L]
            ratios = decay_ratios(cum)
            if layout is not None:
                np.copyto(ratios, 0, where=cross)
                kept = cum
            qk = np.multiply(np.matmul(qc, kt), ratios,
                             out=scratch("gdn.qk", ratios.shape, qc.dtype) if products is None else products[0])
            kk = np.multiply(np.matmul(kc, kt), ratios, out=ratios if products is None else products[1])
            np.copyto(kk, 0, where=_upper(length, 0))
            last_cum = cum[..., -1:]
            gamma, through = np.exp(cum)[..., None], np.exp(last_cum)  # [..., L, 1], [..., 1]
            to_end = np.exp(last_cum - cum)[..., None, :]  # [..., 1, L]
        kd = np.multiply(kt, to_end, out=scratch("gdn.kd", (*lead, n, length), qc.dtype))  # [..., K, L]
        if layout is not None:
            np.copyto(kd, 0, where=~last)
    return qk, kk, gamma, through, kd, kept


def _carry(u, w, kd, through, first, leaving):
    """The loop over chunks of one batch of lanes from the state ``first`` entering the first one: ``u`` gets each
    chunk's entering state, and ``leaving[c]`` the state leaving chunk ``c`` (the one entering the next)."""
    step, read = np.empty_like(first), np.empty_like(u[0])
    enter = first
    for c in range(len(u)):
        u[c] -= np.matmul(w[c], enter, out=read)
        # the chunk's total decay: per head, or per key row of S
        np.multiply(enter, through[c][..., None], out=leaving[c])
        leaving[c] += np.matmul(kd[c], u[c], out=step)
        enter = leaving[c]


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
