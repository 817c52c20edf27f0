"""mamba_ssm's ``selective_state_update``: one decode step of Mamba-1 or Mamba-2, the state updated in place,
as one ``selective_scan`` or ``mamba2`` call of one token (ABI.md §4/§8); not differentiable, like mamba_ssm's.
It runs where its tensors lie (``bridge.device_for``).
"""
from __future__ import annotations

from typing import Any, Callable, Hashable, NamedTuple

import numpy as np
import torch
from torch.autograd.graph import increment_version

from .arguments import check_selective_state_update, check_state_batch_indices
from .bridge import (CPU, DTYPES, UNBUILT, BoundCall, _last, call_key, default_device, device_for, host_array, hot_path,
                     keep_hot_path, kept_per_signature, on_cuda, plan_for, rlx_dtype, run_arrays, stamp, tensor)
from .fused import FINAL_STATE, FusedCall, call_of, forward_graph
from .held_views import HeldView
from .library import PLAIN, define, dense, direct, runs_directly
from .registry import FUNCTIONS
from .written import written_call
from .ssm import _param_dtype, _state_dtype

__all__ = ["selective_state_update"]

def _tied_along_dim(heads_form: bool, dt: torch.Tensor, A: torch.Tensor, *per_head: torch.Tensor | None) -> bool:
    """Whether dt, A (and D, dt bias) of a heads-form step are per-head values broadcast along ``dim`` by
    stride-0 views, as a Mamba-2 block passes them."""
    return (heads_form and A.dim() == 3 and A.stride(-1) == 0 and A.stride(-2) == 0 and dt.dim() == 3
            and dt.stride(-1) == 0 and all(t is None or (t.dim() == 2 and t.stride(-1) == 0) for t in per_head))


