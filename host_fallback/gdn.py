"""``gated_delta_net`` of ABI.md §4: the gated delta rule, with per-head or per-channel gates.

Two paths. The step path runs the recurrence, vectorized over batch and heads; it serves short
sequences (decode). The chunked path is the WY / UT-transform form: inside a chunk of ``L`` steps
the updates ``u`` solve a unit lower triangular system ``(I + A) u = beta*v - beta*gamma*k S0``
(``A`` the strictly lower ``beta K K^T`` scaled by decay ratios), so a chunk costs a handful of
GEMMs, and a sequential loop over chunks carries the state. Long sequences run blocks of batch
items or heads on several threads (``chunked.run_blocks``). ``path_for(thunk)`` names the path.

16-bit storage computes in f32 (the f16 path is what GPU runtimes without a native kernel fall
back to); ``state`` is read and the final state written back, rounded once, when ``carry_state``.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from . import threads
from .chunked import (chunk_cumsum, chunk_view, decay_ratios, floor_log_decays, from_chunks, pick_path,
                      redo_nonfinite, run_blocks, scratch, to_chunks, unit_lower_inverse)
from .arena import COMPUTE, STORAGE, view
from .layout import Bound, regions

Thunk = Mapping[str, Any]

#: Default chunk length of the chunked path (a power of two, at least ``LEAF``).
CHUNK = 32
#: Longest sequence that takes the step path, measured with ``benchmarks/ssm.py --crossover``.
STEP_MAX = 12
#: Per-channel gates: block size below which decayed K.K^T entries are formed pair by pair.
LEAF = 2


def _swap(x: np.ndarray) -> np.ndarray:
    return np.swapaxes(x, -1, -2)


def _step(q, k, v, g, beta, s, length, out):
    """The recurrence of ABI.md §4, step by step, into ``out``; ``s [B, H, N, N]`` is updated in place.

    Per step the state is decayed, then read ONCE for both ``k^T S`` and ``q^T S`` (one batched matmul
    of the rows [k; q]); the output is ``q^T S_new = q^T S + (q.k) u``, so the updated state is not read
    again. A step whose output that way is not finite takes ``q^T S_new`` from the updated state, the
    ABI's order, so NaN and each signed Inf land where they do on every device. The rank-1 update ``k u^T`` is a matmul of depth 2 (the second column and row zero): NumPy
    runs depth 1 in its own loop, 20x slower (B8 H8 N64: 780 vs 38 µs), and the einsum 3x slower.
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    lead, n = s.shape[:-2], s.shape[-1]
    outer = scratch("gdn.outer", s.shape, s.dtype)  # k u^T: a state-sized buffer kept, not allocated per step
    rows = scratch("gdn.rows", (*lead, 2, n), s.dtype)  # [k; q] of one step
    kcol = scratch("gdn.kcol", (*lead, n, 2), s.dtype)  # [k, 0]
    urow = scratch("gdn.urow", (*lead, 2, n), s.dtype)  # [u; 0]
    kcol[..., 1] = 0
    urow[..., 1, :] = 0
    # a per-head decay scales each (batch, head) state as one row of N*N: NumPy's broadcast of a
    # [B, H, 1, 1] factor runs an inner loop per state row, 3x slower (B8 H8 N64: 95 vs 30 µs)
    flat = s.reshape(-1, n * n) if g.ndim == 3 and s.flags.c_contiguous else None
    for t in range(q.shape[1]):
        decay = np.exp(g[:, t])
        if flat is not None:
            flat *= decay.reshape(-1, 1)
        else:
            s *= decay[..., :, None] if g.ndim == 4 else decay[..., None, None]
        rows[..., 0, :], rows[..., 1, :] = k[:, t], q[:, t]
        read = np.matmul(rows, s)  # [k^T S; q^T S]
        u = urow[..., 0, :]
        np.multiply(np.subtract(v[:, t], read[..., 0, :], out=u), beta[:, t, :, None], out=u)
        kcol[..., 0] = k[:, t]
        s += np.matmul(kcol, urow, out=outer)
        qk = np.einsum("...i,...i->...", q[:, t], k[:, t])
        out[:, t] = scale * (read[..., 1, :] + qk[..., None] * u)
        if not math.isfinite(out[:, t].sum()):  # a NaN or Inf: the classes of S_new's products, not the rewrite's
            out[:, t] = scale * np.matmul(q[:, t, ..., None, :], s)[..., 0, :]


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


