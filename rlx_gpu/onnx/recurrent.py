"""ONNX's LSTM, GRU and RNN nodes as one-layer lstm/gru/rnn thunks (ABI.md §3 and §8).

The mapping, written once here: ``layout = 0`` is time-major, so X, Y, Y_h and the initial states
are transposed to and from the ABI's batch-major tensors (as views where the strides allow); gates
are reordered from ONNX's i, o, f, c (LSTM) and z, r, h (GRU) to the ABI's i, f, g, o and r, z, n;
an LSTM's and an RNN's two bias halves ``Wb``, ``Rb`` are summed into the one merged ``bias``, a
GRU's stay ``b_ih``, ``b_hh``; ``direction = reverse`` is ``reverse``; ``P`` is ``peepholes``;
``activations`` with ``activation_alpha``/``activation_beta`` are read as onnxruntime reads them
(the lists hold values only for the functions that take them, in order; what they omit takes
onnxruntime's defaults). Attributes equal to the ABI's defaults emit no field, so a model that
version 1 can express (what ``torch.onnx.export`` writes for nn.LSTM/GRU/RNN) gives a v1 schedule.

With ``sequence_lens``, a row of length 0 keeps its initial state as its final state (ABI.md §8),
where onnxruntime writes zeros to Y_h and Y_c for it.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .importer import Handler, Importer
from .values import Value, View, reshape, take

GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
#: ABI gate k is ONNX gate ORDER[op][k]: ONNX i,o,f,c -> i,f,g(c),o; z,r,h -> r,z,n(h)
ORDER = {"LSTM": [0, 2, 3, 1], "GRU": [1, 0, 2], "RNN": [0]}
ABI_OP = {"LSTM": "lstm", "GRU": "gru", "RNN": "rnn"}
DEFAULT_ACTIVATIONS = {"LSTM": ("sigmoid", "tanh", "tanh"), "GRU": ("sigmoid", "tanh"), "RNN": ("tanh",)}

#: ONNX activation name (lower case) -> ABI name, whether it takes alpha and beta, onnxruntime's defaults
ACTIVATIONS = {
    "sigmoid": ("sigmoid", False, False), "tanh": ("tanh", False, False), "relu": ("relu", False, False),
    "affine": ("affine", True, True), "leakyrelu": ("leaky_relu", True, False),
    "thresholdedrelu": ("thresholded_relu", True, False), "scaledtanh": ("scaled_tanh", True, True),
    "hardsigmoid": ("hard_sigmoid", True, True), "elu": ("elu", True, False),
    "softsign": ("softsign", False, False), "softplus": ("softplus", False, False),
}
ACTIVATION_DEFAULTS = {"leakyrelu": (0.01, 0.0), "hardsigmoid": (0.2, 0.5), "elu": (1.0, 0.0)}

COMMON = ("activation_alpha", "activation_beta", "activations", "clip", "direction", "hidden_size", "layout")


def read_activations(importer: Importer, node: Any, dirs: int) -> list[list[Any]]:
    """``[name, alpha, beta]`` per slot and direction, ABI names, alpha/beta filled as onnxruntime fills them."""
    attrs = importer.attributes(node)
    slots = len(DEFAULT_ACTIVATIONS[node.op_type])
    names = list(attrs.get("activations") or DEFAULT_ACTIVATIONS[node.op_type] * dirs)
    if len(names) != slots * dirs:
        raise importer.unsupported(node, "activations", names, f"{node.op_type} takes {slots} per direction, "
                                   f"{slots * dirs} for {dirs} direction(s)")
    alphas = iter(attrs.get("activation_alpha", []))
    betas = iter(attrs.get("activation_beta", []))
    out = []
    for name in names:
        key = name.lower()
        if key not in ACTIVATIONS:
            raise importer.unsupported(node, "activations", names, f"{name!r} is not one of "
                                       f"{', '.join(sorted(ACTIVATIONS))}")
        abi, takes_alpha, takes_beta = ACTIVATIONS[key]
        alpha, beta = ACTIVATION_DEFAULTS.get(key, (0.0, 0.0))
        alpha = float(next(alphas, alpha)) if takes_alpha else 0.0
        beta = float(next(betas, beta)) if takes_beta else 0.0
        out.append([abi, alpha, beta])
    return out


def _gate_stream(importer: Importer, value: Value, op: str, dirs: int, hidden: int) -> Value:
    """A ``[dirs, G*hidden, ...]`` ONNX weight or bias block with its gates in the ABI's order, flat."""
    g = GATES[op]
    rest = value.shape[2] if len(value.shape) == 3 else 1
    blocks = reshape(importer.graph, value, (dirs, g, hidden * rest))
    return reshape(importer.graph, take(importer.graph, blocks, 1, ORDER[op]), (dirs * g * hidden * rest,))


