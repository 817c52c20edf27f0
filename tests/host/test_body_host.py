"""Body ops of ABI.md §5 on the host against float64 formulas written per element from the ABI."""
from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from host_fallback import execute

NP = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16, "f64": np.float64}
SIZE = {"f32": 4, "f16": 2, "bf16": 2, "f64": 8}
# One rounding into the storage type on top of f32 (or f64) arithmetic and a few ulp of libm.
RTOL = {"f32": 4e-6, "f16": 2e-3, "bf16": 1e-2, "f64": 1e-12}
DTYPES = list(NP)
SENTINEL = 0xA5
ARENA = 4096


def new_arena(nbytes: int = ARENA) -> np.ndarray:
    return np.full(nbytes, SENTINEL, np.uint8)


def put(arena: np.ndarray, offset: int, dtype: str, values) -> np.ndarray:
    """Store values (rounded into dtype) at offset; return what was stored, as float64."""
    stored = np.asarray(values, np.float64).astype(NP[dtype]).ravel()
    arena[offset: offset + stored.nbytes] = stored.view(np.uint8)
    return stored.astype(np.float64)


def get(arena: np.ndarray, offset: int, dtype: str, count: int) -> np.ndarray:
    return arena[offset: offset + count * SIZE[dtype]].view(NP[dtype]).astype(np.float64)


def run_checked(thunk: dict, arena: np.ndarray, dst: int, nbytes: int) -> None:
    """Run the thunk and check that no byte outside [dst, dst+nbytes) changed."""
    before = arena.copy()
    execute(thunk, arena)
    outside = np.ones(ARENA, bool)
    outside[dst: dst + nbytes] = False
    assert np.array_equal(arena[outside], before[outside]), "a byte outside dst was written"


UNARY_REF = {
    "exp": (np.exp, (-5, 5)),
    "log": (np.log, (0.1, 5)),
    "tanh": (np.tanh, (-4, 4)),
    "sigmoid": (lambda x: 1.0 / (1.0 + np.exp(-x)), (-6, 6)),
    "relu": (lambda x: np.where(x > 0, x, 0.0), (-4, 4)),
    "neg": (lambda x: -x, (-4, 4)),
    "sqrt": (np.sqrt, (0.1, 9)),
    "rsqrt": (lambda x: 1.0 / np.sqrt(x), (0.1, 9)),
    "square": (lambda x: x * x, (-4, 4)),
    "abs": (lambda x: np.where(x < 0, -x, x), (-4, 4)),
    "recip": (lambda x: 1.0 / x, (0.2, 5)),
    "softplus": (lambda x: np.log(1.0 + np.exp(x)), (-8, 8)),
    "step": (lambda x: np.where(x > 0, 1.0, 0.0), (-4, 4)),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fn", sorted(UNARY_REF))
def test_unary(fn: str, dtype: str) -> None:
    ref, (lo, hi) = UNARY_REF[fn]
    rng = np.random.default_rng(hash((fn, dtype)) % 2**32)
    n = 37
    values = rng.uniform(lo, hi, n)
    if fn == "recip":
        values *= rng.choice([-1, 1], n)
    if lo < 0:
        values[:3] = [0.0, -0.0, 1e-3]  # the kink of relu/step/abs
    arena = new_arena()
    x = put(arena, 64, dtype, values)
    dst = 64 + 64 * 8
    run_checked({"op": "unary", "dtype": dtype, "fn": fn, "x": 64, "dst": dst, "n": n}, arena, dst, n * SIZE[dtype])
    np.testing.assert_allclose(get(arena, dst, dtype, n), ref(x), rtol=RTOL[dtype], atol=RTOL[dtype] * 1e-3)


def test_unary_in_place() -> None:
    arena = new_arena()
    x = put(arena, 0, "f32", [0.5, -1.0, 2.0])
    execute({"op": "unary", "dtype": "f32", "fn": "square", "x": 0, "dst": 0, "n": 3}, arena)
    np.testing.assert_array_equal(get(arena, 0, "f32", 3), x * x)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_softplus_is_stable_far_out(dtype: str) -> None:
    arena = new_arena()
    x = put(arena, 0, dtype, [-1000.0, -60.0, 0.0, 60.0, 1000.0])
    execute({"op": "unary", "dtype": dtype, "fn": "softplus", "x": 0, "dst": 256, "n": 5}, arena)
    got = get(arena, 256, dtype, 5)
    assert np.all(np.isfinite(got))
    expected = [0.0, np.exp(-60.0), np.log(2.0), x[3], x[4]]
    tiny = float(ml_dtypes.finfo(NP[dtype]).smallest_subnormal)  # e^-60 underflows in f16
    np.testing.assert_allclose(got, expected, rtol=RTOL[dtype], atol=tiny)


BINARY_REF = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
    "max": lambda a, b: a if a > b else b,
    "min": lambda a, b: a if a < b else b,
}

