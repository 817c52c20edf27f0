"""Checks shared by the tests of the backward ops (ABI.md §9): central finite differences of the float64
conformance reference's forward, and the inputs of a thunk copied into a wider one."""
from __future__ import annotations

from typing import Callable

import numpy as np

from host_fallback.abi import OPTIONAL_INPUTS, forward_thunk, gradient, regions
from host_fallback.arena import STORAGE, view
from rlx_gpu.conformance.cases import lay_out
from rlx_gpu.conformance.references import REFERENCES

Sample = Callable[[str, tuple[int, ...], np.random.Generator], np.ndarray]


def with_gradients(op: str, params: dict) -> dict:
    """``params`` of a backward thunk of the forward ``op``, with the gradient of every optional input they place."""
    return {**params, **{gradient(name): True for name in OPTIONAL_INPUTS[op] if params.get(name)}}


def laid(op: str, dtype: str, params: dict, sample: Sample, seed: int = 0) -> tuple[dict, np.ndarray]:
    """A thunk of ``op`` and its arena, every input (forward inputs, d_dst, the states' gradients) drawn by
    ``sample(field, shape, rng)`` and every integer tensor given by its list in ``params``."""
    thunk, nbytes = lay_out(op, dtype, params)
    rng = np.random.default_rng(seed)
    arena = np.zeros(nbytes, np.uint8)
    for r in regions(thunk):
        if r.dtype == "i32":
            view(arena, r.offset, r.dtype, r.shape)[...] = params[r.field]
        elif r.reads:
            view(arena, r.offset, r.dtype, r.shape)[...] = sample(r.field, r.shape, rng).astype(STORAGE[r.dtype])
    return thunk, arena


def read(thunk: dict, arena: np.ndarray) -> dict[str, np.ndarray]:
    """Every tensor of a laid-out thunk as float64 values, by field."""
    return {r.field: view(arena, r.offset, r.dtype, r.shape).astype(np.float64) for r in regions(thunk)}


def loss(thunk: dict, values: dict[str, np.ndarray]) -> float:
    """``Σ dst·d_dst`` plus ``Σ final·d_STATE`` for every carried state, with the reference forward of the
    backward ``thunk`` on ``values``."""
    forward = forward_thunk(thunk)
    out = REFERENCES[forward["op"]](forward, lambda f: values[f])
    return sum(float(np.sum(out[f] * values["d_dst" if f == "dst" else gradient(f)])) for f in out)


def check_finite_differences(thunk: dict, arena: np.ndarray, grads: dict[str, np.ndarray], seed: int = 0) -> None:
    """``grads`` (``d_NAME`` -> the backward's gradient) against central differences of ``loss`` along one
    random direction per input: one directional derivative covers every element of it."""
    values = read(thunk, arena)
    expected = {gradient(r.field) for r in regions(forward_thunk(thunk)) if r.field != "dst" and r.dtype != "i32"}
    assert set(grads) == expected
    rng = np.random.default_rng(seed + 1)
    eps = 1e-6
    for name, grad in grads.items():
        field = name[2:]
        direction = rng.standard_normal(values[field].shape)
        sides = [loss(thunk, {**values, field: values[field] + sign * eps * direction}) for sign in (1, -1)]
        numeric = (sides[0] - sides[1]) / (2 * eps)
        analytic = float(np.sum(grad * direction))
        scale = np.linalg.norm(grad) * np.linalg.norm(direction) + 1e-12
        assert abs(numeric - analytic) <= 1e-7 * scale, (thunk["op"], name, numeric, analytic)


def copy_inputs(thunk: dict, arena: np.ndarray, wide: dict, wide_arena: np.ndarray) -> None:
    """Give the f64 thunk ``wide`` the values the inputs of ``thunk`` store (same op, same fields)."""
    for r in regions(thunk):
        if r.reads and r.dtype != "i32":
            w = next(x for x in regions(wide) if x.field == r.field)
            view(wide_arena, w.offset, w.dtype, w.shape)[...] = view(arena, r.offset, r.dtype, r.shape)
