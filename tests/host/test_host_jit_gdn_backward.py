"""host_fallback's compiled passes of gated_delta_net's chunked backward, per key channel
(``jit_gdn_backward.gdn_channel_gradients`` and ``gdn_channel_decays``), per head (``gdn_head_operands`` and
``gdn_head_gradients``) and either (``gdn_reverse_state``), bound by ``gdn_backward_grads`` and
``gdn_backward_chunked``, beside their NumPy twin (``RLX_HOST_JIT=0``).

Both paths, either gate kind, against the conformance reference's float64 backward (itself checked against finite
differences and torch autograd by test_gdn_backward) on the values the thunk stores: f64 and f32 thunks, chunks that
end inside the sequence, packed sequences through state slots with grouped value heads and K != V, a saved forward
(ABI.md §9.1), 37 key channels; a NaN gate or output gradient left to the same lanes on both paths (redone step by
step), each gradient pass's check sums seeing a NaN in its lane; the same bytes on every run.
"""
from __future__ import annotations

import numpy as np
import pytest

import host_fallback
from host_fallback import gdn_backward
from host_fallback.abi import complete, regions
from host_fallback.arena import view
from rlx_gpu.conformance.references import REFERENCES
from rlx_gpu.conformance.runner import sample
from support.gradient_check import copy_inputs, laid, read
from support.saved_forward import filled_reserve, laid_case

numba = pytest.importorskip("numba", reason="the jit extra (Numba) is not installed")
from host_fallback import jit, jit_gdn_backward  # noqa: E402  (needs Numba)

OP = "gated_delta_net_backward"
BASE = dict(batch=2, seq=45, heads=2, state_size=8, gate_per_channel=True, carry_state=True)
#: (label, params): seq 45 ends a chunk of 16 inside the sequence; the second packs sequences (one empty, one starting
#: inside a chunk) through state slots, two value heads a key head, K != V, L2-norm and a scale; the third has 37 key
#: channels (odd, past 16: the kernels' sums over the channels fold 37 -> 19 -> 10 partial sums); each per key
#: channel and per head
CASES = [(f"{label}-{gates}", dict(params, gate_per_channel=gates == "channel"))
         for label, params in (("partial-chunk", BASE),
                               ("packed-groups", dict(BASE, batch=1, seq=40, value_heads=4, value_size=3,
                                                      qk_l2norm=True, scale=0.7, cu_seqlens=[0, 2, 2, 23, 40],
                                                      state_slots=[3, 0, 4, 1], num_slots=5)),
                               ("wide-keys", dict(BASE, batch=1, seq=40, state_size=37, value_size=20)))
         for gates in ("channel", "head")]
#: The kernels each gate kind calls.
KERNELS = {True: {"gdn_channel_decays", "gdn_channel_gradients", "gdn_reverse_state"},
           False: {"gdn_head_operands", "gdn_head_gradients", "gdn_reverse_state"}}
#: NMSE of each f32 gradient against float64's (test_gdn_backward's bound for f32)
NMSE = 1e-10


def _laid(params: dict, dtype: str) -> tuple[dict, np.ndarray]:
    return laid(OP, dtype, params, lambda field, shape, rng: sample(OP, params, field, shape, rng))


def _grads(thunk: dict, arena: np.ndarray, **options) -> dict[str, np.ndarray]:
    out = arena.copy()
    host_fallback.execute(thunk, out, **options)
    return {f: v for f, v in read(thunk, out).items() if f.startswith("d_") and f != "d_dst"}


def _both(monkeypatch, thunk: dict, arena: np.ndarray, **options) -> tuple[dict, dict]:
    """The gradients by the compiled kernels (each asserted called) and by NumPy's path."""
    monkeypatch.delenv(jit.ENV, raising=False)
    calls = []
    for name in jit_gdn_backward.__all__:
        kernel = getattr(jit_gdn_backward, name)
        monkeypatch.setattr(jit_gdn_backward, name, lambda *a, _k=kernel, _n=name: (calls.append(_n), _k(*a))[1])
    compiled = _grads(thunk, arena, **options)
    assert set(calls) == KERNELS[complete(thunk)["gate_per_channel"]], calls
    monkeypatch.setenv(jit.ENV, "0")
    numpy_path = _grads(thunk, arena, **options)
    monkeypatch.delenv(jit.ENV)
    return compiled, numpy_path


def _reference(thunk: dict, arena: np.ndarray) -> dict[str, np.ndarray]:
    values = read(thunk, arena)
    return REFERENCES[OP](complete(thunk), lambda f: values[f])


@pytest.mark.parametrize("label,params", CASES, ids=[c[0] for c in CASES])
def test_f64_both_paths_match_the_reference(monkeypatch, label, params):
    thunk, arena = _laid(params, "f64")
    want = _reference(thunk, arena)
    for got in _both(monkeypatch, thunk, arena, path="chunked", chunk=16):
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-9, atol=1e-11, err_msg=f"{label} {name}")


@pytest.mark.parametrize("label,params", CASES, ids=[c[0] for c in CASES])
def test_f32_both_paths_match_float64_and_rerun_to_the_same_bytes(monkeypatch, label, params):
    thunk, arena = _laid(params, "f32")
    wide, wide_arena = _laid(params, "f64")
    copy_inputs(thunk, arena, wide, wide_arena)  # the f64 reference gets the values the f32 thunk stores
    want = _reference(wide, wide_arena)
    for got in _both(monkeypatch, thunk, arena, path="chunked", chunk=16):
        for name, value in want.items():
            err = np.mean((got[name] - value) ** 2) / max(np.mean(value ** 2), 1e-30)
            assert err <= NMSE, (label, name, err)
    first, second = arena.copy(), arena.copy()
    host_fallback.execute(thunk, first, path="chunked", chunk=16)
    host_fallback.execute(thunk, second, path="chunked", chunk=16)
    assert np.array_equal(first, second)


