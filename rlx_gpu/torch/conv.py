"""Dao-AILab causal-conv1d's functions with its signatures and layouts, on rlx_gpu's ``causal_conv1d`` op.

``causal_conv1d_fn`` (differentiable) and ``causal_conv1d_update`` (a decode step, in place on the cache, as
the anchor's) take ``x`` as ``(batch, dim, seqlen)`` (any strides: a channel-last view too) and map it onto the
op's token-major ``[B,S,D]`` (ABI.md §10) with a transpose, which ``torch.compile`` traces around the opaque
op. ``seq_idx`` becomes the op's packed sequences (``cu_seqlens``) over the flattened batch, by
``rlx_gpu::packed_rows`` (so ``torch.compile(fullgraph=True)`` traces it: a size known when it runs). The decode step
is its own op, ``torch.ops.rlx_gpu.causal_conv1d_update``, writing the cache in place: one ``causal_conv1d``
call with a carried state on the whole pool (the cache's slot indices its ``state_slots``); a cache of any
``state_len >= width-1`` (Hugging Face keeps ``width`` columns, vLLM ``width-1``) feeds its last ``width-1``
columns to the convolution and shifts as a whole.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
from torch.autograd.graph import increment_version

from .arguments import check_causal_conv1d_fn, check_causal_conv1d_update, check_seq_idx, check_state_batch_indices
from .bridge import (CPU, DTYPES, UNBUILT, BoundCall, Spec, _last, bound_call, call_key, default_device, device_for,
                     host_array, hot_path, keep_hot_path, on_cuda, plan_for, rlx_dtype, run_arrays, stamp, tensor)
from .fused import FINAL_STATE, FusedCall, FusedOp, call_of, cast, define_fused, forward_graph
from .library import PLAIN, define, dense, direct, runs_directly
from .registry import FUNCTIONS
from .written import written_call
from .ssm import _PACKED_ROWS

_CAUSAL_CONV1D = define_fused(FusedOp("causal_conv1d", ("x", "weight"), ("bias", "state", "cu_seqlens"),
                                      (("activation", "str?"),), "x"))

__all__ = ["causal_conv1d_fn", "causal_conv1d_update"]


def _activation(name: str, activation: Any) -> str | None:
    if activation not in (None, "silu", "swish"):
        raise NotImplementedError(f"{name}: activation={activation!r}; expected None, 'silu' or 'swish'")
    return None if activation is None else "silu"


@FUNCTIONS.register("causal_conv1d")
def causal_conv1d_fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     seq_idx: torch.Tensor | None = None, initial_states: torch.Tensor | None = None,
                     return_final_states: bool = False, final_states_out: torch.Tensor | None = None,
                     activation: str | None = None) -> Any:
    """``out = act(conv1d(x, weight, bias, padding=width-1, groups=dim)[..., :seqlen])`` per row, from
    ``initial_states (batch, dim, width-1)`` instead of zero padding when given; ``x (batch, dim, seqlen)``,
    ``weight (dim, width)`` with ``2 <= width <= 8``. Returns ``out (batch, dim, seqlen)``, and with
    ``return_final_states`` ``(out, final_states)``, the last ``width-1`` inputs of each row (written into
    ``final_states_out`` when given). ``seq_idx (batch, seqlen)``, not decreasing along a row, restarts the
    convolution wherever it changes: the rows' sequences are packed end to end (``rlx_gpu::packed_rows``, as
    ``mamba_chunk_scan_combined`` does), a row's initial state feeding its first sequence and its final state
    its last sequence's (Dao-AILab's refuses states with ``seq_idx``; mamba_ssm's scan takes them so)."""
    name = "causal_conv1d_fn"
    check_causal_conv1d_fn(x, weight, bias, seq_idx, initial_states, final_states_out)
    act = _activation(name, activation)
    batch, dim, seqlen = x.shape
    tokens = x.transpose(1, 2)
    cu = first = last = None
    state = None
    if initial_states is not None:
        state = cast(initial_states, x.dtype)
    elif return_final_states:
        state = x.new_zeros((batch, dim, weight.shape[1] - 1))
    if seq_idx is not None:  # the rows' sequences packed end to end, a state entry each
        if not torch.compiler.is_compiling():  # named after this function (traced, the indices are trusted)
            check_seq_idx(name, seq_idx)
        cu, first, last = _PACKED_ROWS(seq_idx)
        tokens = tokens.reshape(1, batch * seqlen, dim)
        if state is not None:
            pool = x.new_zeros((cu.shape[0] - 1, dim, weight.shape[1] - 1))
            state = pool.index_copy(0, first.to(x.device), state) if initial_states is not None else pool
        cu = cu.to(x.device)
    y, final = _CAUSAL_CONV1D(tokens, cast(weight, x.dtype), cast(bias, x.dtype), state, cu, act)
    out = y.reshape(batch, seqlen, dim).transpose(1, 2)
    if not return_final_states:
        return out
    if last is not None:
        final = final.index_select(0, last.to(x.device))
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
    ``x`` appended. Returns ``out`` shaped like ``x``. One op, ``torch.ops.rlx_gpu.causal_conv1d_update``, on the
    whole cache: not differentiable, like the anchor's."""
    name = "causal_conv1d_update"
    key = None
    if cache_seqlens is None and conv_state_indices is None and runs_directly(x, conv_state, weight, bias):
        key = call_key(x, conv_state, weight, bias, activation)
        path = hot_path(key)
        if path is not None and path is not UNBUILT:
            return path(x, conv_state, weight, bias)
    if cache_seqlens is not None:
        raise NotImplementedError(f"{name}: cache_seqlens (a ring-buffer cache) is not supported: rlx_gpu's op "
                                  "(ABI.md §10) shifts the cache, its oldest column first, and reads no write "
                                  "position; pass cache_seqlens=None with a shifted cache")
    check_causal_conv1d_update(x, conv_state, weight, bias, conv_state_indices)
    act = _activation(name, activation)
    out = _UPDATE_CALL(conv_state, x, weight, bias, act, conv_state_indices)
    if key is not None and path is UNBUILT:
        keep_hot_path(key, lambda: _hot_update(x, conv_state, weight, bias, act))
    return out


