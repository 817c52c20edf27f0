"""mamba3 (ABI.md §11): the float64 reference (rlx_gpu.conformance.reference_mamba3) against its own finite
differences and the equalities its definition implies (two calls chained through the state equal one call;
packed sequences equal separate rows)."""
from __future__ import annotations

import numpy as np
import pytest

from rlx_gpu.conformance import reference_mamba3 as ref
from tests.support.mamba3_cases import INPUTS, OPTIONAL, STATES, draw, tokens


def _loss_and_grads(args: dict, slots, seed: int = 1):
    """A random linear loss of the outputs and final states, and the reference backward's gradients of it."""
    rng = np.random.default_rng(seed)
    y, pools = ref.mamba3(**args, state_slots=slots)
    d_dst, d_states = rng.standard_normal(y.shape), [rng.standard_normal(p.shape) for p in pools]

    def loss(a: dict) -> float:
        y, pools = ref.mamba3(**a, state_slots=slots)
        return float(np.sum(y * d_dst) + sum(np.sum(p * g) for p, g in zip(pools, d_states)))
    grads = ref.mamba3_backward(**args, d_dst=d_dst, d_states=d_states, state_slots=slots)
    return loss, grads


def test_the_reference_backward_is_the_gradient_of_the_reference_forward():
    args = draw(2, 4, 4, 3, 6, 3, groups=2, entries=3)
    slots = [2, 0]
    loss, grads = _loss_and_grads(args, slots)
    eps = 1e-6
    tensors = [(f, args[f]) for f in INPUTS + OPTIONAL] + [(f, a) for f, a in zip(STATES, args["states"])]
    for field, array in tensors:
        numeric = np.zeros(array.shape)
        for i in np.ndindex(array.shape):
            kept = array[i]
            array[i] = kept + eps
            up = loss(args)
            array[i] = kept - eps
            numeric[i] = (up - loss(args)) / (2 * eps)
            array[i] = kept
        np.testing.assert_allclose(grads[f"d_{field}"], numeric, rtol=1e-6, atol=1e-6, err_msg=field)


def _same_angles(a: np.ndarray, b: np.ndarray) -> None:
    """Angle states agree modulo 2π (ABI.md §11)."""
    np.testing.assert_allclose(np.cos(a), np.cos(b), atol=1e-12)
    np.testing.assert_allclose(np.sin(a), np.sin(b), atol=1e-12)


