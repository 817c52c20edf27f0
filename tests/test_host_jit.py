"""host_fallback.jit: the lstm step compiled by Numba (the ``jit`` extra, which the ``test`` extra installs).

Its exp against float64's, its use exactly where it applies, the compiled and the NumPy step each
against the float64 reference (rlx_gpu/conformance/reference_rnn.py, through test_rnn_host's ``check``)
over the fields it handles, their non-finite classes against each other, and the NumPy step where
Numba is missing or turned off.
"""
from __future__ import annotations

import numpy as np
import pytest

from host_fallback import jit, threads
from test_rnn_host import build, check, read, run_host

numba = pytest.importorskip("numba", reason="the jit extra (Numba) is not installed")
from host_fallback import jit_kernels  # noqa: E402  (needs Numba)


@pytest.fixture
def calls(monkeypatch):
    """Counts the compiled lstm step's calls (it still runs)."""
    counted = {"n": 0}
    real = jit_kernels.lstm_pointwise

    def spy(*args):
        counted["n"] += 1
        real(*args)
    monkeypatch.setattr(jit_kernels, "lstm_pointwise", spy)
    return counted


@numba.njit(fastmath=jit_kernels._FLAGS)
def _exp_over(x, out):  # the kernels' exp in a loop, as they run it (vectorized)
    for k in range(x.size):
        out[k] = jit_kernels._exp(x[k])


def test_exp_is_within_an_ulp_and_keeps_nan_and_inf():
    x = np.concatenate([np.linspace(-87.3, 88.7, 400_001, dtype=np.float32),
                        np.random.default_rng(0).uniform(-1, 1, 10_000).astype(np.float32)])
    got = np.empty_like(x)
    _exp_over(x, got)
    want = np.exp(x.astype(np.float64))
    normal = want >= 2.0 ** -125  # below (x < -87.0, e^x < 2.4e-38): 0, which a gate adds to 1
    rel = np.abs(got[normal] / want[normal] - 1)
    assert rel.max() <= 2 ** -23, f"max relative error {rel.max():.3g} at x={x[normal][rel.argmax()]}"
    tiny_got, tiny_want = got[~normal], want[~normal]
    assert np.all((tiny_got == 0) | (np.abs(tiny_got / tiny_want - 1) <= 2 ** -23))
    ends = np.array([np.nan, np.inf, -np.inf, 88.73, 1e30, -87.34, -1e30, 0.0, -0.0], np.float32)
    got = np.empty_like(ends)
    _exp_over(ends, got)
    assert np.isnan(got[0]) and got[1] == np.inf and got[2] == 0
    np.testing.assert_array_equal(got[3:], [np.inf, np.inf, 0, 0, 1, 1])


# (label, build/check arguments): the fields the compiled step handles, at narrow blocks (batch x hidden
# below EXP_TANH_MIN_ELEMENTS: g's rows at z) and wide ones (at -2z), one and two threads.
NARROW = dict(batch=4, seq=20, input_size=3, hidden=5, num_layers=2, bidirectional=True, carry=True)
WIDE = dict(batch=16, seq=18, input_size=3, hidden=128, num_layers=2, bidirectional=True, carry=True)
CASES = [
    ("narrow", NARROW, {}),
    ("narrow-unidirectional-reverse", {**NARROW, "bidirectional": False}, dict(reverse=True)),
    ("narrow-clip", NARROW, dict(clip=0.3)),
    ("narrow-input_forget", NARROW, dict(input_forget=True)),
    ("narrow-proj_size", NARROW, dict(proj_size=3)),
    ("narrow-seq_lens", NARROW, dict(seq_lens=[20, 0, 2, 13])),
    ("narrow-everything", NARROW, dict(input_forget=True, proj_size=2, clip=0.5, seq_lens=[1, 20, 0, 3])),
    ("wide", WIDE, {}),
    ("wide-clip", WIDE, dict(clip=0.3)),
    ("wide-seq_lens", WIDE, dict(seq_lens=[18, 0, 5, 17] * 4)),
    ("wide-input_forget-proj_size", WIDE, dict(input_forget=True, proj_size=24)),
]


