"""A recurrent module's decode hot path (``nn``): the forward op of one call signature on CPU tensors, its call
plan bound once, the weight streams copied in only when a parameter changed, a step setting only x and the
states among the plan's inputs. On the host a module's decode loop (batch first, ``hx`` given) runs a step of its
own (``decode_path``): the signature check, the parameters' marks, the plan's call and the output tensors in one
frame, as few calls as it can (after the kernel's weight stream swept the cache each is a µs)."""
from __future__ import annotations

import operator
import weakref
from typing import Any, Callable, Hashable, Mapping, NamedTuple, Sequence

import torch

from ..runtime.host_call import HostCall, places
from .bridge import CPU, _ENVIRON, BoundCall, _device_variables, _last, host_array, plan_for, specs_of, tensor
from .fused import CALL
from .library import _any_requires_grad, _dispatch_modes, _function_mode, _grad_enabled, _transforms
from .recurrent import Recurrence, _forward_graph, _inputs, _packings
from .written import place_writer


class HotRecurrent(NamedTuple):
    """A signature's forward bound once (``hot_recurrent``). ``run(x, weights, states) -> [y, *final states]`` takes
    any call of the signature (None: a parameter's dtype or device changed); on the host, ``host`` is the
    ``HostCall`` writing ``(x, *states, packing)`` into the plan's arena and ``packing(weights)`` the weight
    streams with their key (``_Packings``; None as ``run``'s), what a module's decode step calls itself
    (``latest_path``); ``host`` is None on another device or where a tensor is no plain view."""

    run: Callable[..., list[torch.Tensor] | None]
    host: HostCall | None
    packing: Callable[[Sequence[torch.Tensor]], tuple[Mapping[str, torch.Tensor], Hashable | None] | None]


def hot_recurrent(spec: Recurrence, x: torch.Tensor, weights: Sequence[torch.Tensor],
                  states: Sequence[torch.Tensor]) -> HotRecurrent | None:
    """The forward of ``spec`` bound for the signature of a call on CPU tensors that just ran (a module's
    hot path: ``nn``): its call plan bound once, the weight streams taken from ``_Packings`` and copied in only
    when a parameter changed (their stamp); a run answers None where a parameter has another dtype or device
    than the signature's (its ``.data`` swapped: the call goes the whole way). None where the weights are no
    parameters (packed on every call) or there are no steps to run."""
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

    def packing(weights: Sequence[torch.Tensor]) -> tuple[Mapping[str, torch.Tensor], Hashable | None] | None:
        if not all(w.dtype is kind[0] and w.device == kind[1] for w in weights):
            return None  # a parameter's .data swapped for another dtype's or device's: the whole way
        return _packings.streams(spec, weights)

    def run(x: torch.Tensor, weights: Sequence[torch.Tensor], states: Sequence[torch.Tensor]
            ) -> list[torch.Tensor] | None:
        marks = (*map(_version, weights), *map(_address, weights))
        held, seen, values, stamps, packed = latest
        if marks != seen or not all(map(operator.is_, weights, map(_referent, held))):
            packed = packing(weights)
            if packed is None:
                return None
            values, stamps = _placed(bound, *packed)
            kept = packed[1] is not None  # parameters: a packing kept per version
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
    return HotRecurrent(run, host, packing)


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
        if _grad_enabled() and _any_requires_grad(input, *given, *current_weights(module)) \
                or tuple(map(environ, variables)) != device:
            return None
        return path(module, input, hx)
    return latest


def current_weights(module: Any) -> list[torch.Tensor]:
    """``module``'s parameters as torch.nn's forward reads them (``RNNBase._update_flat_weights``): its
    ``_flat_weights``, made again where a parameter was put into ``_parameters`` without ``__setattr__``
    (``torch.func.functional_call``, ``torch.nn.utils.stateless``) or is computed (``parametrize``). Each is
    compared by identity with ``_parameters``' entry of its name in one pass (torch's own check reads each name
    through ``nn.Module.__getattr__``); only a difference runs torch's."""
    weights = module._flat_weights
    if not all(map(operator.is_, weights, map(module._parameters.get, module._flat_weights_names))):
        module._update_flat_weights()
        weights = module._flat_weights
    return weights


class Signature(NamedTuple):
    """A decode call's signature as ``decode_path`` checks it (``signature``): the type of ``hx``, the types of the
    input and the states, each one's dtype, shape, strides and CPU-ness in a row, and the values of the default
    device's variables (``bridge.default_device``)."""

    form: type
    types: tuple[type, ...]
    layout: tuple
    device: tuple


def signature(input: torch.Tensor, given: Sequence[torch.Tensor], hx: Any) -> Signature:
    """The ``Signature`` of a call of ``input`` and the states ``given`` as ``hx``."""
    tensors = (input, *given)
    return Signature(type(hx), tuple(map(type, tensors)), tuple(v for t in tensors for v in (
        t.dtype, t.shape, t.stride(), t.is_cpu)), tuple(map(_ENVIRON.get, _device_variables())))


class ModulePath(NamedTuple):
    """What a recurrent module keeps per call signature (``bridge.keep_hot_path``): ``call(module, input, hx)``, the
    hot path behind the check of the signature (``latest_path``), and ``own(module)``: the latest path the module
    keeps (``nn._RlxRecurrent._rlx_latest``), ``call`` itself or, on the host, a decode step of its own
    (``decode_path``)."""

    call: Callable[..., Any]
    own: Callable[[Any], Callable[..., Any]]


