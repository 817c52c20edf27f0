"""``LSTM``, ``GRU`` and ``RNN``: torch.nn's modules running on rlx_gpu's recurrent thunks.

Each is a subclass of its torch.nn module, so the constructor (``input_size, hidden_size,
num_layers, bias, batch_first, dropout, bidirectional, proj_size, nonlinearity, device, dtype``), the
parameters and the ``state_dict`` keys are torch's own: a torch state_dict loads unchanged, and an
instance is an ``isinstance`` of the torch module. Only ``forward`` differs: the parameters are
packed into ABI.md §3's weight streams with torch ops (so their gradients flow back through the
packing) and run as one thunk for all layers, or, with dropout between layers in training mode, one
thunk per layer with torch's dropout between them. Inputs and outputs follow torch: ``[seq, batch,
features]`` or, with ``batch_first``, ``[batch, seq, features]``, unbatched ``[seq, features]``, and
``PackedSequence`` in and out (``h_n`` in the caller's batch order, sorted or not).
"""
from __future__ import annotations

from typing import Any

import torch
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from ..graph.torch_weights import layer_directions
from .arguments import check_rnn_forward
from .recurrent import Recurrence, recurrent

#: torch.nn's ``RNNBase.mode`` -> the ABI op that runs it.
OPS = {"LSTM": "lstm", "GRU": "gru", "RNN_TANH": "rnn", "RNN_RELU": "rnn"}


def weight_streams(module: torch.nn.RNNBase, layers: range) -> dict[str, torch.Tensor]:
    """The ABI.md §3 weight streams of ``layers`` of ``module`` (``w_ih, w_hh`` and ``bias`` (b_ih + b_hh)
    or ``b_ih, b_hh`` for a GRU, plus ``w_hr`` with ``proj_size``), built from the parameters with
    differentiable torch ops; a module without biases gets zeros."""
    dirs = 2 if module.bidirectional else 1
    names = layer_directions(module.num_layers, module.bidirectional)[layers.start * dirs: layers.stop * dirs]

    def stacked(kind: str) -> torch.Tensor:
        return torch.stack([getattr(module, f"{kind}_{n}") for n in names])

    w_hh = stacked("weight_hh")
    streams = {"w_ih": torch.cat([getattr(module, f"weight_ih_{n}").reshape(-1) for n in names]), "w_hh": w_hh}
    if module.bias:
        b_ih, b_hh = stacked("bias_ih"), stacked("bias_hh")
    else:
        b_ih = b_hh = w_hh.new_zeros(w_hh.shape[:2])
    if module.mode == "GRU":
        streams.update(b_ih=b_ih, b_hh=b_hh)
    else:
        streams["bias"] = b_ih + b_hh
    if module.proj_size:
        streams["w_hr"] = stacked("weight_hr")
    return streams


def packed_like(y: torch.Tensor, like: PackedSequence) -> PackedSequence:
    """The padded batch ``y [batch, seq, features]`` (rows in the caller's order) packed as ``like`` is:
    the same ``batch_sizes``, ``sorted_indices`` and ``unsorted_indices``."""
    running = like.batch_sizes
    rows = torch.arange(int(running[0]))
    step, rank = (rows[None, :] < running[:, None]).nonzero(as_tuple=True)  # packed order: step-major
    order = rank if like.sorted_indices is None else like.sorted_indices.cpu()[rank]
    data = y[order.to(y.device), step.to(y.device)]
    return PackedSequence(data, running, like.sorted_indices, like.unsorted_indices)