def _chunked(q, k, v, g, beta, s, length, dst):
    """The chunked WY form, into ``dst``; ``s [B, H, N, N]`` is updated in place.

    Every GEMM operand used transposed (``K^T``, the decayed keys ``kd``) is laid out contiguous
    first: OpenBLAS runs small GEMMs with a transposed operand far slower.
    """
    seq, n = q.shape[1], q.shape[-1]
    per_channel = g.ndim == 4
    # k is copied into chunks (its transpose is fast from there); q and v are read in place
    q, k, v = chunk_view(q, length), to_chunks(k, length, "gdn.k"), chunk_view(v, length)
    beta = to_chunks(beta, length)  # [C, B, H, L, ...]
    lead = q.shape[:3]
    kt = scratch("gdn.kt", (*lead, n, length), q.dtype)  # [C, B, H, N, L]
    np.copyto(kt, _swap(k))
    low = float(g.min(initial=0.0))
    g = floor_log_decays(g, low)
    if per_channel:
        # |cum - m| <= (steps from the midpoint) * max|g|: one cheap bound over all chunks first
        bounded = max(-low, float(g.max(initial=0.0))) * (length // 2 + 1) <= CHANNEL_SPREAD
        padded = chunk_cumsum(g, length)  # [B, C, L, H, N], log-decay from the chunk start, inclusive
        cum = scratch("gdn.cum", (padded.shape[1], padded.shape[0], padded.shape[3], length, n), g.dtype)
        np.copyto(cum, padded.transpose(1, 0, 3, 2, 4))  # [C, B, H, L, N]
        cumt = scratch("gdn.cumt", (*cum.shape[:3], n, length), g.dtype)
        np.copyto(cumt, _swap(cum))  # [C, B, H, N, L]
        qk, kk = _channel_grams_fast(q, k, kt, cum, cumt, bounded)
        last = cumt[..., -1:]
        through = np.exp(last[..., 0])
        to_end = np.exp(np.subtract(last, cumt, out=cumt), out=cumt)
        gamma = np.exp(cum, out=cum)
    else:
        cum = np.cumsum(to_chunks(g, length), axis=-1)
        ratios = decay_ratios(cum)
        qk = np.matmul(q, kt, out=scratch("gdn.qk", ratios.shape, q.dtype))
        kk = np.matmul(k, kt, out=scratch("gdn.kk", ratios.shape, q.dtype))
        qk *= ratios
        kk *= ratios
        np.copyto(kk, 0, where=_upper(length, 0))
        last = cum[..., -1:]
        gamma, to_end, through = np.exp(cum)[..., None], np.exp(last - cum)[..., None, :], np.exp(last)
    # (I + A) u = beta v - beta gamma k S0 with A = beta kk: u = T beta v - (T beta gamma k) S0. The
    # diagonal scalings go on T's columns where they can ([L, L] against [L, N] for k and v)
    kk *= beta[..., None]
    t = unit_lower_inverse(kk)
    t *= beta[..., None, :]
    u = np.matmul(t, v, out=scratch("gdn.u", q.shape, q.dtype))
    if per_channel:
        w = np.matmul(t, np.multiply(gamma, k, out=scratch("gdn.gk", q.shape, q.dtype)),
                      out=scratch("gdn.w", q.shape, q.dtype))
    else:
        t *= _swap(gamma)
        w = np.matmul(t, k, out=scratch("gdn.w", q.shape, q.dtype))
    kd = np.multiply(kt, to_end, out=kt)  # [..., N, L]
    count = q.shape[0]
    starts = scratch("gdn.starts", (count, *s.shape), s.dtype)  # the state entering each chunk
    starts[0] = s
    step, read = np.empty_like(s), np.empty_like(u[0])
    for c in range(count):
        u[c] -= np.matmul(w[c], starts[c], out=read)
        nxt = starts[c + 1] if c + 1 < count else s
        # the chunk's total decay: per head, or per key row of S
        np.multiply(starts[c], through[c][..., None], out=nxt)
        nxt += np.matmul(kd[c], u[c], out=step)
    scale = 1.0 / math.sqrt(n)
    if per_channel:
        qg = np.multiply(q, gamma, out=scratch("gdn.q", q.shape, q.dtype))
        qg *= scale
    else:
        qg = np.multiply(q, gamma * scale, out=scratch("gdn.q", q.shape, q.dtype))
    out = np.matmul(qg, starts, out=scratch("gdn.out", q.shape, q.dtype))
    qk *= scale
    out += np.matmul(qk, u, out=w)
    redo_nonfinite(out, starts, lambda q, k, v, g, beta, s, o: _step(q, k, v, g, beta, s, length, o),
                   lambda: [q, k, v, chunk_view(g, length), beta])
    np.copyto(dst, from_chunks(out, seq))


_PATHS = {"step": _step, "chunked": _chunked}


def _choose(thunk: Thunk, path: str | None, chunk: int | None) -> tuple[str, int]:
    length = chunk or CHUNK
    if length < LEAF or length & (length - 1):
        raise ValueError(f"gated_delta_net: chunk length must be a power of two >= {LEAF}, got {length}")
    return pick_path("gated_delta_net", path, thunk["seq"], STEP_MAX, "chunked"), length


def _parts(thunk: Thunk, name: str, workers: int | None) -> int:
    # the step path stays on one thread unless forced: its per-step arrays are too small to split
    # (B=2 S=1024 H=8 N=64: 73 ms on one thread, 105 ms on two)
    b, h, n = thunk["batch"], thunk["heads"], thunk["state_size"]
    work = 0 if name == "step" else b * thunk["seq"] * h * n * n
    return threads.parts_for("gated_delta_net", work, b, h, workers)


def path_for(thunk: Thunk, *, path: str | None = None, chunk: int | None = None, workers: int | None = None) -> str:
    """Name the path ``gated_delta_net`` runs ``thunk`` on: ``step`` or ``chunked L=32``, with
    ``, N threads`` when split across cores."""
    name, length = _choose(thunk, path, chunk)
    parts = _parts(thunk, name, workers)
    return (name if name == "step" else f"{name} L={length}") + (f", {parts} threads" if parts > 1 else "")


def gated_delta_net(thunk: Thunk, arena: np.ndarray, *, path: str | None = None, chunk: int | None = None,
                    workers: int | None = None) -> None:
    """Gated delta rule: ``S = exp(g) S``; ``u = beta (v - S^T k)``; ``S += k u^T``; ``out = S^T q / sqrt(N)``.

    ``path`` (``"step"`` or ``"chunked"``), ``chunk`` (a power-of-two chunk length) and ``workers``
    (threads over the batch x heads recurrences) override the choice. Any ``state_size`` is served
    (memory grows as ``N^2``).
    """
    name, length = _choose(thunk, path, chunk)
    n, carry = thunk["state_size"], thunk["carry_state"]

    def inputs(bound: Bound, bs: slice, hs: slice) -> list[np.ndarray]:
        q, k, v, g, beta = (bound.load(f, (bs, slice(None), hs)) for f in ("q", "k", "v", "g", "beta"))
        if not carry:
            return [q, k, v, g, beta, np.zeros((q.shape[0], q.shape[2], n, n), q.dtype)]
        s = bound.in_place("state", (bs, hs))  # updated where it lies when f32/f64: no 1 MiB copy in and out
        return [q, k, v, g, beta, bound.load("state", (bs, hs)) if s is None else s]

    run_blocks(thunk, arena, _PATHS[name], inputs, length, thunk["heads"], _parts(thunk, name, workers), carry)


def prepare(thunk: Thunk):
    """The thunk-only setup of ``gated_delta_net``, once (``host_fallback.PREPARE``): where its tensors lie.

    A carried state in f32 or f64 on the step path on one thread (decode) then runs straight on views
    of the arena: the inputs read where they lie, the state updated and the output written in place
    (ABI.md lets no output overlap an input), without the block machinery's loads, copies and stores,
    which cost about as much as the step itself at B8 H8 N64. Anything else runs ``gated_delta_net``.
    """
    fields = {r.field: (r.offset, r.dtype, r.shape) for r in regions(thunk)}
    direct = thunk["carry_state"] and STORAGE[thunk["dtype"]] == COMPUTE[thunk["dtype"]]

    def run(arena: np.ndarray, *, path: str | None = None, chunk: int | None = None, workers: int | None = None) -> None:
        name, length = _choose(thunk, path, chunk)
        if not direct or name != "step" or _parts(thunk, name, workers) > 1:
            gated_delta_net(thunk, arena, path=path, chunk=chunk, workers=workers)
            return
        q, k, v, g, beta, state, dst = (view(arena, *fields[f]) for f in ("q", "k", "v", "g", "beta", "state", "dst"))
        _step(q, k, v, g, beta, state, length, dst)
    return run


KERNELS = {"gated_delta_net": gated_delta_net}
PREPARE = {"gated_delta_net": prepare}
