"""The costs of the causal_conv1d kernels (``launches/conv.py`` plans them; ``cost`` says how counted).

A depthwise convolution: per (token, channel) W multiply-adds of its window, no matrix product. The backward's
first launch recomputes each token's pre-activation (with silu) for its gradient g, walking each chunk from W-1
tokens past its end (their g only), then d_x (W multiply-adds of the g ahead) and the chunk's sums of d_weight's
terms (W more) and of g; the second adds the chunks' sums per channel; with carry the third takes the initial
state's gradient from the row's first W-1 tokens. Rows shorter than the window are counted as if full.
"""
from __future__ import annotations

from typing import Any, Mapping

from .core import Launch
from .cost import Cost, declare, real, stored, tokens

#: FLOPs of silu u/(1 + exp(-u)) (exp, add, division); of its derivative times g, g·s·(1 + u·(1 - s)) with
#: s = σ(u) (exp, add, division, then a subtraction, two multiplies, an add and a multiply)
_SILU, _SILU_BACK = 3, 8



def _chunks(args: Mapping[str, Any]) -> int:
    """The chunks of T tokens the launch's work-items walk."""
    return -(-tokens(args) // args["T"])


def _state(launch: Launch, args: Mapping[str, Any]) -> float:
    """Bytes of every row's state entry (W-1 values per channel), in the compute type where state_real says so."""
    return args["R"] * args["D"] * (args["W"] - 1) * (real(launch) if args["state_real"] else stored(launch))


def _params(launch: Launch, args: Mapping[str, Any]) -> float:
    """Bytes of the weight and the bias."""
    return args["D"] * (args["W"] + args["has_bias"]) * stored(launch)


def _pre_activation_grad(args: Mapping[str, Any]) -> int:
    """FLOPs of one token's g at one channel: with silu its pre-activation (W multiply-adds) and the derivative."""
    return (2 * args["W"] + _SILU_BACK) * args["silu"]


@declare("causal_conv1d")
def forward(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """Per (token, channel): bias + the W taps times the window, then silu; with carry each row's state read and
    its final one written."""
    values = tokens(args) * args["D"]
    state = _state(launch, args) if args["carry"] else 0
    return Cost(other=values * (2 * args["W"] + _SILU * args["silu"]),
                read=values * stored(launch) + _params(launch, args) + state,
                written=values * stored(launch) + state)


@declare("causal_conv1d_backward_dx")
def backward_dx(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """Per (token, channel): g, d_x from the W g ahead, the sums g·e over the window and of g; per chunk and channel
    the g of the W-1 tokens past its end again."""
    d, w = args["D"], args["W"]
    values, chunks = tokens(args) * d, _chunks(args)
    other = values * (_pre_activation_grad(args) + 4 * w + 1) + chunks * d * (w - 1) * _pre_activation_grad(args)
    state = _state(launch, args) if args["carry"] else 0
    read = 2 * values * stored(launch) + _params(launch, args) + 2 * state  # x, d_dst; the state and d_state
    return Cost(other=other, read=read, written=values * stored(launch) + chunks * d * (w + 1) * real(launch))


@declare("causal_conv1d_backward_weight")
def backward_weight(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """Per channel and each of d_weight's W terms and d_bias's: the chunks' sums added in chunk order."""
    d, w, chunks = args["D"], args["W"], args["chunks"]
    return Cost(other=d * (w + 1) * (chunks - 1), read=chunks * d * (w + 1) * real(launch),
                written=d * (w + args["has_bias"]) * stored(launch))


@declare("causal_conv1d_backward_state")
def backward_state(launch: Launch, args: Mapping[str, Any]) -> Cost:
    """Per (row, channel): g of the row's first W-1 tokens, then position k < W-1 of the initial state's gradient
    sums k + 1 taps times those g."""
    rows, d, w = args["R"], args["D"], args["W"]
    other = rows * d * ((w - 1) * _pre_activation_grad(args) + w * (w - 1))
    early = rows * (w - 1) * d * stored(launch)  # x and d_dst of the row's first W-1 tokens
    read = 2 * early + _params(launch, args) + 2 * _state(launch, args)
    return Cost(other=other, read=read, written=_state(launch, args))