def _hot_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                activation: str | None) -> Callable[..., torch.Tensor] | None:
    """The hot path (``bridge.hot_path``) of a ``causal_conv1d_update`` signature whose call just ran the whole way:
    the op's bound call with ``x`` written straight into its arena, the weight and bias by their stamps, and the
    cache handed to the kernel, updated where it lies (``written``), for one token a row (``x (batch, dim)``), a
    cache of ``width-1`` columns (vLLM's: the op's state is the cache itself) and tensors of one float type the
    op stores (no cast); None for any other (Hugging Face's cache of ``width`` columns shifts a column first)."""
    tensors = (x, conv_state, weight, bias)
    if (x.dim() != 2 or x.shape[0] == 0 or conv_state.shape[-1] != weight.shape[1] - 1
            or not all(type(t) in PLAIN and t.dtype == x.dtype for t in tensors if t is not None)):
        return None
    fields = ("x", "weight", "bias", "state") if bias is not None else ("x", "weight", "state")
    _, _, signature = _update_call(x, (*x.shape, 1), conv_state, tuple(conv_state.shape), weight, activation, fields)
    bound = bound_call(signature, lambda: None, x)  # the one the call that just ran bound
    if bound is None or not bound.plain:
        return None
    views = {"x": (0, x.numpy(force=True)[:, None]), "state": (1, conv_state.numpy(force=True)),
             "weight": (2, weight.numpy(force=True)), "bias": (3, None if bias is None else bias.numpy(force=True))}
    plan = bound.plan
    written = written_call(plan, {f: views[f] for f in plan.inputs}, tensors, ("weight", "bias"), ("state",),
                           {FINAL_STATE: "state"}, ("y",))
    if written is None:
        return None

    def update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
               ) -> torch.Tensor:
        y, = written((x, conv_state, weight, bias))
        _last.plan = plan
        increment_version(conv_state)  # as the op's schema (``Tensor(a!) conv_state``) has the dispatcher do
        return torch.from_numpy(y.reshape(x.shape))
    return update


def _carried_dtype(state: torch.Tensor, x: torch.Tensor) -> torch.dtype:
    """The element type the op carries ``state`` in: its own where ABI.md §8's ``state_dtype`` allows it (x's,
    f32 or f64, at least as wide as x's), else one both convert to exactly (x's, or f32 for 16-bit x), so the
    entries the step does not touch come back unchanged."""
    if state.dtype in (x.dtype, torch.float32, torch.float64) and state.dtype.itemsize >= x.dtype.itemsize:
        return state.dtype
    return x.dtype if x.dtype.itemsize >= 4 else torch.float32


