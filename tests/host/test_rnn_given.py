"""The host's lstm/gru/rnn on the caller's arrays (``implementations.GIVEN``, the kernels' side of
``runtime.given``): a training forward writes ``dst`` and its saved forward (reserve) into the arrays given in
place of their arena views, the backward reads the reserve and ``d_dst`` where the caller holds them. The same
bits as the runs through the arena, whose own bytes of those fields are never touched (they hold NaN here: a
read of them would show in every gradient), and an array that does not fit refused before anything runs."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import host_fallback
import rlx_gpu
from host_fallback.abi import regions
from host_fallback.arena import STORAGE, view
from support.rnn_backward_cases import backward_params, laid_backward

CASES = [("lstm", "f32", {}), ("gru", "f32", dict(seq_lens=[5, 2, 0])), ("rnn", "f64", dict(clip=0.5))]


def _region(thunk: dict, field: str):
    return next(r for r in regions(thunk) if r.field == field)


def _poisoned(arena: np.ndarray, *places) -> np.ndarray:
    """A copy of ``arena`` with 0xFF (NaN in every float type) over each region of ``places``."""
    out = arena.copy()
    for r in places:
        out[r.offset: r.offset + r.nbytes] = 0xFF
    return out


def _given_array(r) -> np.ndarray:
    """A caller's array for the region ``r``, zeros as the arena's (the slots of a reserve the op does not use are
    left as they were): the reserve as float32s (as a torch frontend holds it)."""
    if r.dtype == "u8":
        return np.zeros(r.nbytes // 4, np.float32)
    return np.zeros(r.shape, STORAGE[r.dtype])


@pytest.mark.parametrize("op,dtype,extra", CASES, ids=[c[0] for c in CASES])
def test_a_training_step_on_the_callers_arrays_gives_the_arena_runs_bits(op, dtype, extra):
    params = backward_params(op, **extra)
    need = rlx_gpu.reserve_bytes({"op": op, "dtype": dtype, **params})
    backward, arena = laid_backward(op, dtype, {**params, "reserve": True, "reserve_bytes": need})
    forward = {k: v for k, v in backward.items() if not k.startswith("d_")}
    forward.update(op=op, dst=-(-arena.size // 16) * 16)  # past the backward's arena: it updates no input
    dst, reserve, d_dst = _region(forward, "dst"), _region(forward, "reserve"), _region(backward, "d_dst")
    longer = np.zeros(dst.offset + dst.nbytes, np.uint8)
    longer[:arena.size] = arena
    longer[reserve.offset: reserve.offset + reserve.nbytes] = 0  # as the caller's array (the backward's inputs fill it)

    through_arena = longer.copy()
    host_fallback.execute(forward, through_arena)
    work = _poisoned(longer, dst, reserve)
    given = {dst.offset: _given_array(dst), reserve.offset: _given_array(reserve)}
    assert host_fallback.bound_kernel(forward, {})(work, given) is True
    assert np.array_equal(given[dst.offset].view(np.uint8).ravel(), through_arena[dst.offset: dst.offset + dst.nbytes])
    kept = through_arena[reserve.offset: reserve.offset + reserve.nbytes]
    assert np.array_equal(given[reserve.offset].view(np.uint8), kept)
    assert np.all(work[reserve.offset: reserve.offset + reserve.nbytes] == 0xFF)  # the arena's reserve untouched

    want = arena.copy()
    want[reserve.offset: reserve.offset + reserve.nbytes] = kept
    host_fallback.execute(backward, want)
    got = _poisoned(arena, reserve, d_dst)
    caller_d_dst = view(arena, d_dst.offset, d_dst.dtype, d_dst.shape).copy()
    run = host_fallback.bound_kernel(backward, {})
    assert run(got, {reserve.offset: given[reserve.offset], d_dst.offset: caller_d_dst}) is True
    for r in regions(backward):
        if r.writes:
            assert np.array_equal(got[r.offset: r.offset + r.nbytes], want[r.offset: r.offset + r.nbytes]), r.field


def test_an_array_that_does_not_fit_is_refused_before_anything_runs():
    params = backward_params("lstm")
    need = rlx_gpu.reserve_bytes({"op": "lstm", "dtype": "f32", **params})
    backward, arena = laid_backward("lstm", "f32", {**params, "reserve": True, "reserve_bytes": need})
    reserve, d_dst = _region(backward, "reserve"), _region(backward, "d_dst")
    run, before = host_fallback.bound_kernel(backward, {}), arena.copy()
    for given in ({reserve.offset: np.zeros(need // 4 - 1, np.float32)},  # short
                  {d_dst.offset: np.zeros(d_dst.shape, np.float64)},  # not its storage dtype
                  {d_dst.offset + 4: np.zeros(d_dst.shape, np.float32)}):  # at no field's offset
        assert run(arena, given) is False
    assert np.array_equal(arena, before)


def test_infinities_on_given_arrays_warn_nothing():
    """NaN and inf are data on the caller's arrays as on the arena's: no NumPy warning reaches the caller."""
    params = backward_params("gru", clip=0.5)
    need = rlx_gpu.reserve_bytes({"op": "gru", "dtype": "f32", **params})
    backward, arena = laid_backward("gru", "f32", {**params, "reserve": True, "reserve_bytes": need})
    reserve, d_dst = _region(backward, "reserve"), _region(backward, "d_dst")
    caller_d_dst = np.full(d_dst.shape, np.inf, np.float32)
    caller_d_dst[..., ::2] = -np.inf  # inf - inf in the gradient sums: NaN
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert host_fallback.bound_kernel(backward, {})(arena, {reserve.offset: _given_array(reserve),
                                                                d_dst.offset: caller_d_dst}) is True
