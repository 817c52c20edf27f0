"""The body ops of ABI.md §5: element-wise, matmul, reduction and data-movement ops (what a scan body is made of)."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from .aliasing import ALIASING
from .model import Field, OpDef, Region, Thunk, fail, flags, offsets, positive, rule

#: ``fn`` of ``unary`` and of ``binary`` (the host's ``body.UNARY`` / ``body.BINARY`` implement them, in this order).
UNARY_FNS = ("exp", "log", "tanh", "sigmoid", "relu", "neg", "sqrt", "rsqrt", "square", "abs", "recip", "softplus",
             "step")
BINARY_FNS = ("add", "sub", "mul", "div", "max", "min")


def strided_extent(shape: list[int], strides: list[int]) -> int:
    """Elements spanned by a strided read of ``shape`` (0 when the shape is empty)."""
    if any(d == 0 for d in shape):
        return 0
    return 1 + sum((d - 1) * st for d, st in zip(shape, strides))


def _unary(t: Thunk) -> list[Region]:
    return [Region("x", t["x"], (t["n"],), t["dtype"], "r"), Region("dst", t["dst"], (t["n"],), t["dtype"], "w")]


def _binary(t: Thunk) -> list[Region]:
    dt = t["dtype"]
    return [
        Region("a", t["a"], (strided_extent(t["shape"], t["a_strides"]),), dt, "r"),
        Region("b", t["b"], (strided_extent(t["shape"], t["b_strides"]),), dt, "r"),
        Region("dst", t["dst"], tuple(t["shape"]), dt, "w"),
    ]


def _matmul(t: Thunk) -> list[Region]:
    batch, m, k, n, dt = t["batch"], t["m"], t["k"], t["n"], t["dtype"]

    def extent(stride: int, size: int) -> int:
        return 0 if batch == 0 or size == 0 else (batch - 1) * stride + size

    return [
        Region("a", t["a"], (extent(t["a_batch_stride"], m * k),), dt, "r"),
        Region("b", t["b"], (extent(t["b_batch_stride"], k * n),), dt, "r"),
        Region("dst", t["dst"], (batch, m, n), dt, "w"),
    ]


def _reduce_sum(t: Thunk) -> list[Region]:
    o, r, i, dt = t["outer"], t["r"], t["inner"], t["dtype"]
    return [Region("x", t["x"], (o, r, i), dt, "r"), Region("dst", t["dst"], (o, i), dt, "w")]


def _copy(t: Thunk) -> list[Region]:
    return [Region("src", t["src"], (t["nbytes"],), "u8", "r"), Region("dst", t["dst"], (t["nbytes"],), "u8", "w")]


def _fill(t: Thunk) -> list[Region]:
    return [Region("dst", t["dst"], (t["n"],), t["dtype"], "w")]


def _cast(t: Thunk) -> list[Region]:
    return [Region("src", t["src"], (t["n"],), t["src_dtype"], "r"), Region("dst", t["dst"], (t["n"],), t["dtype"], "w")]


def _check_binary(t: Thunk) -> None:
    for name in ("a_strides", "b_strides"):
        if len(t[name]) != len(t["shape"]):
            raise fail(t, name, f"rank {len(t[name])} differs from shape's rank {len(t['shape'])}")


def _check_copy(t: Thunk) -> None:
    n, src, dst = t["nbytes"], t["src"], t["dst"]
    if n and src < dst + n and dst < src + n:
        raise fail(t, "dst", f"range [{dst}, {dst + n}) overlaps src range [{src}, {src + n}); copy ranges "
                             "must not overlap")


def _sample_unary(field: str, params: Mapping[str, Any], x: np.ndarray) -> np.ndarray:
    """Conformance inputs: positive arguments for the functions defined on them alone."""
    return np.abs(x) + 0.1 if params["fn"] in ("log", "sqrt", "rsqrt") else x


UNARY = OpDef("unary", offsets("x", "dst") + (Field("n", "count"), Field("fn", "enum", UNARY_FNS)), _unary,
              rules=(ALIASING,), sample=_sample_unary, place=(5, 1))
BINARY = OpDef("binary", offsets("a", "b", "dst") + (Field("fn", "enum", BINARY_FNS), Field("shape", "shape"),
                                                     Field("a_strides", "strides"), Field("b_strides", "strides")),
               _binary, rules=(rule(_check_binary), ALIASING), place=(5, 2))
MATMUL = OpDef("matmul", offsets("a", "b", "dst") + (Field("batch", "count"),) + positive("m", "k", "n")
               + flags("trans_a", "trans_b") + (Field("a_batch_stride", "count"), Field("b_batch_stride", "count")),
               _matmul, rules=(ALIASING,), place=(5, 3))
REDUCE_SUM = OpDef("reduce_sum", offsets("x", "dst") + positive("outer", "r", "inner"), _reduce_sum,
                   rules=(ALIASING,), place=(5, 4))
COPY = OpDef("copy", offsets("src", "dst") + (Field("nbytes", "count"),), _copy, rules=(rule(_check_copy), ALIASING),
             place=(5, 5))
FILL = OpDef("fill", offsets("dst") + (Field("n", "count"), Field("value", "float")), _fill, rules=(ALIASING,), place=(5, 6))
CAST = OpDef("cast", offsets("src", "dst") + (Field("n", "count"), Field("src_dtype", "dtype")), _cast,
             rules=(ALIASING,), place=(5, 7))