@FUNCTIONS.register("mamba2")
def selective_state_update(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                           C: torch.Tensor, D: torch.Tensor | None = None, z: torch.Tensor | None = None,
                           dt_bias: torch.Tensor | None = None, dt_softplus: bool = False,
                           state_batch_indices: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step of Mamba-1 or Mamba-2, mamba_ssm's ``selective_state_update``: ``state`` is
    updated IN PLACE, ``state = exp(dt·A)·state + dt·B·x``, and ``out = (C·state + D·x)⊙silu(z)`` returned.

    Parameters
    ----------
    state : torch.Tensor
        ``[batch, dim, dstate]`` or ``[batch, nheads, dim, dstate]``; with ``state_batch_indices`` a pool
        whose entry ``state_batch_indices[i]`` row ``i`` reads and writes (entries named by no row are
        left untouched; no entry may be named twice).
    x, dt, z : torch.Tensor
        ``[batch, dim]`` or ``[batch, nheads, dim]`` (a ``dt`` broadcast along ``dim`` may be a stride-0 view).
    A : torch.Tensor
        ``[dim, dstate]`` or ``[nheads, dim, dstate]``; ``D`` and ``dt_bias`` ``[dim]`` or ``[nheads, dim]``.
    B, C : torch.Tensor
        ``[batch, dstate]`` or ``[batch, ngroups, dstate]``; head ``h`` reads group ``h // (nheads/ngroups)``.

    Returns
    -------
    torch.Tensor
        ``out``, shaped and typed like ``x``. Not differentiable, like mamba_ssm's.
    """
    key = None
    if state_batch_indices is None and runs_directly(state, x, dt, A, B, C, D, z, dt_bias):
        key = call_key(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus)
        path = hot_path(key)
        if path is not None and path is not UNBUILT:
            return path(state, x, dt, A, B, C, D, z, dt_bias)
    check_selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices)
    out = _STATE_UPDATE_CALL(state, x, dt, A, B, C, D, z, dt_bias, bool(dt_softplus), state_batch_indices)
    if key is not None and path is UNBUILT:
        keep_hot_path(key, lambda: _hot_step(state, x, dt, A, B, C, D, z, dt_bias, bool(dt_softplus)))
    return out


def _hot_step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
              C: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None, dt_bias: torch.Tensor | None,
              dt_softplus: bool) -> Callable[..., torch.Tensor] | None:
    """The hot path of a signature (``bridge.hot_path``) whose call just passed its checks: the step on its
    route's bound call, the final state written straight into the caller's (CPU tensors of torch's own
    types, rows to run, the state in the op's layout a view of the caller's); None for any other."""
    if x.shape[0] == 0 or not all(type(t) in PLAIN for t in (state, x, dt, A, B, C, D, z, dt_bias) if t is not None):
        return None
    route = _route(state, x, dt, A, B, D, z, dt_bias, dt_softplus)
    if route.bound is None or not route.in_place:
        return None

    if not route.bound.plain:
        def step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                 C: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None,
                 dt_bias: torch.Tensor | None) -> torch.Tensor:
            y = _step(route, state, x, dt, A, B, C, D, z, dt_bias, None)
            increment_version(state)  # as the op's schema (``Tensor(a!) state``) has the dispatcher do
            return y
        return step
    return _plain_step(route, state.dim() == 4, B.dim() == 3, C.dim() == 3,
                       (state, x, dt, A, B, C, D, z, dt_bias))


def _plain_step(route: _StepRoute, heads_form: bool, b_grouped: bool, c_grouped: bool,
                tensors: tuple[Any, ...]) -> Callable[..., torch.Tensor]:
    """``_step`` on a route whose tensors NumPy views as they are (no bf16): the same views, stamps and call,
    the signature's cases decided once (its forms, which fields the plan takes in which order), so a step
    makes only its tensors' views and the plan's call; on the host, its tensors written straight into the
    plan's arena (``written``: no view a step) where each field is a view of its tensor (``tensors``: the
    call's that just ran, ``(state, x, dt, A, B, C, D, z, dt_bias)``)."""
    bound = route.bound
    order = bound.plan.inputs  # the op's fields the plan takes, in its order
    stamped = [(i, ("a", "d", route.bias).index(f)) for i, f in enumerate(order) if f in ("a", "d", route.bias)]
    state_at = bound.plan.outputs.index(FINAL_STATE)
    fields, broadcast, count = route.fields, np.broadcast_to, len(bound.plan.outputs)
    # the tensors a decode passes again and again: the state and the parameters
    pools, a_views, d_views, bias_views = HeldView(), HeldView(), HeldView(), HeldView()

    def views(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
              C: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None,
              dt_bias: torch.Tensor | None) -> dict[str, Any]:
        """The op's fields by name: NumPy views of the tensors (the state's writes through to the caller's)."""
        pool, xs = pools(state), x.numpy(force=True)
        Bs, Cs = B.numpy(force=True), C.numpy(force=True)
        Ds = None if D is None else d_views(D)
        zs = None if z is None else z.numpy(force=True)
        biases = None if dt_bias is None else bias_views(dt_bias)
        if heads_form:
            Bs, Cs = Bs if b_grouped else Bs[:, None], Cs if c_grouped else Cs[:, None]
            return fields(broadcast, pool, xs, dt.numpy(force=True), a_views(A), Bs, Cs, Ds, zs, biases)
        # Mamba-1's own form, one head: the op's fields are its tensors with a token axis (no reshape)
        return {"x": xs[:, None], "delta": dt.numpy(force=True)[:, None], "a": a_views(A),
                "b": Bs[:, None] if b_grouped else Bs[:, None, None],
                "c": Cs[:, None] if c_grouped else Cs[:, None, None], "d": Ds, "delta_bias": biases,
                "z": None if zs is None else zs[:, None], "state": pool}

    plan = bound.plan
    written = written_call(plan, {f: (_POSITIONS[f], a) for f, a in views(*tensors).items() if a is not None},
                           tensors, ("a", "d", route.bias), ("state",), {FINAL_STATE: "state"}, ("y",))
    if written is not None:
        def step_written(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                         C: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None,
                         dt_bias: torch.Tensor | None) -> torch.Tensor:
            y, = written((state, x, dt, A, B, C, D, z, dt_bias))
            _last.plan = plan
            increment_version(state)  # as the op's schema (``Tensor(a!) state``) has the dispatcher do
            return torch.from_numpy(y.reshape(x.shape))  # a new array's view: NumPy's reshape costs less than torch's
        return step_written

    def step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None,
             dt_bias: torch.Tensor | None) -> torch.Tensor:
        by_field = views(state, x, dt, A, B, C, D, z, dt_bias)
        params = (A, D, dt_bias)
        stamps = [None] * len(order)
        for i, p in stamped:
            stamps[i] = stamp(params[p])
        into = [None] * count
        into[state_at] = by_field["state"]  # the final state straight into the caller's
        y = bound.run([by_field[f] for f in order], stamps, into)[0]
        increment_version(state)  # as the op's schema (``Tensor(a!) state``) has the dispatcher do
        return torch.from_numpy(y.reshape(x.shape))  # a new array's view: NumPy's reshape costs less than torch's
    return step


