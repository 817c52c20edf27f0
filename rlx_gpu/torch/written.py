"""A hot path's call with its tensors written straight into the arena of a call plan on host memory (the host's,
or an OpenCL CPU device's shared memory: ``runtime.host_call``).

A decode step's inputs are small: moving one costs less than the Python around it. ``BoundCall`` makes a NumPy
view of each tensor, the view the plan takes (a reshape, a field picked out of a broadcast), and the plan checks
and copies it; ``written_call`` works all that out once per signature instead, as a writer per input
(``place_writer``): per call, one ``memmove`` of the caller's tensor's bytes into the input's place in the
arena, or, for a field picked out of a broadcast (Mamba-2's per-head dt, A, D), one NumPy assignment of the
picked elements. The large inputs a kernel reads where they lie (a carried state) are handed over as NumPy views
(kept per tensor, ``HeldView``, for a state the call updates in place); on a device they are copied in and out
(the kernel reads the arena only), which still skips ``CallPlan.call``'s views and checks (on PoCL, 5-10 µs of a
Mamba-1 decode step's Python: docs/performance.md).
"""
from __future__ import annotations

from typing import Any, Callable, Collection, Mapping, Sequence

import numpy as np
import torch

from ..runtime.host_call import HostCall, move, places
from .bridge import BoundCall, _last, stamp
from .held_views import HeldView

#: A writer: ``put(t)`` writes the caller's tensor ``t`` (of the bound signature) into an input's place.
Put = Callable[[torch.Tensor], Any]


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def place_writer(place: np.ndarray, t: torch.Tensor, field: np.ndarray, held: bool) -> Put | None:
    """How a call writes tensor ``t`` into ``place`` (an input's arena place) where ``field`` is the view of
    ``t``'s memory (``t.numpy()``'s, reshaped, or picked out of a broadcast) the plan would take: one ``memmove``
    of ``t``'s bytes into ``place`` when ``field`` is ``t`` reshaped (``_mover``), else one NumPy assignment
    of the elements ``field`` picks from ``t``'s view (``_picked``; the view kept per tensor where ``held``: a
    parameter). None where ``field`` is neither, or of another dtype than ``place`` (a conversion the plan does)."""
    own = t.numpy(force=True)
    if field.dtype != place.dtype or own.dtype != place.dtype or field.shape != place.shape or not field.size:
        return None
    if _address(field) == _address(own) and field.flags.c_contiguous and own.flags.c_contiguous \
            and field.size == own.size:
        return _mover(place, t)
    picked = _picked(place, own, field)
    if picked is None:
        return None
    index, target = picked
    view = HeldView() if held else _numpy

    def put(t: torch.Tensor) -> None:
        target[...] = view(t)[index]
    return put


def _mover(place: np.ndarray, t: torch.Tensor) -> Put:
    """A writer of a tensor of ``t``'s signature (shape, strides, dtype: C-contiguous, as ``t``) into ``place``
    (C-contiguous, of its dtype and size): one ``memmove`` of its bytes from its address. A decode step's
    ``copy_`` runs torch's dispatcher and TensorIterator, whose code a kernel's sweep of the cache has evicted
    (on an Intel Xeon after an LSTM step, 16 µs against 10 for the memmove). What the signature does not tell
    goes by ``copy_``, which knows it: a tensor whose negation is lazy (its neg bit: ``z.conj().imag``) or one
    of no memory (a zero tensor, ``torch._efficientzerotensor``: address 0)."""
    target, nbytes = _address(place), place.nbytes
    copy = torch.from_numpy(place).view(t.shape).copy_
    data, negated = torch.Tensor.data_ptr, torch.Tensor.is_neg

    def put(t: torch.Tensor) -> Any:
        address = data(t)
        return move(target, address, nbytes) if address and not negated(t) else copy(t)
    return put


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.numpy(force=True)


def _picked(place: np.ndarray, own: np.ndarray, field: np.ndarray) -> tuple[tuple, np.ndarray] | None:
    """``(index, target)`` such that ``target[...] = own[index]`` writes ``field`` (a view of ``own``'s memory)
    into ``place`` (``target`` a view of it): ``index`` takes the first element along each axis ``own``
    broadcasts (stride 0) or has one of; None where ``field`` reads other elements, checked on the elements'
    addresses."""
    index = tuple(0 if n == 1 or step == 0 else slice(None) for n, step in zip(own.shape, own.strides))
    picked = own[index]
    if _address(field) != _address(own) or picked.size != place.size:
        return None
    if not np.array_equal(_addresses(field).reshape(-1), _addresses(picked).reshape(-1)):
        return None
    return index, place.reshape(picked.shape)


