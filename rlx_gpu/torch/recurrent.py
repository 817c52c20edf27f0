"""lstm, gru and rnn as torch custom ops: ``torch.ops.rlx_gpu.lstm``, ``.gru`` and ``.rnn``, each with its
``..._backward`` (the forward thunk of ABI.md §3, its §9 backward thunk).

Each op takes torch.nn's own parameters, ``weights`` in the order of ``RNNBase._flat_weights``
(per layer and direction ``w_ih, w_hh[, b_ih, b_hh][, w_hr]``), and packs them into ABI.md §3's
weight streams itself, once per parameter version: the packing is kept while every parameter's
storage and ``_version`` stay the same (an optimizer step bumps the versions), so a decode or
training loop does not re-pack its weights per call. A forward autograd records (``save_forward``)
also returns its saved forward (ABI.md §9.1's reserve: the gates and cell values of every step, one
float tensor of ``rlx_gpu.reserve_bytes`` bytes), which autograd keeps for the backward thunk to read
instead of running the forward again; without it (``recompute``, or a forward autograd does not record)
the backward thunk recomputes the forward from the inputs (the input, the weights, the initial states
and the lengths), so autograd keeps nothing else between the two passes. Its stream gradients are
unpacked into one gradient per parameter.
"""
from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Any, Hashable, Mapping, Sequence

import torch

from host_fallback.abi import OPS

from ..graph.builder import Graph
from ..graph.nodes import Tensor
from ..schedule.reserve import reserve_bytes
from .bridge import CPU, host_array, kept_per_signature, run_graph, specs_of, stamp, tensor
from .fused import CALL, declare, output_gradients, saves
from .library import define, dense, direct, empty, schema_args

#: How many packings of weights are kept (the least recently used one is dropped past it).
PACKED_CACHE = 32


@dataclass(frozen=True)
class Recurrence:
    """The static arguments of one lstm, gru or rnn thunk: with the input shapes, what keys its schedules.

    ``proj_size`` applies to an lstm (torch's projection, ABI.md §8's ``w_hr``), ``relu`` to an rnn
    (torch's ``nonlinearity="relu"``; tanh otherwise); ``has_biases`` is torch's ``bias``.
    """

    op: str
    hidden: int
    num_layers: int = 1
    bidirectional: bool = False
    proj_size: int = 0
    relu: bool = False
    has_biases: bool = True

    @property
    def streams(self) -> tuple[str, ...]:
        """The weight-stream fields of the thunk."""
        if self.op == "gru":
            return "w_ih", "w_hh", "b_ih", "b_hh"
        return ("w_ih", "w_hh", "bias") + (("w_hr",) if self.proj_size else ())

    @property
    def states(self) -> tuple[str, ...]:
        """The carried-state fields, in the order the op takes and returns them."""
        return OPS[self.op].states

    @property
    def per_direction(self) -> int:
        """How many of torch's parameters each layer and direction has."""
        return 2 + 2 * self.has_biases + bool(self.proj_size)

    def emit(self, g: Graph, t: Mapping[str, Tensor]) -> Tensor:
        """Emit the forward thunk on the graph tensors ``t`` (by field; ``seq_lens`` optional); returns ``y``."""
        common = dict(hidden=self.hidden, num_layers=self.num_layers, bidirectional=self.bidirectional,
                      lengths=t.get("seq_lens"), name=CALL)
        if self.op == "lstm":
            out = g.lstm(t["x"], t["w_ih"], t["w_hh"], t["bias"], h0=t["h0"], c0=t["c0"], proj_size=self.proj_size,
                         w_hr=t.get("w_hr"), **common)
        elif self.op == "gru":
            out = g.gru(t["x"], t["w_ih"], t["w_hh"], t["b_ih"], t["b_hh"], h0=t["h0"], **common)
        else:
            out = g.rnn(t["x"], t["w_ih"], t["w_hh"], t["bias"], h0=t["h0"], relu=self.relu, **common)
        return out[0]


