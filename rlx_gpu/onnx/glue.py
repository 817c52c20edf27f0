"""The glue ops around ONNX's recurrent nodes: shapes, views, casts, products, elementwise math,
reductions and the softmax heads of classifiers (what ``torch.onnx.export`` writes around nn.LSTM/GRU/RNN).

Every handler folds its node into a NumPy constant when all its inputs are known at import time
(the shape arithmetic ``torch.onnx.export`` emits), and otherwise emits builder ops on views.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import numpy as np

from .importer import FLOAT_TYPES, Handler, Importer
from .values import Value, View, concat, reshape, take

Inputs = list  # of Value | None, by the node's input positions


def _axis(importer: Importer, node: Any, axis: int, rank: int, what: str = "axis") -> int:
    if not -rank <= axis < max(rank, 1):
        raise importer.unsupported(node, what, axis, f"out of range for rank {rank}")
    return axis % max(rank, 1)


def _shape_of(value: Value) -> tuple[int, ...]:
    return tuple(value.shape)


def _identity(importer: Importer, node: Any, ins: Inputs) -> list[Value]:
    return [ins[0]]


def _constant(importer: Importer, node: Any, ins: Inputs) -> list[Value]:
    from onnx import numpy_helper

    attrs = importer.attributes(node)
    if len(attrs) != 1:
        raise importer.error(node, f"needs exactly one value attribute, has {sorted(attrs) or 'none'}")
    (name, value), = attrs.items()
    if name == "value":
        return [numpy_helper.to_array(node.attribute[0].t)]
    dtype = np.float32 if name.startswith("value_float") else np.int64
    return [np.asarray(value, dtype=dtype)]


def _constant_of_shape(importer: Importer, node: Any, ins: Inputs) -> list[Value]:
    from onnx import numpy_helper

    shape = [int(d) for d in importer.constant(node, ins[0], "the shape").ravel()]
    fill = next((numpy_helper.to_array(a.t) for a in node.attribute if a.name == "value"), np.zeros(1, np.float32))
    return [np.full(shape, fill.ravel()[0], dtype=fill.dtype)]


def _cast(importer: Importer, node: Any, ins: Inputs) -> list[Value]:
    from onnx import helper

    to = importer.attributes(node)["to"]
    x = ins[0]
    if isinstance(x, np.ndarray):
        return [x.astype(helper.tensor_dtype_to_np_dtype(to))]
    if to not in FLOAT_TYPES:
        raise importer.unsupported(node, "to", to, "a run-time value casts only to float32, float16, bfloat16 "
                                   "or float64")
    return [View.of(importer.graph.cast(importer.dense(x), FLOAT_TYPES[to]))]


def _shape(importer: Importer, node: Any, ins: Inputs) -> list[Value]:
    attrs = importer.attributes(node)
    dims = np.asarray(_shape_of(ins[0]), dtype=np.int64)
    return [dims[slice(attrs.get("start", 0), attrs.get("end"))]]


def _axes(importer: Importer, node: Any, ins: Inputs) -> list[int] | None:
    """The ``axes`` of Squeeze/Unsqueeze/Slice: the attribute (old opsets) or the second input."""
    attrs = importer.attributes(node)
    if "axes" in attrs:
        return [int(a) for a in attrs["axes"]]
    if len(ins) > 1 and ins[1] is not None:
        return [int(a) for a in importer.constant(node, ins[1], "axes").ravel()]
    return None


def _unsqueeze(importer: Importer, node: Any, ins: Inputs) -> list[Value]:
    x = ins[0]
    rank = len(_shape_of(x)) + len(_axes(importer, node, ins) or [])
    axes = sorted(_axis(importer, node, a, rank, "axes") for a in _axes(importer, node, ins) or [])
    shape = list(_shape_of(x))
    for a in axes:
        shape.insert(a, 1)
    return [reshape(importer.graph, x, shape)]


def _squeeze(importer: Importer, node: Any, ins: Inputs) -> list[Value]:
    x = ins[0]
    shape = _shape_of(x)
    given = _axes(importer, node, ins)
    axes = {_axis(importer, node, a, len(shape), "axes") for a in given} if given is not None else \
        {a for a, d in enumerate(shape) if d == 1}
    if any(shape[a] != 1 for a in axes):
        raise importer.unsupported(node, "axes", sorted(axes), f"an axis of shape {list(shape)} is not of size 1")
    return [reshape(importer.graph, x, [d for a, d in enumerate(shape) if a not in axes])]


def _reshape(importer: Importer, node: Any, ins: Inputs) -> list[Value]:
    x = ins[0]
    target = [int(d) for d in importer.constant(node, ins[1], "the shape").ravel()]
    if not importer.attributes(node).get("allowzero", 0):
        target = [x.shape[i] if d == 0 else d for i, d in enumerate(target)]
    try:
        shape = np.empty(_shape_of(x), dtype=np.uint8).reshape(target).shape
    except ValueError as err:
        raise importer.error(node, f"cannot reshape {list(_shape_of(x))} to {target}") from err
    return [reshape(importer.graph, x, shape)]


def _expand(importer: Importer, node: Any, ins: Inputs) -> list[Value]:
    x = ins[0]
    want = [int(d) for d in importer.constant(node, ins[1], "the shape").ravel()]
    shape = np.broadcast_shapes(_shape_of(x), tuple(want))
    if isinstance(x, np.ndarray):
        return [np.array(np.broadcast_to(x, shape))]
    return [x.expand(shape)]


def _concat(importer: Importer, node: Any, ins: Inputs) -> list[Value]:
    rank = len(_shape_of(ins[0]))
    return [concat(importer.graph, ins, _axis(importer, node, importer.attributes(node)["axis"], rank))]


def _transpose(importer: Importer, node: Any, ins: Inputs) -> list[Value]:
    x = ins[0]
    perm = importer.attributes(node).get("perm") or list(reversed(range(len(_shape_of(x)))))
    return [x.transpose(perm)]


def _gather(importer: Importer, node: Any, ins: Inputs) -> list[Value]:
    data, indices = ins[0], importer.constant(node, ins[1], "the indices")
    axis = _axis(importer, node, importer.attributes(node).get("axis", 0), len(_shape_of(data)))
    flat = [int(i) % data.shape[axis] for i in indices.ravel()]
    picked = take(importer.graph, data, axis, flat)
    shape = (*_shape_of(data)[:axis], *indices.shape, *_shape_of(data)[axis + 1:])
    return [reshape(importer.graph, picked, shape)]


def _slice(importer: Importer, node: Any, ins: Inputs) -> list[Value]:
    x = ins[0]
    attrs = importer.attributes(node)
    if "starts" in attrs:  # before opset 10 the bounds are attributes
        starts, ends, steps = attrs["starts"], attrs["ends"], [1] * len(attrs["starts"])
    else:
        starts = importer.constant(node, ins[1], "starts").ravel().tolist()
        ends = importer.constant(node, ins[2], "ends").ravel().tolist()
        steps = importer.constant(node, ins[4], "steps").ravel().tolist() if len(ins) > 4 and ins[4] is not None \
            else [1] * len(starts)
    axes = _axes(importer, node, ins[:1] + ins[3:4]) if "starts" not in attrs else attrs.get("axes")
    axes = list(range(len(starts))) if axes is None else axes
    out = x
    for start, end, step, axis in zip(starts, ends, steps, axes):
        axis = _axis(importer, node, int(axis), len(_shape_of(x)), "axes")
        picked = range(*slice(int(start), int(end), int(step)).indices(_shape_of(x)[axis]))
        out = take(importer.graph, out, axis, list(picked))
    return [out]


def _matmul(importer: Importer, node: Any, ins: Inputs) -> list[Value]:
    a, b = ins
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return [np.matmul(a, b)]
    try:
        shape = np.matmul(np.empty(_shape_of(a), np.uint8), np.empty(_shape_of(b), np.uint8)).shape
    except ValueError as err:
        raise importer.error(node, f"inputs of shapes {list(_shape_of(a))} and {list(_shape_of(b))} do not "
                                   "multiply") from err
    a2 = reshape(importer.graph, a, (1, *_shape_of(a))) if len(_shape_of(a)) == 1 else a
    b2 = reshape(importer.graph, b, (*_shape_of(b), 1)) if len(_shape_of(b)) == 1 else b
    dtype = (a if isinstance(a, View) else b).dtype
    y = importer.graph.matmul(importer.dense(a2, dtype), importer.dense(b2, dtype))
    return [reshape(importer.graph, View.of(y), shape)]


def _gemm(importer: Importer, node: Any, ins: Inputs) -> list[Value]:
    attrs = importer.attributes(node)
    a, b = ins[0], ins[1]
    c = ins[2] if len(ins) > 2 else None
    alpha, beta = float(attrs.get("alpha", 1.0)), float(attrs.get("beta", 1.0))
    if all(isinstance(v, np.ndarray) or v is None for v in (a, b, c)):
        y = (a.T if attrs.get("transA") else a) @ (b.T if attrs.get("transB") else b) * np.float32(alpha)
        return [y + np.float32(beta) * c if c is not None else y]
    dtype = (a if isinstance(a, View) else b).dtype
    g = importer.graph
    y = g.matmul(importer.dense(a, dtype), importer.dense(b, dtype), trans_a=bool(attrs.get("transA")),
                 trans_b=bool(attrs.get("transB")))
    if alpha != 1.0:
        y = g.binary("mul", y, np.float64(alpha))
    if c is not None:
        c = importer.dense(c, dtype)
        y = g.binary("add", y, c if beta == 1.0 else g.binary("mul", c, np.float64(beta)))
    return [View.of(y)]


def _fold_binary(fn: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if fn == "div" and np.issubdtype(np.result_type(a, b), np.integer):
        return np.trunc(a / b).astype(np.result_type(a, b))  # ONNX's integer Div truncates
    return {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}[fn](a, b)


def _binary(fn: str) -> Callable[[Importer, Any, Inputs], list[Value]]:
    def run(importer: Importer, node: Any, ins: Inputs) -> list[Value]:
        a, b = ins
        if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
            with np.errstate(all="ignore"):
                return [_fold_binary(fn, a, b)]
        dtype = (a if isinstance(a, View) else b).dtype
        return [View.of(importer.graph.binary(fn, importer.dense(a, dtype), importer.dense(b, dtype)))]
    return run


UNARY = {"Relu": ("relu", lambda x: np.maximum(x, 0)), "Tanh": ("tanh", np.tanh),
         "Sigmoid": ("sigmoid", lambda x: 1 / (1 + np.exp(-x))), "Exp": ("exp", np.exp), "Log": ("log", np.log),
         "Neg": ("neg", np.negative), "Sqrt": ("sqrt", np.sqrt), "Abs": ("abs", np.abs),
         "Reciprocal": ("recip", np.reciprocal), "Softplus": ("softplus", lambda x: np.logaddexp(0, x))}


def _unary(op: str) -> Callable[[Importer, Any, Inputs], list[Value]]:
    fn, fold = UNARY[op]

    def run(importer: Importer, node: Any, ins: Inputs) -> list[Value]:
        if isinstance(ins[0], np.ndarray):
            with np.errstate(all="ignore"):
                return [fold(ins[0]).astype(ins[0].dtype)]
        return [View.of(importer.graph.unary(fn, importer.dense(ins[0])))]
    return run


def _extreme(fn: str) -> Callable[[Importer, Any, Inputs], list[Value]]:
    """ONNX's variadic Max and Min: the elementwise extreme of every input, broadcast."""
    fold = {"max": np.maximum, "min": np.minimum}[fn]

    def run(importer: Importer, node: Any, ins: Inputs) -> list[Value]:
        if not ins or any(v is None for v in ins):
            raise importer.error(node, f"takes one or more inputs, got {list(node.input)}")
        if all(isinstance(v, np.ndarray) for v in ins):
            return [functools.reduce(fold, ins)]
        dtype = next(v.dtype for v in ins if isinstance(v, View))
        out = importer.dense(ins[0], dtype)
        for v in ins[1:]:
            out = importer.graph.binary(fn, out, importer.dense(v, dtype))
        return [View.of(out)]
    return run