def _bias_halves(importer: Importer, value: Value, op: str, dirs: int, hidden: int) -> tuple[Value, Value]:
    """``Wb`` and ``Rb`` of an ONNX ``B [dirs, 2*G*hidden]``, each in the ABI's gate order."""
    halves = reshape(importer.graph, value, (dirs, 2, GATES[op] * hidden))
    return tuple(_gate_stream(importer, reshape(importer.graph, take(importer.graph, halves, 1, [k]),
                                                (dirs, GATES[op] * hidden)), op, dirs, hidden) for k in (0, 1))


def _add(importer: Importer, a: Value, b: Value, dtype: str) -> Value:
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a + b
    return View.of(importer.graph.binary("add", importer.dense(a, dtype), importer.dense(b, dtype)))


def _check_shape(importer: Importer, node: Any, what: str, value: Value, shape: tuple[int, ...]) -> None:
    if tuple(value.shape) != shape:
        raise importer.error(node, f"input {what} has shape {list(value.shape)}, expected {list(shape)}")


def _options(importer: Importer, node: Any, dirs: int, sizes: tuple[int, int, int], seq_lens: Value | None,
             p: Value | None, stream: Callable[[str, Value], Any], prefix: str) -> dict[str, Any]:
    """The node's attributes, ``sequence_lens`` and ``P`` as the builder's keywords, each given only where it
    differs from the ABI's default; ``sizes``: ``(batch, seq, hidden)``, ``stream`` a weight's graph value,
    ``prefix`` the node's weights' name."""
    op, attrs, (batch, seq, hidden) = node.op_type, importer.attributes(node), sizes
    options: dict[str, Any] = {"reverse": True} if attrs.get("direction", "forward") == "reverse" else {}
    if seq_lens is not None:
        _check_shape(importer, node, "sequence_lens", seq_lens, (batch,))
        if not (isinstance(seq_lens, np.ndarray) and np.all(seq_lens == seq)):
            options["lengths"] = (importer.graph.weight(f"{prefix}.seq_lens", seq_lens, "i32")
                                  if isinstance(seq_lens, np.ndarray) else importer.dense(seq_lens))
    if "clip" in attrs:
        if not attrs["clip"] > 0:
            raise importer.unsupported(node, "clip", attrs["clip"], "a clip bound is a positive number")
        options["clip"] = float(attrs["clip"])
    activations = read_activations(importer, node, dirs)
    if op == "RNN" and {a[0] for a in activations} in ({"tanh"}, {"relu"}):
        options["nonlinearity"] = activations[0][0]
    elif [a[0] for a in activations] != list(DEFAULT_ACTIVATIONS[op]) * dirs:
        options["activations"] = activations
    if op == "GRU" and not attrs.get("linear_before_reset", 0):
        options["linear_before_reset"] = False
    if op == "LSTM":
        if attrs.get("input_forget", 0):
            options["input_forget"] = True
        if p is not None and not (isinstance(p, np.ndarray) and not p.any()):
            _check_shape(importer, node, "P", p, (dirs, 3 * hidden))
            options["peepholes"] = stream("peepholes", p)
    return options


