"""The graph's data and its body ops: ``Tensor``, ``Slot``, ``Node`` and ``BodyGraph``.

A ``BodyGraph`` records ``Node``s whose fields are the op's ABI fields with ``Tensor``s (and, for the
scan family, ``Slot``s and nested graphs) standing in for byte offsets; ``lowering.lower`` lays out
the arena and turns them into numbers. Shapes and the element counts of ABI.md §3 are checked here,
when the op is declared, so a mistake is reported against the user's names rather than a thunk index.
Everything a scan body or a gradient graph (``autodiff``) is built from lives here, so ``scans``,
``autodiff`` and ``lowering`` depend on this module and ``builder.Graph`` depends on them.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from host_fallback.abi import DTYPES, ELEM_SIZE, TENSOR_DTYPES
from host_fallback.abi.body import BINARY_FNS, UNARY_FNS
from host_fallback.arena import STORAGE

from ..errors import GraphError
from ..schedule.limits import MAX_RANK
from .registry import BUILDERS


@dataclass(frozen=True, eq=False)
class Tensor:
    """A dense row-major tensor of a graph; tensors that share ``buf`` are reshaped views of one buffer.

    ``offset`` (elements) is nonzero only for a window into part of a buffer, which the builder makes
    for itself (``concat`` writes its parts into windows, ``strided_copy`` reads from one at ``start``)
    and never returns.
    """

    graph: "BodyGraph"
    buf: int
    shape: tuple[int, ...]
    dtype: str
    name: str | None = None
    offset: int = 0

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * ELEM_SIZE[self.dtype]

    @property
    def whole(self) -> bool:
        """True unless this is a window into part of its buffer."""
        return self.offset == 0 and self.nbytes == self.graph.buffers[self.buf]

    def __repr__(self) -> str:
        return f"Tensor({self.name or f'#{self.buf}'}, {list(self.shape)}, {self.dtype})"

    def __add__(self, o: Any) -> Tensor: return self.graph.binary("add", self, o)
    def __radd__(self, o: Any) -> Tensor: return self.graph.binary("add", o, self)
    def __sub__(self, o: Any) -> Tensor: return self.graph.binary("sub", self, o)
    def __rsub__(self, o: Any) -> Tensor: return self.graph.binary("sub", o, self)
    def __mul__(self, o: Any) -> Tensor: return self.graph.binary("mul", self, o)
    def __rmul__(self, o: Any) -> Tensor: return self.graph.binary("mul", o, self)
    def __truediv__(self, o: Any) -> Tensor: return self.graph.binary("div", self, o)
    def __rtruediv__(self, o: Any) -> Tensor: return self.graph.binary("div", o, self)
    def __neg__(self) -> Tensor: return self.graph.unary("neg", self)
    def __matmul__(self, o: Any) -> Tensor: return self.graph.matmul(self, o)


@dataclass(frozen=True, eq=False)
class Slot:
    """The byte offset of ``tensor`` inside the arena of the nested ``graph`` (a scan body)."""

    graph: "BodyGraph"
    tensor: Tensor


@dataclass(eq=False)
class Node:
    """One op: ``fields`` are its ABI fields with Tensors for offsets; ``writes`` the tensors it defines."""

    op: str  # an ABI op, or "reshape" (a view: no thunk)
    dtype: str
    fields: dict[str, Any]
    writes: tuple[Tensor, ...]

    def tensors(self) -> Iterator[Tensor]:
        """Every tensor of this graph the node touches (Slots belong to a nested arena)."""
        def walk(v: Any) -> Iterator[Tensor]:
            if isinstance(v, Tensor):
                yield v
            elif isinstance(v, (list, tuple)):
                for item in v:
                    yield from walk(item)
        yield from walk(list(self.fields.values()))


#: Names unnamed constants uniquely across graphs, so a derived graph can copy a body's constants by name.
_CONSTANTS = itertools.count()


def _count(shape: Sequence[int]) -> int:
    return int(np.prod(shape, dtype=np.int64))


class BodyGraph:
    """A program under construction with the declarations and the body ops: a scan body, a gradient graph.

    ``Graph`` adds the recurrent and state-space ops, scans and ``compile()``. ``dtype`` is the default
    element type of inputs, weights and constants.
    """

    def __init__(self, dtype: str = "f32"):
        self.dtype = self._check_dtype(dtype)
        self.nodes: list[Node] = []
        self.buffers: list[int] = []  # byte size of every buffer, by buf id
        self.inputs: dict[str, Tensor] = {}
        self.weights: dict[str, Tensor] = {}
        self.outputs: dict[str, Tensor] = {}
        self.init: dict[int, bytes] = {}  # constant bytes of every weight buffer
        # the activation a weight was packed with (torch_weights.PackedStream), by buf id
        self.activations: dict[int, str] = {}
        self._ids = itertools.count()

    # ----------------------------------------------------------------- declarations
    @staticmethod
    def _check_dtype(dtype: str, allowed: tuple[str, ...] = DTYPES) -> str:
        """``dtype`` if one of ``allowed`` (an op's element types; inputs and weights may also be ``i32``,
        the integer tensors of ABI.md §8)."""
        if dtype not in allowed:
            raise GraphError(f"unknown dtype {dtype!r}; expected one of {', '.join(allowed)}")
        return dtype

    def _claim(self, name: str) -> str:
        if name in self.inputs or name in self.weights or name in self.outputs:
            raise GraphError(f"the name {name!r} is already taken in this graph")
        return name

    def _new(self, shape: Sequence[int], dtype: str, name: str | None = None) -> Tensor:
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise GraphError(f"negative dimension in shape {list(shape)}")
        self.buffers.append(_count(shape) * ELEM_SIZE[dtype])
        return Tensor(self, len(self.buffers) - 1, shape, dtype, name)

    def _emit(self, op: str, dtype: str, fields: dict[str, Any], *writes: Tensor) -> None:
        self.nodes.append(Node(op, dtype, fields, writes))

    def input(self, name: str, shape: Sequence[int], dtype: str | None = None) -> Tensor:
        """Declare an input the caller supplies by ``name`` at run time."""
        t = self._new(shape, self._check_dtype(dtype or self.dtype, TENSOR_DTYPES), self._claim(name))
        self.inputs[name] = t
        return t

    def weight(self, name: str, array: Any, dtype: str | None = None) -> Tensor:
        """Declare a constant array, baked into the schedule's ``init`` (rounded to nearest even)."""
        dt = self._check_dtype(dtype or self.dtype, TENSOR_DTYPES)
        values = np.asarray(array, dtype=np.float64)
        t = self._new(values.shape, dt, self._claim(name))
        self.init[t.buf] = np.ascontiguousarray(values.astype(STORAGE[dt])).tobytes()
        if getattr(array, "nonlinearity", None):
            self.activations[t.buf] = array.nonlinearity
        self.weights[name] = t
        return t

    def constant(self, value: Any, dtype: str | None = None) -> Tensor:
        """An unnamed weight (a scalar or an array)."""
        return self.weight(f"const.{next(_CONSTANTS)}", value, dtype)

    def output(self, name: str, t: Tensor) -> Tensor:
        """Mark ``t`` as an output read back by ``name``; an input, weight or other output is copied first."""
        t = self._t(t)
        taken = {u.buf for u in itertools.chain(self.inputs.values(), self.weights.values(), self.outputs.values())}
        if t.buf in taken:
            t = self.copy(t)
        self.outputs[self._claim(name)] = t
        return t

    def _t(self, v: Any, dtype: str | None = None) -> Tensor:
        """A tensor of this graph; numbers and arrays become constants."""
        if isinstance(v, Tensor):
            if v.graph is not self:
                raise GraphError(f"{v!r} belongs to another graph; pass a scan body's values through its inputs")
            return v
        return self.constant(v, dtype)

    # ----------------------------------------------------------------- body ops
    @BUILDERS.register("unary")
    def unary(self, fn: str, x: Any) -> Tensor:
        """Elementwise ``fn(x)``, ``fn`` one of ABI.md §5's unary functions."""
        if fn not in UNARY_FNS:
            raise GraphError(f"unary: unknown fn {fn!r}; expected one of {', '.join(UNARY_FNS)}")
        x = self._t(x)
        y = self._new(x.shape, x.dtype)
        self._emit("unary", x.dtype, {"x": x, "dst": y, "n": x.size, "fn": fn}, y)
        return y

    @BUILDERS.register("binary")
    def binary(self, fn: str, a: Any, b: Any, shape: Sequence[int] | None = None) -> Tensor:
        """Elementwise ``fn(a, b)`` with NumPy broadcasting (to ``shape`` too when given)."""
        if fn not in BINARY_FNS:
            raise GraphError(f"binary: unknown fn {fn!r}; expected one of {', '.join(BINARY_FNS)}")
        a = self._t(a, b.dtype if isinstance(b, Tensor) else None)
        b = self._t(b, a.dtype)
        if a.dtype != b.dtype:
            raise GraphError(f"binary {fn}: {a!r} and {b!r} differ in dtype; cast one first")
        try:
            out = np.broadcast_shapes(a.shape, b.shape, *([tuple(shape)] if shape is not None else []))
        except ValueError as err:
            raise GraphError(f"binary {fn}: shapes {list(a.shape)} and {list(b.shape)} do not broadcast") from err
        y = self._new(out, a.dtype)
        # Size-1 output axes carry no stride information: dropping them keeps the rank within the ABI's 6.
        keep = [ax for ax, d in enumerate(out) if d != 1]
        dims = [out[ax] for ax in keep] or [1]
        strides = [self._strides(t.shape, out, keep) for t in (a, b)]
        if len(dims) > MAX_RANK:
            raise GraphError(f"binary {fn}: output shape {list(out)} has more than {MAX_RANK} non-unit axes")
        self._emit("binary", a.dtype, {"a": a, "b": b, "dst": y, "fn": fn, "shape": dims,
                                       "a_strides": strides[0], "b_strides": strides[1]}, y)
        return y

    @staticmethod
    def _strides(shape: tuple[int, ...], out: tuple[int, ...], keep: list[int]) -> list[int]:
        """Element strides of ``shape`` read as ``out`` (right-aligned; 0 on broadcast axes)."""
        padded = (1,) * (len(out) - len(shape)) + shape
        dense = [_count(padded[ax + 1:]) for ax in range(len(padded))]
        strides = [0 if padded[ax] == 1 else dense[ax] for ax in keep]
        return strides or [0]

    @BUILDERS.register("matmul")
    def matmul(self, a: Any, b: Any, *, trans_a: bool = False, trans_b: bool = False) -> Tensor:
        """Batched ``op(a)·op(b)`` over leading axes; an operand without them is shared across the batch."""
        a, b = self._t(a), self._t(b)
        if len(a.shape) < 2 or len(b.shape) < 2 or a.dtype != b.dtype:
            raise GraphError(f"matmul: {a!r} and {b!r} must be matrices (rank >= 2) of one dtype")
        m, k = a.shape[-2:][::-1] if trans_a else a.shape[-2:]
        k2, n = b.shape[-2:][::-1] if trans_b else b.shape[-2:]
        if k != k2:
            raise GraphError(f"matmul: inner sizes differ: {a!r}{' (transposed)' * trans_a} has k={k}, "
                             f"{b!r}{' (transposed)' * trans_b} has k={k2}")
        batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        for t in (a, b):
            if _count(t.shape[:-2]) != 1 and t.shape[:-2] != batch:
                raise GraphError(f"matmul: {t!r} must have batch axes {list(batch)} or none; the ABI shares a "
                                 "whole operand or none")
        y = self._new((*batch, m, n), a.dtype)
        self._emit("matmul", a.dtype, {
            "a": a, "b": b, "dst": y, "batch": _count(batch), "m": m, "k": k, "n": n, "trans_a": bool(trans_a),
            "trans_b": bool(trans_b), "a_batch_stride": m * k if _count(a.shape[:-2]) > 1 else 0,
            "b_batch_stride": k * n if _count(b.shape[:-2]) > 1 else 0}, y)
        return y

    @BUILDERS.register("reduce_sum")
    def reduce_sum(self, x: Any, axis: int | Sequence[int] = -1, keepdims: bool = False) -> Tensor:
        """Sum over ``axis`` (one or several)."""
        x = self._t(x)
        if not x.shape:
            raise GraphError(f"reduce_sum: {x!r} is a scalar; there is no axis to sum over")
        axes = sorted({ax % len(x.shape) for ax in ([axis] if isinstance(axis, int) else axis)}, reverse=True)
        y = x
        for ax in axes:
            shape = y.shape[:ax] + (1,) + y.shape[ax + 1:]
            out = self._new(shape, x.dtype)
            self._emit("reduce_sum", x.dtype, {"x": y, "dst": out, "outer": max(1, _count(y.shape[:ax])),
                                               "r": y.shape[ax], "inner": max(1, _count(y.shape[ax + 1:]))}, out)
            y = out
        return y if keepdims else self.reshape(y, [d for ax, d in enumerate(y.shape) if ax not in axes])

    @BUILDERS.register("cast")
    def cast(self, x: Any, dtype: str) -> Tensor:
        """Convert to ``dtype`` (rounding to nearest even); the same tensor when it already is."""
        x = self._t(x)
        if x.dtype == self._check_dtype(dtype):
            return x
        y = self._new(x.shape, dtype)
        self._emit("cast", dtype, {"src": x, "dst": y, "n": x.size, "src_dtype": x.dtype}, y)
        return y

    @BUILDERS.register("fill")
    def fill(self, shape: Sequence[int], value: float, dtype: str | None = None) -> Tensor:
        """A tensor of ``shape`` holding ``value`` everywhere (written by a thunk, every run)."""
        y = self._new(shape, self._check_dtype(dtype or self.dtype))
        self._emit("fill", y.dtype, {"dst": y, "n": y.size, "value": float(value)}, y)
        return y

    @BUILDERS.register("copy")
    def copy(self, x: Any) -> Tensor:
        """A new buffer holding the bytes of ``x``."""
        x = self._t(x)
        y = self._new(x.shape, x.dtype)
        self._emit("copy", x.dtype, {"src": x, "dst": y, "nbytes": x.nbytes}, y)
        return y

    def reshape(self, x: Any, shape: Sequence[int]) -> Tensor:
        """A view of ``x`` with another shape of the same element count (``-1`` infers one axis)."""
        x = self._t(x)
        try:
            shape = np.empty(x.shape, dtype=np.uint8).reshape(tuple(shape)).shape
        except ValueError as err:
            raise GraphError(f"reshape: cannot view {x!r} as {list(shape)}") from err
        y = Tensor(self, x.buf, tuple(shape), x.dtype, offset=x.offset)
        self._emit("reshape", x.dtype, {"x": x, "dst": y}, y)
        return y

    def _window(self, x: Tensor, start: int, shape: Sequence[int]) -> Tensor:
        """A view of ``shape`` into ``x``'s buffer from element ``start`` of ``x`` (no thunk)."""
        return Tensor(self, x.buf, tuple(int(d) for d in shape), x.dtype, offset=x.offset + int(start))

    def _strided_into(self, x: Tensor, shape: Sequence[int], strides: Sequence[int], dst: Tensor) -> None:
        """Write the elements of ``x`` at element ``strides`` into ``dst`` (dense ``shape``), as ``x·1``.

        A product by one is exact for every value (inf and NaN included): the elements move unchanged.
        """
        keep = [ax for ax, d in enumerate(shape) if d != 1]
        if len(keep) > MAX_RANK:
            raise GraphError(f"strided_copy: shape {list(shape)} has more than {MAX_RANK} non-unit axes")
        one = self.constant(1.0, x.dtype)
        self._emit("binary", x.dtype, {"a": x, "b": one, "dst": dst, "fn": "mul",
                                       "shape": [shape[ax] for ax in keep] or [1],
                                       "a_strides": [strides[ax] for ax in keep] or [0],
                                       "b_strides": [0] * max(1, len(keep))}, dst)

    def strided_copy(self, x: Any, shape: Sequence[int], strides: Sequence[int], start: int = 0) -> Tensor:
        """A dense ``shape`` tensor whose element at index ``i`` is element ``start + Σ i_k·strides[k]`` of ``x``.

        Transposes, slices and broadcasts (stride 0) of a row-major buffer, read in one ``binary``
        thunk as ``x·1``, which is exact for every value.
        """
        x = self._t(x)
        shape, strides, start = [int(d) for d in shape], [int(s) for s in strides], int(start)
        if len(shape) != len(strides) or any(s < 0 for s in strides) or start < 0:
            raise GraphError(f"strided_copy: strides {strides} must be one non-negative stride per axis of {shape}, "
                             f"start {start} non-negative")
        if _count(shape) and start + 1 + sum((d - 1) * s for d, s in zip(shape, strides) if d) > x.size:
            raise GraphError(f"strided_copy: shape {shape} at strides {strides} from {start} reads past the end "
                             f"of {x!r}")
        y = self._new(shape, x.dtype)
        self._strided_into(self._window(x, start, (x.size - start,)) if start else x, shape, strides, y)
        return y

    def concat(self, parts: Sequence[Any], axis: int = 0) -> Tensor:
        """``parts`` joined along ``axis``, as NumPy's ``concatenate``: every element is copied, none computed.

        Along the outermost axis (or one with only size-1 axes before it) each part is one ``copy``
        into its place; along an inner axis each part is written, transposed, into an axis-first
        buffer that one strided copy then puts in order.
        """
        ts = [self._t(p) for p in parts]
        if not ts:
            raise GraphError("concat: no parts to join")
        first = ts[0]
        if not -len(first.shape) <= axis < len(first.shape):
            raise GraphError(f"concat: axis {axis} is out of range for {first!r}")
        axis %= len(first.shape)
        for t in ts:
            other = t.shape[:axis] + t.shape[axis + 1:]
            if t.dtype != first.dtype or other != first.shape[:axis] + first.shape[axis + 1:]:
                raise GraphError(f"concat: {t!r} does not join {first!r} along axis {axis}: every part has one "
                                 "dtype and the same sizes on the other axes")
        if len(ts) == 1:
            return first
        total = sum(t.shape[axis] for t in ts)
        shape = (*first.shape[:axis], total, *first.shape[axis + 1:])
        pre, post = _count(shape[:axis]), _count(shape[axis + 1:])
        y = self._new(shape if pre == 1 else (total, pre, post), first.dtype)
        start = 0
        for t in ts:
            n = t.shape[axis]
            if t.size and pre == 1:
                part = self._window(y, start * post, t.shape)
                self._emit("copy", t.dtype, {"src": t, "dst": part, "nbytes": t.nbytes}, part)
            elif t.size:
                part = self._window(y, start * pre * post, (n, pre, post))
                self._strided_into(t, (n, pre, post), (post, n * post, 1), part)
            start += n
        if pre == 1:
            return y
        return self.reshape(self.strided_copy(y, (pre, total, post), (post, pre * post, 1)), shape)

    def broadcast_to(self, x: Any, shape: Sequence[int]) -> Tensor:
        """``x`` repeated along broadcast axes to ``shape`` (as ``x·1``, which is exact)."""
        x = self._t(x)
        return self.binary("mul", x, self.constant(1.0, x.dtype), shape)
