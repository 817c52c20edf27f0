"""Dao-AILab causal-conv1d's functions with its signatures and layouts, on rlx_gpu's ``causal_conv1d`` op.

``causal_conv1d_fn`` (differentiable) and ``causal_conv1d_update`` (a decode step, in place on the cache, as
the anchor's) take ``x`` as ``(batch, dim, seqlen)`` (any strides: a channel-last view too) and map it onto the
op's token-major ``[B,S,D]`` (ABI.md §10) with a transpose, which ``torch.compile`` traces around the opaque
op. ``seq_idx`` becomes the op's packed sequences (``cu_seqlens``) over the flattened batch; a cache of any
``state_len >= width-1`` (Hugging Face keeps ``width`` columns, vLLM ``width-1``) feeds its last ``width-1``
columns to the convolution and shifts as a whole.
"""
from __future__ import annotations

from typing import Any

import torch

from .arguments import check_state_batch_indices
from .fused import FusedOp, cast, define_fused
from .registry import FUNCTIONS

_CAUSAL_CONV1D = define_fused(FusedOp("causal_conv1d", ("x", "weight"), ("bias", "state", "cu_seqlens"),
                                      (("activation", "str?"),), "x"))

__all__ = ["causal_conv1d_fn", "causal_conv1d_update"]


def _activation(name: str, activation: Any) -> str | None:
    if activation not in (None, "silu", "swish"):
        raise NotImplementedError(f"{name}: activation={activation!r}; expected None, 'silu' or 'swish'")
    return None if activation is None else "silu"


def _packed(seq_idx: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """``cu_seqlens`` (int32) of the ``batch * seqlen`` flattened tokens: a sequence starts at every row's start
    and wherever ``seq_idx`` changes within a row."""
    idx = seq_idx.reshape(batch, seqlen)
    starts = torch.ones_like(idx, dtype=torch.bool)
    starts[:, 1:] = idx[:, 1:] != idx[:, :-1]
    first = torch.nonzero(starts.reshape(-1)).reshape(-1)
    return torch.cat([first, first.new_tensor([batch * seqlen])]).to(device=seq_idx.device, dtype=torch.int32)


@FUNCTIONS.register("causal_conv1d")
def causal_conv1d_fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     seq_idx: torch.Tensor | None = None, initial_states: torch.Tensor | None = None,
                     return_final_states: bool = False, final_states_out: torch.Tensor | None = None,
                     activation: str | None = None) -> Any:
    """``out = act(conv1d(x, weight, bias, padding=width-1, groups=dim)[..., :seqlen])`` per row, from
    ``initial_states (batch, dim, width-1)`` instead of zero padding when given; ``x (batch, dim, seqlen)``,
    ``weight (dim, width)`` with ``2 <= width <= 8``. Returns ``out (batch, dim, seqlen)``, and with
    ``return_final_states`` ``(out, final_states)``, the last ``width-1`` inputs of each row (written into
    ``final_states_out`` when given). ``seq_idx (batch, seqlen)`` restarts the convolution wherever it changes."""
    name = "causal_conv1d_fn"
    act = _activation(name, activation)
    batch, dim, seqlen = x.shape
    tokens = x.transpose(1, 2)
    cu = None
    if seq_idx is not None:
        if initial_states is not None or return_final_states:
            raise NotImplementedError(f"{name}: seq_idx with initial_states or return_final_states is not supported "
                                      "(as in Dao-AILab causal-conv1d)")
        cu = _packed(seq_idx, batch, seqlen)
        tokens = tokens.reshape(1, batch * seqlen, dim)
    state = None
    if initial_states is not None:
        state = cast(initial_states, x.dtype)
    elif return_final_states:
        state = x.new_zeros((batch, dim, weight.shape[1] - 1))
    y, final = _CAUSAL_CONV1D(tokens, cast(weight, x.dtype), cast(bias, x.dtype), state, cu, act)
    out = y.reshape(batch, seqlen, dim).transpose(1, 2)
    if not return_final_states:
        return out
    if final_states_out is not None:
        final_states_out.copy_(final)
        final = final_states_out
    return out, final


@FUNCTIONS.register("causal_conv1d")
def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None, activation: str | None = None,
                         cache_seqlens: torch.Tensor | None = None,
                         conv_state_indices: torch.Tensor | None = None) -> torch.Tensor:
    """A decode step on the cache: ``x (batch, dim)`` or ``(batch, dim, seqlen)``, ``conv_state (entries, dim,
    state_len)`` with ``state_len >= width-1``, updated in place (row ``b`` uses entry ``conv_state_indices[b]``,
    else ``b``): its last ``width-1`` columns precede ``x``, then the whole buffer shifts left by ``seqlen`` with
    ``x`` appended. Returns ``out`` shaped like ``x``."""
    name = "causal_conv1d_update"
    if cache_seqlens is not None:
        raise NotImplementedError(f"{name}: cache_seqlens (a ring-buffer cache) is not supported; rlx_gpu keeps the "
                                  "shifted cache of ABI.md §10: pass cache_seqlens=None")
    act = _activation(name, activation)
    steps = x.unsqueeze(-1) if x.dim() == 2 else x
    width, state_len = weight.shape[1], conv_state.shape[-1]
    if state_len < width - 1:
        raise ValueError(f"{name}: conv_state holds {state_len} columns; width {width} needs at least {width - 1}")
    if conv_state_indices is not None and not torch.compiler.is_compiling():  # traced, the indices are trusted
        check_state_batch_indices(name, conv_state_indices, conv_state.shape[0], "conv_state_indices", "conv_state")
    rows = (torch.arange(x.shape[0], device=conv_state.device) if conv_state_indices is None
            else conv_state_indices.to(device=conv_state.device, dtype=torch.long))
    cache = conv_state[rows]
    window = cast(cache[..., state_len - (width - 1):], x.dtype)
    y, _ = _CAUSAL_CONV1D(steps.transpose(1, 2), cast(weight, x.dtype), cast(bias, x.dtype), window, None, act)
    conv_state[rows] = torch.cat([cache, cast(steps, conv_state.dtype)], dim=-1)[..., -state_len:]
    out = y.transpose(1, 2)
    return out.squeeze(-1) if x.dim() == 2 else out
