"""The fused ops (state-space, linear attention, the short convolution) as torch custom ops:
``torch.ops.rlx_gpu.<op>`` with its ``<op>_backward``, each defined by its op's torch module beside the
functions calling it (``define_fused(FusedOp(...))``).

Each takes the tensors of its ABI op by field name (ABI.md §4, §8: the op's own layout, batch-major)
and its static arguments, and returns ``(y, final_state)`` (a tensor of no elements as the final state
of a call given no initial ``state``). The forward runs a graph holding that one call; the backward op
runs a graph holding the call and its ``Graph.backward``: the ``OP_backward`` thunk of ABI.md §9,
which recomputes the forward from the same inputs, so autograd keeps nothing but the inputs between
the two. Both graphs are compiled once per signature (``bridge.run_graph``). The anchors' functions
(``ssm.py``, ``gdn.py``) map their callers' layouts onto these ops with torch operations, which
``torch.compile`` traces around the opaque op.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Hashable, Iterable, Mapping, NamedTuple, Sequence

import torch

from ..graph.builder import Graph
from ..graph.nodes import Tensor
from ..runtime.config import load_config
from ..runtime.registry import resolve
from .bridge import (BoundCall, Spec, bound_call, default_device, kept_per_signature, plan_for, run_graph,
                     specs_of, stamp)
from .library import define, dense, direct, empty, schema_args

#: The per-channel or per-head parameters of the ops (module parameters in a model): given to the call plan
#: with their stamps, so they cross into the arena once per parameter version.
PARAMETERS = ("a", "d", "dt_bias", "delta_bias")
#: The graph methods' keyword for a field, where the two names differ.
KEYWORDS = {"d": "D", "state": "initial_state"}
#: The name a call gets in its graph: the builder names its final states' outputs ``{CALL}.state``,
#: ``{CALL}.h_n``, ``{CALL}.c_n``.
CALL = "call"
FINAL_STATE = f"{CALL}.state"


class FusedOp(NamedTuple):
    """One ABI op as a custom op: its required tensor fields (the graph method's positional arguments,
    in order), its optional ones, its statics with their schema types, and the field whose shape ``y``
    takes (its dtype is the first field's). ``reserve``, for an op with a saved forward (ABI.md §9.1): the
    elements of the first field's type it takes for the given tensors (by field; ``None``: none for them);
    its forward takes a last ``bool save`` and returns the reserve third, its backward reads it."""

    name: str
    tensors: tuple[str, ...]
    optional: tuple[str, ...]
    statics: tuple[tuple[str, str], ...]
    y_like: str
    reserve: Callable[[Mapping[str, torch.Tensor]], int | None] | None = None

    @property
    def fields(self) -> tuple[str, ...]:
        return self.tensors + self.optional


#: op -> its ``FusedOp``, as the torch module of each op declares it (``define_fused``).
OPS: dict[str, FusedOp] = {}
#: op -> what the anchors call: the op as ``library.direct`` makes it, its schema's arguments in order.
CALLS: dict[str, Any] = {}


class FusedCall(NamedTuple):
    """One call: the graph method ``op``, its hashable keyword arguments and its tensors' field names (a
    tuple: made and hashed on every call, as part of the key of its compiled schedule)."""

    op: str
    static: tuple[tuple[str, Hashable], ...]
    fields: tuple[str, ...]

    def emit(self, graph: Graph, tensors: dict[str, Tensor]) -> tuple[Tensor, Tensor | None]:
        """Declare the call in ``graph`` on ``tensors`` (by field); its output and final state (or None)."""
        positional = OPS[self.op].tensors
        args = [tensors[f] for f in positional]
        kwargs = {KEYWORDS.get(f, f): t for f, t in tensors.items() if f not in positional}
        out = getattr(graph, self.op)(*args, **kwargs, **dict(self.static), name=CALL)
        return out if isinstance(out, tuple) else (out, None)


def declare(graph: Graph, specs: Mapping[str, Spec]) -> dict[str, Tensor]:
    """One graph input per entry of ``specs``, of its name, shape and element type."""
    return {name: graph.input(name, shape, dtype) for name, (shape, dtype) in specs.items()}


def output_gradients(graph: Graph, y: Tensor, d_y: Tensor, d_state: dict[str, Tensor] | None,
                     wanted: Iterable[str]) -> None:
    """Emit the backward thunk of the call that returned ``y`` and mark the gradients of the ``wanted``
    fields as outputs ``grad.FIELD`` (no input ``d_...`` takes such a name). The call's own outputs (its
    final states) are unmarked first, so its forward thunk is pruned: the backward thunk recomputes what
    it needs of it, or reads the saved forward (reserve) the call's node was given (``Graph.saved_forward``)."""
    grads = graph.backward(y, d_y, d_state, recompute=True)
    for name in [n for n in graph.outputs if n.startswith(f"{CALL}.")]:
        del graph.outputs[name]
    for field in wanted:
        graph.output(f"grad.{field}", grads[field])