class _RlxRecurrent:
    """The ``forward`` of ``LSTM``, ``GRU`` and ``RNN``, for a subclass of torch.nn's module."""

    def forward(self, input: Any, hx: Any = None) -> tuple[Any, Any]:
        module: torch.nn.RNNBase = self  # type: ignore[assignment]
        check_rnn_forward(module, input, hx)
        packed = isinstance(input, PackedSequence)
        batched = packed or input.dim() == 3
        if packed:
            x, lengths = pad_packed_sequence(input, batch_first=True)
            seq_lens = lengths.to(torch.int32)
        else:
            x = input.unsqueeze(0) if not batched else input if module.batch_first else input.transpose(0, 1)
            seq_lens = None
        states = self._initial_states(x, hx, batched)
        module.check_forward_args(input.data if packed else x if module.batch_first else x.transpose(0, 1),
                                  tuple(states.values()) if module.mode == "LSTM" else states["h0"],
                                  input.batch_sizes if packed else None)
        y, finals = self._layers(x, states, seq_lens)
        if packed:
            output: Any = packed_like(y, input)
        elif not batched:
            output = y.squeeze(0)
        else:
            output = y if module.batch_first else y.transpose(0, 1).contiguous()
        if not batched:
            finals = [f.squeeze(1) for f in finals]
        return output, (tuple(finals) if module.mode == "LSTM" else finals[0])

    def _initial_states(self, x: torch.Tensor, hx: Any, batched: bool) -> dict[str, torch.Tensor]:
        """``{"h0": ..}`` (and ``"c0"`` for an LSTM), ``[layers*dirs, batch, width]``: zeros without ``hx``."""
        module: torch.nn.RNNBase = self  # type: ignore[assignment]
        fields = ("h0", "c0") if module.mode == "LSTM" else ("h0",)
        if hx is None:
            dirs = 2 if module.bidirectional else 1
            widths = {"h0": module.proj_size or module.hidden_size, "c0": module.hidden_size}
            return {f: x.new_zeros(module.num_layers * dirs, x.shape[0], widths[f]) for f in fields}
        given = tuple(hx) if module.mode == "LSTM" and isinstance(hx, (tuple, list)) else (hx,)
        if len(given) != len(fields) or not all(isinstance(t, torch.Tensor) for t in given):
            wanted = "a tuple (h_0, c_0)" if module.mode == "LSTM" else "a tensor"
            raise TypeError(f"{type(self).__name__}: hx must be {wanted} of initial states, or None for zeros")
        return {f: t if batched else t.unsqueeze(1) for f, t in zip(fields, given)}

    def _layers(self, x: torch.Tensor, states: dict[str, torch.Tensor],
                seq_lens: torch.Tensor | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``y`` and the final states of every layer: one thunk for them all, or with dropout between layers
        in training mode one per layer."""
        module: torch.nn.RNNBase = self  # type: ignore[assignment]
        spec = dict(op=OPS[module.mode], hidden=module.hidden_size, bidirectional=module.bidirectional,
                    proj_size=module.proj_size, relu=module.mode == "RNN_RELU")
        split = module.training and module.dropout > 0 and module.num_layers > 1
        groups = [range(l, l + 1) for l in range(module.num_layers)] if split else [range(module.num_layers)]
        dirs = 2 if module.bidirectional else 1
        finals: list[list[torch.Tensor]] = [[] for _ in states]
        for layers in groups:
            if layers.start > 0:
                x = torch.nn.functional.dropout(x, module.dropout, training=True)
            rows = slice(layers.start * dirs, layers.stop * dirs)
            x, *ends = recurrent(Recurrence(num_layers=len(layers), **spec), x, weight_streams(module, layers),
                                 {f: s[rows] for f, s in states.items()}, seq_lens)
            for out, end in zip(finals, ends):
                out.append(end)
        return x, [torch.cat(f) if len(f) > 1 else f[0] for f in finals]


class LSTM(_RlxRecurrent, torch.nn.LSTM):
    """``torch.nn.LSTM`` on rlx_gpu: the same constructor, parameters and ``state_dict``; ``forward(input,
    (h_0, c_0))`` returns ``(output, (h_n, c_n))``, differentiable in the input, every parameter and both states."""


class GRU(_RlxRecurrent, torch.nn.GRU):
    """``torch.nn.GRU`` on rlx_gpu: the same constructor, parameters and ``state_dict``; ``forward(input,
    h_0)`` returns ``(output, h_n)``, differentiable in the input, every parameter and ``h_0``."""


class RNN(_RlxRecurrent, torch.nn.RNN):
    """``torch.nn.RNN`` (``nonlinearity`` tanh or relu) on rlx_gpu: the same constructor, parameters and
    ``state_dict``; ``forward(input, h_0)`` returns ``(output, h_n)``, differentiable in the input, every
    parameter and ``h_0``."""
