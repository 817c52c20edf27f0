"""A recurrent module's decode hot path (``nn``): the forward op of one call signature on CPU tensors, its call
plan bound once, the weight streams copied in only when a parameter changed, a step setting only x and the
states among the plan's inputs."""
from __future__ import annotations

import operator
import weakref
from typing import Any, Callable, Hashable, Mapping, Sequence

import torch

from ..runtime.host_call import HostCall, places
from .bridge import CPU, _ENVIRON, BoundCall, _device_variables, _last, host_array, plan_for, specs_of, tensor
from .fused import CALL
from .library import _any_requires_grad, _dispatch_modes, _function_mode, _grad_enabled, _transforms
from .recurrent import Recurrence, _forward_graph, _inputs, _packings
from .written import place_writer


def hot_recurrent(spec: Recurrence, x: torch.Tensor, weights: Sequence[torch.Tensor],
                  states: Sequence[torch.Tensor]) -> Callable[..., list[torch.Tensor]] | None:
    """The forward of ``spec`` bound for the signature of a call on CPU tensors that just ran (a module's
    hot path: ``nn``), ``run(x, weights, states) -> [y, *final states]``: its call plan bound once, the
    weight streams taken from ``_Packings`` and copied in only when a parameter changed (their stamp); a run
    answers None where a parameter has another dtype or device than the signature's (its ``.data`` swapped: the
    call goes the whole way). None where the weights are no parameters (packed on every call) or there are no
    steps to run."""
    if x.shape[:2].numel() == 0 or not x.is_cpu:
        return None
    inputs, stamps = _inputs(spec, x, weights, states, None)
    if not stamps:
        return None
    specs = specs_of(inputs)
    plan = plan_for(("forward", spec, False), lambda: _forward_graph(spec, inputs, False), specs, None)
    positions = {name: i for i, name in enumerate(inputs)}  # x, the streams, the states
    finals = {"h0": f"{CALL}.h_n", "c0": f"{CALL}.c_n"}
    bound = BoundCall(plan, positions, spec.streams, ("y", *(finals[s] for s in spec.states)))
    view, wrap = (torch.Tensor.numpy, torch.from_numpy) if bound.plain else (host_array, lambda a: tensor(a, CPU))
    # where x and each state go among the plan's inputs (``bound.order``: each one's position among ``inputs``)
    x_at, state_ats = bound.order.index(0), [bound.order.index(positions[s]) for s in spec.states]
    # the latest call's parameters (weakly), their marks (``_version``, ``_address``), and the plan's inputs and
    # stamps with its packing in place: a decode loop's are unchanged, so a step sets only x and the states
    latest: list[Any] = [(), None, None, None, None]
    host = _written(spec, plan, x, states, inputs, bound) if bound.plain else None
    kind = (weights[0].dtype, weights[0].device)

    def run(x: torch.Tensor, weights: Sequence[torch.Tensor], states: Sequence[torch.Tensor]
            ) -> list[torch.Tensor] | None:
        marks = (*map(_version, weights), *map(_address, weights))
        held, seen, values, stamps, packed = latest
        if marks != seen or not all(map(operator.is_, weights, map(_referent, held))):
            if not all(w.dtype is kind[0] and w.device == kind[1] for w in weights):
                return None  # a parameter's .data swapped for another dtype's or device's: the whole way
            streams, key = _packings.streams(spec, weights)
            values, stamps = _placed(bound, streams, key)
            packed = (streams, key)
            kept = key is not None  # parameters: a packing kept per version
            latest[:] = [tuple(map(weakref.ref, weights)), marks, values, stamps, packed] if kept else [(), *[None] * 4]
        if host is not None:  # written straight into the plan's arena
            out = host((x, *states, packed))
            _last.plan = plan
            return list(map(torch.from_numpy, out))
        values = values.copy()  # a stream is read only when its stamp changed
        values[x_at] = view(x)
        for at, state in zip(state_ats, states):
            values[at] = view(state)
        return [wrap(a) for a in bound.run(values, stamps)]
    return run