def forward_graph(call: FusedCall, specs: Mapping[str, Spec], save: bool = False) -> Graph:
    """The call's graph: outputs ``y``, its final state and, to ``save``, its saved forward ``reserve``."""
    graph = Graph()
    y, _ = call.emit(graph, declare(graph, specs))
    graph.output("y", y)
    if save:
        graph.output("reserve", graph.saved_forward(y))
    return graph


def _backward_graph(call: FusedCall, specs: Mapping[str, Spec], wanted: tuple[str, ...]) -> Graph:
    graph = Graph()
    tensors = declare(graph, specs)
    y, final = call.emit(graph, {f: tensors[f] for f in call.fields})
    if "reserve" in tensors:  # the saved forward the forward call returned: read, the forward thunk pruned
        graph.saved_forward(y, tensors["reserve"])
    d_state = {"state": tensors["d_final_state"]} if final is not None else None
    output_gradients(graph, y, tensors["d_dst"], d_state, wanted)
    return graph


def _static(name: str, value: Any) -> Hashable:
    """A schema value as the graph method takes it: ``dt_limit`` ``[lo, hi]`` as ``(lo, hi or None)``."""
    if name == "dt_limit" and value is not None:
        lo, hi = value
        return float(lo), None if hi == math.inf else float(hi)
    return value


def _call(op: FusedOp, args: Sequence[Any]) -> tuple[FusedCall, dict[str, torch.Tensor]]:
    """The ``FusedCall`` and its given tensors by field, from an op's schema arguments."""
    count = len(op.fields)
    given = {f: t for f, t in zip(op.fields, args[:count]) if t is not None}
    return FusedCall(op.name, _statics(op, args[count:]), tuple(given)), given


def _statics(op: FusedOp, values: Sequence[Any]) -> tuple[tuple[str, Hashable], ...]:
    """An op's static schema arguments as the graph method's keywords."""
    return tuple((name, _static(name, v)) for (name, _), v in zip(op.statics, values))


def _no_work(op: FusedOp, given: Mapping[str, torch.Tensor]) -> bool:
    """A call on no tokens (batch 0 or length 0): the anchors return empty outputs and, for a state,
    the initial one; no graph is built for it."""
    return given[op.tensors[0]].shape[:2].numel() == 0


def _signature(op: FusedOp, args: Sequence[Any]) -> tuple:
    """What decides a call's schedule and its binding: the op, the default device, each tensor's shape,
    dtype and device, the statics (a list as a tuple)."""
    return (op.name, default_device(), *[(a.shape, a.dtype, a.device) if isinstance(a, torch.Tensor)
                                         else tuple(a) if type(a) is list else a for a in args])


def _bind(op: FusedOp, args: Sequence[Any]) -> BoundCall | None:
    """The bound forward call of a signature of CPU tensors with tokens to run (None for any other: the
    general path runs it)."""
    call, given = _call(op, args)
    if _no_work(op, given) or not all(t.is_cpu for t in given.values()):
        return None
    specs = specs_of(given)
    plan = plan_for(("forward", call), lambda: forward_graph(call, specs), specs, None)
    positions = {f: i for i, f in enumerate(op.fields) if f in given}
    return BoundCall(plan, positions, [f for f in PARAMETERS if f in given],
                     ("y", FINAL_STATE) if "state" in given else ("y",))


def bound_forward(name: str, args: Sequence[Any]) -> BoundCall | None:
    """The bound forward call ``rlx_gpu::<name>`` keeps for the signature of ``args`` (its schema's
    arguments; None where the general path runs it): what its implementation calls, and a hot path."""
    op = OPS[name]
    return bound_call(_signature(op, args), lambda: _bind(op, args), args[0])


