"""causal_conv1d's compiled decode step (``jit``'s ``causal_conv1d_decode``, bound by ``conv._compiled_decode``)
beside NumPy's (``RLX_HOST_JIT=0``): both against the float64 reference of ABI.md §10 (rlx_gpu.conformance.
reference_conv) over rows, slots and packed sequences, silu or none, bias or none, widths 2..8; against each other
(NumPy's bytes without an activation, silu within four ulps, the pool's bytes always, NaN and ±inf where NumPy puts
them); the same bytes on one thread or two; NumPy's step wherever the compiled one does not apply."""
from __future__ import annotations

import numpy as np
import pytest

from host_fallback import conv, jit
from rlx_gpu.conformance import reference_conv as ref

numba = pytest.importorskip("numba", reason="the jit extra (Numba) is not installed")
from host_fallback import jit_conv  # noqa: E402  (needs Numba)

ROWS, DIM, ENTRIES = 5, 37, 8
SLOTS = np.array([6, 0, 3, 1, 7])
#: how a step names its rows: batch rows, or packed one-token sequences of one batch row (cu_seqlens)
LAYOUTS = [dict(varlen=False, slots=False), dict(varlen=False, slots=True), dict(varlen=True, slots=False),
           dict(varlen=True, slots=True)]


@pytest.fixture
def calls(monkeypatch):
    """The compiled kernel's calls (it still runs), each its ``(lo, hi)`` rows."""
    seen = []

    def spy(*args, real=jit_conv.causal_conv1d_decode):
        seen.append(args[-2:])
        real(*args)
    monkeypatch.setattr(jit_conv, "causal_conv1d_decode", spy)
    return seen


def _step(width, *, varlen, slots, bias=True, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed + width)
    return dict(x=rng.standard_normal((1, ROWS, DIM) if varlen else (ROWS, 1, DIM)).astype(dtype),
                weight=rng.standard_normal((DIM, width)).astype(dtype),
                bias=rng.standard_normal(DIM).astype(dtype) if bias else None,
                state=rng.standard_normal((ENTRIES if slots else ROWS, DIM, width - 1)).astype(dtype),
                cu_seqlens=np.arange(ROWS + 1) if varlen else None, state_slots=SLOTS if slots else None)


def _run(case, activation, *, workers=1):
    """``(y, pool after)`` of one decode step."""
    pool = case["state"].copy()
    y = conv.causal_conv1d(case["x"], case["weight"], case["bias"], activation, pool, case["cu_seqlens"],
                           case["state_slots"], workers=workers)
    return y, pool


def _run_numpy(case, activation, monkeypatch):
    """``_run`` with NumPy's step (``RLX_HOST_JIT=0``)."""
    with monkeypatch.context() as m:
        m.setenv(jit.ENV, "0")
        return _run(case, activation)


def _reference(case, activation):
    wide = {k: v.astype(np.float64) if isinstance(v, np.ndarray) and v.dtype.kind == "f" else v for k, v in case.items()}
    return ref.causal_conv1d(wide["x"], wide["weight"], bias=wide["bias"], activation=activation, state=wide["state"],
                             cu_seqlens=wide["cu_seqlens"], state_slots=wide["state_slots"])