#: Each op field's tensor, by its position among ``selective_state_update``'s (state, x, dt, A, B, C, D, z, dt_bias).
_POSITIONS = {"state": 0, "x": 1, "dt": 2, "delta": 2, "a": 3, "b": 4, "c": 5, "d": 6, "z": 7, "dt_bias": 8,
              "delta_bias": 8}


class _StepRoute(NamedTuple):
    """How one signature of ``selective_state_update`` maps onto an op: worked out once (``_step_route``),
    so a decode step does only the NumPy views of its tensors and the plan's call."""

    op: str
    call: FusedCall
    specs: dict[str, tuple[tuple[int, ...], str]]  # the op's fields: shapes and element types
    # (broadcast_to, pool rows, x, dt, A, B, C, D, z, dt_bias) -> by field: NumPy views, or torch views on CUDA
    fields: Callable[..., dict[str, Any]]
    bias: str  # the op's field of the dt bias
    bound: BoundCall | None  # CPU tensors: the call bound once (None on another device)
    in_place: bool  # the state field is a view of the caller's state: the final state is written straight to it


def _step_route(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                D: torch.Tensor | None, z: torch.Tensor | None, dt_bias: torch.Tensor | None,
                dt_softplus: bool, pooled: bool) -> _StepRoute:
    """The route of one signature (shapes, strides, dtypes, devices and the default device); ``pooled``: the
    op's state is the whole pool, row ``r`` reading and writing entry ``state_slots[r]`` (ABI.md §8), where the
    state rows are those of ``x``'s batch otherwise."""
    heads_form = state.dim() == 4
    batch = x.shape[0]
    entries = state.shape[0] if pooled else batch
    heads, dim = (x.shape[1], x.shape[2]) if heads_form else (1, x.shape[1])
    channels, dstate, groups = heads * dim, state.shape[-1], B.shape[1] if B.dim() == 3 else 1
    act, param = rlx_dtype(x), DTYPES[_param_dtype(A, x)]
    carried = DTYPES[state.dtype if state.dtype.itemsize >= x.dtype.itemsize else _state_dtype(x)]
    given = {"d": D is not None, "z": z is not None}
    if _tied_along_dim(heads_form, dt, A, D, dt_bias):
        # one dt, A, D and dt bias per head, broadcast along dim (mamba_ssm's tie_hdim): Mamba-2's own op
        op, bias, statics = "mamba2", "dt_bias", {"dt_softplus": dt_softplus}
        shapes = {"x": (batch, 1, heads, dim), "dt": (batch, 1, heads), "a": (heads,), "b": (batch, 1, groups, dstate),
                  "c": (batch, 1, groups, dstate), "d": (heads,), "dt_bias": (heads,), "z": (batch, 1, heads, dim),
                  "state": (entries, heads, dim, dstate)}

        def fields(broadcast, rows, xs, dts, As, Bs, Cs, Ds, zs, biases):
            return {"x": xs[:, None], "dt": dts[:, None, :, 0], "a": As[:, 0, 0], "b": Bs[:, None], "c": Cs[:, None],
                    "d": None if Ds is None else Ds[:, 0], "dt_bias": None if biases is None else biases[:, 0],
                    "z": None if zs is None else zs[:, None], "state": rows}
    else:  # every (head, channel) a channel of Mamba-1's op, its B and C those of the head's group
        op, bias, statics = "selective_scan", "delta_bias", {"delta_softplus": dt_softplus}
        shapes = {"x": (batch, 1, channels), "delta": (batch, 1, channels), "a": (channels, dstate),
                  "b": (batch, 1, groups, dstate), "c": (batch, 1, groups, dstate), "d": (channels,),
                  "delta_bias": (channels,), "z": (batch, 1, channels), "state": (entries, channels, dstate)}

        def fields(broadcast, rows, xs, dts, As, Bs, Cs, Ds, zs, biases):
            def spread(t, shape):  # one head (Mamba-1's own form): the parameters are per channel already
                return t if heads == 1 else broadcast(t, shape)

            def per_channel(t):
                return None if t is None else spread(t, (heads, dim)).reshape(channels)

            return {"x": xs.reshape(batch, 1, channels), "delta": dts.reshape(batch, 1, channels),
                    "a": spread(As, (heads, dim, dstate)).reshape(channels, dstate),
                    "b": Bs[:, None], "c": Cs[:, None], "d": per_channel(Ds), "delta_bias": per_channel(biases),
                    "z": None if zs is None else zs.reshape(batch, 1, channels),
                    "state": rows.reshape(entries, channels, dstate)}
    given[bias] = dt_bias is not None
    if pooled:
        shapes["state_slots"] = (batch,)
    dtypes = {f: param if f in ("a", "d", bias) else carried if f == "state" else "i32" if f == "state_slots" else act
              for f in shapes}
    specs = {f: (shape, dtypes[f]) for f, shape in shapes.items() if given.get(f, True)}
    call = call_of(op, tuple(specs), **statics)
    bound = None
    if state.is_cpu and x.is_cpu:
        plan = plan_for(("forward", call), lambda: forward_graph(call, specs), specs, None)
        bound = BoundCall(plan, {f: f for f in specs}, ("a", "d", bias), ("y", FINAL_STATE))
    # the caller's state in the op's layout is a view of it (Mamba-2's op, one head, or heads whose strides merge)
    in_place = op == "mamba2" or heads == 1 or _merges(state, shapes["state"])
    return _StepRoute(op, call, specs, fields, bias, bound, in_place)


