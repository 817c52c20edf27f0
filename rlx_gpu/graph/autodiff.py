"""Reverse mode for scan bodies: ``vjp(body)`` derives ``(carry, *x_t, d_output) -> dcarry[, dx]``.

The derived graph replays the body's forward ops (the backward pass needs its intermediate values),
then walks them in reverse, applying one rule per op and summing the cotangents of tensors used more
than once. Lowering prunes what the requested outputs do not need.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from host_fallback.arena import STORAGE

from ..errors import GraphError
from .nodes import BodyGraph, Node, Tensor

BODY_OPS = frozenset({"unary", "binary", "matmul", "reduce_sum", "cast", "copy", "fill", "reshape"})

# d(fn(x))/dx times dy, from the forward input x and output y.
_UNARY: dict[str, Callable[[BodyGraph, Tensor, Tensor, Tensor], Tensor | None]] = {
    "exp": lambda g, dy, x, y: dy * y,
    "log": lambda g, dy, x, y: dy / x,
    "tanh": lambda g, dy, x, y: dy * (1.0 - y * y),
    "sigmoid": lambda g, dy, x, y: dy * (y * (1.0 - y)),
    "relu": lambda g, dy, x, y: dy * g.unary("step", x),
    "neg": lambda g, dy, x, y: -dy,
    "sqrt": lambda g, dy, x, y: (dy * 0.5) / y,
    "rsqrt": lambda g, dy, x, y: dy * (y * y * y * -0.5),
    "square": lambda g, dy, x, y: dy * (x * 2.0),
    "abs": lambda g, dy, x, y: dy * (g.unary("step", x) - g.unary("step", -x)),
    "recip": lambda g, dy, x, y: -(dy * (y * y)),
    "softplus": lambda g, dy, x, y: dy * g.unary("sigmoid", x),
    "step": lambda g, dy, x, y: None,  # zero almost everywhere
}


def _binary_rule(g: BodyGraph, fn: str, dy: Tensor, a: Tensor, b: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """Cotangents of ``a`` and ``b`` at the output's (broadcast) shape."""
    if fn == "add":
        return dy, dy
    if fn == "sub":
        return dy, -dy
    if fn == "mul":
        return dy * b, dy * a
    if fn == "div":
        return dy / b, -(dy * y) / b
    # max/min: the gradient goes to the operand that was selected; ties go to b, as step(0) = 0.
    pick_a = g.unary("step", a - b if fn == "max" else b - a)
    return dy * pick_a, dy * (1.0 - pick_a)