def _forward(op: FusedOp, *args: Any) -> tuple[torch.Tensor, ...]:
    save = bool(op.reserve and args[-1])  # (an op with a saved forward takes ``save`` last)
    bound = None if save else bound_forward(op.name, args)
    if bound is not None:  # CPU tensors: the signature's bound call (a decode step's path)
        y, *final = bound(args)
        return (y, final[0] if final else empty(y)) + ((empty(y),) if op.reserve else ())
    call, given = _call(op, args)
    state = given.get("state")
    if _no_work(op, given):
        y = dense(given[op.y_like].shape, given[op.tensors[0]]).zero_()
        return (y, empty(y) if state is None else state.clone()) + ((empty(y),) if op.reserve else ())
    save = save and op.reserve(given) is not None
    stamps = {f: stamp(given[f]) for f in PARAMETERS if f in given}  # a parameter: copied in once per version
    out = run_graph(("forward", call, save), lambda: forward_graph(call, specs_of(given), save), given, stamps=stamps)
    result = (out["y"], empty(out["y"]) if state is None else out[FINAL_STATE])
    return result + ((out["reserve"] if save else empty(out["y"]),) if op.reserve else ())


def _forward_fake(op: FusedOp, *args: Any) -> tuple[torch.Tensor, ...]:
    given = dict(zip(op.fields, args))
    first = given[op.tensors[0]]
    y = dense(given[op.y_like].shape, first)
    state = given["state"]
    result = (y, empty(first) if state is None else dense(state.shape, state))
    if not op.reserve:
        return result
    count = op.reserve({f: t for f, t in given.items() if t is not None}) if args[-1] else None
    return result + ((empty(first) if not count else dense((count,), first)),)


def _backward(op: FusedOp, d_y: torch.Tensor, d_state: torch.Tensor | None, *args: Any) -> list[torch.Tensor]:
    reserve, args = (args[0], args[1:]) if op.reserve else (None, args)
    call, given = _call(op, args[:-1])
    wanted = tuple(f for f, need in zip(op.fields, args[-1]) if need and f in given)
    if _no_work(op, given):
        grads = {f: torch.zeros_like(given[f], memory_format=torch.contiguous_format) for f in wanted}
        if "state" in wanted:
            grads["state"] = d_state.clone()
    else:
        inputs = {**given, "d_dst": d_y}
        if "state" in given:
            inputs["d_final_state"] = d_state
        saved = reserve is not None and reserve.numel() > 0
        if saved:
            inputs["reserve"] = reserve
        out = run_graph(("backward", call, wanted, saved), lambda: _backward_graph(call, specs_of(inputs), wanted),
                        inputs)
        grads = {f: out[f"grad.{f}"] for f in wanted}
    return [grads[f] if f in grads else empty(d_y) for f in op.fields]


def _backward_fake(op: FusedOp, d_y: torch.Tensor, d_state: torch.Tensor | None, *args: Any) -> list[torch.Tensor]:
    need, args = args[-1], args[1:] if op.reserve else args  # (the saved forward first, for an op with one)
    return [dense(t.shape, t) if t is not None and wanted else empty(d_y)
            for t, wanted in zip(args[:len(op.fields)], need)]


def _register(op: FusedOp) -> Any:
    """Define ``rlx_gpu::{op}_backward`` and ``rlx_gpu::{op}``, the second differentiable through the first."""
    args = schema_args(op.tensors, op.optional, op.statics)
    reads = "Tensor? reserve, " if op.reserve else ""
    backward = define(f"{op.name}_backward", f"(Tensor d_y, Tensor? d_state, {reads}{args}, bool[] wanted) -> Tensor[]",
                      lambda *a: _backward(op, *a), lambda *a: _backward_fake(op, *a), once_differentiable=True)
    count, state, kept = len(op.fields), op.fields.index("state"), len(op.statics)

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        # the saved forward (an empty tensor where none was saved) stays with autograd until the backward
        ctx.save_for_backward(*inputs[:count], *output[2:])
        ctx.statics, ctx.inputs = inputs[count: count + kept], len(inputs)

    def gradients(ctx: Any, d_y: torch.Tensor, d_final: torch.Tensor | None, *_: Any) -> tuple[Any, ...]:
        saved = ctx.saved_tensors
        wanted = [bool(ctx.needs_input_grad[i]) for i in range(count)]
        d_state = None
        if saved[state] is not None:  # autograd leaves the gradient of an unused final state out
            d_state = d_final if d_final is not None else torch.zeros_like(saved[state])
        grads = backward(d_y, d_state, *saved[count:], *saved[:count], *ctx.statics, wanted)
        return (*(g if w else None for g, w in zip(grads, wanted)), *(None for _ in range(ctx.inputs - count)))

    outputs = "(Tensor, Tensor, Tensor)" if op.reserve else "(Tensor, Tensor)"
    return define(op.name, f"({args}{', bool save' if op.reserve else ''}) -> {outputs}", lambda *a: _forward(op, *a),
                  lambda *a: _forward_fake(op, *a), gradients, setup_context)