def _merges(t: torch.Tensor, shape: tuple[int, ...]) -> bool:
    """Whether ``t`` has a view of ``shape`` (its strides allow it without a copy)."""
    try:
        t.view(shape)
    except RuntimeError:
        return False
    return True


_step_routes: dict[Hashable, _StepRoute] = {}
kept_per_signature(_step_routes.clear)  # a route holds its bound call's plan: ``clear_cache`` drops it
#: How many signatures' routes are kept (all are dropped past it: a route is cheap to work out again).
STEP_ROUTES = 256


def _state_update(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                  C: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None, dt_bias: torch.Tensor | None,
                  dt_softplus: bool, state_batch_indices: torch.Tensor | None) -> torch.Tensor:
    """``rlx_gpu::selective_state_update``'s implementation: the step as one ``selective_scan`` or ``mamba2``
    call of one token, the state rows it reads gathered from the pool and written back.

    The tensors are mapped onto the op's fields as NumPy views of their memory, by a route worked out
    once per signature (a decode step's budget has no room for a dozen torch view operations); each is
    converted to its field's element type as the call plan copies it in. CUDA tensors are mapped as torch
    views instead, and the call runs on torch's stream without leaving the device (``bridge.run_arrays``),
    the state written back by torch ops: a decode step a ``torch.cuda.CUDAGraph`` can capture (without
    ``state_batch_indices``, whose check reads them).
    """
    if x.shape[0] == 0:
        return dense(x.shape, x).zero_()
    pooled = state_batch_indices is not None and not on_cuda(x)  # (CUDA: the rows gathered by torch ops)
    return _step(_route(state, x, dt, A, B, D, z, dt_bias, dt_softplus, pooled), state, x, dt, A, B, C, D, z,
                 dt_bias, state_batch_indices)