@pytest.mark.parametrize("width", range(2, 9))
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda f: "-".join(k for k, v in f.items() if v) or "rows")
@pytest.mark.parametrize("activation", ["none", "silu"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_compiled_and_numpy_steps_match_the_reference_and_each_other(width, layout, activation, bias, calls,
                                                                     monkeypatch):
    case = _step(width, bias=bias, **layout)
    y, pool = _run(case, activation)
    assert calls == [(0, ROWS)]  # one call for every row
    y_np, pool_np = _run_numpy(case, activation, monkeypatch)
    assert len(calls) == 1
    want, final = _reference(case, activation)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y_np, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(pool, final)  # values moved, never computed: exact
    assert pool.tobytes() == pool_np.tobytes()
    if activation == "none":  # no contraction, NumPy's order: its bytes
        assert y.tobytes() == y_np.tobytes()
    else:  # exp's own polynomial: each silu within 3 ulp of the exact one (2^22 normal draws x 8), 4 apart at most
        np.testing.assert_array_max_ulp(y, y_np, maxulp=4)
    untouched = np.setdiff1d(np.arange(len(pool)), SLOTS if layout["slots"] else np.arange(ROWS))
    assert pool[untouched].tobytes() == case["state"][untouched].tobytes()


@pytest.mark.parametrize("activation", ["none", "silu"])
def test_nan_and_inf_land_where_numpy_puts_them(activation, calls, monkeypatch):
    """NaN and ±inf inputs and carried values, and pre-activations past exp's range (silu's -0 and inf)."""
    case = _step(4, varlen=False, slots=True)
    case["x"][0, 0, :4] = [np.nan, np.inf, -np.inf, 200.0]
    case["x"][1, 0, :2] = [-200.0, 1e30]
    case["state"][SLOTS[2], 5:8, 1] = [np.nan, np.inf, -np.inf]
    y, pool = _run(case, activation)
    y_np, pool_np = _run_numpy(case, activation, monkeypatch)
    assert len(calls) == 1 and pool.tobytes() == pool_np.tobytes()
    for name, test in (("NaN", np.isnan), ("+inf", np.isposinf), ("-inf", np.isneginf)):
        np.testing.assert_array_equal(test(y), test(y_np), err_msg=name)
    assert np.isnan(y).any() and np.isinf(y).any()
    np.testing.assert_array_equal(np.signbit(y), np.signbit(y_np))  # silu's -0 of a large negative input
    finite = np.isfinite(y)
    np.testing.assert_array_max_ulp(y[finite], y_np[finite], maxulp=4)


@pytest.mark.parametrize("layout", LAYOUTS[1:], ids=["slots", "varlen", "varlen-slots"])
def test_a_split_step_gives_one_workers_bytes(layout, calls, monkeypatch):
    """Forced past its threshold, the step's rows on two threads, a compiled call each: one worker's bytes."""
    monkeypatch.setitem(conv.DECODE_SPLIT_WORK, "compiled", 0)
    case = _step(4, **layout)
    one, two = _run(case, "silu", workers=1), _run(case, "silu", workers=2)
    assert calls == [(0, ROWS), (0, 2), (2, ROWS)] or calls == [(0, ROWS), (2, ROWS), (0, 2)]
    assert one[0].tobytes() == two[0].tobytes() and one[1].tobytes() == two[1].tobytes()


def test_below_its_threshold_a_step_stays_on_one_thread(calls):
    """``workers`` caps the threads: a step under ``DECODE_SPLIT_WORK`` takes one whatever it allows."""
    case = _step(4, varlen=False, slots=False)
    assert ROWS * DIM * 4 < min(conv.DECODE_SPLIT_WORK.values())
    _run(case, "silu", workers=2)
    assert calls == [(0, ROWS)]
    with pytest.raises(ValueError, match="causal_conv1d: workers must be a positive int, got 0"):
        _run(case, "silu", workers=0)  # still checked below the threshold


def _f64_pool(case):
    case["state"] = case["state"].astype(np.float64)


def _f64_all(case):
    for k in ("x", "weight", "bias", "state"):
        case[k] = case[k].astype(np.float64)


def _no_numba(monkeypatch):
    monkeypatch.setattr(jit, "_kernels", lambda: None)  # as after a failed import


@pytest.mark.parametrize("change", [_f64_pool, _f64_all, None], ids=["f64-pool", "f64", "no-numba"])
def test_numpy_runs_where_the_compiled_step_does_not_apply(change, calls, monkeypatch):
    """A pool in another float type (computed at the wider, as NumPy's step does), f64 activations, no Numba:
    NumPy's step, with the reference's values."""
    case = _step(3, varlen=True, slots=True)
    if change is None:
        _no_numba(monkeypatch)
    else:
        change(case)
    y, pool = _run(case, "silu")
    want, final = _reference(case, "silu")
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(pool, final.astype(pool.dtype))
    assert calls == []


def _read_only(a):
    a = a.copy()
    a.flags.writeable = False
    return a


def test_strided_and_read_only_inputs_are_taken(calls, monkeypatch):
    """A strided token, read-only weight (Fortran-ordered: its transpose is the taps as they are), bias and slots:
    the compiled step still (on copies where it must), NumPy's bytes."""
    case = _step(4, varlen=False, slots=True, bias=True)
    want = _run_numpy(case, "none", monkeypatch)
    case["x"] = np.repeat(case["x"], 2, axis=2)[..., ::2]
    case["weight"] = _read_only(np.asfortranarray(case["weight"]))
    case["bias"], case["state_slots"] = _read_only(case["bias"]), _read_only(case["state_slots"])
    got = _run(case, "none")
    assert calls == [(0, ROWS)]
    assert got[0].tobytes() == want[0].tobytes() and got[1].tobytes() == want[1].tobytes()


def test_an_output_over_its_input_takes_numpys_step(calls):
    """``out`` the input itself: NumPy's step, which reads every token before it writes."""
    case = _step(4, varlen=False, slots=True)
    want, _ = _reference(case, "silu")
    pool, x = case["state"].copy(), case["x"].copy()
    conv.causal_conv1d(x, case["weight"], case["bias"], "silu", pool, state_slots=SLOTS, out=x)
    np.testing.assert_allclose(x, want, rtol=1e-5, atol=1e-5)
    assert calls == []
