"""``LSTM``, ``GRU`` and ``RNN``: torch.nn's modules running on rlx_gpu's recurrent ops.

Each is a ``torch.nn.RNNBase`` built as its torch.nn namesake builds itself, so the constructor
(``input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional, proj_size,
nonlinearity, device, dtype``), the parameters and the ``state_dict`` keys are torch's own: a torch
state_dict loads unchanged. They are not instances of ``torch.nn.LSTM``/``GRU``/``RNN`` themselves:
Dynamo refuses to trace those classes, and these compile (``torch.compile(fullgraph=True)``). Only
``forward`` differs: the parameters go as they are to ``torch.ops.rlx_gpu.lstm`` (``gru``, ``rnn``),
which packs them into ABI.md §3's weight streams once per parameter version, and run as one op for
all layers, or, with dropout between layers in training mode, one op per layer with torch's dropout
between them. Inputs and outputs follow torch: ``[seq, batch,
features]`` or, with ``batch_first``, ``[batch, seq, features]``, unbatched ``[seq, features]``, and
``PackedSequence`` in and out (``h_n`` in the caller's batch order, sorted or not).

In training mode a forward that autograd records saves what its backward reads (ABI.md §9.1's reserve,
cuDNN's reserve space: every step's gates and cell values), so the backward does not run the forward again;
the keyword ``recompute=True`` (or the attribute ``module.recompute``) trades that speed for memory: the
backward recomputes the forward. In eval mode and under ``torch.no_grad()`` nothing is saved.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.nn.modules.module import (_global_backward_hooks, _global_backward_pre_hooks, _global_forward_hooks,
                                     _global_forward_pre_hooks)
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from host_fallback.abi import OPS as DEFINITIONS

from .arguments import check_rnn_forward
from .bridge import UNBUILT, call_key, hot_path, keep_hot_path, kept_per_signature
from .library import PLAIN, runs_directly
from .recurrent import Recurrence, recurrent
from .recurrent_hot import ModulePath, current_weights, decode_path, hot_recurrent, latest_path, signature
from .registry import FUNCTIONS

#: Dynamo answers True while it traces: traced code never reads a hot path. (``is_compiling``'s other True, a
#: non-strict ``torch.export`` running the module on fake tensors under its modes, is refused by the latest path's
#: own check; this one is one frame where ``is_compiling`` is two.)
_is_compiling = torch.compiler.is_dynamo_compiling
_jit_tracing = torch._C._get_tracing_state
_MODULE_CALL = torch.nn.Module.__call__
#: torch.nn's ``RNNBase.mode`` -> the ABI op that runs it.
OPS = {"LSTM": "lstm", "GRU": "gru", "RNN_TANH": "rnn", "RNN_RELU": "rnn"}
_holding: weakref.WeakSet = weakref.WeakSet()  # the modules holding a latest path (``_RlxRecurrent._rlx_latest``)


@kept_per_signature
def _forget_latest_paths() -> None:
    """Drop every module's latest path with the bridge's caches (``rlx_gpu.torch.clear_cache()``): its plan is
    freed, and its next call runs the whole way (a parameter written through ``.data`` is seen)."""
    for module in list(_holding):
        module.__dict__["_rlx_latest"] = None
    _holding.clear()


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

    #: The hot path of the module's latest call signature behind a check of that signature (``latest_path``):
    #: None before one and after any attribute of the module is set (``__setattr__``).
    _rlx_latest: Callable[..., Any] | None = None

    def __init__(self, mode: str, *args: Any, recompute: bool = False, **kwargs: Any) -> None:
        super().__init__(mode, *args, **kwargs)
        self.recompute = recompute  # True: the backward recomputes the forward instead of reading its reserve

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        # any attribute (training, dropout, a parameter, _flat_weights after .to()) may change a call's path
        self.__dict__["_rlx_latest"] = None

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_rlx_latest", None)  # a bound plan: not pickled, not deep-copied
        return state

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``torch.nn.Module.__call__``, which calls ``forward``, but for a call of the latest signature with a hot
        path, no hook on the module or any module and no tracing: the hot path itself (``latest_path``; on the host a
        decode step of the module's own, ``decode_path``), without nn.Module's two frames (a decode step's 5 µs after
        its kernel swept the cache)."""
        if not _is_compiling():  # Dynamo traces nn.Module's call, reading nothing below
            latest = self._rlx_latest
            if latest is not None and not kwargs and 0 < len(args) <= 2 and not (
                    self._forward_hooks or self._forward_pre_hooks or self._backward_hooks or self._backward_pre_hooks
                    or _global_forward_hooks or _global_forward_pre_hooks or _global_backward_hooks
                    or _global_backward_pre_hooks or _jit_tracing()):
                out = latest(self, args[0], args[1]) if len(args) == 2 else latest(self, args[0])  # no *args' tuple
                if out is not None:
                    return out
        return _MODULE_CALL(self, *args, **kwargs)

    def forward(self, input: Any, hx: Any = None) -> tuple[Any, Any]:
        module: torch.nn.RNNBase = self  # type: ignore[assignment]
        key = None
        given = () if hx is None else tuple(hx) if isinstance(hx, (tuple, list)) else (hx,)
        weights = current_weights(module)
        if isinstance(input, torch.Tensor) and all(isinstance(t, torch.Tensor) for t in given) and runs_directly(
                input, *given, *weights):
            first = weights[0]  # its dtype and device are what torch.nn checks the input against
            key = (type(module), module.mode, module.input_size, module.hidden_size, module.num_layers, module.bias,
                   module.batch_first, module.bidirectional, module.proj_size, module.training, module.dropout,
                   first.dtype, first.is_cpu, isinstance(hx, tuple), *call_key(input, *given))
            path = hot_path(key)
            if path is not None and path is not UNBUILT:
                out = path.call(module, input, hx)
                if out is not None:  # None: a parameter's dtype or device changed (``hot_recurrent``)
                    if module._compiled_call_impl is None:  # not after module.compile(): its call is compiled
                        self.__dict__["_rlx_latest"] = path.own(self)  # the module's next call goes to it straight
                        _holding.add(self)
                    return out
        check_rnn_forward(module, input, hx)
        packed = isinstance(input, PackedSequence)
        x, states, seq_lens, batched = self._arguments(input, hx)
        module.check_forward_args(input.data if packed else x if module.batch_first else x.transpose(0, 1),
                                  tuple(states.values()) if module.mode == "LSTM" else states["h0"],
                                  input.batch_sizes if packed else None)
        y, finals = self._layers(x, states, seq_lens)
        if key is not None and path is UNBUILT:
            keep_hot_path(key, lambda: self._hot_path(x, states, batched, input, given, hx))
        return self._results(input, y, finals, batched)

    def _arguments(self, input: Any, hx: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor], Any, bool]:
        """The input as ``[batch, seq, features]``, the initial states by field, the lengths of a packed input
        (int32, else None) and whether the input is batched."""
        module: torch.nn.RNNBase = self  # type: ignore[assignment]
        packed = isinstance(input, PackedSequence)
        batched = packed or input.dim() == 3
        if packed:
            x, lengths = pad_packed_sequence(input, batch_first=True)
            seq_lens = lengths.to(torch.int32)
        else:
            x = input.unsqueeze(0) if not batched else input if module.batch_first else input.transpose(0, 1)
            seq_lens = None
        return x, self._initial_states(x, hx, batched), seq_lens, batched

    def _results(self, input: Any, y: torch.Tensor, finals: list[torch.Tensor], batched: bool) -> tuple[Any, Any]:
        """torch.nn's ``(output, h_n)`` (``(output, (h_n, c_n))``) from ``y [batch, seq, width]`` and the final
        states."""
        module: torch.nn.RNNBase = self  # type: ignore[assignment]
        if isinstance(input, PackedSequence):
            output: Any = packed_like(y, input)
        elif not batched:
            output = y.squeeze(0)
        else:
            output = y if module.batch_first else y.transpose(0, 1).contiguous()
        if not batched:
            finals = [f.squeeze(1) for f in finals]
        return output, (tuple(finals) if module.mode == "LSTM" else finals[0])

    def _hot_path(self, x: torch.Tensor, states: dict[str, torch.Tensor], batched: bool, input: torch.Tensor,
                  given: tuple[torch.Tensor, ...], hx: Any) -> ModulePath | None:
        """The hot path (``bridge.hot_path``) of a signature whose call (``input``, the states ``given`` as ``hx``)
        just passed its checks: all layers as one op on CPU tensors of torch's own types (not a packed input; not
        dropout between layers in training) on the bound forward (``recurrent_hot.hot_recurrent``), behind the
        check of that signature a module's latest path needs (``recurrent_hot.latest_path``; a decode loop's
        form on the host, each module's decode step of its own); None for any other."""
        module: torch.nn.RNNBase = self  # type: ignore[assignment]
        weights = module._flat_weights
        if self._split() or not all(type(t) in PLAIN for t in (x, *states.values(), *weights)):
            return None
        hot = hot_recurrent(self._recurrence(module.num_layers), x, weights, list(states.values()))
        if hot is None:
            return None
        run = hot.run

        if batched and module.batch_first and hx is not None:  # a decode loop's form: the tensors are the op's
            lstm = module.mode == "LSTM"

            def as_given(module: Any, input: torch.Tensor, hx: Any) -> tuple[Any, Any] | None:
                out = run(input, module._flat_weights, hx if lstm else (hx,))
                return None if out is None else (out[0], (out[1], out[2]) if lstm else out[1])
            path = latest_path(as_given, input, given, hx)
            if hot.host is None:
                return ModulePath(path, lambda module: path)
            called = signature(input, given, hx)
            return ModulePath(path, lambda module: decode_path(hot, module, called, lstm))

        def forward(module: Any, input: torch.Tensor, hx: Any) -> tuple[Any, Any] | None:
            x, states, _, _ = module._arguments(input, hx)
            out = run(x, module._flat_weights, states.values())
            return None if out is None else module._results(input, out[0], out[1:], batched)
        path = latest_path(forward, input, given, hx)
        return ModulePath(path, lambda module: path)

    def _initial_states(self, x: torch.Tensor, hx: Any, batched: bool) -> dict[str, torch.Tensor]:
        """``{"h0": ..}`` (and ``"c0"`` for an LSTM), ``[layers*dirs, batch, width]``: zeros without ``hx``."""
        module: torch.nn.RNNBase = self  # type: ignore[assignment]
        fields = DEFINITIONS[OPS[module.mode]].states
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
        weights = module._flat_weights  # what torch.nn's forward reads too: the parameters by name, kept up to date
        split = self._split()
        groups = [range(l, l + 1) for l in range(module.num_layers)] if split else [range(module.num_layers)]
        dirs = 2 if module.bidirectional else 1
        per_layer = len(weights) // module.num_layers
        finals: list[list[torch.Tensor]] = [[] for _ in states]
        for layers in groups:
            if layers.start > 0:
                x = torch.nn.functional.dropout(x, module.dropout, training=True)
            rows = slice(layers.start * dirs, layers.stop * dirs)
            x, *ends = recurrent(self._recurrence(len(layers)), x,
                                 weights[layers.start * per_layer: layers.stop * per_layer],
                                 {f: s[rows] for f, s in states.items()} if split else states, seq_lens,
                                 recompute=self.recompute or not module.training)
            for out, end in zip(finals, ends):
                out.append(end)
        return x, [torch.cat(f) if len(f) > 1 else f[0] for f in finals]


    def _split(self) -> bool:
        """Whether the layers run one op each: dropout between them in training mode."""
        module: torch.nn.RNNBase = self  # type: ignore[assignment]
        return module.training and module.dropout > 0 and module.num_layers > 1

    def _recurrence(self, num_layers: int) -> Recurrence:
        """The statics of an op running ``num_layers`` of the module's layers."""
        module: torch.nn.RNNBase = self  # type: ignore[assignment]
        return Recurrence(OPS[module.mode], module.hidden_size, num_layers, module.bidirectional, module.proj_size,
                          module.mode == "RNN_RELU", module.bias)


