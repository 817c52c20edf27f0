"""host_fallback selective_scan and mamba2 against the float64 step recurrences of ABI.md §4."""
from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import host_fallback
from host_fallback import ssm, ssm_ssd
from rlx_gpu.conformance.reference_ssm import lay_out, mamba2, read, selective_scan

settings.register_profile("ci", derandomize=True, max_examples=8, deadline=None)
PROPERTY = settings.get_profile("ci") if os.environ.get("CI") else settings(max_examples=30, deadline=None)

#: Error allowed relative to the largest reference output: f32/f64 math, one rounding on store.
TOL = {"f64": 1e-10, "f32": 2e-5, "f16": 3e-3, "bf16": 2e-2}


def _close(got, want, dtype):
    assert np.all(np.isfinite(got))
    err = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30)
    assert err <= TOL[dtype], f"relative error {err:.3g} > {TOL[dtype]} ({dtype})"


def _scan_inputs(rng, b, s, h, n, decay=(0.05, 2.0)):
    return {
        "x": rng.standard_normal((b, s, h)),
        "delta": rng.uniform(0.01, 0.5, (b, s, h)),
        "a": -rng.uniform(*decay, (h, n)),
        "b": rng.standard_normal((b, s, n)),
        "c": rng.standard_normal((b, s, n)),
    }


def _mamba2_inputs(rng, b, s, h, p, n, a_range=(-2.0, -0.05)):
    return {
        "x": rng.standard_normal((b, s, h, p)),
        "dt": rng.uniform(0.01, 0.5, (b, s, h)),
        "a": rng.uniform(*a_range, (h,)),
        "b": rng.standard_normal((b, s, h, n)) / np.sqrt(n),
        "c": rng.standard_normal((b, s, h, n)),
    }


def _run_scan(dtype, tensors, **options):
    b, s, h = tensors["x"].shape
    params = {"batch": b, "seq": s, "hidden": h, "state_size": tensors["a"].shape[1]}
    thunk, arena = lay_out("selective_scan", dtype, params, tensors)
    host_fallback.execute(thunk, arena, **options)
    want = selective_scan(*(read(thunk, arena, f) for f in ("x", "delta", "a", "b", "c")))
    return read(thunk, arena, "dst"), want


def _run_mamba2(dtype, tensors, **options):
    b, s, h, p = tensors["x"].shape
    params = {"batch": b, "seq": s, "heads": h, "head_dim": p, "state_size": tensors["b"].shape[-1]}
    thunk, arena = lay_out("mamba2", dtype, params, tensors)
    host_fallback.execute(thunk, arena, **options)
    want = mamba2(*(read(thunk, arena, f) for f in ("x", "dt", "a", "b", "c")))
    return read(thunk, arena, "dst"), want


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "f64"])
@pytest.mark.parametrize("path", ["step", "blocked"])
@pytest.mark.parametrize("seq,n", [(1, 16), (37, 1), (37, 16), (21, 64)])
def test_selective_scan_matches_recurrence(dtype, path, seq, n):
    rng = np.random.default_rng(seq * 100 + n)
    got, want = _run_scan(dtype, _scan_inputs(rng, 2, seq, 5, n), path=path, chunk=8)
    _close(got, want, dtype)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "f64"])
@pytest.mark.parametrize("path", ["step", "chunked"])
@pytest.mark.parametrize("seq,heads,n", [(1, 3, 16), (37, 1, 1), (37, 3, 16), (21, 2, 64), (19, 1, 128), (9, 2, 256)])
def test_mamba2_matches_recurrence(dtype, path, seq, heads, n):
    rng = np.random.default_rng(seq * 1000 + n + heads)
    got, want = _run_mamba2(dtype, _mamba2_inputs(rng, 2, seq, heads, 4, n), path=path, chunk=8)
    _close(got, want, dtype)


@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
def test_mamba2_any_chunk_length(chunk):
    got, want = _run_mamba2("f32", _mamba2_inputs(np.random.default_rng(chunk), 2, 40, 2, 3, 8), path="chunked",
                            chunk=chunk)
    _close(got, want, "f32")


def test_growing_and_steep_decays_stay_finite():
    """Positive a*dt grows the state; a*dt of -50 a step underflows it: neither gives inf or NaN."""
    rng = np.random.default_rng(3)
    for a_range in [(0.05, 0.3), (-200.0, -100.0)]:
        tensors = _mamba2_inputs(rng, 2, 45, 2, 4, 8, a_range)
        got, want = _run_mamba2("f32", tensors, path="chunked", chunk=16)
        assert np.all(np.isfinite(want))
        _close(got, want, "f32")
    for decay in [(-0.3, -0.05), (100.0, 200.0)]:  # a > 0: growth; then a steep decay
        got, want = _run_scan("f32", _scan_inputs(rng, 2, 40, 3, 4, decay), path="blocked", chunk=16)
        assert np.all(np.isfinite(want))
        _close(got, want, "f32")