@pytest.mark.parametrize("compiled", [True, False], ids=["numba-step", "numpy-step"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("label,shape,v2", CASES, ids=[c[0] for c in CASES])
def test_both_steps_match_the_reference(label, shape, v2, dtype, compiled, calls, monkeypatch):
    if not compiled:
        monkeypatch.setenv(jit.ENV, "0")
    parallel = "wide" in label
    check("lstm", dtype, options={"parallel_directions": parallel}, **shape, **v2)
    # one call per step of every layer-direction; with seq_lens the steps where some row still runs
    steps = max(min(n, shape["seq"]) for n in v2.get("seq_lens", [shape["seq"]]))
    layer_directions = shape["num_layers"] * (2 if shape["bidirectional"] else 1)
    assert calls["n"] == (layer_directions * steps if compiled else 0)


@pytest.mark.parametrize("label,options", [
    ("decode: the stored weights", dict(seq=5)),
    ("peepholes", dict(peepholes=True)),
    ("f64", dict(dtype="f64")),
    ("another activation", dict(activations=[["sigmoid", 0, 0], ["relu", 0, 0], ["tanh", 0, 0]] * 2)),
], ids=lambda v: v if isinstance(v, str) else "")
def test_the_numpy_step_runs_where_the_compiled_one_does_not_apply(label, options, calls):
    options = dict(options)
    dtype = options.pop("dtype", "f32")
    check("lstm", dtype, **{**NARROW, **options})
    assert calls["n"] == 0


@pytest.mark.parametrize("op", ["gru", "rnn"])
def test_gru_and_rnn_keep_numpy_steps(op, calls):
    check(op, "f32", **NARROW)
    assert calls["n"] == 0


def test_without_numba_the_numpy_step_runs(monkeypatch, calls):
    monkeypatch.setattr(jit, "_kernels", lambda: None)  # as after a failed import
    assert jit.kernel("lstm_pointwise") is None
    check("lstm", "f32", **NARROW)
    assert calls["n"] == 0


@pytest.mark.parametrize("value", ["0", "off", "False", " no "])
def test_rlx_host_jit_turns_it_off(monkeypatch, value):
    monkeypatch.setenv(jit.ENV, value)
    assert jit.kernel("lstm_pointwise") is None
    monkeypatch.setenv(jit.ENV, "1")
    assert jit.kernel("lstm_pointwise") is jit_kernels.lstm_pointwise


@pytest.mark.parametrize("shape", [NARROW, WIDE], ids=["narrow", "wide"])
def test_nan_and_inf_land_where_numpy_puts_them(shape, monkeypatch):
    """NaN, +inf and -inf in x, and weights large enough to saturate or overflow gates: the compiled
    step's NaN and ±inf positions are the NumPy step's, and its finite values agree."""
    thunk, arena, inp, writes = build("lstm", "f32", clip=0.0, **shape)
    x = inp["x"].astype(np.float32)
    rng = np.random.default_rng(5)
    for value in (np.nan, np.inf, -np.inf, 3e38, -3e38):
        b, t, i = (rng.integers(0, n) for n in x.shape)
        x[b, t, i] = value
    with np.errstate(over="ignore"):
        x[..., 0] *= 1e4  # saturated gates: exp(-z) overflows, σ = 0 and tanh = -1 exactly
    arena[thunk["x"]: thunk["x"] + x.nbytes] = x.view(np.uint8).ravel()
    results = []
    for env in ("1", "0"):
        monkeypatch.setenv(jit.ENV, env)
        out = run_host(thunk, arena, writes)
        results.append({f: read(out, thunk, f, s) for f, s in (
            ("dst", (shape["batch"], shape["seq"], 2 * shape["hidden"])),
            ("h0", (4, shape["batch"], shape["hidden"])), ("c0", (4, shape["batch"], shape["hidden"])))})
    compiled, numpy_step = results
    for field in compiled:
        a, b = compiled[field], numpy_step[field]
        assert np.isnan(a).any() and np.isfinite(a).any(), field  # the case reaches both classes
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=f"{field}: NaN positions")
        np.testing.assert_array_equal(np.isposinf(a), np.isposinf(b), err_msg=f"{field}: +inf positions")
        np.testing.assert_array_equal(np.isneginf(a), np.isneginf(b), err_msg=f"{field}: -inf positions")
        finite = np.isfinite(a)
        np.testing.assert_allclose(a[finite], b[finite], rtol=1e-5, atol=1e-6, err_msg=field)


def test_two_threads_give_the_bytes_of_one(calls):
    """The compiled step runs without the GIL: two threads running the directions give the bytes of one
    thread running them in turn (each GEMM on a one-thread BLAS in both)."""
    thunk, arena, _, writes = build("lstm", "f32", **WIDE)
    with threads.single_threaded_blas():
        serial = run_host(thunk, arena, writes, parallel_directions=False)
    threaded = run_host(thunk, arena, writes, parallel_directions=True)
    np.testing.assert_array_equal(serial, threaded)
    assert calls["n"] > 0
