"""State-space ops of ABI.md §4: ``selective_scan`` (Mamba-1) and ``mamba2`` (SSD).

Each op has a step path (the recurrence, vectorized over batch, channels/heads and state) for
short sequences, and a fast path for long ones: ``selective_scan`` precomputes the decays and
inputs of a block of steps in bulk and runs a two-operation loop over it; ``mamba2`` uses the
chunked state-space-duality form. Long sequences run blocks of batch items and channels (heads) on
several threads (``chunked.run_blocks``). ``path_for(thunk)`` names the path a thunk gets. Both read
16-bit storage into f32 and round once on store.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from . import threads
from .chunked import (chunk_view, decay_ratios, floor_log_decays, from_chunks, pick_path, redo_nonfinite,
                      run_blocks, scratch, to_chunks, to_chunks_t)
from .layout import Bound

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


def _swap(x: np.ndarray) -> np.ndarray:
    return np.swapaxes(x, -1, -2)


def _scan_step(x, delta, a, b, c, block, y):
    bsz, seq, hidden = x.shape
    h = np.zeros((bsz, hidden, a.shape[1]), x.dtype)
    for t in range(seq):
        d = delta[:, t, :, None]
        h = np.exp(d * a) * h + (d * x[:, t, :, None]) * b[:, t, None, :]
        y[:, t] = (h @ c[:, t, :, None])[..., 0]


def _scan_blocked(x, delta, a, b, c, block, dst):
    # state-major [B, N, H] states, so that every broadcast below runs along the H contiguous
    # channels (with H innermost a multiply broadcasts over only N values per inner loop)
    bsz, seq, hidden = x.shape
    at = np.ascontiguousarray(a.T)  # [N, H]
    dt = np.ascontiguousarray(np.moveaxis(delta, 1, 0))[:, :, None, :]  # [S, B, 1, H]
    dx = dt * np.moveaxis(x, 1, 0)[:, :, None, :]  # [S, B, 1, H]: delta * x
    bt = np.moveaxis(b, 1, 0)[..., None]  # [S, B, N, 1]
    ct = np.moveaxis(c, 1, 0)[:, :, None, :]  # [S, B, 1, N]
    prev = np.zeros((bsz, a.shape[1], hidden), x.dtype)
    y = np.empty((seq, bsz, hidden), x.dtype)
    for t0 in range(0, seq, block):
        steps = slice(t0, min(seq, t0 + block))
        decay = np.multiply(dt[steps], at)
        np.exp(decay, out=decay)
        states = dx[steps] * bt[steps]  # [T, B, N, H]
        for t in range(decay.shape[0]):
            np.multiply(decay[t], prev, out=decay[t])
            np.add(states[t], decay[t], out=states[t])
            prev = states[t]
        y[steps] = (ct[steps] @ states)[:, :, 0, :]
    np.copyto(dst, np.moveaxis(y, 0, 1))


def _ssd_steps(logd, xs, b, c, s, y):
    """The SSD recurrence from the state ``s [B, H, P, N]`` (updated in place): per step ``t`` (axis
    1 of ``logd [B, S, H]``, ``xs [B, S, H, P]`` = dt*x, ``b, c [B, S, H, N]``)
    ``s = exp(logd) s + xs (x) b`` and ``y[:, t] = s c``."""
    for t in range(logd.shape[1]):
        s *= np.exp(logd[:, t])[..., None, None]
        s += xs[:, t, ..., None] * b[:, t, ..., None, :]
        y[:, t] = (s @ c[:, t, ..., None])[..., 0]


def _mamba2_step(x, dt, a, b, c, length, y):
    s = np.zeros((x.shape[0], x.shape[2], x.shape[3], b.shape[-1]), x.dtype)
    _ssd_steps(dt * a, dt[..., None] * x, b, c, s, y)


def _ssd_factored(xs, cum, b, c, scores, y, local):
    """The SSD terms of each chunk with its decay ratios factored through its midpoint ``m``:
    ``exp(cum_l - cum_s) = exp(cum_l - m) exp(m - cum_s)``, so the decayed scores are one GEMM of
    ``c exp(cum - m)`` by ``b exp(m - cum)``. Writes the intra-chunk outputs ``y``, and ``local``,
    the state each chunk builds from zero decayed to its end, transposed (``[..., N, P]``); returns
    ``c exp(cum)``, with which ``c`` reads the state entering the chunk.

    ``b`` is chunked ``[..., L, N]`` and read transposed; every GEMM operand is laid out as the GEMM
    reads it (OpenBLAS runs transposed small GEMMs far slower)."""
    length, n = cum.shape[-1], b.shape[-1]
    mid = cum[..., (length - 1) // 2 : (length + 1) // 2]
    cs = np.multiply(c, np.exp(cum - mid)[..., None], out=scratch("m2.cs", c.shape, c.dtype))
    bt = scratch("m2.bt", (*cum.shape[:-1], n, length), b.dtype)
    np.multiply(_swap(b), np.exp(mid - cum)[..., None, :], out=bt)
    np.matmul(cs, bt, out=scores)
    np.copyto(scores, 0, where=_strict_upper(length))
    np.matmul(scores, xs, out=y)
    np.matmul(bt, xs, out=local)
    local *= np.exp(cum[..., -1:] - mid)[..., None]
    cs *= np.exp(mid)[..., None]
    return cs


def _ssd_masked(xs, cum, cs, bt, scores, y, local):
    """``_ssd_factored`` with every decay ratio formed on its own (``chunked.decay_ratios``), for
    chunks whose decays span too wide a range to factor; ``cs [..., L, N]`` (``c``, scaled in place
    and returned) and ``bt [..., N, L]`` (``b`` transposed) are contiguous."""
    np.matmul(cs, bt, out=scores)
    scores *= decay_ratios(cum)
    np.matmul(scores, xs, out=y)
    np.matmul(bt, xs * np.exp(cum[..., -1:] - cum)[..., None], out=local)
    cs *= np.exp(cum)[..., None]
    return cs


def _mamba2_chunked(x, dt, a, b, c, length, dst):
    # the big intermediates live in reused scratch arrays (see chunked.scratch)
    seq, p, n = x.shape[1], x.shape[-1], b.shape[-1]
    logd = floor_log_decays(dt * a)
    xdt = np.multiply(x, dt[..., None], out=scratch("m2.xdt", x.shape, x.dtype))
    xs = chunk_view(xdt, length)  # [C, B, H, L, P]: the input each step adds, dt*x
    steps = to_chunks(logd, length)  # [C, B, H, L]
    cum = np.cumsum(steps, axis=-1)  # log-decay from the chunk start, inclusive
    lead = cum.shape[:3]
    scores = scratch("m2.scores", (*lead, length, length), x.dtype)
    y = scratch("m2.y", (*lead, length, p), x.dtype)
    local = scratch("m2.local", (*lead, n, p), x.dtype)
    # a chunk factors where |cum - m| <= max|logd| (L/2 + 1) <= MAMBA2_SPREAD (NaN: it does not);
    # decided chunk by chunk, so one lane's values never change another lane's arithmetic
    factored = np.max(np.abs(steps), axis=-1) * (length // 2 + 1) <= MAMBA2_SPREAD
    if not factored.any():
        cs = _ssd_masked(xs, cum, to_chunks(c, length), to_chunks_t(b, length), scores, y, local)
    else:
        with np.errstate(over="ignore", invalid="ignore"):  # the chunks that do not factor are redone
            cs = _ssd_factored(xs, cum, to_chunks(b, length), chunk_view(c, length), scores, y, local)
        if not factored.all():
            pick = np.nonzero(~factored)
            part = [np.empty_like(t[pick]) for t in (scores, y, local)]
            bt = np.ascontiguousarray(_swap(chunk_view(b, length)[pick]))
            cs[pick] = _ssd_masked(xs[pick], cum[pick], chunk_view(c, length)[pick], bt, *part)
            y[pick], local[pick] = part[1], part[2]
    through = np.exp(cum[..., -1])[..., None, None]
    starts = scratch("m2.starts", local.shape, x.dtype)  # the state entering each chunk, [N, P]
    starts[0] = 0
    for k in range(local.shape[0] - 1):
        np.multiply(through[k], starts[k], out=starts[k + 1])
        starts[k + 1] += local[k]
    # state-to-output: the state entering the chunk, decayed to each step and read by c
    y += np.matmul(cs, starts, out=scores if length == p else None)
    redo_nonfinite(y, starts, _ssd_steps_transposed, lambda: [steps, xs, chunk_view(b, length), chunk_view(c, length)])
    np.copyto(dst, from_chunks(y, seq))


def _ssd_steps_transposed(logd, xs, b, c, s, y):
    """``_ssd_steps`` from a state given transposed, ``[..., N, P]`` (the chunked path's layout)."""
    _ssd_steps(logd, xs, b, c, np.ascontiguousarray(_swap(s)), y)


_UPPER: dict[int, np.ndarray] = {}


def _strict_upper(length: int) -> np.ndarray:
    if length not in _UPPER:
        _UPPER[length] = np.triu(np.ones((length, length), bool), 1)
    return _UPPER[length]


_SCAN_PATHS: dict[str, Callable[..., None]] = {"step": _scan_step, "blocked": _scan_blocked}
_MAMBA2_PATHS: dict[str, Callable[..., None]] = {"step": _mamba2_step, "chunked": _mamba2_chunked}


def _choose(thunk: Thunk, path: str | None, chunk: int | None) -> tuple[str, int]:
    if thunk["op"] == "selective_scan":
        return pick_path("selective_scan", path, thunk["seq"], SCAN_STEP_MAX, "blocked"), chunk or SCAN_BLOCK
    return pick_path("mamba2", path, thunk["seq"], MAMBA2_STEP_MAX, "chunked"), chunk or MAMBA2_CHUNK


#: Weight of one selective_scan state element against a multiply-add in ``threads.SPLIT_MIN_WORK``:
#: each costs an exp and passes over strided bulk arrays (B=2 H=256 N=16, one thread / two: seq 128
#: 2.3 / 2.7 ms, seq 256 4.2 / 3.8 ms).
SCAN_ELEMENT_WORK = 8


def _parts(thunk: Thunk, name: str, workers: int | None) -> int:
    # the step paths stay on one thread unless forced: their per-step arrays are too small to split
    # (B=2 S=1024: selective_scan 27 ms on one thread, 38 on two; mamba2 66 ms, 84)
    b, n = thunk["batch"], thunk["state_size"]
    units, per_unit = ((thunk["hidden"], n * SCAN_ELEMENT_WORK) if thunk["op"] == "selective_scan" else
                       (thunk["heads"], thunk["head_dim"] * n))
    work = 0 if name == "step" else b * thunk["seq"] * units * per_unit
    return threads.parts_for(thunk["op"], work, b, units, workers)


def path_for(thunk: Thunk, *, path: str | None = None, chunk: int | None = None, workers: int | None = None) -> str:
    """Name the path ``selective_scan``/``mamba2`` runs ``thunk`` on: ``step``, ``blocked T=64``,
    ``chunked L=64``, with ``, N threads`` when split across cores."""
    name, length = _choose(thunk, path, chunk)
    parts = _parts(thunk, name, workers)
    label = name if name == "step" else f"{name} {'T' if name == 'blocked' else 'L'}={length}"
    return label + (f", {parts} threads" if parts > 1 else "")


def selective_scan(thunk: Thunk, arena: np.ndarray, *, path: str | None = None, chunk: int | None = None,
                   workers: int | None = None) -> None:
    """Mamba-1: per channel ``h = exp(delta*a)*h + delta*b*x``, ``y = c . h``, from ``h = 0``.

    ``path`` (``"step"`` or ``"blocked"``), ``chunk`` (steps per block) and ``workers`` (threads
    over the batch x channel recurrences) override the choice.
    """
    name, length = _choose(thunk, path, chunk)

    def inputs(bound: Bound, bs: slice, hs: slice) -> list[np.ndarray]:
        rows = (bs, slice(None), hs)
        return [bound.load("x", rows), bound.load("delta", rows), bound.load("a", hs), bound.load("b", bs),
                bound.load("c", bs)]

    run_blocks(thunk, arena, _SCAN_PATHS[name], inputs, length, thunk["hidden"], _parts(thunk, name, workers))


def mamba2(thunk: Thunk, arena: np.ndarray, *, path: str | None = None, chunk: int | None = None,
           workers: int | None = None) -> None:
    """Mamba-2 (SSD): per head ``S = exp(dt*a)*S + (dt*x) (x) b``, ``y = S c``, from ``S = 0``.

    ``path`` (``"step"`` or ``"chunked"``), ``chunk`` (chunk length) and ``workers`` (threads over
    the batch x heads recurrences) override the choice.
    """
    name, length = _choose(thunk, path, chunk)

    def inputs(bound: Bound, bs: slice, hs: slice) -> list[np.ndarray]:
        rows = (bs, slice(None), hs)
        return [bound.load(f, rows) for f in ("x", "dt")] + [bound.load("a", hs)] + [bound.load(f, rows) for f in "bc"]

    run_blocks(thunk, arena, _MAMBA2_PATHS[name], inputs, length, thunk["heads"], _parts(thunk, name, workers))


KERNELS = {"selective_scan": selective_scan, "mamba2": mamba2}