def _addresses(a: np.ndarray) -> np.ndarray:
    """Each element's byte offset from ``a``'s first, in ``a``'s shape."""
    grid = np.indices(a.shape).reshape(a.ndim, -1) if a.ndim else np.zeros((0, 1), np.intp)
    return (np.asarray(a.strides, np.intp) @ grid).reshape(a.shape) if a.ndim else np.zeros((), np.intp)


def written_call(plan: Any, fields: Mapping[str, tuple[int, np.ndarray]], args: Sequence[torch.Tensor],
                 stamped: Collection[str], handed: Collection[str], in_place: Mapping[str, str],
                 taken: Sequence[str]) -> HostCall | None:
    """The ``HostCall`` of ``plan`` (called once already) for a signature whose call had the tensors ``args``:
    ``fields`` gives each plan input's tensor (its position among ``args``) and the view of it the plan takes;
    ``stamped`` the inputs given with their stamps (``bridge.stamp``), ``handed`` those the kernel reads where
    they lie (the tensor itself, viewed as a kept NumPy array; another input is too where it is the tensor's
    own memory and large enough for the plan's ``given`` layout: no copy of it a call, its stamp moot),
    ``in_place`` the outputs (by name) the kernel writes in place of a handed input (by name), ``taken`` the
    outputs returned. None where the plan is no plan on host memory (``places``) or a view is one this cannot
    write (``place_writer``) or hand over."""
    arena = places(plan, shared=True)
    if arena is None:
        return None
    layout = plan._given
    writes, stamps, hand = [], [], []
    for i, name in enumerate(plan.inputs):
        at, field = fields[name]
        own = args[at].numpy(force=True)
        whole = (field.shape == own.shape and _address(field) == _address(own) and own.flags.c_contiguous
                 and own.dtype == field.dtype == arena[name].dtype)
        if name in handed and not whole:
            return None
        # the caller's tensor itself, which the kernel may read (and update) where it lies: one ``handed``, or
        # another large enough for the plan's ``given`` layout (Mamba-1's A, as ``CallPlan.call`` hands it)
        if name in handed or whole and layout is not None and layout.inputs[i]:
            # a state the call updates in place, or a parameter, comes back call after call: its view is kept;
            # another (a state the kernel updates a copy of) is a new tensor each call, viewed afresh
            hand.append((i, at, HeldView() if name in in_place.values() or name in stamped else _numpy))
            continue
        put = place_writer(arena[name], args[at], field, name in stamped)
        if put is None:
            return None
        if name in stamped:
            stamps.append((name, at, put, stamp))
        else:
            writes.append((at, put))
    order = [plan.inputs[i] for i, _, _ in hand]
    return HostCall(plan, writes, stamps, hand, {plan.outputs.index(o): order.index(i) for o, i in in_place.items()},
                    [plan.outputs.index(o) for o in taken])


def bound_written(bound: BoundCall, tensors: Sequence[torch.Tensor]) -> Callable[..., list[torch.Tensor]] | None:
    """``bound`` (a ``BoundCall``, called once) as a ``HostCall`` on the tensors it takes as they are
    (``tensors``: the call's that just ran): ``run(tensors) -> outputs``, new CPU tensors; the large inputs the
    kernel may read where they lie handed over. None where ``written_call`` gives none."""
    plan = bound.plan
    layout, arena = plan._given, places(plan, shared=True)
    if arena is None:
        return None
    fields = {name: (at, tensors[at].numpy(force=True)) for name, at in zip(plan.inputs, bound.order)}
    handed = [name for i, name in enumerate(plan.inputs) if layout is not None and layout.inputs[i]]
    stamped = [plan.inputs[i] for i, _ in bound.stamped]
    host = written_call(plan, fields, tensors, stamped, handed, {}, [plan.outputs[j] for j in bound.outputs])
    if host is None:
        return None

    def run(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        out = host(tensors)
        _last.plan = plan
        return [torch.from_numpy(a) for a in out]
    return run