@pytest.mark.parametrize("case,workers", [("per_head", None), ("per_channel", None),
                                          (dict(batch=1, heads=4, value_heads=8), 2)],
                         ids=["per_head", "per_channel", "two-threads-over-heads"])
def test_a_saved_forward_read_by_both_paths(monkeypatch, case, workers):
    """A saved forward (chunks of 32, the last one partial) read by either path gives float64's gradients; with two
    threads splitting the heads, each reads its heads' slots where they lie (strided views of the reserve)."""
    thunk, arena, forward = laid_case("gated_delta_net", "f32", case)
    arena = filled_reserve(thunk, arena, forward)
    want = _reference(thunk, arena)
    compiled, numpy_path = _both(monkeypatch, thunk, arena, **({} if workers is None else {"workers": workers}))
    for got in (compiled, numpy_path):
        for name, value in want.items():
            err = np.mean((got[name] - value) ** 2) / max(np.mean(value ** 2), 1e-30)
            assert err <= NMSE, (case, name, err)
    for name, value in numpy_path.items():
        np.testing.assert_allclose(compiled[name], value, rtol=2e-4, atol=2e-5, err_msg=name)


@pytest.mark.parametrize("case", ["per_channel", "carry.slots", "state_f64"])
def test_a_saved_forward_read_a_chunk_at_a_time_gives_the_whole_sequences_gradients(monkeypatch, case):
    """The chunked path over a saved forward in segments of one chunk (``gdn_backward.SEGMENT_CHUNKS``; three chunks,
    the last partial), each entering with the state the saved forward kept and leaving with the gradient of the one
    after it, gives the gradients of one pass over the whole sequence, on both paths."""
    thunk, arena, forward = laid_case("gated_delta_net", "f32", case)
    arena = filled_reserve(thunk, arena, forward)
    whole = _both(monkeypatch, thunk, arena)
    monkeypatch.setattr(gdn_backward, "SEGMENT_CHUNKS", 1)
    for got, want in zip(_both(monkeypatch, thunk, arena), whole):
        assert set(got) == set(want)
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6 * np.abs(value).max(), err_msg=name)


@pytest.mark.parametrize("per_channel", [True, False], ids=["channel", "head"])
@pytest.mark.parametrize("field,dtype,tol", [("g", "f64", 1e-12), ("d_dst", "f32", 1e-4)])
def test_a_nan_leaves_the_same_lanes_non_finite_on_both_paths(monkeypatch, field, dtype, tol, per_channel):
    """A NaN log-decay (or output gradient) makes its lane's chunked gradients non-finite on either path, which
    redoes it step by step: the same NaN everywhere, the same values elsewhere."""
    thunk, arena = _laid(dict(BASE, seq=48, gate_per_channel=per_channel), dtype)
    r = next(r for r in regions(thunk) if r.field == field)
    view(arena, r.offset, dtype, r.shape)[(0, 20, 1, 3)[:len(r.shape)]] = np.nan  # row 0, step 20, head 1(, channel 3)
    with np.errstate(invalid="ignore"):
        compiled, numpy_path = _both(monkeypatch, thunk, arena, path="chunked", chunk=16)
    assert np.isnan(compiled["d_g"][0, :21, 1]).any() and not np.isnan(compiled["d_g"][1]).any()
    for name, value in numpy_path.items():
        np.testing.assert_array_equal(np.isnan(compiled[name]), np.isnan(value), err_msg=name)
        np.testing.assert_allclose(compiled[name], value, rtol=tol, atol=tol / 10, err_msg=name)


@pytest.mark.parametrize("kernel,arity", [("gdn_channel_gradients", jit_gdn_backward._GRADIENTS),
                                          ("gdn_head_gradients", jit_gdn_backward._HEAD)], ids=["channel", "head"])
def test_a_gradient_pass_sums_every_gradient_it_writes_into_its_lanes_check(monkeypatch, kernel, arity):
    """The compiled gradient passes add each lane's gradients to ``check`` (what ``_redo_nonfinite`` reads to find
    the lanes to redo): a NaN in one lane's ``O S0^T`` (the top-left block of its products, which only ``dq`` and
    ``dg`` take) leaves that lane's check NaN and every other lane's as it was."""
    calls = []
    original = getattr(jit_gdn_backward, kernel)
    monkeypatch.setattr(jit_gdn_backward, kernel, lambda *a: (calls.append([np.copy(x) for x in a]), original(*a))[1])
    thunk, arena = _laid(dict(BASE, gate_per_channel=kernel == "gdn_channel_gradients"), "f32")
    _grads(thunk, arena, path="chunked", chunk=16)
    at = list(arity).index

    def check_after(args: list) -> np.ndarray:
        args = [np.copy(x) for x in args]
        scalars = [x[()] for x in args[len(arity):]]  # scale and group, as the pass takes them
        with np.errstate(invalid="ignore"):
            original(*args[:len(arity)], *scalars)
        return args[at("check")]

    clean = check_after(calls[0])
    poisoned = [np.copy(x) for x in calls[0]]
    poisoned[at("products")][1, 2, 0] = np.nan  # lane 1, step 2, key channel 0
    checked = check_after(poisoned)
    assert np.isfinite(clean).all() and np.isnan(checked[1])
    np.testing.assert_array_equal(np.delete(checked, 1), np.delete(clean, 1))
