"""Host decode steps without per-call waste: the recurrences' thunk-only setup done once
(``host_fallback.PREPARE``), the gated delta rule's carried state updated where it lies.

References: ``conformance.reference_rnn`` and ``reference_ssm`` (float64, written from ABI.md).
"""
from __future__ import annotations

import numpy as np
import pytest

import host_fallback
from host_fallback.abi import regions
from host_fallback.bound import Bound
from rlx_gpu.conformance.reference_rnn import reference
from rlx_gpu.conformance.reference_ssm import gated_delta_net, lay_out, read as read_ssm
from support.rnn_host import build, read

SHAPE = dict(batch=3, seq=1, input_size=5, hidden=7, num_layers=2, bidirectional=True, carry=True)


@pytest.mark.parametrize("op", ["lstm", "gru", "rnn"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_a_prepared_recurrence_serves_many_arenas_and_sees_their_new_contents(op, dtype):
    """One ``prepare`` runs on arena A (checked against the float64 reference), on a different arena
    B, and on A again after its input and weights were rewritten in place: every run leaves exactly
    the bytes the unprepared kernel leaves."""
    thunk, arena_a, inputs, _ = build(op, dtype, seed=1, **SHAPE)
    _, arena_b, _, _ = build(op, dtype, seed=2, **SHAPE)
    _, arena_c, _, _ = build(op, dtype, seed=3, **SHAPE)
    run = host_fallback.PREPARE[op](thunk)
    b, h, dirs = SHAPE["batch"], SHAPE["hidden"], 2
    biases = {f: inputs[f] for f in ("bias", "b_ih", "b_hh") if f in inputs}
    want = reference(op, inputs["x"], inputs["w_ih"], inputs["w_hh"], biases, hidden=h, num_layers=2,
                     bidirectional=True, h0=inputs["h0"], c0=inputs.get("c0"))
    steps = [(arena_a, None), (arena_b, None), (arena_a, ("x", "w_ih", "w_hh"))]
    for arena, rewrite in steps:
        for r in (r for r in regions(thunk) if r.field in (rewrite or ())):
            arena[r.offset: r.offset + r.nbytes] = arena_c[r.offset: r.offset + r.nbytes]  # C's, in place
        expected = arena.copy()
        host_fallback.execute(thunk, expected)
        run(arena)
        np.testing.assert_array_equal(arena, expected)
        if arena is arena_a and rewrite is None:
            tol = 2e-5 if dtype == "f32" else 3e-2
            np.testing.assert_allclose(read(arena, thunk, "dst", (b, 1, dirs * h)), want[0], rtol=tol, atol=tol)


def _gdn(dtype, per_channel, seed=0):
    rng = np.random.default_rng(seed)
    b, h, n = 2, 3, 16
    k = rng.standard_normal((b, 1, h, n))
    tensors = {"q": rng.standard_normal((b, 1, h, n)), "k": k / np.linalg.norm(k, axis=-1, keepdims=True),
               "v": rng.standard_normal((b, 1, h, n)),
               "g": rng.uniform(-3, 0, (b, 1, h, n) if per_channel else (b, 1, h)),
               "beta": rng.uniform(0, 1, (b, 1, h)), "state": rng.standard_normal((b, h, n, n))}
    params = {"batch": b, "seq": 1, "heads": h, "state_size": n, "gate_per_channel": per_channel, "carry_state": True}
    return lay_out("gated_delta_net", dtype, params, tensors)


@pytest.mark.parametrize("dtype", ["f32", "f64", "bf16"])
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("workers", [1, 2])
def test_gdn_decode_updates_the_carried_state_in_place(monkeypatch, dtype, per_channel, workers):
    """f32/f64: the step path updates ``state`` where it lies and stores nothing back; 16-bit storage
    still loads, computes in f32 and stores. Two workers split the heads (a non-contiguous state block)."""
    thunk, arena = _gdn(dtype, per_channel)
    inputs = [read_ssm(thunk, arena, f) for f in ("q", "k", "v", "g", "beta", "state")]
    stored: list[str] = []
    original = Bound.store
    monkeypatch.setattr(Bound, "store", lambda self, field, *a: (stored.append(field), original(self, field, *a)))
    host_fallback.execute(thunk, arena, path="step", workers=workers)
    assert ("state" in stored) == (dtype == "bf16")
    want, want_state = gated_delta_net(*inputs)
    tol = {"f32": 1e-5, "f64": 1e-12, "bf16": 3e-2}[dtype]
    np.testing.assert_allclose(read_ssm(thunk, arena, "dst"), want, rtol=tol, atol=tol)
    np.testing.assert_allclose(read_ssm(thunk, arena, "state"), want_state, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", ["f32", "f64", "bf16"])
@pytest.mark.parametrize("per_channel", [False, True])
def test_prepared_gdn_decode_runs_on_the_arena_views_of_each_arena_it_is_given(monkeypatch, dtype, per_channel):
    """``PREPARE["gated_delta_net"]``: f32/f64 decode runs straight on arena views (no block stores at
    all), 16-bit storage through the kernel; two steps on one arena and one on another, each against
    the float64 reference chained from the state it left."""
    thunk, arena_a = _gdn(dtype, per_channel)
    _, arena_b = _gdn(dtype, per_channel, seed=9)
    stored: list[str] = []
    original = Bound.store
    monkeypatch.setattr(Bound, "store", lambda self, field, *a: (stored.append(field), original(self, field, *a)))
    run = host_fallback.PREPARE["gated_delta_net"](thunk)
    tol = {"f32": 1e-5, "f64": 1e-12, "bf16": 3e-2}[dtype]
    for arena in (arena_a, arena_a, arena_b):
        inputs = [read_ssm(thunk, arena, f) for f in ("q", "k", "v", "g", "beta", "state")]
        run(arena)
        want, want_state = gated_delta_net(*inputs)
        np.testing.assert_allclose(read_ssm(thunk, arena, "dst"), want, rtol=tol, atol=tol)
        np.testing.assert_allclose(read_ssm(thunk, arena, "state"), want_state, rtol=tol, atol=tol)
    assert (stored == []) == (dtype != "bf16")
