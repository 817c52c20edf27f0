"""mamba3 (ABI.md §11) at the border: an op of version 2 alone, its cross-field rules (even state_size,
1 <= num_angles <= N/2, groups dividing heads, the element types of dt_dtype and state_dtype, the four states
together with carry_state), its default state type, its footprint and the run-time checks of its integer
tensors."""
from __future__ import annotations

import numpy as np
import pytest

import rlx_gpu
from host_fallback.abi import OPS, complete, regions
from rlx_gpu.conformance.cases import SMALL, lay_out, schedule_of

CARRIED = dict(carry_state=True, angle_state=True, state=True, k_state=True, v_state=True)


def _schedule(dtype: str = "f32", **params) -> dict:
    thunk, nbytes = lay_out("mamba3", dtype, {**SMALL["mamba3"], **params})
    return schedule_of(thunk, nbytes)


def test_mamba3_is_an_op_of_version_2():
    sched = _schedule()
    assert sched["abi"] == "rlx-thunks/2"
    with pytest.raises(rlx_gpu.ScheduleError, match=r"thunk 0 \(mamba3\), field 'op': .*rlx-thunks/2"):
        rlx_gpu.load_schedule(dict(sched, abi="rlx-thunks/1"))
    rlx_gpu.load_schedule(_schedule(**CARRIED))


@pytest.mark.parametrize("params,field,message", [
    (dict(state_size=7), "state_size", "7 is odd"),
    (dict(num_angles=4), "num_angles", r"4 is outside 1 <= num_angles <= state_size/2 = 3"),
    (dict(groups=4, heads=6), "groups", "4 does not divide heads = 6"),
    (dict(dt_dtype="f16"), "dt_dtype", "f16 cannot hold a f32 thunk's values"),
    (dict(state_dtype="bf16", **CARRIED), "state_dtype", "bf16 cannot hold mamba3's state"),
])
def test_a_rule_names_the_field_and_the_value(params, field, message):
    with pytest.raises(rlx_gpu.ScheduleError, match=rf"thunk 0 \(mamba3\), field '{field}': {message}"):
        rlx_gpu.load_schedule(_schedule(**params))


def test_the_four_states_come_with_carry_state_and_only_with_it():
    sched = _schedule(**CARRIED)
    del sched["thunks"][0]["k_state"]
    with pytest.raises(rlx_gpu.ScheduleError, match=r"field 'k_state': missing: carry_state = true needs all four"):
        rlx_gpu.load_schedule(sched)
    with pytest.raises(rlx_gpu.ScheduleError, match=r"field 'angle_state': given without carry_state"):
        rlx_gpu.load_schedule(_schedule(angle_state=True))


@pytest.mark.parametrize("dtype,state", [("bf16", "f32"), ("f16", "f32"), ("f32", "f32"), ("f64", "f64")])
def test_the_states_default_to_f32_and_to_f64_for_an_f64_thunk(dtype, state):
    thunk, _ = lay_out("mamba3", dtype, {**SMALL["mamba3"], **CARRIED})
    by_field = {r.field: r for r in regions(thunk)}
    assert complete(thunk)["state_dtype"] == state
    assert {by_field[f].dtype for f in ("angle_state", "state", "k_state", "v_state")} == {state}
    assert by_field["state"].shape == (2, 2, 3, 6) and by_field["angle_state"].shape == (2, 2, 2)


def test_the_backward_op_has_a_gradient_of_each_state():
    names = OPS["mamba3_backward"].field_names
    assert {"d_angle_state", "d_state", "d_k_state", "d_v_state", "d_q_bias", "d_z"} <= set(names)


def test_a_slot_used_twice_is_refused_before_anything_is_written():
    thunk, nbytes = lay_out("mamba3", "f32", {**SMALL["mamba3"], **CARRIED, "state_slots": [1, 1], "num_slots": 3})
    slots = next(r for r in regions(thunk) if r.field == "state_slots")
    arena = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    arena[slots.offset:slots.offset + 8] = np.array([1, 1], "<i4").view(np.uint8)
    before = arena.copy()
    with pytest.raises(rlx_gpu.RlxError, match=r"field 'state_slots'\[1\] = 1: slot already used"):
        rlx_gpu.get_device("host").run(schedule_of(thunk, nbytes), arena)
    assert np.array_equal(arena, before)
