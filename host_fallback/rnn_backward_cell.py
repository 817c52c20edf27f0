"""What one layer-direction's backward steps need besides the tensors (``rnn_backward``): its activations,
each with its derivative from the (clipped) pre-activation and the value, and the op's flags (``_Cell``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

Array = np.ndarray


# --- activations: the function and its derivative, from the (clipped) pre-activation u and the value y
def _sigmoid(u: Array) -> Array:
    with np.errstate(over="ignore"):  # exp(-u) = inf for very negative u gives σ = 0, as it should
        return 1.0 / (1.0 + np.exp(-u))


def _elu(u: Array, a: float) -> Array:
    return np.where(u >= 0, u, a * np.expm1(np.minimum(u, 0)))


def _hard_sigmoid(u: Array, a: float, b: float) -> Array:
    return np.clip(a * u + b, 0, 1)


_FUNCTIONS: dict[str, Callable[[Array, float, float], Array]] = {
    "sigmoid": lambda u, a, b: _sigmoid(u),
    "tanh": lambda u, a, b: np.tanh(u),
    "relu": lambda u, a, b: np.maximum(u, 0),
    "affine": lambda u, a, b: a * u + b,
    "leaky_relu": lambda u, a, b: np.where(u >= 0, u, a * u),
    "thresholded_relu": lambda u, a, b: np.where(u > a, u, 0),
    "scaled_tanh": lambda u, a, b: a * np.tanh(b * u),
    "hard_sigmoid": _hard_sigmoid,
    "elu": lambda u, a, b: _elu(u, a),
    "softsign": lambda u, a, b: u / (1 + np.abs(u)),
    "softplus": lambda u, a, b: np.logaddexp(0, u),
}
_DERIVATIVES: dict[str, Callable[[Array, Array, float, float], Array]] = {
    "sigmoid": lambda u, y, a, b: y * (1 - y),
    "tanh": lambda u, y, a, b: 1 - y * y,
    "relu": lambda u, y, a, b: (u > 0).astype(u.dtype),
    "affine": lambda u, y, a, b: np.full_like(u, a),
    "leaky_relu": lambda u, y, a, b: np.where(u >= 0, 1, a).astype(u.dtype),
    "thresholded_relu": lambda u, y, a, b: (u > a).astype(u.dtype),
    "scaled_tanh": lambda u, y, a, b: a * b * (1 - np.tanh(b * u) ** 2),
    "hard_sigmoid": lambda u, y, a, b: np.where((a * u + b >= 0) & (a * u + b <= 1), a, 0).astype(u.dtype),
    "elu": lambda u, y, a, b: np.where(u >= 0, 1, y + a).astype(u.dtype),
    "softsign": lambda u, y, a, b: 1 / (1 + np.abs(u)) ** 2,
    "softplus": lambda u, y, a, b: _sigmoid(u),
}


@dataclass(frozen=True)
class _Activation:
    name: str
    alpha: float
    beta: float

    def __call__(self, u: Array) -> Array:
        return _FUNCTIONS[self.name](u, self.alpha, self.beta).astype(u.dtype, copy=False)

    def slope(self, u: Array, y: Array) -> Array:
        return _DERIVATIVES[self.name](u, y, self.alpha, self.beta).astype(u.dtype, copy=False)

    def into(self, u: Array, out: Array) -> None:
        """``out = self(u)``; sigmoid and tanh without a temporary (``out`` may be ``u``)."""
        if self.name == "sigmoid":
            np.negative(u, out=out)
            with np.errstate(over="ignore"):  # exp(-u) = inf gives σ = 0, as it should
                np.exp(out, out=out)
            out += 1
            np.reciprocal(out, out=out)
        elif self.name == "tanh":
            np.tanh(u, out=out)
        else:
            out[...] = self(u)


@dataclass(frozen=True)
class _Cell:
    """What one layer-direction's steps need besides the tensors: its activations and the op's flags."""

    acts: tuple[_Activation, ...]  # this direction's slots: lstm f g h, gru f g, rnn f
    clip: float
    linear_before_reset: bool
    input_forget: bool

    def keeps_pre_activations(self, slots: int) -> bool:
        """Whether the reverse pass reads the gates' pre-activations: a clip's mask needs them, and so does
        the slope of any activation of the first ``slots`` slots but sigmoid and tanh (whose slopes follow
        from their values). Otherwise a gate is activated in place and only its value is kept."""
        return bool(self.clip) or any(a.name not in ("sigmoid", "tanh") for a in self.acts[:slots])

    def clipped(self, u: Array) -> tuple[Array, Array | None]:
        """``(u clamped to [-clip, clip], where the clamp passes the gradient)``; ``None``: no clip."""
        if not self.clip:
            return u, None
        return np.clip(u, -self.clip, self.clip), np.abs(u) <= self.clip

    def gate(self, slot: int, u: Array) -> tuple[Array, Array, Array | None]:
        """``(activation slot applied to the clipped u, the clipped u, the clamp's mask)``."""
        uc, mask = self.clipped(u)
        return self.acts[slot](uc), uc, mask

    def gate_into(self, slot: int, u: Array, out: Array, mask: Array | None) -> None:
        """Clip ``u`` in place (its gradient mask into ``mask``), then ``out = activation slot(u)``."""
        if self.clip:
            np.less_equal(np.abs(u), self.clip, out=mask)
            np.clip(u, -self.clip, self.clip, out=u)
        self.acts[slot].into(u, out)

    def grad_into(self, slot: int, dy: Array, uc: Array, y: Array, mask: Array | None, out: Array) -> None:
        """``out`` = the gradient of a gate pre-activation from its value's gradient ``dy`` (``grad``)."""
        np.multiply(dy, self.acts[slot].slope(uc, y), out=out)
        if mask is not None:
            out *= mask

    def grad(self, slot: int, dy: Array, uc: Array, y: Array, mask: Array | None) -> Array:
        """The gradient of a gate pre-activation from its value's gradient ``dy``."""
        out = dy * self.acts[slot].slope(uc, y)
        return out if mask is None else out * mask