def _count(shape: Sequence[int]) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _reduce_max(importer: Importer, x: View, axis: int) -> Any:
    """The maximum of ``x`` along ``axis`` (kept, of size 1): halves compared until one row is left.

    The ABI has no max reduction; each round takes the elementwise ``max`` of the first and the last
    ``ceil(n/2)`` rows (which overlap by one when ``n`` is odd, harmless for a maximum).
    """
    g, n = importer.graph, x.shape[axis]
    while n > 1:
        half = -(-n // 2)
        first, last = (importer.dense(x.run(axis, start, half, 1)) for start in (0, n - half))
        x = View.of(g.binary("max", first, last))
        n = half
    return importer.dense(x)


def _softmax(log: bool) -> Callable[[Importer, Any, Inputs], list[Value]]:
    """Softmax and LogSoftmax: ``exp(x - max)`` over its sum, or ``x - max - log(sum)``, along ``axis``.

    From opset 13 along the one axis (default -1); before it over the input coerced to 2-D at ``axis``
    (default 1), so over every axis from ``axis`` on.
    """
    def run(importer: Importer, node: Any, ins: Inputs) -> list[Value]:
        x, g = ins[0], importer.graph
        shape = _shape_of(x)
        modern = importer.opset >= 13
        axis = _axis(importer, node, importer.attributes(node).get("axis", -1 if modern else 1), len(shape))
        work = x if modern else reshape(g, x, (_count(shape[:axis]), _count(shape[axis:])))
        ax = axis if modern else 1
        if isinstance(work, np.ndarray):
            with np.errstate(all="ignore"):
                shifted = work - work.max(axis=ax, keepdims=True)
                total = np.exp(shifted).sum(axis=ax, keepdims=True)
                y = shifted - np.log(total) if log else np.exp(shifted) / total
            return [y.astype(x.dtype).reshape(shape)]
        shifted = g.binary("sub", importer.dense(work), _reduce_max(importer, work, ax))
        e = g.unary("exp", shifted)
        total = g.reduce_sum(e, ax, keepdims=True)
        y = g.binary("sub", shifted, g.unary("log", total)) if log else g.binary("div", e, total)
        return [reshape(g, View.of(y), shape)]
    return run


def _reduce(mean: bool) -> Callable[[Importer, Any, Inputs], list[Value]]:
    """ReduceSum and ReduceMean over ``axes`` (the attribute, or the second input from opset 13/18)."""
    def run(importer: Importer, node: Any, ins: Inputs) -> list[Value]:
        x, attrs = ins[0], importer.attributes(node)
        shape = _shape_of(x)
        given = _axes(importer, node, ins)
        if not given and attrs.get("noop_with_empty_axes", 0):
            return [x]
        axes = sorted({_axis(importer, node, a, len(shape), "axes") for a in given} if given else range(len(shape)))
        keep = bool(attrs.get("keepdims", 1))
        count = _count([shape[a] for a in axes])
        if isinstance(x, np.ndarray):
            y = x.sum(axis=tuple(axes), keepdims=keep)
            return [(y / count).astype(x.dtype) if mean else y]
        if not shape:
            return [x]
        y = importer.graph.reduce_sum(importer.dense(x), axes, keepdims=keep)
        return [View.of(importer.graph.binary("div", y, float(count)) if mean else y)]
    return run


def _flatten(importer: Importer, node: Any, ins: Inputs) -> list[Value]:
    x = ins[0]
    shape = _shape_of(x)
    axis = importer.attributes(node).get("axis", 1)
    if not -len(shape) <= axis <= len(shape):
        raise importer.unsupported(node, "axis", axis, f"out of range for rank {len(shape)}")
    axis %= len(shape) + 1
    return [reshape(importer.graph, x, (_count(shape[:axis]), _count(shape[axis:])))]


def _dropout(importer: Importer, node: Any, ins: Inputs) -> list[Value]:
    """Dropout at inference: the identity (a training-mode dropout is refused)."""
    training = ins[2] if len(ins) > 2 else None
    if training is not None and bool(importer.constant(node, training, "training_mode").ravel()[0]):
        raise importer.error(node, "input training_mode is true; the importer reads models for inference")
    if len(node.output) > 1 and node.output[1]:
        raise importer.error(node, f"output mask {node.output[1]!r} is not supported: a model for inference "
                                   "has no use for it")
    return [ins[0]]


def _h(run: Callable[[Importer, Any, Inputs], Sequence[Value]], *attributes: str) -> Handler:
    return Handler(run, frozenset(attributes))


HANDLERS = {
    "Identity": _h(_identity),
    "Constant": _h(_constant, "value", "value_float", "value_floats", "value_int", "value_ints"),
    "ConstantOfShape": _h(_constant_of_shape, "value"),
    "Cast": _h(_cast, "to", "saturate"),
    "Shape": _h(_shape, "start", "end"),
    "Gather": _h(_gather, "axis"),
    "Unsqueeze": _h(_unsqueeze, "axes"),
    "Squeeze": _h(_squeeze, "axes"),
    "Reshape": _h(_reshape, "allowzero"),
    "Expand": _h(_expand),
    "Concat": _h(_concat, "axis"),
    "Transpose": _h(_transpose, "perm"),
    "Slice": _h(_slice, "starts", "ends", "axes"),
    "MatMul": _h(_matmul),
    "Gemm": _h(_gemm, "alpha", "beta", "transA", "transB"),
    **{op: _h(_binary(op.lower())) for op in ("Add", "Sub", "Mul", "Div")},
    **{op: _h(_unary(op)) for op in UNARY},
    "Max": _h(_extreme("max")),
    "Min": _h(_extreme("min")),
    "Softmax": _h(_softmax(log=False), "axis"),
    "LogSoftmax": _h(_softmax(log=True), "axis"),
    "ReduceSum": _h(_reduce(mean=False), "axes", "keepdims", "noop_with_empty_axes"),
    "ReduceMean": _h(_reduce(mean=True), "axes", "keepdims", "noop_with_empty_axes"),
    "Flatten": _h(_flatten, "axis"),
    "Dropout": _h(_dropout, "ratio", "seed", "is_test"),
}
