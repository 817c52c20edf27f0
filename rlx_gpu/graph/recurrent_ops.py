"""The recurrent ops of the Graph builder (ABI.md §3, §8): lstm, gru and rnn, with their build-time checks.

A mixin of ``builder.Graph`` (through ``sequence_ops.SequenceOps``): it uses the graph's ``_t``/``_new``/``_emit``/
``output`` and its packed weights' ``activations``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from host_fallback.abi import OPS, is_default
from host_fallback.abi.rnn import recurrent_weight_shapes

from ..errors import GraphError
from .nodes import Tensor
from .registry import BUILDERS
from .torch_weights import NONLINEARITIES, unpack_sequence


def recurrent_weight_counts(op: str, input_size: int, hidden: int, num_layers: int,
                            bidirectional: bool, proj_size: int = 0) -> dict[str, int]:
    """Element count of every weight stream of an lstm/gru/rnn (ABI.md §3, §8's ``proj_size``), by field."""
    shapes = recurrent_weight_shapes(op, input_size, hidden, num_layers, bidirectional, proj_size)
    return {f: int(np.prod(shape, dtype=np.int64)) for f, shape in shapes.items()}


class RecurrentOps:
    """lstm, gru and rnn for ``Graph``."""

    def _lengths(self, op: str, x: Any, lengths: Any) -> tuple[Any, Any]:
        """``(x, lengths)`` with a torch ``PackedSequence`` given as ``x`` unpacked (``torch_weights.unpack_sequence``)."""
        if hasattr(x, "batch_sizes") and hasattr(x, "data"):
            if lengths is not None:
                raise GraphError(f"{op}: x is a PackedSequence, which carries its lengths; leave lengths out")
            return unpack_sequence(x)
        return x, lengths

    def _recurrent(self, op: str, x: Any, params: dict[str, Any], states: dict[str, Any], hidden: int,
                   num_layers: int, bidirectional: bool, name: str | None, lengths: Any = None,
                   proj_size: int = 0, **extra: Any) -> Any:
        """Emit one recurrent thunk; ``extra`` are its flags, version-2 ones (ABI.md §8) left out at their defaults."""
        x, lengths = self._lengths(op, x, lengths)
        x = self._t(x)
        if len(x.shape) != 3:
            raise GraphError(f"{op}: x {x!r} must be [batch, seq, input_size]")
        b, s, i = x.shape
        dirs = 2 if bidirectional else 1
        if proj_size and not 0 < proj_size < hidden:
            raise GraphError(f"lstm: proj_size={proj_size} must lie in 1..hidden-1 (hidden={hidden}); 0 means none")
        width = proj_size or hidden
        expected = recurrent_weight_counts(op, i, hidden, num_layers, bidirectional, proj_size)
        expected.update({f: num_layers * dirs * b * (hidden if f == "c0" else width) for f in states})
        if proj_size:
            expected["w_hr"] = num_layers * dirs * proj_size * hidden
        elif params.get("w_hr") is not None:
            raise GraphError("lstm: w_hr was given without proj_size; pass proj_size=P with w_hr [layers*dirs, P, hidden]")
        if proj_size and params.get("w_hr") is None:
            raise GraphError(f"lstm: proj_size={proj_size} needs w_hr [layers*dirs, {proj_size}, {hidden}] "
                             f"(pack_recurrent of an nn.LSTM with proj_size gives it)")
        expected["peepholes"] = num_layers * dirs * 3 * hidden
        given = {f: self._t(v, x.dtype) for f, v in {**params, **states}.items() if v is not None}
        for field, t in given.items():
            if t.size != expected[field]:
                raise GraphError(f"{op}: input {field!r} ({t!r}) has {t.size} elements, expected {expected[field]}")
            if t.dtype != x.dtype:
                raise GraphError(f"{op}: input {field!r} ({t!r}) is {t.dtype}, x is {x.dtype}")
        probe = {"op": op, "bidirectional": bidirectional, "relu": extra.get("relu", False)}
        v2 = {f: v for f, v in extra.items() if f in OPS[op].defaults and not is_default(probe, f, v)}
        v2.update({f: given[f] for f in ("peepholes", "w_hr") if f in given})
        if proj_size:
            v2["proj_size"] = int(proj_size)
        if lengths is not None:
            lengths = lengths if isinstance(lengths, Tensor) else self.constant(np.asarray(lengths), "i32")
            if lengths.shape != (b,) or lengths.dtype != "i32":
                raise GraphError(f"{op}: lengths {lengths!r} must be i32 [batch={b}]")
            v2["seq_lens"] = lengths
        carry = any(f in given for f in states)
        if carry and not all(f in given for f in states):
            raise GraphError(f"{op}: carried state needs {' and '.join(states)} together; got only "
                             f"{', '.join(f for f in states if f in given)}")
        name = name or f"{op}{next(self._ids)}"
        # The thunk updates its state in place: it works on a copy, so the caller's tensor stays intact.
        finals = {f: self.copy(given[f]) for f in states} if carry else {}
        y = self._new((b, s, dirs * width), x.dtype)
        v1 = {f: v for f, v in extra.items() if f not in OPS[op].defaults}
        fields = {"x": x, **{f: given[f] for f in params if f in given and f not in v2},
                  **{f: finals.get(f, 0) for f in states}, "dst": y,
                  "batch": b, "seq": s, "input_size": i, "hidden": hidden, "num_layers": num_layers,
                  "bidirectional": bool(bidirectional), "carry": carry, **v1, **v2}
        self._emit(op, x.dtype, fields, y, *finals.values())
        for f, t in finals.items():
            self.output(f"{name}.{'h_n' if f == 'h0' else 'c_n'}", t)
        return (y, *finals.values()) if carry else y

    @BUILDERS.register("lstm")
    def lstm(self, x: Any, w_ih: Any, w_hh: Any, bias: Any, *, hidden: int, num_layers: int = 1,
             bidirectional: bool = False, h0: Any = None, c0: Any = None, lengths: Any = None,
             proj_size: int = 0, w_hr: Any = None, peepholes: Any = None, input_forget: bool = False,
             clip: float = 0.0, activations: Any = None, reverse: bool = False, name: str | None = None) -> Any:
        """LSTM (gates i, f, g, o): ``c' = f⊙c + i⊙g``, ``h' = o⊙tanh(c')``; returns ``y`` or ``(y, h_n, c_n)``.

        With ``h0``/``c0`` the final states are also outputs ``{name}.h_n`` and ``{name}.c_n``.
        ``lengths`` (int32 ``[batch]``, or ``x`` given as a torch ``PackedSequence``): row ``b`` runs
        its first ``lengths[b]`` steps, ``y`` is 0 past them and the final state is the one after the
        row's last step. ``proj_size`` with ``w_hr`` is PyTorch's projection (``h`` and ``y`` are
        ``proj_size`` wide). ``peepholes``, ``input_forget``, ``clip``, ``activations`` and ``reverse``
        are ONNX's (ABI.md §8).
        """
        return self._recurrent("lstm", x, {"w_ih": w_ih, "w_hh": w_hh, "bias": bias, "w_hr": w_hr,
                                           "peepholes": peepholes}, {"h0": h0, "c0": c0},
                               hidden, num_layers, bidirectional, name, lengths, proj_size,
                               input_forget=bool(input_forget), **self._onnx_flags(clip, activations, reverse))

    @BUILDERS.register("gru")
    def gru(self, x: Any, w_ih: Any, w_hh: Any, b_ih: Any, b_hh: Any, *, hidden: int, num_layers: int = 1,
            bidirectional: bool = False, h0: Any = None, lengths: Any = None, linear_before_reset: bool = True,
            clip: float = 0.0, activations: Any = None, reverse: bool = False, name: str | None = None) -> Any:
        """GRU (PyTorch gates r, z, n): ``h' = (1-z)⊙n + z⊙h``; returns ``y`` or ``(y, h_n)``.

        ``lengths`` as for ``lstm``; ``linear_before_reset=False`` is ONNX's default GRU,
        ``n = tanh(W_in·x + b_in + W_hn·(r⊙h) + b_hn)``; ``clip``, ``activations``, ``reverse`` as ONNX's.
        """
        return self._recurrent("gru", x, {"w_ih": w_ih, "w_hh": w_hh, "b_ih": b_ih, "b_hh": b_hh}, {"h0": h0},
                               hidden, num_layers, bidirectional, name, lengths,
                               linear_before_reset=bool(linear_before_reset),
                               **self._onnx_flags(clip, activations, reverse))

    @BUILDERS.register("rnn")
    def rnn(self, x: Any, w_ih: Any, w_hh: Any, bias: Any, *, hidden: int, nonlinearity: str | None = None,
            relu: bool | None = None, num_layers: int = 1, bidirectional: bool = False, h0: Any = None,
            lengths: Any = None, clip: float = 0.0, activations: Any = None, reverse: bool = False,
            name: str | None = None) -> Any:
        """Elman RNN: ``h' = act(W_ih·x + W_hh·h + bias)``, act relu or tanh; returns ``y`` or ``(y, h_n)``.

        ``nonlinearity`` is torch's keyword (``"tanh"`` or ``"relu"``; ``relu=True`` says the same).
        Unset, the activation is the one the weights were packed with (``pack_recurrent`` of a torch
        module), else tanh; asking for another than the packed one is an error. ``activations``
        (ONNX's, any function of ABI.md §8) replaces it; ``lengths``, ``clip``, ``reverse`` as for ``lstm``.
        """
        weights = {"w_ih": w_ih, "w_hh": w_hh, "bias": bias}
        act = self._rnn_activation(nonlinearity, relu, weights)
        if activations is not None and act == "relu":
            raise GraphError("rnn: activations replace nonlinearity/relu; give only activations")
        return self._recurrent("rnn", x, weights, {"h0": h0}, hidden, num_layers, bidirectional, name, lengths,
                               relu=act == "relu", **self._onnx_flags(clip, activations, reverse))

    @staticmethod
    def _onnx_flags(clip: float, activations: Any, reverse: bool) -> dict[str, Any]:
        """ONNX's fields as a thunk spells them (``activations`` as ``[[name, alpha, beta], ...]``)."""
        out: dict[str, Any] = {"clip": float(clip), "reverse": bool(reverse)}
        if activations is not None:
            out["activations"] = [[str(n), float(a), float(b)] for n, a, b in activations]
        return out

    def _rnn_activation(self, nonlinearity: str | None, relu: bool | None, weights: dict[str, Any]) -> str:
        """The rnn's activation from its keywords and the activation its weights were packed with."""
        if nonlinearity is not None and nonlinearity not in NONLINEARITIES:
            raise GraphError(f"rnn: nonlinearity={nonlinearity!r} is not one of {', '.join(NONLINEARITIES)}")
        by_relu = None if relu is None else ("relu" if relu else "tanh")
        if nonlinearity is not None and by_relu is not None and nonlinearity != by_relu:
            raise GraphError(f"rnn: nonlinearity={nonlinearity!r} and relu={relu!r} disagree; pass one of them")
        asked = nonlinearity or by_relu
        packed = {f: self.activations.get(v.buf) if isinstance(v, Tensor) else getattr(v, "nonlinearity", None)
                  for f, v in weights.items()}
        packed = {f: a for f, a in packed.items() if a is not None}
        if len(set(packed.values())) > 1:
            raise GraphError(f"rnn: the weights come from RNNs of different activations ({packed}); pack them "
                             f"from one module")
        if packed and asked is not None and asked not in packed.values():
            field, act = next(iter(packed.items()))
            raise GraphError(f"rnn: {field} was packed from an RNN with nonlinearity={act!r}, but "
                             f"{asked!r} was asked; pass nonlinearity={act!r} (or weights of a {asked} RNN)")
        return asked or next(iter(packed.values()), "tanh")