def _unbroadcast(g: BodyGraph, d: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Sum ``d`` over the axes that broadcasting added or stretched, back to ``shape``."""
    lead = len(d.shape) - len(shape)
    axes = list(range(lead)) + [lead + i for i, n in enumerate(shape) if n == 1 and d.shape[lead + i] != 1]
    if axes:
        d = g.reduce_sum(d, axes, keepdims=True)
    return d if d.shape == shape else g.reshape(d, shape)


def _matmul_rule(g: BodyGraph, f: dict, dc: Tensor, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """``C = op(A)·op(B)``: ``dA = dC·op(B)ᵀ`` and ``dB = op(A)ᵀ·dC``, transposed back when stored so."""
    ta, tb = f["trans_a"], f["trans_b"]
    da = g.matmul(b, dc, trans_a=tb, trans_b=True) if ta else g.matmul(dc, b, trans_b=not tb)
    db = g.matmul(dc, a, trans_a=True, trans_b=ta) if tb else g.matmul(a, dc, trans_a=not ta)
    return da, db


class _Reverse:
    """One derivation: the forward replay (``env``) and the cotangents (``cot``), keyed by body tensor."""

    def __init__(self, body: BodyGraph):
        self.g = type(body)(body.dtype)  # a Graph's gradient graph is a Graph
        self.env: dict[Tensor, Tensor] = {}
        self.cot: dict[Tensor, Tensor] = {}
        for name, t in body.inputs.items():
            self.env[t] = self.g.input(name, t.shape, t.dtype)
        for name, t in body.weights.items():
            values = np.frombuffer(body.init[t.buf], dtype=STORAGE[t.dtype]).astype(np.float64).reshape(t.shape)
            self.env[t] = self.g.weight(name, values, t.dtype)

    def replay(self, node: Node) -> None:
        g, env = self.g, self.env
        if node.op == "reshape":
            env[node.fields["dst"]] = g.reshape(env[node.fields["x"]], node.fields["dst"].shape)
            return
        fresh = {w: g._new(w.shape, w.dtype) for w in node.writes}
        fields = {k: (env.get(v) or fresh[v]) if isinstance(v, Tensor) else v for k, v in node.fields.items()}
        g._emit(node.op, node.dtype, fields, *fresh.values())
        env.update(fresh)

    def add(self, t: Tensor, d: Tensor | None) -> None:
        if d is not None:
            self.cot[t] = self.g.binary("add", self.cot[t], d) if t in self.cot else d

    def backward(self, node: Node) -> None:
        g, env, f = self.g, self.env, node.fields
        dst = f["dst"]
        if dst not in self.cot or node.op == "fill":
            return
        dy = self.cot[dst]
        if node.op == "reshape":
            self.add(f["x"], g.reshape(dy, f["x"].shape))
        elif node.op == "copy":
            self.add(f["src"], dy)
        elif node.op == "cast":
            self.add(f["src"], g.cast(dy, f["src"].dtype))
        elif node.op == "unary":
            self.add(f["x"], _UNARY[f["fn"]](g, dy, env[f["x"]], env[dst]))
        elif node.op == "binary":
            da, db = _binary_rule(g, f["fn"], dy, env[f["a"]], env[f["b"]], env[dst])
            self.add(f["a"], _unbroadcast(g, da, f["a"].shape))
            self.add(f["b"], _unbroadcast(g, db, f["b"].shape))
        elif node.op == "matmul":
            da, db = _matmul_rule(g, f, dy, env[f["a"]], env[f["b"]])
            self.add(f["a"], _unbroadcast(g, da, f["a"].shape))
            self.add(f["b"], _unbroadcast(g, db, f["b"].shape))
        elif node.op == "reduce_sum":
            outer, r, inner = f["outer"], f["r"], f["inner"]
            spread = g.broadcast_to(g.reshape(dy, (outer, 1, inner)), (outer, r, inner))
            self.add(f["x"], g.reshape(spread, f["x"].shape))

    def gradient(self, t: Tensor) -> Tensor:
        """The cotangent of body tensor ``t``; zero when the output does not depend on it."""
        return self.cot.get(t) or self.g.fill(t.shape, 0.0, t.dtype)


def vjp(body: BodyGraph, wrt: int | None = None) -> BodyGraph:
    """Derive ``(carry, *x_t, d_output) -> dcarry`` from a one-output body; with ``wrt=j`` also ``dx``.

    The derived graph's inputs are the body's inputs (same names and order: the carry, then every
    per-step or broadcast input) plus ``d_output``; its outputs are ``dcarry`` and, for ``wrt=j``,
    ``dx`` (the gradient of body input ``j + 1``).
    """
    if len(body.outputs) != 1:
        raise GraphError(f"vjp: a scan body has one output (the next carry), this one has {list(body.outputs)}")
    bad = sorted({n.op for n in body.nodes} - BODY_OPS)
    if bad:
        raise GraphError(f"vjp: the body uses {', '.join(bad)}; only body ops ({', '.join(sorted(BODY_OPS))}) "
                         "have derivative rules")
    inputs = list(body.inputs.values())
    if wrt is not None and not 0 <= wrt < len(inputs) - 1:
        raise GraphError(f"vjp: wrt={wrt} names no per-step input; the body has {len(inputs) - 1}")
    rev = _Reverse(body)
    for node in body.nodes:
        rev.replay(node)
    (out,) = body.outputs.values()
    rev.cot[out] = rev.g.input("d_output", out.shape, out.dtype)
    for node in reversed(body.nodes):
        rev.backward(node)
    rev.g.output("dcarry", rev.gradient(inputs[0]))
    if wrt is not None:
        rev.g.output("dx", rev.gradient(inputs[wrt + 1]))
    return rev.g
