"""State-space ops of ABI.md §4: ``selective_scan`` (Mamba-1) and ``mamba2`` (SSD).

Each op has a step path (the recurrence, vectorized over batch, channels/heads and state) for
short sequences, and a fast path for long ones: ``selective_scan`` precomputes the decays and
inputs of a block of steps in bulk and runs a two-operation loop over it; ``mamba2`` uses the
chunked state-space-duality form. ``path_for(thunk)`` names the path a thunk gets. Both read
16-bit storage into f32 and round once on store.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from .chunked import decay_ratios, from_chunks, pick_path, to_chunks
from .layout import Bound

Thunk = Mapping[str, Any]

#: Steps per block of the blocked selective scan (its working set is two ``[T, B, H, N]`` arrays).
SCAN_BLOCK = 64
#: Longest sequence that takes the step path, measured with ``benchmarks/ssm.py --crossover``.
SCAN_STEP_MAX = 16
#: Default chunk length of the SSD form of mamba2.
MAMBA2_CHUNK = 64
#: Longest sequence that takes the mamba2 step path.
MAMBA2_STEP_MAX = 10


def _swap(x: np.ndarray) -> np.ndarray:
    return np.swapaxes(x, -1, -2)


def _scan_step(x, delta, a, b, c, block):
    bsz, seq, hidden = x.shape
    h = np.zeros((bsz, hidden, a.shape[1]), x.dtype)
    y = np.empty_like(x)
    for t in range(seq):
        d = delta[:, t, :, None]
        h = np.exp(d * a) * h + (d * x[:, t, :, None]) * b[:, t, None, :]
        y[:, t] = (h @ c[:, t, :, None])[..., 0]
    return y


def _scan_blocked(x, delta, a, b, c, block):
    bsz, seq, hidden = x.shape
    prev = np.zeros((bsz, hidden, a.shape[1]), x.dtype)
    y = np.empty_like(x)
    for t0 in range(0, seq, block):
        steps = slice(t0, min(seq, t0 + block))
        # time-major, so that each step of the loop below touches two contiguous [B, H, N] slabs
        d = np.moveaxis(delta[:, steps], 1, 0)[..., None]
        decay = np.exp(d * a)
        states = (d * np.moveaxis(x[:, steps], 1, 0)[..., None]) * np.moveaxis(b[:, steps], 1, 0)[:, :, None, :]
        for t in range(decay.shape[0]):
            np.multiply(decay[t], prev, out=decay[t])
            np.add(states[t], decay[t], out=states[t])
            prev = states[t]
        y[:, steps] = np.moveaxis((states @ np.moveaxis(c[:, steps], 1, 0)[..., None])[..., 0], 0, 1)
    return y


def _mamba2_step(x, dt, a, b, c, length):
    bsz, seq, heads, p = x.shape
    s = np.zeros((bsz, heads, p, b.shape[-1]), x.dtype)
    y = np.empty_like(x)
    for t in range(seq):
        s = np.exp(dt[:, t] * a)[..., None, None] * s + (dt[:, t, :, None] * x[:, t])[..., None] * b[:, t, :, None, :]
        y[:, t] = (s @ c[:, t, :, :, None])[..., 0]
    return y


def _mamba2_chunked(x, dt, a, b, c, length):
    xs = to_chunks(x * dt[..., None], length)  # [C, B, H, L, P]: the input each step adds, dt*x
    bs, cs = to_chunks(b, length), to_chunks(c, length)  # [C, B, H, L, N]
    cum = np.cumsum(to_chunks(dt * a, length), axis=-1)  # log-decay from the chunk start, inclusive
    # intra-chunk: y[l] = sum_{s<=l} (c_l . b_s) exp(cum_l - cum_s) dt_s x_s
    y = ((cs @ _swap(bs)) * decay_ratios(cum)) @ xs
    # the state each chunk builds from zero, decayed to its end
    local = _swap(xs * np.exp(cum[..., -1:] - cum)[..., None]) @ bs  # [C, B, H, P, N]
    through = np.exp(cum[..., -1])[..., None, None]
    starts = np.empty_like(local)
    state = np.zeros_like(local[0])
    for k in range(local.shape[0]):
        starts[k] = state
        state = through[k] * state + local[k]
    # state-to-output: the state entering the chunk, decayed to each step and read by c
    y += np.exp(cum)[..., None] * (cs @ _swap(starts))
    return from_chunks(y, x.shape[1])


_SCAN_PATHS: dict[str, Callable[..., np.ndarray]] = {"step": _scan_step, "blocked": _scan_blocked}
_MAMBA2_PATHS: dict[str, Callable[..., np.ndarray]] = {"step": _mamba2_step, "chunked": _mamba2_chunked}


def _choose(thunk: Thunk, path: str | None, chunk: int | None) -> tuple[str, int]:
    if thunk["op"] == "selective_scan":
        return pick_path("selective_scan", path, thunk["seq"], SCAN_STEP_MAX, "blocked"), chunk or SCAN_BLOCK
    return pick_path("mamba2", path, thunk["seq"], MAMBA2_STEP_MAX, "chunked"), chunk or MAMBA2_CHUNK


def path_for(thunk: Thunk, path: str | None = None, chunk: int | None = None, **_: Any) -> str:
    """Name the path ``selective_scan``/``mamba2`` runs ``thunk`` on: ``step``, ``blocked T=64``, ``chunked L=64``."""
    name, length = _choose(thunk, path, chunk)
    if name == "step":
        return name
    return f"{name} {'T' if name == 'blocked' else 'L'}={length}"


def selective_scan(thunk: Thunk, arena: np.ndarray, path: str | None = None, chunk: int | None = None, **_: Any) -> None:
    """Mamba-1: per channel ``h = exp(delta*a)*h + delta*b*x``, ``y = c . h``, from ``h = 0``.

    ``path`` (``"step"`` or ``"blocked"``) and ``chunk`` (steps per block) override the choice.
    """
    bound = Bound(thunk, arena)
    name, length = _choose(thunk, path, chunk)
    y = _SCAN_PATHS[name](*(bound.load(f) for f in ("x", "delta", "a", "b", "c")), length)
    bound.store("dst", y)


def mamba2(thunk: Thunk, arena: np.ndarray, path: str | None = None, chunk: int | None = None, **_: Any) -> None:
    """Mamba-2 (SSD): per head ``S = exp(dt*a)*S + (dt*x) (x) b``, ``y = S c``, from ``S = 0``.

    ``path`` (``"step"`` or ``"chunked"``) and ``chunk`` (chunk length) override the choice.
    """
    bound = Bound(thunk, arena)
    name, length = _choose(thunk, path, chunk)
    y = _MAMBA2_PATHS[name](*(bound.load(f) for f in ("x", "dt", "a", "b", "c")), length)
    bound.store("dst", y)


KERNELS = {"selective_scan": selective_scan, "mamba2": mamba2}
