"""ABI.md §8's activation functions (the ``activations`` of lstm, gru and rnn) as NumPy kernels.

Each writes ``out = act(x)`` over a whole gate block (``out`` may be ``x``) and may use ``scratch``,
an array of x's shape that is neither; ``x`` is left unchanged unless it is ``out``. The recurrent
kernels pick one function per slot and layer-direction (``activation``), so no step branches per
element. A sigmoid has a second form for rows that hold ``-z`` (``sigmoid_of_negated``): one ``exp``,
one add and one division.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

Activation = Callable[[np.ndarray, np.ndarray, np.ndarray], None]


def sigmoid_of_negated(x: np.ndarray, out: np.ndarray, scratch: np.ndarray) -> None:
    """``x`` holds ``-z``: ``out = σ(z) = 1/(1+exp(-z))`` (exp(-z) = inf gives 0)."""
    np.exp(x, out=out)
    out += 1
    np.divide(1, out, out=out)


def _sigmoid(x: np.ndarray, out: np.ndarray, scratch: np.ndarray) -> None:
    np.negative(x, out=out)
    sigmoid_of_negated(out, out, scratch)


def _tanh(x, out, scratch):
    np.tanh(x, out=out)


def _relu(x, out, scratch):
    np.maximum(x, 0, out=out)


def _softsign(x, out, scratch):
    np.abs(x, out=scratch)
    scratch += 1
    np.divide(x, scratch, out=out)


def _softplus(x, out, scratch):
    np.logaddexp(x, 0, out=out)  # log(1 + e^x) without overflowing e^x


def _affine(alpha: float, beta: float) -> Activation:
    def act(x, out, scratch):
        np.multiply(x, alpha, out=out)
        out += beta
    return act


def _leaky_relu(alpha: float, beta: float) -> Activation:
    # x >= 0 ? x : αx is max(x, αx) for α <= 1 and min(x, αx) above
    pick = np.maximum if alpha <= 1 else np.minimum

    def act(x, out, scratch):
        np.multiply(x, alpha, out=scratch)
        pick(x, scratch, out=out)
    return act


def _thresholded_relu(alpha: float, beta: float) -> Activation:
    def act(x, out, scratch):
        keep = x > alpha  # NaN and -inf are not above α: 0, as the formula says
        np.copyto(out, x)
        np.copyto(out, 0, where=~keep)
    return act


def _scaled_tanh(alpha: float, beta: float) -> Activation:
    def act(x, out, scratch):
        np.multiply(x, beta, out=out)
        np.tanh(out, out=out)
        out *= alpha
    return act


def _hard_sigmoid(alpha: float, beta: float) -> Activation:
    def act(x, out, scratch):
        np.multiply(x, alpha, out=out)
        out += beta
        np.clip(out, 0, 1, out=out)
    return act


def _elu(alpha: float, beta: float) -> Activation:
    def act(x, out, scratch):  # max(x, 0) + α·(exp(min(x, 0)) - 1)
        np.minimum(x, 0, out=scratch)
        np.expm1(scratch, out=scratch)
        scratch *= alpha
        np.maximum(x, 0, out=out)
        out += scratch
    return act


def _plain(fn: Activation) -> Callable[[float, float], Activation]:
    return lambda alpha, beta: fn


#: ABI.md §8's activations: name -> ``make(alpha, beta)``.
_ACTIVATIONS: dict[str, Callable[[float, float], Activation]] = {
    "sigmoid": _plain(_sigmoid), "tanh": _plain(_tanh), "relu": _plain(_relu), "affine": _affine,
    "leaky_relu": _leaky_relu, "thresholded_relu": _thresholded_relu, "scaled_tanh": _scaled_tanh,
    "hard_sigmoid": _hard_sigmoid, "elu": _elu, "softsign": _plain(_softsign), "softplus": _plain(_softplus),
}


def activation(spec: Sequence[Any], negated: bool) -> Activation:
    """The function of one ``[name, alpha, beta]`` entry; ``negated``: its input rows hold ``-z``
    (only a sigmoid's rows are ever negated)."""
    name, alpha, beta = spec
    if negated:
        return sigmoid_of_negated
    return _ACTIVATIONS[name](float(alpha), float(beta))