def decode_path(hot: HotRecurrent, module: Any, called: Signature, lstm: bool) -> Callable[..., Any]:
    """``module``'s own latest path for a decode loop's call on the host (``nn``: batch first, ``hx`` given,
    ``hot.host`` set): ``latest(module, input, hx)`` as ``latest_path``'s, in one frame. The check of the signature
    ``called`` is ``latest_path``'s unrolled for the input and the states (an LSTM's h and c, a GRU's or an RNN's
    h) and compared as one tuple; then the parameters' marks (``_version``, ``_address``) are compared with those
    of the module's latest packing (its ``_flat_weights`` the list it had when the path was made: setting a
    parameter on the module drops the path), the ``HostCall`` writes x and the states into the plan's arena and
    runs it, and the outputs come back in torch.nn's form, ``(output, (h_n, c_n))`` or ``(output, h_n)``. Where the
    ``HostCall`` takes them by address (``moved``: each dense, its signature's) x and the states are moved from
    their tensors' addresses, by its call bound as one closure where no stamp is due (``HostCall.moving``); a
    lazily negated tensor or one of no memory (``torch._efficientzerotensor``, address 0) goes the whole way,
    which writes its values. After a kernel that swept the cache each frame and call less is a µs."""
    form, types, layout, device = called
    # the module's parameters as its forward reads them (``current_weights``), checked inline: its ``_flat_weights``
    # the list it had when the path was made (setting an attribute drops the path), each still ``_parameters``' entry
    # of its name (not put there without ``__setattr__``: ``torch.func.functional_call``)
    own, names, parameter = module._flat_weights, module._flat_weights_names, module._parameters.get
    host, packing = hot.host, hot.packing
    plan, moved, moving = host.plan, bool(host.moved), host.moving  # ``moving``: the HostCall's fast case
    variables, environ = _device_variables(), _ENVIRON.get
    wrap, data = torch.from_numpy, torch.Tensor.data_ptr
    latest_packing: list[Any] = [(None, None)]  # the parameters' marks at the module's latest packing, and it
    x_type, h_type, c_type = types if lstm else (*types, None)

    def latest(module: Any, input: Any, hx: Any = None) -> Any:
        if type(hx) is not form or _function_mode() or _dispatch_modes() or _transforms():
            return None
        if lstm:
            if len(hx) != 2:
                return None
            h, c = hx
            if type(input) is not x_type or type(h) is not h_type or type(c) is not c_type or (
                    input.dtype, input.shape, input.stride(), input.is_cpu, h.dtype, h.shape, h.stride(), h.is_cpu,
                    c.dtype, c.shape, c.stride(), c.is_cpu) != layout or input.is_neg() or h.is_neg() or c.is_neg():
                return None
            tensors, addresses = (input, h, c), (data(input), data(h), data(c))
        else:
            if type(input) is not x_type or (input.dtype, input.shape, input.stride(), input.is_cpu, hx.dtype,
                                             hx.shape, hx.stride(), hx.is_cpu) != layout or input.is_neg() \
                    or hx.is_neg():
                return None
            tensors, addresses = (input, hx), (data(input), data(hx))
        if 0 in addresses:  # a tensor of no memory (``torch._efficientzerotensor``): the whole way, as a lazy negation
            return None
        if module._flat_weights is not own or not all(map(operator.is_, own, map(parameter, names))):
            return None  # the whole way, which makes the list again
        if _grad_enabled() and _any_requires_grad(*tensors, *own) or tuple(map(environ, variables)) != device:
            return None
        marks = (*map(_version, own), *map(_address, own))
        seen, packed = latest_packing[0]
        if marks != seen:
            packed = packing(own)
            if packed is None:
                return None
            latest_packing[0] = (marks if packed[1] is not None else None, packed)  # no key: packed every call
        out = None if moving is None else moving(packed, addresses)
        if out is None:
            out = host((*tensors, packed), addresses if moved else None)
        _last.plan = plan
        if lstm:
            return wrap(out[0]), (wrap(out[1]), wrap(out[2]))
        return wrap(out[0]), wrap(out[1])
    return latest


def _written(spec: Recurrence, plan: Any, x: torch.Tensor, states: Sequence[torch.Tensor],
             inputs: Mapping[str, torch.Tensor], bound: BoundCall) -> HostCall | None:
    """The ``HostCall`` of the hot path on the host (``written``): called on ``(x, *states, (streams, key))``,
    x and the states written by one ``memmove`` each (given by their addresses where every one is dense: its
    ``moved``), the weight streams only when their key (``_Packings``) changed; None on another device or where a
    tensor is no plain view (``place_writer``)."""
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
    key = operator.itemgetter(1)  # one for all: their stamps are shared (``HostCall``)
    stamped = [(name, packed, stream(name), key) for name in spec.streams if name in inputs]
    dense = all(t.numpy(force=True).flags.c_contiguous for t in (x, *states))  # each one's bytes its place's
    return HostCall(plan, writes, stamped, (), {}, bound.outputs, ("x", *spec.states) if dense else ())


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
