"""host_fallback's compiled float32 GEMM (``jit``'s ``gemm``) and where it runs (the ``gemm`` module): the kernel
against float64 products at both tile widths, at shapes with every kind of edge (rows past a whole panel,
columns past a whole block, depths past a block), either operand a transposed view or at other strides; its
refusals, before anything is written; the choice between it and NumPy's BLAS; and an lstm's, a gru's and an
rnn's every gradient with a reserve on either path against the float64 conformance reference."""
from __future__ import annotations

import numpy as np
import pytest

from host_fallback import gemm, jit
from host_fallback.abi import complete
from rlx_gpu.conformance.references import REFERENCES
from support.host_jit import count_calls, gradients
from support.gradient_check import read
from support.rnn_backward_cases import backward_params, laid_with_reserve, run_forward
from support.rnn_host import check

numba = pytest.importorskip("numba", reason="the jit extra (Numba) is not installed")
from host_fallback import jit_gemm, jit_lstm  # noqa: E402  (needs Numba)

LANES = sorted(jit_lstm.PANEL_ROWS)
# (m, k, n): one value; less than a tile; one whole 16-lane tile; one past it each way; past the row and depth
# blocks (M_BLOCK 240, K_BLOCK 256) and not a multiple of either; no depth
SHAPES = [(1, 1, 1), (7, 3, 5), (8, 256, 32), (9, 257, 33), (250, 300, 70), (481, 513, 100), (33, 0, 17)]


def _operand(rng, rows: int, cols: int, transposed: bool) -> np.ndarray:
    """``[rows, cols]`` float32, C-contiguous or a transposed view of a ``[cols, rows]`` array."""
    if transposed:
        return rng.standard_normal((cols, rows)).astype(np.float32).T
    return rng.standard_normal((rows, cols)).astype(np.float32)