def _no_projection(name: str, kwargs: dict[str, Any]) -> None:
    if "proj_size" in kwargs:
        raise ValueError(f"{name}: proj_size argument is only supported for LSTM, not RNN or GRU")


@FUNCTIONS.register("lstm")
class LSTM(_RlxRecurrent, torch.nn.RNNBase):
    """``torch.nn.LSTM`` on rlx_gpu: the same constructor, parameters and ``state_dict``; ``forward(input,
    (h_0, c_0))`` returns ``(output, (h_n, c_n))``, differentiable in the input, every parameter and both states."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__("LSTM", *args, **kwargs)

    # torch.nn.LSTM's checks of (h_0, c_0), the functions themselves
    get_expected_cell_size = torch.nn.LSTM.get_expected_cell_size
    check_forward_args = torch.nn.LSTM.check_forward_args


@FUNCTIONS.register("gru")
class GRU(_RlxRecurrent, torch.nn.RNNBase):
    """``torch.nn.GRU`` on rlx_gpu: the same constructor, parameters and ``state_dict``; ``forward(input,
    h_0)`` returns ``(output, h_n)``, differentiable in the input, every parameter and ``h_0``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _no_projection("GRU", kwargs)
        super().__init__("GRU", *args, **kwargs)


@FUNCTIONS.register("rnn")
class RNN(_RlxRecurrent, torch.nn.RNNBase):
    """``torch.nn.RNN`` (``nonlinearity`` tanh or relu, the fourth positional argument or a keyword) on
    rlx_gpu: the same constructor, parameters and ``state_dict``; ``forward(input, h_0)`` returns
    ``(output, h_n)``, differentiable in the input, every parameter and ``h_0``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _no_projection("RNN", kwargs)
        if len(args) > 3:
            self.nonlinearity, args = args[3], args[:3] + args[4:]
        else:
            self.nonlinearity = kwargs.pop("nonlinearity", "tanh")
        if self.nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"RNN: unknown nonlinearity {self.nonlinearity!r}; select from 'tanh' or 'relu'")
        super().__init__("RNN_TANH" if self.nonlinearity == "tanh" else "RNN_RELU", *args, **kwargs)