def latest_path(path: Callable[..., Any], input: torch.Tensor, given: Sequence[torch.Tensor], hx: Any
                ) -> Callable[..., Any]:
    """A module's hot path ``path`` (``nn``: ``path(module, input, hx)``, for the call signature of ``input`` and
    the states ``given`` as ``hx``) behind a check that a call has that signature, done without building and
    hashing its key (``bridge.call_key``: a decode step's 10 µs), what the module keeps as its latest path:
    ``latest(module, input, hx)`` is the path's result, or None where the call is another signature or one
    autograd records (the whole way then). What the check leaves out the module looks after: any attribute set
    on it drops its latest path, and the path itself checks the parameters (their dtype, device and versions).
    The caller checks that Dynamo does not trace the call (``torch.compiler.is_compiling()``) and that no hook
    of nn.Module's is to run."""
    form = type(hx)
    expected = tuple((type(t), t.shape, t.stride(), t.dtype) for t in (input, *given))
    count = len(given)
    # the default device's variables (``bridge.default_device``), read here without its frame
    variables, environ = _device_variables(), _ENVIRON.get
    device = tuple(map(environ, variables))

    def latest(module: Any, input: Any, hx: Any = None) -> Any:
        if type(hx) is not form or _function_mode() or _dispatch_modes() or _transforms():
            return None
        given = () if hx is None else hx if form is tuple else tuple(hx) if form is list else (hx,)
        if len(given) != count:
            return None
        for t, (kind, shape, stride, dtype) in zip((input, *given), expected):
            if type(t) is not kind or t.dtype is not dtype or t.shape != shape or t.stride() != stride \
                    or not t.is_cpu:
                return None
        if _grad_enabled() and _any_requires_grad(input, *given, *module._flat_weights) \
                or tuple(map(environ, variables)) != device:
            return None
        return path(module, input, hx)
    return latest


def _written(spec: Recurrence, plan: Any, x: torch.Tensor, states: Sequence[torch.Tensor],
             inputs: Mapping[str, torch.Tensor], bound: BoundCall) -> HostCall | None:
    """The ``HostCall`` of the hot path on the host (``written``): called on ``(x, *states, (streams, key))``,
    x and the states written by one ``memmove`` each, the weight streams only when their key (``_Packings``)
    changed; None on another device or where a tensor is no plain view (``place_writer``)."""
    arena = places(plan)
    if arena is None:
        return None
    writes = []
    for at, (name, t) in enumerate((("x", x), *zip(spec.states, states))):
        put = place_writer(arena[name], t, t.numpy(force=True), False)
        if put is None:
            return None
        writes.append((at, put))
    packed = 1 + len(spec.states)  # the position of (streams, key)

    def stream(name: str) -> Callable[[Any], Any]:
        target = torch.from_numpy(arena[name])
        return lambda pair: target.copy_(pair[0][name])
    stamped = [(name, packed, stream(name), operator.itemgetter(1)) for name in spec.streams if name in inputs]
    return HostCall(plan, writes, stamped, (), {}, bound.outputs)


_referent = weakref.ref.__call__  # a weak reference's object, mapped without a generator's frame
# a parameter's marks: its version (an in-place torch operation, an optimizer step) and its address (``.data``
# swapped), read without a comprehension's frame
_version = operator.attrgetter("_version")
_address = torch.Tensor.data_ptr


def _placed(bound: BoundCall, streams: Mapping[str, torch.Tensor], key: Hashable | None
            ) -> tuple[list[Any], list[Hashable | None]]:
    """The inputs and stamps of ``bound``'s plan (``hot_recurrent``'s: x, the streams, the states) in its order,
    the weight ``streams`` in their places with the stamp ``key`` (None: none), x and the states left None."""
    given = [None, *streams.values()]
    values = [given[i] if i < len(given) else None for i in bound.order]
    stamps = [key if 0 < i < len(given) else None for i in bound.order]
    return values, stamps
