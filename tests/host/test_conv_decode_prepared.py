"""causal_conv1d's prepared decode step (``conv.prepare``, ``host_fallback.PREPARE``): a thunk of one token a row
with a carried state runs ``jit``'s ``causal_conv1d_decode`` on its arena's views bound once, with no other
Python between a call and the kernel. Against the float64 reference of ABI.md §10 (rlx_gpu.conformance.
reference_conv) over rows and slots, silu or none, bias or none, widths 2..8, and against the whole kernel's
bytes (``host_fallback.execute``); a prepared thunk rebinding each arena it is given; the whole kernel wherever
the prepared step does not apply; a bad worker count refused."""
from __future__ import annotations

import numpy as np
import pytest

import host_fallback
from host_fallback import conv
from rlx_gpu.conformance import reference_conv as ref
from rlx_gpu.conformance.reference_ssm import lay_out, read

pytest.importorskip("numba", reason="the jit extra (Numba) is not installed")

ROWS, DIM, ENTRIES = 3, 37, 5


@pytest.fixture
def whole(monkeypatch):
    """Counts the calls that went the whole kernel's way (``conv._arrays``; they still run)."""
    seen = []

    def spy(*args, real=conv._arrays):
        seen.append(1)
        real(*args)
    monkeypatch.setattr(conv, "_arrays", spy)
    return seen


def _case(width, *, slots=False, bias=True, activation="silu", seq=1, dtype="f32", seed=0):
    """``(thunk, arena, reference y, reference pool)`` of one step of ``ROWS`` rows."""
    rng = np.random.default_rng(seed + width)
    tensors = dict(x=rng.standard_normal((ROWS, seq, DIM)), weight=rng.standard_normal((DIM, width)),
                   state=rng.standard_normal((ENTRIES if slots else ROWS, DIM, width - 1)))
    params = dict(batch=ROWS, seq=seq, dim=DIM, width=width, activation=activation, carry_state=True)
    if bias:
        tensors["bias"] = rng.standard_normal(DIM)
        params["bias"] = True
    if slots:
        params.update(state_slots=[4, 0, 2], num_slots=ENTRIES)
    thunk, arena = lay_out("causal_conv1d", dtype, params, tensors)
    stored = {f: read(thunk, arena, f) for f in tensors}
    y, pool = ref.causal_conv1d(stored["x"], stored["weight"], bias=stored.get("bias"), activation=activation,
                                state=stored["state"], state_slots=[4, 0, 2] if slots else None)
    return thunk, arena, y, pool


@pytest.mark.parametrize("width", range(2, 9))
@pytest.mark.parametrize("slots", [False, True])
@pytest.mark.parametrize("bias,activation", [(True, "silu"), (False, "none")])
def test_the_prepared_step_is_the_reference_and_the_whole_kernels_bytes(width, slots, bias, activation, whole):
    thunk, arena, y, pool = _case(width, slots=slots, bias=bias, activation=activation)
    expected = arena.copy()
    host_fallback.execute(thunk, expected)  # the whole kernel
    whole.clear()
    host_fallback.bound_kernel(thunk, {})(arena)
    assert not whole
    np.testing.assert_allclose(read(thunk, arena, "dst"), y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(read(thunk, arena, "state"), pool, rtol=1e-6, atol=1e-6)
    assert arena.tobytes() == expected.tobytes()


def test_a_prepared_step_binds_each_arena_it_is_given(whole):
    """Arena A, B, then A again with new contents: each step its own arena's reference, none the whole way."""
    (thunk, a, want_a, _), (_, b, want_b, _), (_, fresh, want_fresh, _) = [_case(4, slots=True, seed=seed)
                                                                           for seed in (1, 2, 3)]
    run = host_fallback.PREPARE["causal_conv1d"](thunk)
    for arena, want in ((a, want_a), (b, want_b), (a, want_fresh)):
        if want is want_fresh:
            a[:] = fresh  # the same array object, new contents
        run(arena)
        np.testing.assert_allclose(read(thunk, arena, "dst"), want, rtol=1e-5, atol=1e-5)
    assert not whole


@pytest.mark.parametrize("label,change", [("f16 storage", dict(dtype="f16")), ("two tokens", dict(seq=2))])
def test_the_whole_kernel_runs_where_the_prepared_step_does_not_apply(label, change, whole):
    thunk, arena, y, pool = _case(4, **change)
    host_fallback.bound_kernel(thunk, {})(arena)
    assert len(whole) == 1
    tolerance = 2e-2 if change.get("dtype") == "f16" else 1e-5
    np.testing.assert_allclose(read(thunk, arena, "dst"), y, rtol=tolerance, atol=tolerance)


def test_a_bad_worker_count_is_refused_before_anything_runs(whole):
    thunk, arena, *_ = _case(4)
    before = arena.copy()
    with pytest.raises(ValueError, match=r"^causal_conv1d: workers must be a positive int, got 0$"):
        host_fallback.bound_kernel(thunk, {"workers": 0})(arena)
    assert np.array_equal(arena, before)


def test_arrays_given_in_place_of_the_views_run_where_they_fit_and_nothing_runs_where_they_do_not(whole):
    """``run(arena, given=...)`` (``implementations.GIVEN``): the caller's pool and output taken where they lie
    (the reference's results in them, the arena's pool untouched); an array of another size refused (False),
    nothing written anywhere."""
    thunk, arena, y, pool = _case(4, slots=True)
    regions = {r.field: r for r in host_fallback.abi.regions(thunk)}
    mine = read(thunk, arena, "state").astype(np.float32)
    out = np.zeros(regions["dst"].shape, np.float32)
    run = host_fallback.PREPARE["causal_conv1d"](thunk)
    before = arena.copy()
    assert run(arena, given={regions["state"].offset: mine, regions["dst"].offset: out}) is True
    np.testing.assert_allclose(out, y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(mine, pool, rtol=1e-6, atol=1e-6)
    assert arena.tobytes() == before.tobytes()
    short = np.zeros(3, np.float32)
    assert run(arena, given={regions["state"].offset: short}) is False
    assert arena.tobytes() == before.tobytes() and not whole