def test_two_calls_chained_through_the_state_equal_one_call():
    args = draw(2, 9, 2, 3, 8, 2, entries=2)
    y, pools = ref.mamba3(**args)
    first, mid = ref.mamba3(**tokens(args, 0, 4))
    second, end = ref.mamba3(**{**tokens(args, 4, 9), "states": mid})
    np.testing.assert_allclose(np.concatenate([first, second], axis=1), y, rtol=1e-12, atol=1e-12)
    _same_angles(end[0], pools[0])
    for a, b in zip(end[1:], pools[1:]):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_packed_sequences_equal_separate_rows_and_an_empty_one_leaves_its_entry():
    cu = [0, 3, 3, 8]
    args = draw(1, 8, 2, 3, 6, 3, entries=4)
    slots = [3, 1, 0]
    y, pools = ref.mamba3(**args, cu_seqlens=cu, state_slots=slots)
    for r, (lo, hi) in enumerate(zip(cu, cu[1:])):
        alone = {**tokens(args, lo, hi), "states": [s[[slots[r]]] for s in args["states"]]}
        want_y, want = ref.mamba3(**alone)
        np.testing.assert_allclose(y[:, lo:hi], want_y, rtol=1e-12, atol=1e-12)
        for a, b in zip(pools, want):
            np.testing.assert_allclose(a[slots[r]], b[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(pools[1][2], args["states"][1][2])  # entry 2 is named by no row


@pytest.mark.parametrize("angles", [1, 3])
def test_the_angle_state_is_reduced_into_zero_to_two_pi(angles):
    args = draw(1, 30, 2, 2, 6, angles, entries=1)
    args["dt"] = args["dt"] + 3.0
    _, pools = ref.mamba3(**args)
    assert np.all((pools[0] >= 0) & (pools[0] <= 2 * np.pi))


# ---------------------------------------------------------------- the host kernel against the reference
from host_fallback import mamba3 as host  # noqa: E402


def _host(args: dict, dtype, **options):
    """The host kernel on ``args`` cast to ``dtype`` (the states too), returning ``(y, pools)``."""
    cast = {k: v.astype(dtype) for k, v in args.items() if k != "states"}
    pools = None if "states" not in args else [s.astype(dtype) for s in args["states"]]
    y = host.mamba3(**cast, states=pools, **options)
    return y, pools


@pytest.mark.parametrize("path", ["step", "chunked"])
@pytest.mark.parametrize("varlen", [False, True])
def test_the_host_kernel_is_the_reference_on_both_paths(path, varlen):
    if varlen:
        args, cu, slots = draw(1, 150, 4, 3, 8, 2, groups=2, entries=5, seed=3), [0, 20, 20, 100, 150], [3, 0, 4, 1]
    else:
        args, cu, slots = draw(2, 150, 4, 3, 8, 3, groups=2, entries=3, seed=4), None, [2, 0]
    want_y, want = ref.mamba3(**args, cu_seqlens=cu, state_slots=slots)
    y, pools = _host(args, np.float64, cu_seqlens=cu, state_slots=slots, path=path, chunk=16)
    np.testing.assert_allclose(y, want_y, rtol=1e-11, atol=1e-11)
    _same_angles(pools[0], want[0])
    for a, b in zip(pools[1:], want[1:]):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-11)


def test_f32_computes_close_to_the_reference_and_the_same_bytes_each_run():
    args = draw(2, 130, 2, 4, 8, 4, entries=2, seed=5)
    want_y, _ = ref.mamba3(**args)
    first, _ = _host(args, np.float32)
    again, _ = _host(args, np.float32)
    assert first.dtype == np.float32 and first.tobytes() == again.tobytes()
    assert np.sum((first - want_y) ** 2) / np.sum(want_y ** 2) < 1e-10


def test_host_calls_chained_through_the_state_equal_one_call():
    args = draw(2, 100, 2, 3, 6, 3, entries=2, seed=6)
    y, pools = _host(args, np.float64)
    first, mid = _host(tokens(args, 0, 37), np.float64)
    second, end = _host({**tokens(args, 37, 100), "states": mid}, np.float64)
    np.testing.assert_allclose(np.concatenate([first, second], axis=1), y, rtol=1e-11, atol=1e-11)
    _same_angles(end[0], pools[0])
    for a, b in zip(end[1:], pools[1:]):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-11)


def test_a_nan_in_a_chunk_reaches_only_its_token_and_after():
    args = draw(1, 128, 2, 3, 6, 2, seed=7)
    args["k"][0, 70, 0, 1] = np.nan
    y, _ = _host(args, np.float64, path="chunked")
    assert np.isfinite(y[0, :70]).all() and np.isnan(y[0, 70:, 0]).all()


# ---------------------------------------------------------------- the host backward against the reference's
from host_fallback.mamba3_backward import mamba3_backward as host_backward  # noqa: E402


def test_a_nan_sends_the_backward_down_the_step_walk_as_the_reference_does():
    args = draw(1, 30, 2, 3, 6, 2, entries=1, seed=16)
    args["trap"][0, 12, 1] = np.nan
    rng = np.random.default_rng(17)
    d_dst, d_states = rng.standard_normal(args["v"].shape), [rng.standard_normal(s.shape) for s in args["states"]]
    want = ref.mamba3_backward(**args, d_dst=d_dst, d_states=d_states)
    got = host_backward(**{k: v for k, v in args.items() if k != "states"}, d_dst=d_dst, states=args["states"],
                        d_states=[s.copy() for s in d_states])
    for field in ("d_v", "d_q", "d_trap"):
        np.testing.assert_array_equal(np.isnan(got[field]), np.isnan(want[field]), err_msg=field)
    assert np.isfinite(got["d_v"][0, 13:]).all() and np.isnan(got["d_v"][0, :12]).any()


