"""mamba_ssm's Mamba-3 SISO functions with its signatures and layouts, on rlx_gpu's ``mamba3`` op (ABI.md §11).

``torch.ops.rlx_gpu.mamba3`` takes the op's tensors by field name (token-major, four optional states) and
returns ``(y, angle_state, state, k_state, v_state)`` (tensors of no elements for the states of a call given
none); ``torch.ops.rlx_gpu.mamba3_backward`` runs the call's ``mamba3_backward`` thunk, which recomputes the
forward, so autograd keeps only the inputs between the two. ``mamba3_siso_combined`` and ``mamba3_siso_step``
map the anchor's layouts onto it with torch operations (``ADT, DT, Trap [B,H,S]`` transposed to ``[B,S,H]``;
the step's tokens unsqueezed to ``S = 1``), which autograd and ``torch.compile`` see around the opaque op.

Where ABI.md §11 decides what the anchor leaves open: ``Trap`` is a logit (σ applied inside, as the anchor's
kernels do); the angle advances by ``π·tanh(Angles)·DT``; the carried angle keeps ``state_dtype`` (f32, or f64
for f64 inputs), where the anchor's wrapper rounds it to bf16; ``chunk_size`` is a tuning knob of the anchor's
kernels and changes nothing here.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ..graph.builder import Graph
from .arguments import check_mamba3_siso_combined, check_mamba3_siso_step
from .bridge import (UNBUILT, BoundCall, _last, bound_call, call_key, default_device, hot_path, keep_hot_path,
                     plan_for, run_graph, specs_of)
from .fused import CALL, cast, declare, output_gradients
from .library import PLAIN, define, dense, direct, empty, runs_directly, schema_args
from .registry import FUNCTIONS
from .written import written_call

#: The op's tensor fields: required, then optional (the four carried states among them, in the anchor's order).
TENSORS = ("q", "k", "v", "adt", "dt", "trap", "angles")
STATES = ("angle_state", "state", "k_state", "v_state")
OPTIONAL = ("q_bias", "k_bias", "d", "z") + STATES + ("cu_seqlens",)
FIELDS = TENSORS + OPTIONAL

__all__ = ["mamba3_siso_combined", "mamba3_siso_step"]


def _emit(graph: Graph, tensors: dict[str, Any]) -> tuple[Any, tuple[Any, ...]]:
    """Declare the call in ``graph`` on ``tensors`` (by field): its output and its final states (or ``()``)."""
    states = [tensors[f] for f in STATES if f in tensors]
    out = graph.mamba3(*(tensors[f] for f in TENSORS), q_bias=tensors.get("q_bias"), k_bias=tensors.get("k_bias"),
                       D=tensors.get("d"), z=tensors.get("z"), initial_states=states or None,
                       cu_seqlens=tensors.get("cu_seqlens"), name=CALL)
    return out if isinstance(out, tuple) else (out, ())


def _forward_graph(fields: tuple[str, ...], specs: dict) -> Graph:
    graph = Graph()
    y, _ = _emit(graph, declare(graph, specs))
    graph.output("y", y)
    return graph


def _backward_graph(fields: tuple[str, ...], specs: dict, wanted: tuple[str, ...]) -> Graph:
    graph = Graph()
    tensors = declare(graph, specs)
    y, finals = _emit(graph, {f: tensors[f] for f in fields})
    d_state = {f: tensors[f"d_final_{f}"] for f in STATES} if finals else None
    output_gradients(graph, y, tensors["d_dst"], d_state, wanted)
    return graph


def _given(args: Sequence[Any]) -> dict[str, torch.Tensor]:
    return {f: t for f, t in zip(FIELDS, args) if t is not None}


def _forward(*args: Any) -> tuple[torch.Tensor, ...]:
    given = _given(args)
    carried = "state" in given
    if given["v"].shape[:2].numel() == 0:  # no tokens: an empty output, the states as they were
        y = dense(given["v"].shape, given["q"]).zero_()
        return (y, *(given[f].clone() if carried else empty(y) for f in STATES))
    bound = bound_call(_signature(args), lambda: _bind(given), given["q"])
    if bound is not None:  # CPU tensors: the signature's bound call (a decode step's path)
        y, *finals = bound(args)
        return (y, *(finals if carried else [empty(y) for _ in STATES]))  # distinct: returns may not alias
    fields = tuple(given)
    out = run_graph(("mamba3", fields), lambda: _forward_graph(fields, specs_of(given)), given)
    return (out["y"], *(out[f"{CALL}.{f}"] if carried else empty(out["y"]) for f in STATES))


def _signature(args: Sequence[Any]) -> tuple:
    """What decides the op's schedule and binding: the default device and each field's shape, dtype and device."""
    return ("mamba3", default_device(), *[None if a is None else (a.shape, a.dtype, a.device) for a in args])


def _bind(given: dict[str, torch.Tensor]) -> BoundCall | None:
    """The bound forward call of a signature of CPU tensors (None for any other: ``run_graph`` runs it); the
    biases and ``d`` given with their stamps (a module's parameters: copied in once per version)."""
    if not all(t.is_cpu for t in given.values()):
        return None
    fields, specs = tuple(given), specs_of(given)
    plan = plan_for(("mamba3", fields), lambda: _forward_graph(fields, specs), specs, None)
    outputs = ("y", *(f"{CALL}.{f}" for f in STATES)) if "state" in given else ("y",)
    return BoundCall(plan, {f: FIELDS.index(f) for f in fields}, [f for f in ("q_bias", "k_bias", "d") if f in given],
                     outputs)


def _forward_fake(*args: Any) -> tuple[torch.Tensor, ...]:
    given = _given(args)
    y = dense(given["v"].shape, given["q"])
    return (y, *(dense(given[f].shape, given[f]) if f in given else empty(y) for f in STATES))


def _backward(d_y: torch.Tensor, d_states: Sequence[torch.Tensor | None], *args: Any) -> list[torch.Tensor]:
    given, need = _given(args[:-1]), args[-1]
    wanted = tuple(f for f, n in zip(FIELDS, need) if n and f in given and f != "cu_seqlens")
    if given["v"].shape[:2].numel() == 0:
        grads = {f: torch.zeros_like(given[f], memory_format=torch.contiguous_format) for f in wanted}
        grads.update({f: d.clone() for f, d in zip(STATES, d_states) if f in wanted})
    else:
        fields = tuple(given)
        inputs = {**given, "d_dst": d_y}
        if "state" in given:
            inputs.update({f"d_final_{f}": d for f, d in zip(STATES, d_states)})
        out = run_graph(("mamba3_backward", fields, wanted),
                        lambda: _backward_graph(fields, specs_of(inputs), wanted), inputs)
        grads = {f: out[f"grad.{f}"] for f in wanted}
    return [grads[f] if f in grads else empty(d_y) for f in FIELDS]


def _backward_fake(d_y: torch.Tensor, d_states: Sequence[Any], *args: Any) -> list[torch.Tensor]:
    return [dense(t.shape, t) if t is not None and n else empty(d_y) for t, n in zip(args[:len(FIELDS)], args[-1])]


def _register() -> Any:
    """Define ``rlx_gpu::mamba3_backward`` and ``rlx_gpu::mamba3``, the second differentiable through the first."""
    args = schema_args(TENSORS, OPTIONAL, ())
    backward = define("mamba3_backward", f"(Tensor d_y, Tensor?[] d_states, {args}, bool[] wanted) -> Tensor[]",
                      lambda d_y, d_states, *a: _backward(d_y, d_states, *a),
                      lambda d_y, d_states, *a: _backward_fake(d_y, d_states, *a), once_differentiable=True)

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.save_for_backward(*inputs)

    def gradients(ctx: Any, d_y: torch.Tensor, *d_finals: torch.Tensor | None) -> tuple[Any, ...]:
        saved = ctx.saved_tensors
        wanted = [bool(ctx.needs_input_grad[i]) for i in range(len(FIELDS))]
        given = _given(saved)
        d_states = [None] * 4
        if "state" in given:  # autograd leaves the gradient of an unused final state out
            d_states = [d if d is not None else torch.zeros_like(given[f]) for f, d in zip(STATES, d_finals)]
        grads = backward(d_y, d_states, *saved, wanted)
        return tuple(g if w else None for g, w in zip(grads, wanted))

    return define("mamba3", f"({args}) -> (Tensor, Tensor, Tensor, Tensor, Tensor)", _forward, _forward_fake,
                  gradients, setup_context)


MAMBA3 = direct(_register())


def _element_types(q: torch.Tensor, step: torch.Tensor, params: torch.Tensor | None,
                   states: Sequence[torch.Tensor] | None) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    """The op's ``dt_dtype``, ``param_dtype`` and ``state_dtype`` for these tensors: each the caller's where it is
    at least q's width (mamba_ssm keeps ``ADT, DT, Trap, Angles`` and the biases in f32 beside bf16), else q's;
    the states f32, or f64 where given so or for f64 inputs (ABI.md §11)."""
    def wide(t: torch.Tensor | None) -> torch.dtype:
        return t.dtype if t is not None and t.dtype.itemsize >= q.dtype.itemsize else q.dtype
    wide_state = q.dtype == torch.float64 or (states is not None and any(s.dtype == torch.float64 for s in states))
    return wide(step), wide(params), torch.float64 if wide_state else torch.float32


@FUNCTIONS.register("mamba3")
def mamba3_siso_combined(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, ADT: torch.Tensor, DT: torch.Tensor,
                         Trap: torch.Tensor, Q_bias: torch.Tensor | None, K_bias: torch.Tensor | None,
                         Angles: torch.Tensor, D: torch.Tensor | None = None, Z: torch.Tensor | None = None,
                         Input_States: Sequence[torch.Tensor] | None = None, chunk_size: int = 64,
                         return_final_states: bool = False, cu_seqlens: torch.Tensor | None = None) -> Any:
    """Mamba-3 SISO over sequences: ``Q, K (batch, seqlen, nheads_qk, headdim_qk)``, ``V, Z (batch, seqlen, nheads,
    headdim_v)``, ``ADT, DT, Trap (batch, nheads, seqlen)``, ``Q_bias, K_bias (nheads, headdim_qk)``, ``Angles
    (batch, seqlen, nheads, headdim_angles)``, ``D (nheads,)``; ``Input_States = (angle, ssm, k, v)`` of shapes
    ``(R, nheads, headdim_angles)``, ``(R, nheads, headdim_v, headdim_qk)``, ``(R, nheads, headdim_qk)``, ``(R,
    nheads, headdim_v)`` with ``R`` the batch or the sequences of ``cu_seqlens`` (int32, batch 1). Returns ``out``,
    or with ``return_final_states`` ``(out, angle, ssm, k, v)``, the final states (zero-started when no
    ``Input_States``)."""
    check_mamba3_siso_combined(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, Input_States, cu_seqlens)
    return _combined(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, Input_States, return_final_states,
                     cu_seqlens)


def _combined(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, ADT: torch.Tensor, DT: torch.Tensor,
              Trap: torch.Tensor, Q_bias: torch.Tensor | None, K_bias: torch.Tensor | None, Angles: torch.Tensor,
              D: torch.Tensor | None, Z: torch.Tensor | None, Input_States: Sequence[torch.Tensor] | None,
              return_final_states: bool, cu_seqlens: torch.Tensor | None) -> Any:
    """``mamba3_siso_combined`` on checked arguments (its step's too, checked in its own layout)."""
    out, *finals = MAMBA3(*_op_args(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, Input_States,
                                    return_final_states, cu_seqlens))
    return (out, *finals) if return_final_states else out


def _op_args(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, ADT: torch.Tensor, DT: torch.Tensor,
             Trap: torch.Tensor, Q_bias: torch.Tensor | None, K_bias: torch.Tensor | None, Angles: torch.Tensor,
             D: torch.Tensor | None, Z: torch.Tensor | None, Input_States: Sequence[torch.Tensor] | None,
             return_final_states: bool, cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """The anchor's arguments as the op's fields (``FIELDS``' order): token-major, each in its element type."""
    step_dtype, param_dtype, state_dtype = _element_types(Q, ADT, Q_bias if Q_bias is not None else D, Input_States)
    step = [cast(t.transpose(1, 2), step_dtype) for t in (ADT, DT, Trap)]
    params = [cast(t, param_dtype) for t in (Q_bias, K_bias, D)]
    states: list[torch.Tensor | None] = [None] * 4
    if Input_States is not None:
        states = [cast(t, state_dtype) for t in Input_States]
    elif return_final_states:
        rows = Q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        heads, p, n, a = V.shape[2], V.shape[3], Q.shape[3], Angles.shape[3]
        states = [V.new_zeros((rows, *s), dtype=state_dtype) for s in ((heads, a), (heads, p, n), (heads, n),
                                                                        (heads, p))]
    cu = None if cu_seqlens is None else cu_seqlens.to(torch.int32)
    return (Q, cast(K, Q.dtype), cast(V, Q.dtype), *step, cast(Angles, step_dtype), *params, cast(Z, Q.dtype), *states,
            cu)


@FUNCTIONS.register("mamba3")
def mamba3_siso_step(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, ADT: torch.Tensor, DT: torch.Tensor,
                     Trap: torch.Tensor, Q_bias: torch.Tensor | None, K_bias: torch.Tensor | None,
                     Angles: torch.Tensor, D: torch.Tensor | None = None, Z: torch.Tensor | None = None,
                     Input_States: Sequence[torch.Tensor] | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One decode step: ``Q, K (batch, nheads_qk, headdim_qk)``, ``V, Z (batch, nheads, headdim_v)``, ``ADT, DT,
    Trap (batch, nheads)``, ``Angles (batch, nheads, headdim_angles)``, ``Input_States = (angle, ssm, k, v)`` (as
    ``mamba3_siso_combined``'s, R = batch). Returns ``(out (batch, nheads, headdim_v), [angle, ssm, k, v])``: the
    states after the step, as new tensors."""
    given = (Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, *(Input_States or ()))
    key = None
    if Input_States is not None and len(Input_States) == len(STATES) and runs_directly(*given):
        key = call_key(*given)
        path = hot_path(key)
        if path is not None and path is not UNBUILT:
            return path(given)
    check_mamba3_siso_step(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, Input_States)
    out, *finals = _combined(*_step_views(given[:11]), Input_States, True, None)
    if key is not None and path is UNBUILT:
        keep_hot_path(key, lambda: _hot_step(given))
    return out.squeeze(1), list(finals)


def _step_views(tensors: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """A decode step's ``(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z)`` as ``mamba3_siso_combined``
    takes them: the tokens with their seqlen axis, ``ADT, DT, Trap`` as ``(batch, nheads, 1)``."""
    q, k, v, adt, dt, trap, q_bias, k_bias, angles, d, z = tensors
    return [*(t.unsqueeze(1) for t in (q, k, v)), *(t.unsqueeze(2) for t in (adt, dt, trap)), q_bias, k_bias,
            angles.unsqueeze(1), d, None if z is None else z.unsqueeze(1)]


def _hot_step(given: tuple[torch.Tensor | None, ...]) -> Callable[..., tuple[torch.Tensor, list[torch.Tensor]]] | None:
    """The hot path (``bridge.hot_path``) of a ``mamba3_siso_step`` signature whose call just ran the whole way
    (``given``: its tensors, the four states last): the op's bound call with each tensor written straight into
    its arena place (``written``), where every field the op takes is a view of the caller's tensor (no cast:
    f32 throughout, or the op's element types already); None for any other."""
    if not all(type(t) in PLAIN for t in given if t is not None):
        return None
    op_args = _op_args(*_step_views(given[:11]), given[11:], True, None)
    bound = bound_call(_signature(op_args), lambda: None, op_args[0])  # the one the call that just ran bound
    if bound is None or not bound.plain:
        return None
    # each plan input's tensor among ``given`` and the view of it the plan takes
    at = {"q": 0, "k": 1, "v": 2, "adt": 3, "dt": 4, "trap": 5, "q_bias": 6, "k_bias": 7, "angles": 8, "d": 9,
          "z": 10, **{f: 11 + i for i, f in enumerate(STATES)}}
    # (a field the call casts is a new tensor's view, which ``written_call`` refuses: no hot path then)
    fields = {f: (at[f], op_args[FIELDS.index(f)].numpy(force=True)) for f in bound.plan.inputs}
    plan = bound.plan
    written = written_call(plan, fields, given, ("q_bias", "k_bias", "d"), (), {},
                           ("y", *(f"{CALL}.{f}" for f in STATES)))
    if written is None:
        return None
    shape = given[2].shape

    def step(given: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        y, *finals = written(given)
        _last.plan = plan
        return torch.from_numpy(y.reshape(shape)), [torch.from_numpy(f) for f in finals]
    return step