#: The statics of each op's schema, in order, with their types; the last, ``save_forward``, asks the forward
#: for its saved forward (the op's last output; empty without).
STATICS = {"lstm": (("hidden_size", "int"), ("num_layers", "int"), ("bidirectional", "bool"), ("proj_size", "int"),
                    ("has_biases", "bool"), ("save_forward", "bool")),
           "gru": (("hidden_size", "int"), ("num_layers", "int"), ("bidirectional", "bool"), ("has_biases", "bool"),
                   ("save_forward", "bool")),
           "rnn": (("hidden_size", "int"), ("num_layers", "int"), ("bidirectional", "bool"), ("has_biases", "bool"),
                   ("relu", "bool"), ("save_forward", "bool"))}


def _spec(op: str, statics: Sequence[Any]) -> Recurrence:
    given = dict(zip((name for name, _ in STATICS[op]), statics))
    return Recurrence(op, given["hidden_size"], given["num_layers"], given["bidirectional"],
                      given.get("proj_size", 0), given.get("relu", False), given["has_biases"])


class _Packings:
    """The weight streams of parameter lists, kept per stamp (``bridge.stamp``: parameter, version, memory)
    of every parameter; the stamps also tell a call plan that streams it was given before are unchanged.

    A parameter changed in place by a torch operation (an optimizer step, ``copy_`` under ``no_grad``)
    gets a new ``_version``, so it is packed again; one changed through its ``.data`` (which torch does not
    count) is not seen until ``rlx_gpu.torch.clear_cache()``. Weights that are not parameters (a
    ``torch.func.functional_call``, ``gradcheck``'s inputs) are packed on every call.
    """

    def __init__(self) -> None:
        self._kept: collections.OrderedDict[Any, dict[str, torch.Tensor]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()

    def streams(self, spec: Recurrence, weights: Sequence[torch.Tensor]
                ) -> tuple[dict[str, torch.Tensor], Hashable | None]:
        """The streams of ``weights`` and their key (the same for the same parameters at the same versions;
        None, and packed afresh, where one of them is no parameter: ``bridge.stamp``)."""
        stamps = tuple(map(stamp, weights))
        if None in stamps:
            return _pack(spec, weights), None
        key = (spec, stamps)
        with self._lock:
            kept = self._kept.get(key)
            if kept is not None:
                self._kept.move_to_end(key)
                return kept, key
        packed = _pack(spec, weights)
        with self._lock:
            self._kept[key] = packed
            while len(self._kept) > PACKED_CACHE:
                self._kept.popitem(last=False)
        return packed, key


def _groups(spec: Recurrence, weights: Sequence[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """torch's flat parameters by layer and direction, each by its role (``w_ih``, ``b_ih`` ...)."""
    roles = ("w_ih", "w_hh") + (("b_ih", "b_hh") if spec.has_biases else ()) + (("w_hr",) if spec.proj_size else ())
    n = spec.per_direction
    return [dict(zip(roles, weights[i: i + n])) for i in range(0, len(weights), n)]


def _pack(spec: Recurrence, weights: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """ABI.md §3's streams from torch's parameters: ``w_ih`` one flat run of every input weight,
    ``w_hh`` (and ``w_hr``) stacked, ``bias = b_ih + b_hh`` (a GRU keeps both), zeros without biases."""
    with torch.no_grad():
        groups = _groups(spec, weights)
        w_hh = torch.stack([p["w_hh"] for p in groups])
        streams = {"w_ih": torch.cat([p["w_ih"].reshape(-1) for p in groups]), "w_hh": w_hh}
        if spec.has_biases:
            b_ih, b_hh = torch.stack([p["b_ih"] for p in groups]), torch.stack([p["b_hh"] for p in groups])
        else:
            b_ih = b_hh = w_hh.new_zeros(w_hh.shape[:2])
        if spec.op == "gru":
            streams.update(b_ih=b_ih, b_hh=b_hh)
        else:
            streams["bias"] = b_ih + b_hh
        if spec.proj_size:
            streams["w_hr"] = torch.stack([p["w_hr"] for p in groups])
        return streams


def _unpack(spec: Recurrence, weights: Sequence[torch.Tensor], grads: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """The gradient of each of torch's parameters from the gradients of the streams ``_pack`` made, each in memory
    of its own (an op's outputs may not share any). On the CPU NumPy cuts and copies them: torch's slicing,
    reshapes and clones, each through the dispatcher, cost a two-layer LSTM's training step some 40 µs more."""
    groups = _groups(spec, weights)
    cpu = grads["w_hh"].is_cpu
    streams = {name: host_array(grads[name]) if cpu else grads[name] for name in spec.streams}
    out: list[Any] = []
    start = 0
    for i, p in enumerate(groups):
        size = p["w_ih"].numel()
        out += [streams["w_ih"][start: start + size].reshape(tuple(p["w_ih"].shape)), streams["w_hh"][i]]
        start += size
        if spec.has_biases:
            out += [streams["b_ih"][i], streams["b_hh"][i]] if spec.op == "gru" else [streams["bias"][i]] * 2
        if spec.proj_size:
            out.append(streams["w_hr"][i])
    return [tensor(g.copy(), CPU) for g in out] if cpu else [g.clone() for g in out]


_packings = _Packings()
forget_packings = kept_per_signature(_packings.clear)


def _inputs(spec: Recurrence, x: torch.Tensor, weights: Sequence[torch.Tensor], states: Sequence[torch.Tensor],
            seq_lens: torch.Tensor | None) -> tuple[dict[str, torch.Tensor], dict[str, Hashable]]:
    """The thunk's inputs by field, and the stamps of its weight streams (the call plan copies them only
    when they change)."""
    streams, key = _packings.streams(spec, weights)
    inputs = {"x": x, **streams, **dict(zip(spec.states, states))}
    if seq_lens is not None:
        inputs["seq_lens"] = seq_lens
    return inputs, {name: key for name in streams} if key is not None else {}


def _declared(inputs: Mapping[str, torch.Tensor]) -> tuple[Graph, dict[str, Tensor]]:
    """A graph of x's element type with one input per tensor of ``inputs``."""
    specs = specs_of(inputs)
    g = Graph(specs["x"][1])
    return g, declare(g, specs)


def _forward_graph(spec: Recurrence, inputs: Mapping[str, torch.Tensor], save: bool) -> Graph:
    """The forward thunk: outputs ``y``, the final states ``{CALL}.h_n`` (and ``{CALL}.c_n``) and, to ``save``,
    the saved forward ``reserve``."""
    g, t = _declared(inputs)
    y = spec.emit(g, t)
    g.output("y", y)
    if save:
        g.output("reserve", g.saved_forward(y))
    return g


def _backward_graph(spec: Recurrence, inputs: Mapping[str, torch.Tensor]) -> Graph:
    """The backward thunk: outputs ``grad.NAME`` for the input, every weight stream and the initial states; it
    reads the input ``reserve`` where there is one."""
    g, t = _declared(inputs)
    y = spec.emit(g, t)
    if "reserve" in t:
        g.saved_forward(y, t["reserve"])
    output_gradients(g, y, t["d_y"], {s: t[f"d_{s}"] for s in spec.states}, ("x", *spec.streams, *spec.states))
    return g


def _width(spec: Recurrence) -> int:
    return (2 if spec.bidirectional else 1) * (spec.proj_size or spec.hidden)


def _reserve_elements(spec: Recurrence, x: torch.Tensor) -> int:
    """How many of ``x``'s elements hold the saved forward of the call (``rlx_gpu.reserve_bytes``)."""
    b, s, i = x.shape
    fields = dict(op=spec.op, dtype=_DTYPES[x.dtype], batch=b, seq=s, input_size=i, hidden=spec.hidden,
                  num_layers=spec.num_layers, bidirectional=spec.bidirectional, proj_size=spec.proj_size)
    return reserve_bytes(fields) // x.element_size()


_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64"}


def _split(op: str, args: Sequence[Any]) -> tuple[Recurrence, torch.Tensor, list[torch.Tensor], list[torch.Tensor],
                                                   torch.Tensor | None]:
    """``(spec, x, weights, states, seq_lens)`` from an op's schema arguments."""
    spec = _spec(op, args[-len(STATICS[op]):])
    count = len(spec.states)
    return spec, args[0], list(args[1]), list(args[2: 2 + count]), args[2 + count]


def _forward(op: str, *args: Any) -> tuple[torch.Tensor, ...]:
    spec, x, weights, states, seq_lens = _split(op, args)
    save = bool(args[-1])
    if x.shape[:2].numel() == 0:  # batch 0 or no steps: torch.nn's empty output, the states unchanged
        return (dense((*x.shape[:2], _width(spec)), x).zero_(), *(s.clone() for s in states), empty(x))
    inputs, stamps = _inputs(spec, x, weights, states, seq_lens)
    out = run_graph(("forward", spec, save), lambda: _forward_graph(spec, inputs, save), inputs, stamps=stamps)
    finals = {"h0": f"{CALL}.h_n", "c0": f"{CALL}.c_n"}
    return (out["y"], *(out[finals[s]] for s in spec.states), out["reserve"] if save else empty(x))


def _forward_fake(op: str, *args: Any) -> tuple[torch.Tensor, ...]:
    spec, x, _, states, _ = _split(op, args)
    saved = _reserve_elements(spec, x) if args[-1] and x.shape[:2].numel() else 0
    return (dense((*x.shape[:2], _width(spec)), x), *(dense(s.shape, s) for s in states), dense((saved,), x))


def _backward(op: str, d_y: torch.Tensor, *args: Any) -> list[torch.Tensor]:
    count = len(OPS[op].states)
    d_finals, reserve, rest = args[:count], args[count], args[count + 1:]
    spec, x, weights, states, seq_lens = _split(op, rest)
    if x.shape[:2].numel() == 0:
        return [torch.zeros_like(t) for t in (x, *weights)] + [d.clone() for d in d_finals]
    inputs, stamps = _inputs(spec, x, weights, states, seq_lens)
    dtype = x.dtype  # each gradient in the input's dtype (``to`` asked only where it differs: a dispatcher's pass)
    inputs["d_y"] = d_y if d_y.dtype is dtype else d_y.to(dtype)
    inputs.update({f"d_{s}": d if d.dtype is dtype else d.to(dtype) for s, d in zip(spec.states, d_finals)})
    saved = reserve is not None and reserve.numel() > 0
    if saved:
        inputs["reserve"] = reserve
    out = run_graph(("backward", spec, saved), lambda: _backward_graph(spec, inputs), inputs, stamps=stamps)
    grads = {name[len("grad."):]: t for name, t in out.items()}
    return [grads["x"], *_unpack(spec, weights, grads), *(grads[s] for s in spec.states)]


def _backward_fake(op: str, d_y: torch.Tensor, *args: Any) -> list[torch.Tensor]:
    _, x, weights, states, _ = _split(op, args[len(OPS[op].states) + 1:])
    return [dense(t.shape, t) for t in (x, *weights, *states)]


def _register(op: str) -> Any:
    """Define ``rlx_gpu::{op}_backward`` and ``rlx_gpu::{op}``, the second differentiable through the first."""
    states = OPS[op].states
    args = "Tensor x, Tensor[] weights, " + schema_args(states, ("seq_lens",), STATICS[op])
    d_finals = ", ".join(f"Tensor d_{s}" for s in states)
    backward = direct(define(f"{op}_backward", f"(Tensor d_y, {d_finals}, Tensor? reserve, {args}) -> Tensor[]",
                             lambda *a: _backward(op, *a), lambda *a: _backward_fake(op, *a),
                             once_differentiable=True))
    count = len(states)

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x, weights = inputs[0], inputs[1]
        ctx.weights = len(weights)
        ctx.mark_non_differentiable(output[-1])
        ctx.save_for_backward(x, *weights, *inputs[2: 3 + count], output[-1] if inputs[-1] else None)
        ctx.statics = inputs[3 + count:]
        # an output of no gradient (the saved forward, a final state the loss does not read) comes to ``gradients``
        # as None, not as zeros autograd made (the saved forward's: a training step's tens of µs)
        ctx.set_materialize_grads(False)

    def gradients(ctx: Any, d_y: torch.Tensor, *d_outputs: torch.Tensor | None) -> tuple[Any, ...]:
        saved = ctx.saved_tensors
        x, weights = saved[0], list(saved[1: 1 + ctx.weights])
        states, seq_lens, reserve = saved[1 + ctx.weights: 1 + ctx.weights + count], saved[-2], saved[-1]
        d_finals = tuple(torch.zeros_like(s) if d is None else d for s, d in zip(states, d_outputs))
        if d_y is None:  # only the final states have gradients
            d_y = dense((*x.shape[:2], _width(_spec(op, ctx.statics))), x).zero_()
        grads = backward(d_y, *d_finals, reserve, x, weights, *states, seq_lens, *ctx.statics)
        return (grads[0], list(grads[1: 1 + ctx.weights]), *grads[1 + ctx.weights:], None,
                *(None for _ in ctx.statics))

    outputs = ", ".join(["Tensor"] * (2 + count))  # y, the final states, the saved forward
    return define(op, f"({args}) -> ({outputs})", lambda *a: _forward(op, *a), lambda *a: _forward_fake(op, *a),
                  gradients, setup_context)


CUSTOM_OPS = {op: _register(op) for op in STATICS}
_CALLS = {op: direct(custom) for op, custom in CUSTOM_OPS.items()}  # what the modules call (library.direct)


def recurrent(spec: Recurrence, x: torch.Tensor, weights: Sequence[torch.Tensor], states: Mapping[str, torch.Tensor],
              seq_lens: torch.Tensor | None = None, recompute: bool = False) -> tuple[torch.Tensor, ...]:
    """Run ``torch.ops.rlx_gpu.<spec.op>``, differentiably: ``(y, h_n)`` or, for an lstm, ``(y, h_n, c_n)``.

    Parameters
    ----------
    spec : Recurrence
        The op and its static arguments.
    x : torch.Tensor
        ``[batch, seq, input_size]``, any strides.
    weights : sequence of torch.Tensor
        torch.nn's parameters of the layers run, in ``_flat_weights`` order.
    states : mapping of str to torch.Tensor
        The initial states by field (``spec.states``), ``[num_layers*dirs, batch, width]``.
    seq_lens : torch.Tensor, optional
        int32 ``[batch]``: row ``b`` runs its first ``seq_lens[b]`` steps (ABI.md §8), ``y`` is 0 past
        them and its final state is the one after its last step.
    recompute : bool
        False: a forward autograd records, on the host, saves what its backward reads (the reserve: faster,
        and held until the backward); True: the backward runs the forward again (less memory).
    """
    save = not recompute and saves(x, [*weights, *states.values()])
    statics = {"hidden_size": spec.hidden, "num_layers": spec.num_layers, "bidirectional": spec.bidirectional,
               "proj_size": spec.proj_size, "has_biases": spec.has_biases, "relu": spec.relu, "save_forward": save}
    out = _CALLS[spec.op](x, list(weights), *(states[s] for s in spec.states), seq_lens,
                          *(statics[name] for name, _ in STATICS[spec.op]))
    return out[:-1]  # the saved forward stays with autograd