def test_mamba2_factors_decays_chunk_by_chunk():
    """One lane (batch item 1, head 2) with decays too steep to factor takes the masked form alone:
    it matches the recurrence, and every other lane is bit-identical to a run without it."""
    tensors = _mamba2_inputs(np.random.default_rng(8), 2, 150, 3, 4, 8, a_range=(-0.5, -0.05))
    steep = dict(tensors, dt=tensors["dt"].copy())
    steep["dt"][1, :, 2] *= 40
    spread = [np.max(np.abs(t["dt"] * t["a"])) * (ssm.MAMBA2_CHUNK // 2 + 1) for t in (tensors, steep)]
    assert spread[0] <= ssm_ssd.MAMBA2_SPREAD < spread[1]
    clean, _ = _run_mamba2("f32", tensors, path="chunked")
    got, want = _run_mamba2("f32", steep, path="chunked")
    _close(got, want, "f32")
    others = np.ones(got.shape, bool)
    others[1, :, 2] = False
    np.testing.assert_array_equal(got[others], clean[others])


def test_batch_items_are_independent():
    rng = np.random.default_rng(5)
    whole = _mamba2_inputs(rng, 3, 30, 2, 4, 8)
    got, _ = _run_mamba2("f32", whole, chunk=8)
    scan = _scan_inputs(rng, 3, 30, 4, 8)
    got_scan, _ = _run_scan("f32", scan, chunk=8)
    for i in range(3):
        one = {f: (t[i : i + 1] if f != "a" else t) for f, t in whole.items()}
        np.testing.assert_allclose(_run_mamba2("f32", one, chunk=8)[0][0], got[i], rtol=1e-5, atol=1e-6)
        one = {f: (t[i : i + 1] if f != "a" else t) for f, t in scan.items()}
        np.testing.assert_allclose(_run_scan("f32", one, chunk=8)[0][0], got_scan[i], rtol=1e-5, atol=1e-6)


def test_path_choice_and_bad_options():
    long = {"op": "mamba2", "seq": 1024, "batch": 2, "heads": 8, "head_dim": 64, "state_size": 64}
    scan = {"op": "selective_scan", "seq": 1024, "batch": 2, "hidden": 256, "state_size": 16}
    assert ssm.path_for(long, workers=1) == f"chunked L={ssm.MAMBA2_CHUNK}"
    assert ssm.path_for(long, workers=2) == f"chunked L={ssm.MAMBA2_CHUNK}, 2 threads"
    assert ssm.path_for({**long, "seq": 1}) == "step"  # decode stays on one thread
    assert ssm.path_for({**long, "seq": 16, "head_dim": 4, "state_size": 4}) == f"chunked L={ssm.MAMBA2_CHUNK}"
    assert ssm.path_for(scan, chunk=32, workers=3) == "blocked T=32, 3 threads"
    assert ssm.path_for({**scan, "batch": 1, "hidden": 2}, workers=3) == f"blocked T={ssm.SCAN_BLOCK}, 2 threads"
    assert ssm.path_for(long, path="step") == "step"
    with pytest.raises(ValueError, match="unknown path 'blocked'"):
        ssm.path_for(long, path="blocked")
    with pytest.raises(ValueError, match="workers must be a positive int, got 1.5"):
        ssm.path_for(scan, workers=1.5)


@pytest.mark.parametrize("b,h,workers", [(3, 2, 2), (1, 5, 3), (2, 3, 7)])
@pytest.mark.parametrize("op,path", [("selective_scan", "step"), ("selective_scan", "blocked"),
                                     ("mamba2", "step"), ("mamba2", "chunked")])
def test_split_across_threads_matches_recurrence(op, path, b, h, workers):
    """Blocks of batch items or channels/heads on several threads: every block against the
    reference, and against the one-thread run."""
    rng = np.random.default_rng(b * 10 + h)
    tensors = _scan_inputs(rng, b, 21, h, 8) if op == "selective_scan" else _mamba2_inputs(rng, b, 21, h, 4, 8)
    run = _run_scan if op == "selective_scan" else _run_mamba2
    got, want = run("f32", tensors, path=path, chunk=8, workers=workers)
    _close(got, want, "f32")
    one, _ = run("f32", tensors, path=path, chunk=8, workers=1)
    np.testing.assert_allclose(got, one, rtol=0, atol=1e-6 * np.max(np.abs(one)))


@PROPERTY
@given(
    b=st.integers(1, 2), s=st.integers(1, 40), h=st.integers(1, 3), p=st.integers(1, 4),
    n=st.sampled_from([1, 2, 5, 16]), chunk=st.sampled_from([1, 4, 16, 64]),
    adt=st.floats(-20.0, -1e-3), seed=st.integers(0, 2**16),
)
def test_mamba2_property(b, s, h, p, n, chunk, adt, seed):
    rng = np.random.default_rng(seed)
    tensors = _mamba2_inputs(rng, b, s, h, p, n)
    tensors["a"] = adt / rng.uniform(0.01, 0.5, (h,))  # a*dt up to adt: from barely to steeply decaying
    got, want = _run_mamba2("f32", tensors, path="chunked", chunk=chunk)
    _close(got, want, "f32")


@PROPERTY
@given(
    b=st.integers(1, 2), s=st.integers(1, 40), h=st.integers(1, 6), n=st.sampled_from([1, 3, 16]),
    chunk=st.sampled_from([1, 4, 16, 64]), adt=st.floats(-20.0, -1e-3), seed=st.integers(0, 2**16),
)
def test_selective_scan_property(b, s, h, n, chunk, adt, seed):
    rng = np.random.default_rng(seed)
    tensors = _scan_inputs(rng, b, s, h, n)
    tensors["a"] = adt * rng.uniform(0.1, 1.0, (h, n)) / 0.5
    got, want = _run_scan("f32", tensors, path="blocked", chunk=chunk)
    _close(got, want, "f32")
