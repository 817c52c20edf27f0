"""The host's selective_scan with a saved forward (ABI.md §9.1): a training forward writes the reserve (the
state leaving every chunk of 32 tokens), the backward reads those states instead of its forward pass over the
chunks. Its gradients against the backward that recomputes, the forward's outputs unchanged by writing it,
the states against the step recurrence's, and packed sequences refused."""
from __future__ import annotations

import numpy as np
import pytest

import rlx_gpu
from host_fallback.abi import regions
from host_fallback.ssm import reserve_views
from rlx_gpu.conformance.cases import lay_out, schedule_of
from support.gradient_check import read, with_gradients
from support.saved_forward import (decaying_sampler, filled_reserve, gradients, laid_with_reserve, matches_recomputed,
                                   run_forward, without_reserve)

BASE = dict(batch=2, seq=100, hidden=6, state_size=4)  # four chunks, the last one partial
CASES = [
    ("base", {}),
    ("one_chunk", dict(seq=20)),
    ("groups.d.z", dict(groups=2, d=True, z=True)),
    ("knobs.carry.slots", dict(delta_bias=True, delta_softplus=True, carry_state=True, state=True,
                               state_slots=[2, 0], num_slots=3)),
]
IDS = [label for label, _ in CASES]
TOL = {"f64": 1e-12, "f32": 1e-5, "bf16": 1e-2}


_SAMPLE = decaying_sampler("delta")


def _laid(dtype: str, extra: dict) -> tuple[dict, np.ndarray, dict]:
    return laid_with_reserve("selective_scan", dtype, {**BASE, **extra}, _SAMPLE)


@pytest.mark.parametrize("dtype", ["f64", "f32", "bf16"])
@pytest.mark.parametrize("extra", [e for _, e in CASES], ids=IDS)
def test_gradients_read_from_the_reserve_match_the_recomputed_ones(extra, dtype):
    thunk, arena, forward = _laid(dtype, extra)
    got, saved = matches_recomputed(thunk, arena, forward, TOL[dtype])
    if thunk["seq"] > 32:  # the reserve is read: others states give other gradients
        start = thunk["reserve"]
        saved[start: start + thunk["reserve_bytes"]] = 0
        assert not np.array_equal(gradients(thunk, saved)["d_c"], got["d_c"])


@pytest.mark.parametrize("extra", [e for _, e in CASES], ids=IDS)
def test_the_forward_writing_a_reserve_gives_the_outputs_of_one_without(extra):
    _, arena, forward = _laid("f64", extra)
    with_reserve, without = run_forward(forward, arena), run_forward(without_reserve(forward), arena)
    for r in regions(without_reserve(forward)):
        if r.writes:
            np.testing.assert_allclose(read(forward, with_reserve)[r.field], read(forward, without)[r.field],
                                       rtol=1e-13, atol=1e-13, err_msg=r.field)


def test_the_saved_states_are_the_recurrences_after_every_32_tokens():
    thunk, arena, forward = _laid("f64", CASES[2][1])
    states = reserve_views(thunk, filled_reserve(thunk, arena, forward, path="step"))["states"]
    values = read(thunk, arena)
    delta, x, a = values["delta"], values["x"], values["a"]
    bsz, seq, hidden = x.shape
    b = np.repeat(values["b"], hidden // 2, axis=2)  # [B, S, H, N]: each channel's group
    h = np.zeros((bsz, hidden, a.shape[1]))
    for t in range(seq):
        h = np.exp(delta[:, t, :, None] * a) * h + (delta[:, t] * x[:, t])[..., None] * b[:, t]
        if (t + 1) % 32 == 0 or t + 1 == seq:
            np.testing.assert_allclose(states[:, t // 32], h, rtol=1e-12, atol=1e-12)


def test_a_saved_forward_of_packed_sequences_is_refused():
    params = dict(batch=1, seq=20, hidden=4, state_size=4, cu_seqlens=[0, 7, 20], num_seqs=2)
    need = rlx_gpu.reserve_bytes({"op": "selective_scan", "dtype": "f32", **params})
    for op in ("selective_scan", "selective_scan_backward"):
        thunk, nbytes = lay_out(op, "f32", {**with_gradients("selective_scan", params), "reserve": True,
                                            "reserve_bytes": need})
        with pytest.raises(rlx_gpu.ScheduleError, match=rf"\({op}\), field 'reserve': a saved forward of packed seq"):
            rlx_gpu.load_schedule(schedule_of(thunk, nbytes))
