"""ABI.md §8's activation functions (the ``activations`` of lstm, gru and rnn) as NumPy kernels.

Each writes ``out = act(x)`` over a whole gate block (``out`` may be ``x``) and may use ``scratch``,
an array of x's shape that is neither; ``x`` is left unchanged unless it is ``out``. The recurrent
kernels pick one function per slot and layer-direction (``activation``), so no step branches per
element.

A sigmoid and a tanh have a second form for gate rows the kernels store pre-scaled, exactly (by a
power of two: ``stored_scale``): a sigmoid of rows that hold ``-z`` (``sigmoid_of_negated``) and a
tanh of rows that hold ``-2z`` (``tanh_of_scaled``, ``tanh(z) = 2σ(2z) - 1``), each one ``exp``, one
add and one division (and a subtraction). NumPy's ``exp`` takes about half the time of its ``tanh``
per element (f32; a third in f64), so where the gates of both kinds sit side by side one ``exp`` pass
serves them all (``sigmoid_then_tanh_of_scaled``), and a tanh of a wide block takes the same route
from ``z`` itself (``tanh_through_exp``). The absolute error of that route is within two ulps of 1
(NumPy's ``tanh`` keeps relative accuracy near 0), far inside the recurrences' error bounds.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

Activation = Callable[[np.ndarray, np.ndarray, np.ndarray], None]

#: Smallest block (elements) whose tanh runs faster through ``exp`` (four or five NumPy calls) than
#: through ``np.tanh`` (one): below it the calls' fixed cost decides.
EXP_TANH_MIN_ELEMENTS = 2048


def stored_scale(name: str, elements: int) -> float:
    """The factor to store the rows of a gate whose activation is ``name`` at, for blocks of
    ``elements``: -1 for a sigmoid, -2 for a tanh of a wide block, else 1 (as they are)."""
    if name == "sigmoid":
        return -1.0
    if name == "tanh" and elements >= EXP_TANH_MIN_ELEMENTS:
        return -2.0
    return 1.0


def _exp_plus_one(x: np.ndarray, out: np.ndarray) -> None:
    np.exp(x, out=out)
    out += 1


def sigmoid_of_negated(x: np.ndarray, out: np.ndarray, scratch: np.ndarray) -> None:
    """``x`` holds ``-z``: ``out = σ(z) = 1/(1+exp(-z))`` (exp(-z) = inf gives 0)."""
    _exp_plus_one(x, out)
    np.divide(1, out, out=out)


def _tanh_from_exp_plus_one(out: np.ndarray) -> None:
    np.divide(2, out, out=out)
    out -= 1


def tanh_of_scaled(x: np.ndarray, out: np.ndarray, scratch: np.ndarray) -> None:
    """``x`` holds ``-2z``: ``out = tanh(z) = 2/(1+exp(-2z)) - 1`` (exp(-2z) = inf gives -1)."""
    _exp_plus_one(x, out)
    _tanh_from_exp_plus_one(out)


def sigmoid_then_tanh_of_scaled(x: np.ndarray, split: int) -> None:
    """In place: rows ``[:split]`` of ``x`` hold ``-z`` and become ``σ(z)``, the rows below hold ``-2z``
    and become ``tanh(z)``; one ``exp`` and one add over all of them."""
    _exp_plus_one(x, x)
    np.divide(1, x[:split], out=x[:split])
    _tanh_from_exp_plus_one(x[split:])


def tanh_through_exp(x: np.ndarray, out: np.ndarray, scratch: np.ndarray) -> None:
    """``out = tanh(x)``: ``tanh_of_scaled`` of ``-2x``."""
    np.multiply(x, -2, out=out)
    tanh_of_scaled(out, out, scratch)


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


def activation(spec: Sequence[Any], scale: float, elements: int) -> Activation:
    """The function of one ``[name, alpha, beta]`` entry over blocks of ``elements``, its input rows
    stored at ``scale`` (``stored_scale``; 1: as they are)."""
    name, alpha, beta = spec
    if scale != 1:
        return {-1.0: sigmoid_of_negated, -2.0: tanh_of_scaled}[scale]
    if name == "tanh" and elements >= EXP_TANH_MIN_ELEMENTS:
        return tanh_through_exp
    return _ACTIVATIONS[name](float(alpha), float(beta))
