"""Reverse mode: ``vjp(body)`` derives a scan body's ``(carry, *x_t, d_output) -> dcarry[, dx]``, and
``grad(graph, outputs, wrt)`` differentiates a whole graph in place.

``vjp`` replays the body's forward ops into a new graph (the backward pass needs their intermediate
values), then walks them in reverse, applying one rule per op and summing the cotangents of tensors
used more than once. ``grad`` walks the graph's own nodes the same way, reading the forward values
where they already are: body ops through the same rules, every fused op (lstm ... gated_delta_net)
through its backward op (the graph's ``backward``), every scan through the graph's ``scan_grad``.
Lowering prunes what the requested outputs do not need.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from host_fallback.abi import FORWARD_OPS
from host_fallback.arena import STORAGE

from ..errors import GraphError
from .nodes import BodyGraph, Node, Tensor
from .sequence_ops import STATE_FIELDS

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


class _Same(dict):
    """The forward values of a graph differentiated in place: every tensor is its own value."""

    def __missing__(self, t: Tensor) -> Tensor:
        return t


def _broadcasts(f: dict[str, Any]) -> bool:
    """Whether a binary node reads its operands with NumPy broadcasting (``strided_copy`` reads at any strides)."""
    out = f["dst"].shape
    keep = [ax for ax, d in enumerate(out) if d != 1]
    return all(f[k] == BodyGraph._strides(f[op].shape, out, keep) for op, k in (("a", "a_strides"), ("b", "b_strides")))


def _whole_buffers(node: Node) -> None:
    """Refuse a node that reads or writes part of a buffer (``concat``, ``strided_copy`` from a start)."""
    part = next((t for t in node.tensors() if not t.whole), None)
    if part is not None:
        raise GraphError(f"grad: the {node.op} writing {node.writes[0]!r} reads or writes part of a buffer "
                         f"(concat, or strided_copy from a start), which has no derivative rule; build it from "
                         "reshape, broadcasting binary ops and matmul instead")


class _Reverse:
    """One derivation into graph ``g``: the forward values (``env``) and the cotangents (``cot``), by tensor."""

    def __init__(self, g: BodyGraph, env: dict[Tensor, Tensor], recompute: bool = False):
        self.g, self.env, self.recompute = g, env, recompute  # recompute: no saved forward (Graph.backward)
        self.cot: dict[Tensor, Tensor] = {}

    @classmethod
    def replaying(cls, body: BodyGraph) -> "_Reverse":
        """A derivation into a new graph holding ``body``'s inputs, weights and forward ops."""
        rev = cls(type(body)(body.dtype), {})  # a Graph's gradient graph is a Graph
        for name, t in body.inputs.items():
            rev.env[t] = rev.g.input(name, t.shape, t.dtype)
        for name, t in body.weights.items():
            values = np.frombuffer(body.init[t.buf], dtype=STORAGE[t.dtype]).astype(np.float64).reshape(t.shape)
            rev.env[t] = rev.g.weight(name, values, t.dtype)
        for node in body.nodes:
            rev.replay(node)
        return rev

    def replay(self, node: Node) -> None:
        g, env = self.g, self.env
        _whole_buffers(node)
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
        """Pull the cotangents of ``node``'s outputs back to its inputs."""
        if node.op in STATE_FIELDS:
            self.fused(node)
        elif node.op == "scan":
            self.scan(node)
        else:
            self.body_op(node)

    def body_op(self, node: Node) -> None:
        g, env, f = self.g, self.env, node.fields
        _whole_buffers(node)
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
            if not _broadcasts(f):
                raise GraphError(f"grad: {dst!r} is a strided read of {f['a']!r} (strided_copy) at strides "
                                 f"{f['a_strides']}, which has no derivative rule; build it from reshape, "
                                 "broadcasting binary ops and matmul instead")
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
        else:
            raise GraphError(f"grad: {node.op} (writing {dst!r}) has no derivative rule; grad differentiates "
                             f"body ops ({', '.join(sorted(BODY_OPS))}), scans and {', '.join(FORWARD_OPS)}")

    def fused(self, node: Node) -> None:
        """A fused op through its backward op. Its carried state is one tensor, updated in place: after the op
        it holds the final state, so its cotangent there is the final state's gradient; the backward op gives
        the initial state's, which becomes the tensor's cotangent before the op (the copy that the builder
        filled it with passes it on to the caller's initial state)."""
        f = node.fields
        dst = f["dst"]
        states = [s for s in STATE_FIELDS[node.op] if isinstance(f.get(s), Tensor)]
        d_state = {s: self.cot[f[s]] for s in states if f[s] in self.cot}
        if dst not in self.cot and not d_state:
            return
        d_y = self.cot[dst] if dst in self.cot else self.g.fill(dst.shape, 0.0, dst.dtype)
        grads = self.g.backward(dst, d_y, d_state or None, recompute=self.recompute)
        for field, d in grads.items():
            if field in states:
                self.cot[f[field]] = d
            else:
                self.add(f[field], d)

    def scan(self, node: Node) -> None:
        """A scan through ``scan_grad``, with the forward's checkpoints (a trajectory's rows are its steps)."""
        f = node.fields
        out = f["outer_final_off"]
        if out not in self.cot:
            return
        length, k = f["length"], f["num_checkpoints"]
        xs = [x for _, x, _ in f["xs_inputs"]]
        bcast = [b for _, b, _ in f["bcast_inputs"]]
        if f["save_trajectory"]:
            upstream = {"d_traj": self._every_step(self.cot[out], length, k)}
        else:
            upstream = {"d_final": self.cot[out]}
        grads = self.g.scan_grad(f["body"], f["outer_init_off"], xs, bcast, num_checkpoints=k, length=length,
                                 **upstream)
        self.add(f["outer_init_off"], grads.d_init)
        for t, d in zip(xs + bcast, grads.d_xs + grads.d_bcast):
            self.add(t, d)

    def _every_step(self, d_rows: Tensor, length: int, k: int) -> Tensor:
        """The gradient of every step's carry from that of the trajectory's rows: with ``0 < k < length``
        checkpoints row ``j`` is step ``ceil((j+1)·length/k) - 1`` (ABI.md §6), the other steps get zero,
        placed by a 0/1 matrix (exact)."""
        if not 0 < k < length:
            return d_rows
        place = np.zeros((length, k))
        place[[-(-(j + 1) * length // k) - 1 for j in range(k)], range(k)] = 1.0
        flat = self.g.reshape(d_rows, (k, d_rows.size // k))
        spread = self.g.matmul(self.g.constant(place, d_rows.dtype), flat)
        return self.g.reshape(spread, (length, *d_rows.shape[1:]))

    def gradient(self, t: Tensor) -> Tensor:
        """The cotangent of tensor ``t``; zero when the outputs do not depend on it."""
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
    rev = _Reverse.replaying(body)
    (out,) = body.outputs.values()
    rev.cot[out] = rev.g.input("d_output", out.shape, out.dtype)
    for node in reversed(body.nodes):
        rev.body_op(node)
    rev.g.output("dcarry", rev.gradient(inputs[0]))
    if wrt is not None:
        rev.g.output("dx", rev.gradient(inputs[wrt + 1]))
    return rev.g


def _tensors(g: BodyGraph, what: str, values: Any) -> list[Tensor]:
    """``values`` (one tensor or a sequence of them) as tensors of ``g``."""
    items = [values] if isinstance(values, Tensor) else list(values)
    for t in items:
        if not isinstance(t, Tensor) or t.graph is not g:
            raise GraphError(f"grad: every one of {what} must be a tensor of this graph, got {t!r}")
    return items


def _cotangents(g: BodyGraph, outputs: list[Tensor], d_outputs: Any, single: bool) -> list[Tensor]:
    """The cotangent of every output: ``d_outputs`` as tensors, or 1 for a one-element output."""
    if d_outputs is None:
        big = [o for o in outputs if o.size != 1]
        if big:
            raise GraphError(f"grad: d_outputs is needed for {big[0]!r}: only a one-element output (a loss) has "
                             "the implicit gradient 1; pass d_outputs shaped like the outputs")
        return [g.fill(o.shape, 1.0, o.dtype) for o in outputs]
    given = [d_outputs] if single else list(d_outputs)
    if len(given) != len(outputs):
        raise GraphError(f"grad: {len(given)} d_outputs for {len(outputs)} outputs; give one per output")
    ds = [g._t(d, o.dtype) for d, o in zip(given, outputs)]
    for d, o in zip(ds, outputs):
        if (d.shape, d.dtype) != (o.shape, o.dtype):
            raise GraphError(f"grad: the cotangent {d!r} of {o!r} must be {list(o.shape)} {o.dtype}")
    return ds


def grad(g: BodyGraph, outputs: Tensor | Sequence[Tensor], wrt: Tensor | Sequence[Tensor],
         d_outputs: Any = None, *, recompute: bool = False) -> Tensor | tuple[Tensor, ...]:
    """The gradients of ``Σ_i <outputs[i], d_outputs[i]>`` with respect to each of ``wrt``, emitted into ``g``.

    See ``Graph.grad``. ``g`` provides ``backward`` (a fused op's backward thunk) and ``scan_grad``.
    """
    outs, targets = _tensors(g, "outputs", outputs), _tensors(g, "wrt", wrt)
    ds = _cotangents(g, outs, d_outputs, isinstance(outputs, Tensor))
    forward = list(g.nodes)
    # only the nodes that depend on a wrt tensor (by buffer: views and in-place updates included)
    reached = {t.buf for t in targets}
    path = []
    for node in forward:
        if any(t.buf in reached for t in node.tensors()):
            path.append(node)
            reached.update(t.buf for t in node.writes)
    rev = _Reverse(g, _Same(), recompute)
    for o, d in zip(outs, ds):
        rev.add(o, d)
    found: dict[Tensor, Tensor] = {}
    for node in reversed(path):
        # a wrt tensor's gradient is complete once every node after the one that wrote it is walked
        for t in targets:
            if t not in found and any(t is w for w in node.writes):
                found[t] = rev.gradient(t)
        rev.backward(node)
    result = tuple(found[t] if t in found else rev.gradient(t) for t in targets)
    return result[0] if isinstance(wrt, Tensor) else result
