"""A state-space op's saved forward (ABI.md §9.1) laid out for the tests: the backward thunk with a reserve, its
arena, and the forward thunk that fills that reserve; the forward run into a longer arena (its ``dst`` placed past
the backward's tensors), the reserve copied over, and the gradients read back."""
from __future__ import annotations


import numpy as np

import host_fallback
import rlx_gpu
from host_fallback.abi import regions

from .gradient_check import Sample, laid, read, with_gradients


def decaying_sampler(positive: str) -> Sample:
    """Inputs drawn from a normal law, the step ``positive`` (dt, delta) small and positive and ``a`` negative:
    every state decays."""
    def sample(field: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
        values = rng.standard_normal(shape)
        if field == positive:
            return np.abs(values) * 0.3 + 0.02
        return -np.abs(values) - 0.1 if field == "a" else values
    return sample


def laid_with_reserve(op: str, dtype: str, params: dict, sample: Sample) -> tuple[dict, np.ndarray, dict]:
    """``op``'s backward thunk with a reserve of ``rlx_gpu.reserve_bytes``, its arena (inputs drawn by ``sample``),
    and the forward thunk reading the same inputs and writing that reserve."""
    params = with_gradients(op, params)
    need = rlx_gpu.reserve_bytes({"op": op, "dtype": dtype, **params})
    thunk, arena = laid(f"{op}_backward", dtype, {**params, "reserve": True, "reserve_bytes": need}, sample)
    forward = {k: v for k, v in thunk.items() if not k.startswith("d_")}
    forward.update(op=op, dst=-(-arena.size // 16) * 16)
    return thunk, arena, forward


def run_forward(forward: dict, arena: np.ndarray, **options) -> np.ndarray:
    """The arena after ``forward``, lengthened to hold its ``dst``."""
    dst = next(r for r in regions(forward) if r.field == "dst")
    longer = np.zeros(dst.offset + dst.nbytes, np.uint8)
    longer[:arena.size] = arena
    host_fallback.execute(forward, longer, **options)
    return longer


def without_reserve(thunk: dict) -> dict:
    return {k: v for k, v in thunk.items() if k not in ("reserve", "reserve_bytes")}


def gradients(thunk: dict, arena: np.ndarray) -> dict[str, np.ndarray]:
    """The backward ``thunk``'s gradients (float64, by field) run on a copy of ``arena``."""
    out = arena.copy()
    host_fallback.execute(thunk, out)
    return {f: v for f, v in read(thunk, out).items() if f.startswith("d_") and f != "d_dst"}


def filled_reserve(thunk: dict, arena: np.ndarray, forward: dict, **options) -> np.ndarray:
    """A copy of ``arena`` whose reserve holds what ``forward`` (run with ``options``) wrote there."""
    start, end = thunk["reserve"], thunk["reserve"] + thunk["reserve_bytes"]
    out = arena.copy()
    out[start:end] = run_forward(forward, arena, **options)[start:end]
    return out