def define_fused(op: FusedOp) -> Any:
    """Define ``torch.ops.rlx_gpu.<op>`` and its backward; the torch module of the op declares it so, beside
    the functions calling it. Returns what those call (``CALLS[op.name]``)."""
    if op.name in OPS:
        raise ValueError(f"fused op {op.name!r} defined twice")
    OPS[op.name] = op
    CALLS[op.name] = direct(_register(op))
    return CALLS[op.name]


def cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``t`` in ``dtype`` (``t`` itself when it is already, without the cost of a ``to`` call; None stays None)."""
    return t if t is None or t.dtype == dtype else t.to(dtype)


def _schema_statics(op: str, static: Mapping[str, Any]) -> list[Any]:
    """``rlx_gpu::<op>``'s static arguments in schema order from ``fused``'s keywords (``dt_limit``'s
    ``(lo, hi or None)`` as ``[lo, hi or inf]``; ``_static`` turns it back for the graph method)."""
    values: list[Any] = []
    for name, _ in OPS[op].statics:
        value = static.get(name)
        if name == "dt_limit" and value is not None:
            value = [float(value[0]), math.inf if value[1] is None else float(value[1])]
        values.append(value)
    return values


def _schema_args(op: str, tensors: Mapping[str, torch.Tensor | None], static: Mapping[str, Any]) -> list[Any]:
    """The arguments of ``rlx_gpu::<op>`` in schema order: tensors by field (absent ones ``None``), then statics."""
    return [tensors.get(f) for f in OPS[op].fields] + _schema_statics(op, static)


def fused(op: str, tensors: dict[str, torch.Tensor | None], recompute: bool = False,
          **static: Any) -> tuple[torch.Tensor, Any]:
    """Run ``torch.ops.rlx_gpu.<op>`` on ``tensors`` (by field; absent or ``None`` ones left out) and the
    statics; differentiable. Returns the call's output and its final state (``None`` without a ``state``).
    An op with a saved forward (``FusedOp.reserve``) saves it for its backward where ``saves`` says so,
    unless ``recompute``."""
    args = _schema_args(op, tensors, static)
    if OPS[op].reserve:
        given = [t for t in tensors.values() if t is not None]
        args.append(not recompute and saves(given[0], given[1:]))
    y, final, *_ = CALLS[op](*args)
    return y, final if tensors.get("state") is not None else None


@functools.lru_cache(maxsize=8)
def _host_by_default(variables: tuple[Any, ...]) -> bool:
    """Whether CPU tensors run on the host with the device variables at these values (``bridge.default_device``)."""
    return resolve(None, load_config(None)).backend == "host"


kept_per_signature(_host_by_default.cache_clear)  # the config's device may have changed since


def saves(x: torch.Tensor, tensors: Sequence[torch.Tensor]) -> bool:
    """Whether a call saves its forward: autograd records it and it runs on the host, whose kernels write
    and read a reserve (a device's do not yet: there the backward recomputes, on the device). A traced call
    (``torch.compile``) saves none: the device a compiled graph runs on is not known while tracing."""
    return (not torch.compiler.is_compiling() and torch.is_grad_enabled() and torch._C._any_requires_grad(x, *tensors)
            and x.is_cpu and _host_by_default(default_device()))


def call_of(op: str, fields: Sequence[str], **static: Any) -> FusedCall:
    """The ``FusedCall`` of ``op`` on tensors of ``fields`` with the statics given as ``fused`` takes them:
    for the implementation of another op (``selective_state_update``), itself the opaque call, which runs
    ``forward_graph(call_of(...), specs)`` through ``bridge.run_arrays``."""
    return FusedCall(op, _statics(OPS[op], _schema_statics(op, static)), tuple(fields))