def _route(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
           D: torch.Tensor | None, z: torch.Tensor | None, dt_bias: torch.Tensor | None,
           dt_softplus: bool, pooled: bool = False) -> _StepRoute:
    """The route of the call's signature, worked out on its first call."""
    signature = (dt_softplus, pooled, default_device(), *[None if t is None else (t.shape, t.stride(), t.dtype,
                                                                                  t.device)
                                                          for t in (state, x, dt, A, B, D, z, dt_bias)])
    route = _step_routes.get(signature)
    if route is None:
        if len(_step_routes) >= STEP_ROUTES:
            _step_routes.clear()
        route = _step_routes.setdefault(signature, _step_route(state, x, dt, A, B, D, z, dt_bias, dt_softplus,
                                                               pooled))
    return route


def _step(route: _StepRoute, state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
          B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None,
          dt_bias: torch.Tensor | None, state_batch_indices: torch.Tensor | None) -> torch.Tensor:
    """The step on its ``route`` (a batch of rows to run)."""
    on_device = on_cuda(x)
    view, broadcast = (torch.Tensor.detach, torch.broadcast_to) if on_device else (host_array, np.broadcast_to)
    heads_form = state.dim() == 4
    pool = view(state) if heads_form else view(state)[:, None]  # views: the step writes through them
    slots = None
    if state_batch_indices is None:
        rows, current = None, pool
    else:
        check_state_batch_indices("selective_state_update", state_batch_indices, state.shape[0])
        rows = view(state_batch_indices).reshape(-1)
        if "state_slots" in route.specs:  # the op reads and writes the named entries of the whole pool itself
            rows, current, slots = None, pool, rows.astype(np.int32, copy=False)
        else:
            rows = rows.long() if on_device else rows.astype(np.intp)
            current = pool[rows]
    xs = view(x) if heads_form else view(x)[:, None]
    Bs = view(B) if B.dim() == 3 else view(B)[:, None]
    Cs = view(C) if C.dim() == 3 else view(C)[:, None]
    fields = route.fields(broadcast, current, xs, view(dt), view(A), Bs, Cs,
                          *(None if t is None else view(t) for t in (D, z, dt_bias)))
    if slots is not None:
        fields["state_slots"] = slots
    stamps = {"a": stamp(A), "d": None if D is None else stamp(D),
              route.bias: None if dt_bias is None else stamp(dt_bias)}
    if route.bound is not None and not on_device and rows is None and route.in_place:  # the final state straight in
        y, _ = route.bound.arrays(fields, stamps, into=(None, fields["state"]))
        return tensor(y.reshape(x.shape), CPU)  # a new array's view: NumPy's reshape costs less than torch's
    specs = route.specs
    out = run_arrays(("forward", route.call), lambda: forward_graph(route.call, specs), specs,
                     {f: a for f, a in fields.items() if a is not None}, None if x.is_cpu else device_for(state, x),
                     {f: s for f, s in stamps.items() if s is not None})
    final = out[FINAL_STATE]
    if rows is None:
        pool[...] = final.reshape(pool.shape)  # converted to the state's dtype, rounding to nearest even
    else:
        pool[rows] = final.reshape(current.shape)
    return (out["y"] if on_device else tensor(out["y"], x.device)).reshape(x.shape)


_STATE_UPDATE = define(
    "selective_state_update",
    "(Tensor(a!) state, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D, Tensor? z, Tensor? dt_bias, "
    "bool dt_softplus, Tensor? state_batch_indices) -> Tensor",
    _state_update, lambda state, x, *rest: dense(x.shape, x))
_STATE_UPDATE_CALL = direct(_STATE_UPDATE)
