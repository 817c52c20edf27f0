"""The host's mamba2 with a saved forward (ABI.md §9.1): a training forward writes the reserve (the states
leaving every chunk of 64 tokens, the output before ``d`` and ``z``, each chunk's decayed scores), the backward reads it instead of
recomputing them. Its gradients against the backward that recomputes (the same values by another GEMM order:
equal within rounding), the forward's outputs unchanged by writing it, the reserve the same from the step and
chunked forwards (the chunked form either way), the same bytes on every run, and packed sequences refused."""
from __future__ import annotations

import numpy as np
import pytest

import host_fallback
import rlx_gpu
from host_fallback.abi import regions
from host_fallback.ssm import reserve_views
from rlx_gpu.conformance.cases import lay_out, schedule_of
from support.gradient_check import read, with_gradients
from support.saved_forward import (decaying_sampler, filled_reserve, laid_with_reserve, matches_recomputed,
                                   run_forward, without_reserve)

BASE = dict(batch=2, seq=150, heads=2, head_dim=3, state_size=4)  # three chunks, the last one partial
CARRIED = dict(carry_state=True, state=True)
CASES = [
    ("base", {}),
    ("exact_chunks", dict(seq=128)),
    ("one_chunk", dict(seq=40)),
    ("groups.d.z", dict(heads=4, groups=2, d=True, z=True)),
    ("dt_knobs", dict(dt_bias=True, dt_softplus=True, dt_limit=[0.0, 1.2], z=True)),
    ("carry.slots", dict(CARRIED, state_slots=[2, 0], num_slots=3, d=True)),
]
IDS = [label for label, _ in CASES]
#: Largest difference from the recomputing backward, relative to the gradient's largest magnitude.
TOL = {"f64": 1e-11, "f32": 2e-5, "bf16": 2e-2}


_SAMPLE = decaying_sampler("dt")


def _laid(dtype: str, extra: dict) -> tuple[dict, np.ndarray, dict]:
    return laid_with_reserve("mamba2", dtype, {**BASE, **extra}, _SAMPLE)


@pytest.mark.parametrize("dtype", ["f64", "f32", "bf16"])
@pytest.mark.parametrize("extra", [e for _, e in CASES], ids=IDS)
def test_gradients_read_from_the_reserve_match_the_recomputed_ones(extra, dtype):
    thunk, arena, forward = _laid(dtype, extra)
    matches_recomputed(thunk, arena, forward, TOL[dtype])


@pytest.mark.parametrize("extra", [e for _, e in CASES], ids=IDS)
def test_the_forward_writing_a_reserve_gives_the_outputs_of_one_without(extra):
    _, arena, forward = _laid("f64", extra)
    with_reserve, without = run_forward(forward, arena), run_forward(without_reserve(forward), arena)
    for r in regions(without_reserve(forward)):
        if r.writes:
            np.testing.assert_array_equal(read(forward, with_reserve)[r.field], read(forward, without)[r.field],
                                          err_msg=r.field)


@pytest.mark.parametrize("extra", [CASES[0][1], CASES[5][1]], ids=[IDS[0], IDS[5]])
def test_a_forward_asked_for_the_step_path_writes_the_chunked_forms_reserve(extra):
    thunk, arena, forward = _laid("f64", extra)
    step, chunked = (reserve_views(thunk, filled_reserve(thunk, arena, forward, path=p)) for p in ("step", "chunked"))
    for name in ("states", "y", "scores"):
        np.testing.assert_array_equal(step[name], chunked[name], err_msg=name)


def test_the_saved_scores_are_the_decayed_scores_of_each_chunk():
    thunk, arena, forward = _laid("f64", dict(seq=100))
    saved, values = reserve_views(thunk, filled_reserve(thunk, arena, forward)), read(thunk, arena)
    logd = values["dt"] * values["a"]
    b, c = values["b"], values["c"]
    for k, lo in enumerate(range(0, 100, 64)):
        span = slice(lo, min(100, lo + 64))
        cum = np.cumsum(logd[:, span], axis=1)  # [B, L, H]
        want = np.einsum("blhn,bshn->bhls", c[:, span], b[:, span]) * np.exp(cum.transpose(0, 2, 1)[..., :, None]
                                                                             - cum.transpose(0, 2, 1)[..., None, :])
        want = np.tril(want)
        got = saved["scores"][:, k]
        np.testing.assert_allclose(got[..., : want.shape[-1], : want.shape[-1]], want, rtol=1e-10, atol=1e-12)
        assert not got[..., want.shape[-1]:, :].any() and not got[..., want.shape[-1]:].any()


def test_the_reserve_and_the_gradients_are_the_same_bytes_on_every_run():
    thunk, arena, forward = _laid("f32", CASES[3][1])
    first, second = run_forward(forward, arena), run_forward(forward, arena)
    assert np.array_equal(first, second)
    arena = filled_reserve(thunk, arena, forward)
    runs = [arena.copy(), arena.copy()]
    for run in runs:
        host_fallback.execute(thunk, run)
    assert np.array_equal(runs[0], runs[1])


def test_a_saved_forward_of_packed_sequences_is_refused():
    params = dict(batch=1, seq=20, heads=2, head_dim=3, state_size=4, cu_seqlens=[0, 7, 20], num_seqs=2)
    need = rlx_gpu.reserve_bytes({"op": "mamba2", "dtype": "f32", **params})
    for op in ("mamba2", "mamba2_backward"):
        thunk, nbytes = lay_out(op, "f32", {**with_gradients("mamba2", params), "reserve": True, "reserve_bytes": need})
        with pytest.raises(rlx_gpu.ScheduleError, match=rf"\({op}\), field 'reserve': a saved forward of packed seq"):
            rlx_gpu.load_schedule(schedule_of(thunk, nbytes))
        rlx_gpu.load_schedule(schedule_of(*lay_out(op, "f32", with_gradients("mamba2", params))))


def test_a_forward_with_a_reserve_refuses_another_chunk_length():
    _, arena, forward = _laid("f32", {})
    with pytest.raises(ValueError, match="chunks of 64, got chunk=32"):
        run_forward(forward, arena, chunk=32)