def _recurrent(importer: Importer, node: Any, ins: list[Value | None]) -> list[Value | None]:
    op, g = node.op_type, GATES[node.op_type]
    attrs = importer.attributes(node)
    ins = ins + [None] * (8 - len(ins))
    x, w, r, b, seq_lens, initial_h = ins[:6]
    initial_c, p = (ins[6], ins[7]) if op == "LSTM" else (None, None)
    if not isinstance(x, View):
        raise importer.error(node, "X must be a run-time value (a graph input or computed from one)")
    if w is None or r is None:
        raise importer.error(node, "inputs W and R are required")
    layout = attrs.get("layout", 0)
    if layout not in (0, 1):
        raise importer.unsupported(node, "layout", layout, "ONNX defines 0 (time-major) and 1 (batch-major)")
    direction = attrs.get("direction", "forward")
    if direction not in ("forward", "reverse", "bidirectional"):
        raise importer.unsupported(node, "direction", direction, "expected forward, reverse or bidirectional")
    dirs = 2 if direction == "bidirectional" else 1
    xb = x if layout == 1 else x.transpose((1, 0, 2))  # the ABI's [batch, seq, input]
    batch, seq, inputs = xb.shape
    hidden = int(attrs.get("hidden_size", r.shape[-1] if r is not None else 0))
    dtype = x.dtype
    _check_shape(importer, node, "W", w, (dirs, g * hidden, inputs))
    _check_shape(importer, node, "R", r, (dirs, g * hidden, hidden))
    b = np.zeros((dirs, 2 * g * hidden), np.float32) if b is None else b
    _check_shape(importer, node, "B", b, (dirs, 2 * g * hidden))
    prefix = importer.prefix(node)

    def stream(field: str, value: Value) -> Any:
        if isinstance(value, np.ndarray):
            return importer.graph.weight(f"{prefix}.{field}", value, dtype)
        return importer.dense(value, dtype)

    weights = {"w_ih": stream("w_ih", _gate_stream(importer, w, op, dirs, hidden)),
               "w_hh": stream("w_hh", _gate_stream(importer, r, op, dirs, hidden))}
    wb, rb = _bias_halves(importer, b, op, dirs, hidden)
    if op == "GRU":
        weights.update(b_ih=stream("b_ih", wb), b_hh=stream("b_hh", rb))
    else:
        weights["bias"] = stream("bias", _add(importer, wb, rb, dtype))

    options = _options(importer, node, dirs, (batch, seq, hidden), seq_lens, p, stream, prefix)
    states = ("initial_h", "initial_c") if op == "LSTM" else ("initial_h",)
    given = dict(zip(states, (initial_h, initial_c)))
    carry = any(v is not None for v in given.values()) or any(node.output[1:])
    for field, state in zip(("h0", "c0"), states):
        value = given[state]
        if value is None:
            value = np.zeros((dirs, batch, hidden), np.float32)
        elif layout == 1:
            _check_shape(importer, node, state, value, (batch, dirs, hidden))
            value = value.transpose((1, 0, 2))
        _check_shape(importer, node, state, value, (dirs, batch, hidden))
        if carry:
            options[field] = importer.dense(value, dtype)
    graph = importer.graph
    declared = set(graph.outputs)
    result = getattr(graph, ABI_OP[op])(importer.dense(xb), **weights, hidden=hidden, bidirectional=dirs == 2,
                                        name=prefix, **options)
    for name in set(graph.outputs) - declared:  # the final states it names; the ONNX graph names its own outputs
        del graph.outputs[name]
    y, *finals = result if carry else (result,)
    y = View.of(y).reshape((batch, seq, dirs, hidden))
    outs: list[Value | None] = [y if layout == 1 else y.transpose((1, 2, 0, 3))]
    for final in finals:
        outs.append(View.of(final) if layout == 0 else View.of(final).transpose((1, 0, 2)))
    return outs


HANDLERS = {
    "LSTM": Handler(_recurrent, frozenset(COMMON + ("input_forget",))),
    "GRU": Handler(_recurrent, frozenset(COMMON + ("linear_before_reset",))),
    "RNN": Handler(_recurrent, frozenset(COMMON)),
}
