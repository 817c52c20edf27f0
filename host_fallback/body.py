"""Body ops of ABI.md §5 (the element-wise, matmul and data-movement ops a scan body is made of).

Every kernel reads its operands into the compute type (f32 for 16-bit storage, f64 for f64) and
rounds to nearest even once, on store.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .arena import COMPUTE
from .bound import Bound
from .implementations import KERNELS

Thunk = Mapping[str, Any]


def _softplus(x: np.ndarray) -> np.ndarray:
    # log(1 + e^x) = max(x, 0) + log1p(e^-|x|): never overflows, and keeps precision for x << 0
    return np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))


#: ``fn`` of ``unary``; inputs outside a function's domain give NaN or Inf as in C.
UNARY: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "exp": np.exp,
    "log": np.log,
    "tanh": np.tanh,
    "sigmoid": lambda x: 1 / (1 + np.exp(-x)),
    "relu": lambda x: np.maximum(x, 0),
    "neg": np.negative,
    "sqrt": np.sqrt,
    "rsqrt": lambda x: 1 / np.sqrt(x),
    "square": np.square,
    "abs": np.abs,
    "recip": lambda x: 1 / x,
    "softplus": _softplus,
    "step": lambda x: (x > 0).astype(x.dtype),
}

#: ``fn`` of ``binary``.
BINARY: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "div": np.divide,
    "max": np.maximum,
    "min": np.minimum,
}


def _strided(bound: Bound, field: str, shape: tuple[int, ...], strides: tuple[int, ...], dtype: str) -> np.ndarray:
    """Read ``field`` at element ``strides`` as a compute-type array of ``shape`` (a fresh copy)."""
    if any(d == 0 for d in shape):  # as_strided over an empty region would read outside it
        return np.zeros(shape, COMPUTE[dtype])
    flat = bound.view(field)
    itemsize = flat.dtype.itemsize
    return as_strided(flat, shape, tuple(s * itemsize for s in strides), writeable=False).astype(COMPUTE[dtype])


@KERNELS.register('unary')
def unary(t: Thunk, arena: np.ndarray) -> None:
    """``dst[i] = fn(x[i])`` for ``i < n``."""
    io = Bound(t, arena)
    with np.errstate(all="ignore"):
        io.store("dst", UNARY[t["fn"]](io.load("x")))


@KERNELS.register('binary')
def binary(t: Thunk, arena: np.ndarray) -> None:
    """``dst[idx] = fn(a[idx·a_strides], b[idx·b_strides])`` over the dense index space ``shape``."""
    io, shape, dt = Bound(t, arena), tuple(t["shape"]), t["dtype"]
    a = _strided(io, "a", shape, tuple(t["a_strides"]), dt)
    b = _strided(io, "b", shape, tuple(t["b_strides"]), dt)
    with np.errstate(all="ignore"):
        io.store("dst", BINARY[t["fn"]](a, b))


@KERNELS.register('matmul')
def matmul(t: Thunk, arena: np.ndarray) -> None:
    """``dst[i] = A_i·B_i``, ``A_i`` at ``a + i·a_batch_stride`` (stored ``[k,m]`` if ``trans_a``); ``B_i`` alike."""
    io, dt = Bound(t, arena), t["dtype"]
    batch, m, k, n = t["batch"], t["m"], t["k"], t["n"]

    def operand(field: str, rows: int, cols: int, transposed: bool, batch_stride: int) -> np.ndarray:
        if transposed:  # stored [cols, rows]: read it as such, then swap the two matrix axes
            return _strided(io, field, (batch, cols, rows), (batch_stride, rows, 1), dt).swapaxes(1, 2)
        return _strided(io, field, (batch, rows, cols), (batch_stride, cols, 1), dt)

    a = operand("a", m, k, t["trans_a"], t["a_batch_stride"])
    b = operand("b", k, n, t["trans_b"], t["b_batch_stride"])
    io.store("dst", np.matmul(a, b))


@KERNELS.register('reduce_sum')
def reduce_sum(t: Thunk, arena: np.ndarray) -> None:
    """``dst[o,i] = Σ_j x[o,j,i]`` for ``x [outer,r,inner]``."""
    io = Bound(t, arena)
    io.store("dst", io.load("x").sum(axis=1))


def copy_bytes(src: np.ndarray, src_off: int, dst: np.ndarray, dst_off: int, nbytes: int) -> None:
    """Copy ``nbytes`` from ``src[src_off:]`` to ``dst[dst_off:]``; overlapping ranges raise ``ValueError``.

    The check runs before any byte moves, so a refused copy leaves both arenas untouched.
    """
    source, target = src[src_off: src_off + nbytes], dst[dst_off: dst_off + nbytes]
    if nbytes > 0 and np.may_share_memory(source, target):  # exact for 1-D contiguous byte ranges
        raise ValueError(
            f"copy: src range [{src_off}, {src_off + nbytes}) overlaps dst range [{dst_off}, {dst_off + nbytes}) "
            f"(nbytes={nbytes}); copy ranges must not overlap — copy through a scratch range instead"
        )
    target[...] = source


@KERNELS.register('copy')
def copy(t: Thunk, arena: np.ndarray) -> None:
    """``dst[0:nbytes] = src[0:nbytes]`` byte for byte; the ranges must not overlap."""
    copy_bytes(arena, t["src"], arena, t["dst"], t["nbytes"])


@KERNELS.register('fill')
def fill(t: Thunk, arena: np.ndarray) -> None:
    """``dst[i] = value`` for ``i < n``, rounded once into ``dtype``."""
    io = Bound(t, arena)
    io.store("dst", np.full(t["n"], t["value"], COMPUTE[t["dtype"]]))


@KERNELS.register('cast')
def cast(t: Thunk, arena: np.ndarray) -> None:
    """``dst[i] = src[i]`` converted from ``src_dtype`` into ``dtype`` via the compute type (round to nearest even)."""
    io = Bound(t, arena)
    # Through the destination's compute type like every other op, so an f64 source bound for
    # f16/bf16 passes f32 first: the rounding a device kernel's 16-bit store from float performs.
    io.store("dst", io.load("src").astype(COMPUTE[t["dtype"]]))