@pytest.mark.parametrize("varlen", [False, True])
def test_the_host_backward_is_the_reference_backward(varlen):
    if varlen:
        args, cu, slots = draw(1, 90, 4, 3, 8, 2, groups=2, entries=5, seed=8), [0, 20, 20, 70, 90], [3, 0, 4, 1]
    else:
        args, cu, slots = draw(2, 90, 4, 3, 8, 3, groups=2, entries=3, seed=9), None, [2, 0]
    rng = np.random.default_rng(10)
    d_dst, d_states = rng.standard_normal(args["v"].shape), [rng.standard_normal(s.shape) for s in args["states"]]
    want = ref.mamba3_backward(**args, d_dst=d_dst, d_states=d_states, cu_seqlens=cu, state_slots=slots)
    pools = [s.copy() for s in d_states]
    got = host_backward(**{k: v for k, v in args.items() if k != "states"}, d_dst=d_dst, states=args["states"],
                        d_states=pools, cu_seqlens=cu, state_slots=slots, chunk=16)
    got.update({f"d_{f}": pool for f, pool in zip(STATES, pools)})
    assert set(got) == set(want)
    for field, values in want.items():
        np.testing.assert_allclose(got[field], values, rtol=1e-10, atol=1e-10, err_msg=field)
    unnamed = 2 if varlen else 1  # the pool entry no row names keeps its bytes
    np.testing.assert_array_equal(pools[1][unnamed], d_states[1][unnamed])


def test_the_host_backward_gives_the_same_bytes_each_run():
    args = draw(2, 70, 2, 3, 6, 2, seed=11)
    d_dst = np.random.default_rng(12).standard_normal(args["v"].shape).astype(np.float32)
    cast = {k: v.astype(np.float32) for k, v in args.items()}
    first, again = host_backward(**cast, d_dst=d_dst), host_backward(**cast, d_dst=d_dst)
    assert all(first[f].dtype == np.float32 and first[f].tobytes() == again[f].tobytes() for f in first)


@pytest.mark.parametrize("jit", ["1", "0"])
@pytest.mark.parametrize("seq", [7, 40])  # the step walk (short), the chunked path's reverse
def test_f32_backward_compiled_or_not_is_close_to_the_reference(jit, seq, monkeypatch):
    monkeypatch.setenv("RLX_HOST_JIT", jit)
    args = draw(1, seq, 4, 8, 6, 2, groups=2, entries=2, seed=13)
    rng = np.random.default_rng(14)
    d_dst, d_states = rng.standard_normal(args["v"].shape), [rng.standard_normal(s.shape) for s in args["states"]]
    want = ref.mamba3_backward(**args, d_dst=d_dst, d_states=d_states)
    low = {k: v.astype(np.float32) for k, v in args.items() if k != "states"}
    pools = [s.astype(np.float32) for s in d_states]
    got = host_backward(**low, d_dst=d_dst.astype(np.float32), states=[s.astype(np.float32) for s in args["states"]],
                        d_states=pools)
    got.update({f"d_{f}": pool for f, pool in zip(STATES, pools)})
    for field, values in want.items():
        assert got[field].dtype == np.float32
        np.testing.assert_allclose(got[field], values, rtol=2e-4, atol=2e-4 * np.abs(values).max(), err_msg=field)


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_the_threads_split_whole_groups_and_change_no_byte(groups):
    args = draw(2, 130, 4, 3, 8, 2, groups=groups, entries=2, seed=15)
    low = {k: (v.astype(np.float32) if k != "states" else [s.astype(np.float32) for s in v]) for k, v in args.items()}
    one_pools, two_pools = [s.copy() for s in low["states"]], [s.copy() for s in low["states"]]
    rest = {k: v for k, v in low.items() if k != "states"}
    one = host.mamba3(**rest, states=one_pools, workers=1)
    two = host.mamba3(**rest, states=two_pools, workers=2)
    assert one.tobytes() == two.tobytes()
    assert all(a.tobytes() == b.tobytes() for a, b in zip(one_pools, two_pools))
    split = {1: [(slice(0, 2), slice(None)), (slice(2, 4), slice(None))],
             2: [(slice(0, 2), slice(0, 1)), (slice(2, 4), slice(1, 2))],
             4: [(slice(0, 2), slice(0, 2)), (slice(2, 4), slice(2, 4))]}[groups]
    assert host.head_parts(4, groups, 2) == split
