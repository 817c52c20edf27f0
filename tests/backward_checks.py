"""What the backward-op tests share: laying a thunk out, the loss of its forward and its directional derivatives.

A backward thunk (ABI.md §9) gives the gradient of ``L = Σ dst·d_dst (+ Σ final state·d_state)``; the
float64 conformance reference of its forward evaluates ``L`` (independent of the host kernels), and
one central finite difference along a random direction per input checks every element of that
input's gradient at once (an error shows unless it is orthogonal to a random vector).
"""
from __future__ import annotations

import numpy as np

from host_fallback.arena import STORAGE, view
from host_fallback.gradients import gradient
from host_fallback.layout import forward_thunk, regions
from rlx_gpu.conformance.cases import lay_out
from rlx_gpu.conformance.references import REFERENCES


def reference_loss(thunk: dict, values: dict[str, np.ndarray]) -> float:
    """``Σ dst·d_dst`` plus each final state times its gradient field, by the float64 reference forward."""
    forward = forward_thunk(thunk)
    out = REFERENCES[forward["op"]](forward, lambda f: values[f])
    return sum(float(np.sum(out[f] * values["d_dst" if f == "dst" else gradient(f)])) for f in out)


def assert_finite_differences(thunk: dict, values: dict[str, np.ndarray], grads: dict[str, np.ndarray], seed: int,
                              label: str, eps: float = 1e-6, tolerance: float = 1e-7) -> None:
    """Every ``d_NAME`` of ``grads`` against the central difference of ``reference_loss`` along a random
    direction of ``NAME``, relative to ``|grad| |direction|``."""
    rng = np.random.default_rng(seed)
    for name, grad in grads.items():
        field = name[2:]
        direction = rng.standard_normal(values[field].shape)
        sides = [reference_loss(thunk, {**values, field: values[field] + sign * eps * direction}) for sign in (1, -1)]
        numeric = (sides[0] - sides[1]) / (2 * eps)
        analytic = float(np.sum(grad * direction))
        scale = np.linalg.norm(grad) * np.linalg.norm(direction) + 1e-12
        assert abs(numeric - analytic) <= tolerance * scale, (label, name, numeric, analytic)


def laid_out(op: str, dtype: str, params: dict, sampler, seed: int = 0) -> tuple[dict, np.ndarray]:
    """A thunk of ``op`` and its arena: integer tensors from ``params``, every other input
    ``sampler(field, shape, rng)`` rounded into its element type, outputs zero."""
    thunk, nbytes = lay_out(op, dtype, dict(params))
    rng = np.random.default_rng(seed)
    arena = np.zeros(nbytes, np.uint8)
    for r in regions(thunk):
        if r.dtype == "i32":
            view(arena, r.offset, r.dtype, r.shape)[...] = params[r.field]
        elif r.reads:
            view(arena, r.offset, r.dtype, r.shape)[...] = sampler(r.field, r.shape, rng).astype(STORAGE[r.dtype])
    return thunk, arena


def read(thunk: dict, arena: np.ndarray) -> dict[str, np.ndarray]:
    """Every tensor of ``thunk`` in ``arena`` as float64."""
    return {r.field: view(arena, r.offset, r.dtype, r.shape).astype(np.float64) for r in regions(thunk)}
