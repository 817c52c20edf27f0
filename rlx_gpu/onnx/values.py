"""The values of an ONNX graph while it is imported: NumPy constants, and strided views of graph tensors.

A value known at import time (an initializer, a ``Constant``, a shape, anything computed from those)
stays a NumPy array and is folded; a value known only at run time is a ``View``: a graph tensor read
at element strides, so that ONNX's transposes, reshapes and broadcasts cost nothing until an op
needs its operand dense (then one ``strided_copy`` thunk, or nothing when the view is the buffer).
Selections along an axis (``Gather``, ``Slice``, gate reordering) are views too: each run of evenly
spaced indices is a view at an offset, and several runs are joined by ``concat``, which copies. A
value is moved, never multiplied by a 0/1 matrix, so an inf or NaN stays where it is.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np

from ..graph.builder import Graph, Tensor
from ..graph.nodes import BodyGraph


def dense_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major element strides of ``shape``."""
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= int(d)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class View:
    """``tensor``'s buffer read as ``shape`` at element ``strides`` (0 on a broadcast axis) from element ``offset``."""

    tensor: Tensor
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int = 0

    @classmethod
    def of(cls, tensor: Tensor) -> "View":
        return cls(tensor, tuple(tensor.shape), dense_strides(tensor.shape))

    @property
    def dtype(self) -> str:
        return self.tensor.dtype

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def is_dense(self) -> bool:
        """True when the view is the buffer itself in row-major order (size-1 axes have any stride)."""
        return self.offset == 0 and self.size == self.tensor.size and all(
            d == 1 or s == t for d, s, t in zip(self.shape, self.strides, dense_strides(self.shape)))

    def transpose(self, perm: Sequence[int]) -> "View":
        return View(self.tensor, tuple(self.shape[p] for p in perm), tuple(self.strides[p] for p in perm), self.offset)

    def expand(self, shape: Sequence[int]) -> "View":
        """NumPy broadcasting of the view to ``shape`` (stride 0 on the new and the stretched axes)."""
        shape = tuple(int(d) for d in shape)
        pad = len(shape) - len(self.shape)
        own = ((1,) * pad + self.shape, (0,) * pad + self.strides)
        strides = tuple(0 if d == 1 and want != 1 else s for d, s, want in zip(*own, shape))
        return View(self.tensor, shape, strides, self.offset)

    def reshape(self, shape: Sequence[int]) -> "View | None":
        """The view as ``shape`` without a copy, or None when its strides do not allow one.

        Old and new axes are matched in groups of equal element count; a group of old axes must be
        contiguous among themselves, and its new axes then take strides from the group's innermost one.
        """
        shape = tuple(int(d) for d in shape)
        if self.size == 0:
            return None
        old = [(d, s) for d, s in zip(self.shape, self.strides) if d != 1]
        new = [ax for ax, d in enumerate(shape) if d != 1]
        strides = [0] * len(shape)
        oi = ni = 0
        while oi < len(old):
            o_end, n_end = oi + 1, ni + 1
            o_count, n_count = old[oi][0], shape[new[ni]]
            while o_count != n_count:
                if n_count < o_count:
                    n_count *= shape[new[n_end]]
                    n_end += 1
                else:
                    o_count *= old[o_end][0]
                    o_end += 1
            if any(old[k][1] != old[k + 1][1] * old[k + 1][0] for k in range(oi, o_end - 1)):
                return None
            step = old[o_end - 1][1]
            for k in reversed(range(ni, n_end)):
                strides[new[k]] = step
                step *= shape[new[k]]
            oi, ni = o_end, n_end
        return View(self.tensor, shape, tuple(strides), self.offset)

    def run(self, axis: int, first: int, count: int, step: int) -> "View":
        """The ``count`` elements ``first, first + step, ...`` (``step >= 0``) along ``axis``, as a view."""
        stride = self.strides[axis]
        return View(self.tensor, (*self.shape[:axis], count, *self.shape[axis + 1:]),
                    (*self.strides[:axis], step * stride, *self.strides[axis + 1:]), self.offset + first * stride)


Value = Union[np.ndarray, View]


def dense(graph: BodyGraph, value: Value, dtype: str | None = None) -> Tensor:
    """``value`` as a dense graph tensor: the buffer itself, a reshaped view of it, or one strided copy."""
    if isinstance(value, np.ndarray):
        return graph.constant(value, dtype)
    if value.is_dense():
        t = value.tensor
        return t if t.shape == value.shape else graph.reshape(t, value.shape)
    return graph.strided_copy(value.tensor, value.shape, value.strides, value.offset)


def reshape(graph: BodyGraph, value: Value, shape: Sequence[int]) -> Value:
    """``value`` as ``shape`` (same element count): a view where the strides allow, else a copy's view."""
    if isinstance(value, np.ndarray):
        return value.reshape(tuple(shape))
    return value.reshape(shape) or View.of(graph.reshape(dense(graph, value), shape))


def _runs(indices: Sequence[int]) -> list[tuple[int, int, int]]:
    """``indices`` as maximal runs ``(first, count, step)`` of evenly spaced ones with ``step >= 0``."""
    runs: list[tuple[int, int, int]] = []
    i = 0
    while i < len(indices):
        count, step = 1, 0
        if i + 1 < len(indices) and indices[i + 1] >= indices[i]:
            step = indices[i + 1] - indices[i]
            while i + count < len(indices) and indices[i + count] - indices[i + count - 1] == step:
                count += 1
        runs.append((indices[i], count, step))
        i += count
    return runs


def take(graph: BodyGraph, value: Value, axis: int, indices: Sequence[int]) -> Value:
    """The elements ``indices`` (non-negative) of ``value`` along ``axis``, as NumPy's ``take``.

    Of a run-time value: a view when the indices are evenly spaced in order, else the views of
    their runs joined (``concat``).
    """
    indices = [int(i) for i in indices]
    if isinstance(value, np.ndarray):
        return np.take(value, indices, axis=axis)
    if indices == list(range(value.shape[axis])):
        return value
    return concat(graph, [value.run(axis, *run) for run in _runs(indices) or [(0, 0, 0)]], axis)


def concat(graph: Graph | BodyGraph, values: Sequence[Value], axis: int) -> Value:
    """``values`` joined along ``axis`` (NumPy's ``concatenate``); run-time ones by the graph's ``concat``."""
    if all(isinstance(v, np.ndarray) for v in values):
        return np.concatenate(values, axis=axis)
    if len(values) == 1:
        return values[0]
    dtype = next(v.dtype for v in values if isinstance(v, View))
    return View.of(graph.concat([dense(graph, v, dtype) for v in values], axis))