# (shape, a_strides, b_strides): dense, broadcast rows/columns, a transposed read, rank 6, rank 0.
LAYOUTS = [
    ([2, 3, 4], [12, 4, 1], [0, 1, 0]),
    ([2, 3, 4], [1, 2, 6], [4, 0, 1]),
    ([5], [1], [0]),
    ([2, 1, 2, 1, 3, 2], [12, 0, 6, 5, 2, 1], [0, 0, 2, 0, 0, 1]),
    ([], [], []),
]


def flat(index: tuple[int, ...], strides: list[int]) -> int:
    return sum(i * s for i, s in zip(index, strides))


def extent(shape: list[int], strides: list[int]) -> int:
    return 1 + sum((d - 1) * s for d, s in zip(shape, strides))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fn", sorted(BINARY_REF))
@pytest.mark.parametrize("layout", range(len(LAYOUTS)))
def test_binary(fn: str, dtype: str, layout: int) -> None:
    shape, sa, sb = LAYOUTS[layout]
    rng = np.random.default_rng(layout * 100 + len(fn))
    arena = new_arena()
    a = put(arena, 0, dtype, rng.uniform(-3, 3, extent(shape, sa)))
    b = put(arena, 512, dtype, rng.uniform(0.5, 3, extent(shape, sb)) * rng.choice([-1, 1], extent(shape, sb)))
    count = int(np.prod(shape))
    expected = np.array(
        [BINARY_REF[fn](a[flat(idx, sa)], b[flat(idx, sb)]) for idx in np.ndindex(*shape)], np.float64
    )
    thunk = {"op": "binary", "dtype": dtype, "fn": fn, "a": 0, "b": 512, "dst": 1024,
             "shape": shape, "a_strides": sa, "b_strides": sb}
    run_checked(thunk, arena, 1024, count * SIZE[dtype])
    np.testing.assert_allclose(get(arena, 1024, dtype, count), expected, rtol=RTOL[dtype], atol=RTOL[dtype] * 1e-3)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_binary_any_layout_f64(data) -> None:
    rank = data.draw(st.integers(0, 6))
    shape = data.draw(st.lists(st.integers(1, 3), min_size=rank, max_size=rank))
    sa, sb = (data.draw(st.lists(st.integers(0, 4), min_size=rank, max_size=rank)) for _ in "ab")
    arena = new_arena(2048 + 8 * 3 ** 6)  # room for the largest dst: rank 6, every extent 3
    a = put(arena, 0, "f64", np.arange(extent(shape, sa)) * 0.5 - 3)
    b = put(arena, 1024, "f64", np.arange(extent(shape, sb)) * 0.25 + 1)
    execute({"op": "binary", "dtype": "f64", "fn": "sub", "a": 0, "b": 1024, "dst": 2048,
             "shape": shape, "a_strides": sa, "b_strides": sb}, arena)
    expected = [a[flat(idx, sa)] - b[flat(idx, sb)] for idx in np.ndindex(*shape)]
    np.testing.assert_array_equal(get(arena, 2048, "f64", int(np.prod(shape))), expected)


def test_binary_dst_may_alias_an_input() -> None:
    arena = new_arena()
    a = put(arena, 0, "f64", [1.0, 2.0, 3.0])
    execute({"op": "binary", "dtype": "f64", "fn": "mul", "a": 0, "b": 0, "dst": 0, "shape": [3],
             "a_strides": [1], "b_strides": [0]}, arena)
    np.testing.assert_array_equal(get(arena, 0, "f64", 3), a * a[0])