def _update(conv_state: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            activation: str | None, indices: torch.Tensor | None) -> torch.Tensor:
    """``rlx_gpu::causal_conv1d_update``: one ``causal_conv1d`` call with a carried state on the whole pool
    (``state_slots`` = the indices), its state the cache's last ``width-1`` columns (a view: nothing gathered,
    the call's final pool written straight back into them).

    A cache of ``state_len > width-1`` columns (Hugging Face keeps ``width``) shifts as a whole: its first
    ``state_len - (width-1)`` columns take, before the call, the ``seqlen`` columns later (the oldest values of
    the window, or ``x``'s first when ``seqlen`` passes the window), which the call does not touch; the
    cheapest correct form (a wider state would move every column and multiply by zero weights, and 0 * inf
    is NaN)."""
    if indices is not None:
        check_state_batch_indices("causal_conv1d_update", indices, conv_state.shape[0], "conv_state_indices",
                                  "conv_state")
    steps = x.unsqueeze(-1) if x.dim() == 2 else x
    if steps.shape[0] == 0 or steps.shape[-1] == 0:
        return dense(x.shape, x).zero_()
    width, state_len, seqlen = weight.shape[1], conv_state.shape[-1], steps.shape[-1]
    lead = state_len - (width - 1)
    on_device = on_cuda(x)
    view = torch.Tensor.detach if on_device else host_array  # CPU: NumPy views, no torch op on the cache
    pool, xs = view(conv_state), view(steps)
    if lead:
        rows: Any = slice(None)
        if indices is not None:
            rows = indices.reshape(-1).long() if on_device else view(indices.reshape(-1)).astype(np.intp)
        entering = xs[..., max(0, seqlen - state_len):max(0, seqlen + lead - state_len)]
        entering = entering.to(pool.dtype) if on_device else entering.astype(pool.dtype)
        join = torch.cat if on_device else np.concatenate
        pool[rows, :, :lead] = join([pool[rows, :, seqlen:seqlen + lead], entering], -1)  # a copy, then the write
    window = pool[..., lead:]
    arrays = {"x": xs.transpose(1, 2) if on_device else xs.transpose(0, 2, 1), "weight": view(weight),
              "bias": None if bias is None else view(bias), "state": window,
              "state_slots": None if indices is None else view(indices.reshape(-1))}
    arrays = {f: a for f, a in arrays.items() if a is not None}
    call, specs, signature = _update_call(x, steps.shape, conv_state, tuple(window.shape), weight, activation, arrays)
    stamps = {"weight": stamp(weight), "bias": None if bias is None else stamp(bias)}
    bound = bound_call(signature, lambda: _bind(call, specs) if x.is_cpu and conv_state.is_cpu else None, x)
    if bound is not None:  # the final pool straight from the arena into the cache's columns
        y, _ = bound.arrays(arrays, stamps, into=(None, window))
        y = tensor(y, CPU)
    else:
        out = run_arrays(("forward", call), lambda: forward_graph(call, specs), specs, arrays,
                         None if x.is_cpu else device_for(conv_state, x),
                         {f: v for f, v in stamps.items() if v is not None})
        y, final = out["y"], out[FINAL_STATE]
        if on_device:
            window.copy_(final)
        else:
            window[...] = final  # converted to the cache's dtype, rounding to nearest even
            y = tensor(y, x.device)
    y = y.transpose(1, 2)
    return y.reshape(x.shape) if x.dim() == 2 else y.contiguous()


def _update_call(x: torch.Tensor, steps: torch.Size, conv_state: torch.Tensor, window: tuple[int, ...],
                 weight: torch.Tensor, activation: str | None, fields: Any) -> tuple[FusedCall, dict[str, Spec], tuple]:
    """The decode step's call on ``fields`` (those of the op it has), its specs and its bound call's signature:
    ``steps (batch, dim, seqlen)``, the op's state the cache's ``window`` of columns."""
    act = rlx_dtype(x, "x")
    specs = {"x": ((steps[0], steps[2], steps[1]), act), "weight": (tuple(weight.shape), act), "bias": ((steps[1],), act),
             "state": (window, DTYPES[_carried_dtype(conv_state, x)]), "state_slots": ((steps[0],), "i32")}
    specs = {f: specs[f] for f in fields}
    call = call_of("causal_conv1d", tuple(specs), activation=activation)
    return call, specs, ("causal_conv1d_update", call, default_device(), tuple(specs.values()))


def _bind(call: FusedCall, specs: dict[str, Spec]) -> BoundCall:
    """The decode step's call on host arrays, bound once per signature: its inputs by field, the weight and
    bias given with their stamps, ``y`` and the final pool taken."""
    plan = plan_for(("forward", call), lambda: forward_graph(call, specs), specs, None)
    return BoundCall(plan, {f: f for f in specs}, [f for f in ("weight", "bias") if f in specs], ("y", FINAL_STATE))


_UPDATE = define("causal_conv1d_update", "(Tensor(a!) conv_state, Tensor x, Tensor weight, Tensor? bias, "
                 "str? activation, Tensor? conv_state_indices) -> Tensor", _update,
                 lambda conv_state, x, *rest: dense(x.shape, x))
_UPDATE_CALL = direct(_UPDATE)
