"""The host's saved forward (ABI.md §9.1) of the state-space ops, what holds for each (``support.saved_forward.OPS``):
the gradients a backward reads from the reserve equal those it recomputes without one (within rounding: another
GEMM order) and change when the reserve does; writing a reserve leaves the forward's outputs as they are; the
reserve and the gradients are the same bytes on every run; a reserve of packed sequences, or of another chunk
length, is refused. What each op saves, against its recurrence: ``test_<op>_reserve.py``."""
from __future__ import annotations

import numpy as np
import pytest

import host_fallback
import rlx_gpu
from host_fallback.abi import regions
from rlx_gpu.conformance.cases import lay_out, schedule_of
from support.gradient_check import read, with_gradients
from support.saved_forward import (OPS, filled_reserve, gradients, laid_case, matches_recomputed, run_forward,
                                   without_reserve)

CASES = [(op, label, extra) for op, spec in OPS.items() for label, extra in spec.cases]
CASE_IDS = [f"{op}-{label}" for op, label, _ in CASES]


@pytest.mark.parametrize("dtype", ["f64", "f32", "bf16"])
@pytest.mark.parametrize("op, label, extra", CASES, ids=CASE_IDS)
def test_gradients_read_from_the_reserve_match_the_recomputed_ones(op, label, extra, dtype):
    spec = OPS[op]
    thunk, arena, forward = laid_case(op, dtype, extra)
    got, saved = matches_recomputed(thunk, arena, forward, spec.tol[dtype])
    if thunk["seq"] >= spec.reads_from:  # the reserve is read: other values give other gradients
        start = thunk["reserve"]
        saved[start: start + thunk["reserve_bytes"]] = 0
        assert not np.array_equal(gradients(thunk, saved)[spec.read], got[spec.read])


@pytest.mark.parametrize("op, label, extra", CASES, ids=CASE_IDS)
def test_the_forward_writing_a_reserve_gives_the_outputs_of_one_without(op, label, extra):
    spec = OPS[op]
    _, arena, forward = laid_case(op, "f64", extra)
    with_reserve, without = run_forward(forward, arena), run_forward(without_reserve(forward), arena)
    for r in regions(without_reserve(forward)):
        if r.writes:
            np.testing.assert_allclose(read(forward, with_reserve)[r.field], read(forward, without)[r.field],
                                       rtol=spec.forward_tol, atol=spec.forward_tol, err_msg=r.field)


@pytest.mark.parametrize("op", OPS)
def test_the_reserve_and_the_gradients_are_the_same_bytes_on_every_run(op):
    spec = OPS[op]
    thunk, arena, forward = laid_case(op, "f32", max(spec.cases, key=lambda case: len(case[1]))[1])
    first, second = run_forward(forward, arena), run_forward(forward, arena)
    assert np.array_equal(first, second)
    arena = filled_reserve(thunk, arena, forward)
    runs = [arena.copy(), arena.copy()]
    for run in runs:
        host_fallback.execute(thunk, run)
    assert np.array_equal(runs[0], runs[1])


@pytest.mark.parametrize("op", OPS)
def test_a_saved_forward_of_packed_sequences_is_refused(op):
    params = with_gradients(op, OPS[op].packed)
    need = rlx_gpu.reserve_bytes({"op": op, "dtype": "f32", **params})
    for name in (op, f"{op}_backward"):
        thunk, nbytes = lay_out(name, "f32", {**params, "reserve": True, "reserve_bytes": need})
        with pytest.raises(rlx_gpu.ScheduleError, match=rf"\({name}\), field 'reserve': a saved forward of packed seq"):
            rlx_gpu.load_schedule(schedule_of(thunk, nbytes))
        rlx_gpu.load_schedule(schedule_of(*lay_out(name, "f32", params)))


@pytest.mark.parametrize("op", OPS)
def test_a_forward_with_a_reserve_refuses_another_chunk_length(op):
    spec = OPS[op]
    _, arena, forward = laid_case(op, "f32", {})
    other = 96 - spec.chunk  # 32 <-> 64
    with pytest.raises(ValueError, match=f"(chunks|blocks) of {spec.chunk}, got chunk={other}"):
        run_forward(forward, arena, chunk=other)