# (batch, m, k, n, trans_a, trans_b, a_batch_stride, b_batch_stride)
MATMULS = [
    (1, 2, 3, 4, False, False, 6, 12),
    (3, 2, 3, 4, True, False, 6, 0),
    (3, 4, 2, 3, False, True, 10, 6),
    (2, 3, 3, 3, True, True, 9, 9),
    (2, 1, 5, 1, False, False, 0, 5),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", MATMULS)
def test_matmul(case: tuple, dtype: str) -> None:
    batch, m, k, n, ta, tb, sa, sb = case
    rng = np.random.default_rng(sum(case[:4]))
    arena = new_arena()
    a = put(arena, 0, dtype, rng.uniform(-2, 2, (batch - 1) * sa + m * k))
    b = put(arena, 512, dtype, rng.uniform(-2, 2, (batch - 1) * sb + k * n))
    expected, scale = [], []
    for i in range(batch):
        ai = a[i * sa: i * sa + m * k]
        bi = b[i * sb: i * sb + k * n]
        ai = ai.reshape(k, m).T if ta else ai.reshape(m, k)
        bi = bi.reshape(n, k).T if tb else bi.reshape(k, n)
        expected.append(ai @ bi)
        scale.append(np.abs(ai) @ np.abs(bi))
    thunk = {"op": "matmul", "dtype": dtype, "a": 0, "b": 512, "dst": 1024, "batch": batch, "m": m, "k": k, "n": n,
             "trans_a": ta, "trans_b": tb, "a_batch_stride": sa, "b_batch_stride": sb}
    run_checked(thunk, arena, 1024, batch * m * n * SIZE[dtype])
    got = get(arena, 1024, dtype, batch * m * n)
    err = np.abs(got - np.ravel(expected))
    assert np.all(err <= RTOL[dtype] * np.ravel(scale)), f"max error {err.max()}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_sum(dtype: str) -> None:
    outer, r, inner = 2, 5, 3
    arena = new_arena()
    x = put(arena, 0, dtype, np.random.default_rng(1).uniform(0, 2, outer * r * inner))
    expected = [sum(x[(o * r + j) * inner + i] for j in range(r)) for o in range(outer) for i in range(inner)]
    thunk = {"op": "reduce_sum", "dtype": dtype, "x": 0, "dst": 1024, "outer": outer, "r": r, "inner": inner}
    run_checked(thunk, arena, 1024, outer * inner * SIZE[dtype])
    np.testing.assert_allclose(get(arena, 1024, dtype, outer * inner), expected, rtol=RTOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fill(dtype: str) -> None:
    arena = new_arena()
    run_checked({"op": "fill", "dtype": dtype, "dst": 16, "n": 7, "value": 0.1}, arena, 16, 7 * SIZE[dtype])
    np.testing.assert_array_equal(get(arena, 16, dtype, 7), np.full(7, NP[dtype](0.1), np.float64))


@pytest.mark.parametrize(("src_dtype", "dtype"), list(itertools.product(DTYPES, DTYPES)))
def test_cast(src_dtype: str, dtype: str) -> None:
    arena = new_arena()
    src = put(arena, 0, src_dtype, np.random.default_rng(2).uniform(-100, 100, 11))
    run_checked({"op": "cast", "dtype": dtype, "src": 0, "dst": 512, "n": 11, "src_dtype": src_dtype},
                arena, 512, 11 * SIZE[dtype])
    got = get(arena, 512, dtype, 11)
    if src_dtype == "f64" and dtype in ("f16", "bf16"):
        np.testing.assert_allclose(got, src, rtol=RTOL[dtype])  # may round twice, through f32
    else:  # every other pair converts a value exactly representable in f32 once
        np.testing.assert_array_equal(got, src.astype(NP[dtype]).astype(np.float64))


def test_copy_moves_bytes() -> None:
    arena = new_arena()
    arena[100:140] = np.arange(40, dtype=np.uint8)
    run_checked({"op": "copy", "dtype": "f32", "src": 100, "dst": 140, "nbytes": 40}, arena, 140, 40)
    np.testing.assert_array_equal(arena[140:180], np.arange(40))
    execute({"op": "copy", "dtype": "f32", "src": 0, "dst": 0, "nbytes": 0}, arena)


@pytest.mark.parametrize(("src", "dst"), [(100, 120), (120, 100), (100, 100)])
def test_copy_refuses_overlap_and_writes_nothing(src: int, dst: int) -> None:
    arena = new_arena()
    arena[100:160] = np.arange(60, dtype=np.uint8)
    before = arena.copy()
    with pytest.raises(ValueError, match="overlap"):
        execute({"op": "copy", "dtype": "f32", "src": src, "dst": dst, "nbytes": 40}, arena)
    np.testing.assert_array_equal(arena, before)
