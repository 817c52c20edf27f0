"""A recurrent module's decode hot path (``nn``): the forward op of one call signature on CPU tensors, its call
plan bound once, the weight streams copied in only when a parameter changed, a step setting only x and the
states among the plan's inputs."""
from __future__ import annotations

import operator
import weakref
from typing import Any, Callable, Hashable, Mapping, Sequence

import torch

from .bridge import CPU, BoundCall, host_array, plan_for, specs_of, tensor
from .fused import CALL
from .recurrent import Recurrence, _forward_graph, _inputs, _packings


def hot_recurrent(spec: Recurrence, x: torch.Tensor, weights: Sequence[torch.Tensor],
                  states: Sequence[torch.Tensor]) -> Callable[..., list[torch.Tensor]] | None:
    """The forward of ``spec`` bound for the signature of a call on CPU tensors that just ran (a module's
    hot path: ``nn``), ``run(x, weights, states) -> [y, *final states]``: its call plan bound once, the
    weight streams taken from ``_Packings`` and copied in only when a parameter changed (their stamp);
    None where the weights are no parameters (packed on every call) or there are no steps to run."""
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
    # the latest call's parameters (weakly), (version, address) marks, and the plan's inputs and stamps with its
    # packing in place: a decode loop's are unchanged, so a step sets only x and the states
    latest: list[Any] = [(), None, None, None]

    def run(x: torch.Tensor, weights: Sequence[torch.Tensor], states: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        marks = [(w._version, w.data_ptr()) for w in weights]
        held, seen, values, stamps = latest
        if marks != seen or len(held) != len(weights) or not all(map(operator.is_, weights, map(_referent, held))):
            streams, key = _packings.streams(spec, weights)
            values, stamps = _placed(bound, streams, key)
            kept = key is not None  # parameters: a packing kept per version
            latest[:] = [tuple(map(weakref.ref, weights)), marks, values, stamps] if kept else [(), None, None, None]
        values = values.copy()  # a stream is read only when its stamp changed
        values[x_at] = view(x)
        for at, state in zip(state_ats, states):
            values[at] = view(state)
        return [wrap(a) for a in bound.run(values, stamps)]
    return run


_referent = weakref.ref.__call__  # a weak reference's object, mapped without a generator's frame


def _placed(bound: BoundCall, streams: Mapping[str, torch.Tensor], key: Hashable | None
            ) -> tuple[list[Any], list[Hashable | None]]:
    """The inputs and stamps of ``bound``'s plan (``hot_recurrent``'s: x, the streams, the states) in its order,
    the weight ``streams`` in their places with the stamp ``key`` (None: none), x and the states left None."""
    given = [None, *streams.values()]
    values = [given[i] if i < len(given) else None for i in bound.order]
    stamps = [key if 0 < i < len(given) else None for i in bound.order]
    return values, stamps