@pytest.mark.parametrize("lanes", LANES)
@pytest.mark.parametrize("m,k,n", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
@pytest.mark.parametrize("a_t,b_t", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["ab", "aTb", "abT", "aTbT"])
def test_the_kernel_matches_float64_products(lanes, m, k, n, a_t, b_t):
    rng = np.random.default_rng(m * 1000 + k + n)
    a, b = _operand(rng, m, k, a_t), _operand(rng, k, n, b_t)
    out = rng.standard_normal((m, n)).astype(np.float32)  # what it holds before is overwritten
    jit.kernel("gemm")(a, b, out, lanes)
    want = a.astype(np.float64) @ b.astype(np.float64)
    assert np.abs(out - want).max() <= 1e-5 * max(1.0, np.abs(want).max()) * max(1, k) ** 0.5


@pytest.mark.parametrize("lanes", LANES)
def test_the_kernel_reads_operands_at_any_strides(lanes):
    """Rows apart by more than their length (a column slice), a transposed column slice, and rows walked
    backwards: the packing's 8 x 8 transposes and its element loops read each where it lies."""
    rng = np.random.default_rng(5)
    wide, w = rng.standard_normal((97, 300)).astype(np.float32), rng.standard_normal((90, 280)).astype(np.float32)
    a, b = wide[::-1, 7:270], w[3:75, 9:272].T  # [97, 263] rows walked backwards; [263, 72], columns 280 apart
    out = np.empty((97, 72), np.float32)
    jit.kernel("gemm")(a, b, out, lanes)
    np.testing.assert_allclose(out, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-5, atol=1e-4)


def test_the_kernel_writes_into_a_view_and_nothing_around_it():
    rng = np.random.default_rng(1)
    a, b = _operand(rng, 13, 40, False), _operand(rng, 40, 37, True)
    big = np.full((20, 50), 7.0, np.float32)
    jit.kernel("gemm")(a, b, big[3:16, 5:42], 16)
    np.testing.assert_allclose(big[3:16, 5:42], a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)
    inside = np.zeros_like(big, bool)
    inside[3:16, 5:42] = True
    assert (big[~inside] == 7.0).all()


@pytest.mark.parametrize("a_shape,b_shape,out_shape", [((4, 5), (6, 3), (4, 3)), ((4, 5), (5, 3), (4, 2)),
                                                       ((4, 5), (5, 3), (3, 3))])
def test_the_kernel_refuses_shapes_that_do_not_fit_before_writing(a_shape, b_shape, out_shape):
    out = np.full(out_shape, 3.0, np.float32)
    with pytest.raises(ValueError, match="do not fit"):
        jit.kernel("gemm")(np.ones(a_shape, np.float32), np.ones(b_shape, np.float32), out, 16)
    assert (out == 3.0).all()


def test_the_kernel_refuses_an_out_whose_columns_are_apart_and_a_width_it_has_no_tiles_for():
    out = np.full((3, 4), 3.0, np.float32).T
    with pytest.raises(ValueError, match="columns must be adjacent"):
        jit.kernel("gemm")(np.ones((4, 2), np.float32), np.ones((2, 3), np.float32), out, 16)
    with pytest.raises(ValueError, match="lanes must be 8 or 16"):
        jit.kernel("gemm")(np.ones((4, 2), np.float32), np.ones((2, 3), np.float32), out.T.copy().T, 4)
    assert (out == 3.0).all()


@pytest.fixture
def calls(monkeypatch):
    """Counts the kernel's calls (it still runs)."""
    return count_calls(monkeypatch, jit_gemm, ("gemm",))


def _big(rng, transposed_b: bool = False):
    return _operand(rng, 64, 128, False), _operand(rng, 128, 160, transposed_b)  # 1.3M multiply-adds


def test_times_takes_the_path_the_switch_names(monkeypatch, calls):
    rng = np.random.default_rng(2)
    a, b = _big(rng, transposed_b=True)
    monkeypatch.setenv(gemm.ENV, "blas")
    assert not gemm.compiled()
    assert np.array_equal(gemm.times(a, b), a @ b) and calls["gemm"] == 0
    monkeypatch.setenv(gemm.ENV, "compiled")
    assert gemm.compiled()
    out = np.empty((64, 160), np.float32)
    assert gemm.times(a, b, out=out) is out and calls["gemm"] == 1
    np.testing.assert_allclose(out, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-4)
    monkeypatch.setenv(gemm.ENV, "fast")
    with pytest.raises(ValueError, match="RLX_HOST_GEMM='fast'"):
        gemm.compiled()


def test_times_keeps_numpy_s_for_float64_small_products_and_an_out_it_cannot_write_or_that_is_an_operand(
        monkeypatch, calls):
    monkeypatch.setenv(gemm.ENV, "compiled")
    rng = np.random.default_rng(3)
    a, b = _big(rng)
    assert np.array_equal(gemm.times(a.astype(np.float64), b), a.astype(np.float64) @ b)
    small = a[:8], b[:, :16]
    assert np.array_equal(gemm.times(*small), small[0] @ small[1])
    few_rows = np.ones((gemm.MIN_ROWS - 1, 4096), np.float32), b[:1].repeat(4096, 0)  # 20M multiply-adds, 31 rows
    assert np.array_equal(gemm.times(*few_rows), few_rows[0] @ few_rows[1])
    apart = np.empty((160, 64), np.float32).T
    gemm.times(a, b, out=apart)
    np.testing.assert_allclose(apart, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-4)
    assert calls["gemm"] == 0
    square = np.random.default_rng(4).standard_normal((512, 512)).astype(np.float32)  # out is the left operand
    want = square.astype(np.float64) @ square
    gemm.times(square, square.copy(), out=square)
    np.testing.assert_allclose(square, want, rtol=1e-4, atol=1e-3)
    assert calls["gemm"] == 0
    monkeypatch.setenv(jit.ENV, "0")  # no compiled kernels at all: the switch cannot force one
    assert not gemm.compiled() and np.array_equal(gemm.times(a, b), a @ b) and calls["gemm"] == 0


@pytest.mark.parametrize("core,lanes,chosen", [("haswell", 16, True), ("zen", 16, True), ("skylakex", 16, False),
                                               ("sapphirerapids", 16, False), ("haswell", 8, False),
                                               (None, 16, False)])
def test_unset_the_tiles_run_where_the_blas_runs_narrower_vectors_than_the_cpu(monkeypatch, core, lanes, chosen):
    monkeypatch.delenv(gemm.ENV, raising=False)
    monkeypatch.setattr(gemm, "blas_core", lambda: core)
    monkeypatch.setenv(jit.WIDTH_ENV, str(lanes))
    assert gemm.compiled() is chosen


def test_numpy_s_openblas_names_its_core():
    """NumPy's wheels bundle OpenBLAS: the rule above reads its core (a name OpenBLAS knows, lower case)."""
    if "openblas" not in str(np.show_config(mode="dicts")["Build Dependencies"]["blas"]["name"]).lower():
        pytest.skip("NumPy is built on another BLAS here")
    core = gemm.blas_core()
    assert core and core == core.lower() and core.isalnum()


def _as_torch_initialises(field: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Weights uniform in ±1/sqrt(hidden = 96), as torch.nn initialises them (wider ones make the recurrence
    chaotic, where float32 and float64 part ways whatever computes them); the rest standard normal."""
    if field.startswith("w_"):
        return rng.uniform(-96 ** -0.5, 96 ** -0.5, shape)
    return rng.standard_normal(shape)


CASES = [("lstm", {}), ("gru", {}), ("rnn", dict(seq_lens=[16, 3, 0, 9, 16, 16, 1, 12]))]


@pytest.mark.parametrize("path", ["compiled", "blas"])
@pytest.mark.parametrize("op,extra", CASES, ids=[op for op, _ in CASES])
def test_a_recurrent_backward_on_either_path_matches_the_float64_reference(op, extra, path, monkeypatch, calls):
    """B8 S16 I=H=96, 2 layers, bidirectional: its input projections and gradients are above the tiles'
    minimum; every gradient with a reserve within f32's error of the reference's."""
    monkeypatch.setenv(gemm.ENV, path)
    params = backward_params(op, **dict(dict(batch=8, seq=16, input_size=96, hidden=96), **extra))
    thunk, arena, forward = laid_with_reserve(op, "f32", params, seed=4, sampler=_as_torch_initialises)
    values = read(thunk, arena)
    plain = complete({k: v for k, v in thunk.items() if k not in ("reserve", "reserve_bytes")})
    want = {f: v for f, v in REFERENCES[f"{op}_backward"](plain, lambda f: values[f]).items() if f.startswith("d_")}
    start, end = thunk["reserve"], thunk["reserve"] + thunk["reserve_bytes"]
    saved = arena.copy()
    saved[start:end] = run_forward(forward, arena)[start:end]
    got = gradients(thunk, saved)
    assert set(got) == set(want)
    for name, value in want.items():
        err = np.mean((got[name] - value) ** 2) / max(np.mean(value ** 2), 1e-30)
        assert err <= 1e-10, (name, err)
    assert (calls["gemm"] > 0) is (path == "compiled")


@pytest.mark.parametrize("path", ["compiled", "blas"])
@pytest.mark.parametrize("op", ["gru", "rnn"])
def test_a_plain_recurrent_forward_on_either_path_matches_the_float64_recurrences(op, path, monkeypatch, calls):
    """The whole-sequence kernels' input projection (B8 S16 I=H=96: above the tiles' minimum)."""
    monkeypatch.setenv(gemm.ENV, path)
    check(op, "f32", batch=8, seq=16, input_size=96, hidden=96, num_layers=2, bidirectional=True, carry=True)
    assert (calls["gemm"] > 0) is (path == "compiled")
