"""mamba3 (ABI.md §11) on an OpenCL CPU implementation at both kernel targets: kernels/mamba3.cl.

The catalog's cases are small (head_dim <= 5, state_size <= 10): one work-item, one block of rows. These shapes
reach what they do not: several work-items of M3_PB rows sharing a head's angle and key (cpu), several blocks of
rows walking the sequence in turn in one work-group and every state-size variant's lane count (gpu), with every
field at once, against the float64 reference and the host; a decode step on a slot pool is one launch; the same
thunk run twice gives the same bytes; two calls chained through the four states equal one call. mamba3_backward
(kernels/mamba3_backward.cl): several blocks of state rows and chunks of checkpoints, every field, an empty packed
sequence, against the float64 reference and the host backward, the same bytes twice.
"""
from __future__ import annotations

import numpy as np
import pytest

from host_fallback.abi import complete
from rlx_gpu import launches
from rlx_gpu.conformance import runner
from rlx_gpu.conformance.catalog import Case
from rlx_gpu.launches.limits import REFERENCE_GPU, DeviceLimits
from rlx_gpu.runtime.config import default_config_path, load_config
from support.opencl_cpu import needs_opencl_cpu, passes_and_runs_the_same_bytes_twice

CONFIG = load_config(default_config_path())
CARRIED = dict(carry_state=True, angle_state=True, state=True, k_state=True, v_state=True)
EVERY = dict(groups=2, q_bias=True, k_bias=True, d=True, z=True)
#: the step recurrence forced (a prefill from M3C_MIN_SEQ tokens on takes the chunked form otherwise:
#: tests/devices/test_mamba3_chunked_device.py)
STEP = {"ssm_kernel": "lanes"}

#: name -> (dtype, params): more rows than one item / one block holds, odd num_angles, every field
SHAPES = {
    "rows-40-every-field-varlen-slots": ("f32", dict(batch=1, seq=23, heads=4, head_dim=40, state_size=40,
                                                     num_angles=7, cu_seqlens=[0, 9, 9, 23], num_seqs=3,
                                                     state_slots=[2, 0, 3], num_slots=4, **CARRIED, **EVERY)),
    "state-256-bf16": ("bf16", dict(batch=2, seq=5, heads=2, head_dim=20, state_size=256, num_angles=128,
                                    **CARRIED, d=True, z=True)),
    "decode-slots-f16": ("f16", dict(batch=3, seq=1, heads=4, head_dim=64, state_size=32, num_angles=8,
                                     state_slots=[4, 1, 2], num_slots=5, **CARRIED, **EVERY)),
    "f64-rows-17": ("f64", dict(batch=2, seq=12, heads=2, head_dim=17, state_size=12, num_angles=3, **CARRIED,
                                q_bias=True, z=True)),
}
#: prefills (seq >= M3_MIN_SEQ): at the gpu target a head's blocks of rows in groups of their own, and with carried
#: states a second launch for the final angle and key
PREFILLS = {
    "prefill-rows-40-every-field-varlen-slots": ("f32", dict(batch=1, seq=80, heads=2, head_dim=40, state_size=40,
                                                             num_angles=9, cu_seqlens=[0, 30, 30, 80], num_seqs=3,
                                                             state_slots=[1, 3, 0], num_slots=4, **CARRIED, **EVERY)),
    "prefill-rows-24-bf16-no-carry": ("bf16", dict(batch=2, seq=70, heads=2, head_dim=24, state_size=64,
                                                   num_angles=16, d=True)),
}

@pytest.mark.parametrize("lim", [REFERENCE_GPU, DeviceLimits(1024, 1 << 20, True)], ids=["gpu", "cpu"])
def test_every_shape_is_one_launch_and_reaches_past_one_item_or_block(lim):
    for dtype, params in SHAPES.values():
        thunk = complete(runner.lay_out(Case("mamba3", dtype, params)).thunk)
        assert launches.unsupported(thunk, lim) is None
        (launch,) = launches.plan(thunk, lim, **STEP).launches
        if lim.target == "cpu":
            assert launch.local_size[0] * lim.tune("M3_PB") >= params["head_dim"]
    big = complete(runner.lay_out(Case("mamba3", "f32", SHAPES["rows-40-every-field-varlen-slots"][1])).thunk)
    (cpu,) = launches.plan(big, DeviceLimits(1024, 1 << 20, True), **STEP).launches
    (gpu,) = launches.plan(big, REFERENCE_GPU, **STEP).launches
    assert cpu.local_size[0] > 1 and gpu.local_size[0] // dict(gpu.defines)["SSM_L"] < big["head_dim"]


def test_a_prefill_splits_a_head_over_groups_at_the_gpu_target_and_writes_the_final_angle_and_key_after():
    """The step recurrence's prefill (forced: from M3C_MIN_SEQ tokens on the chunked form runs)."""
    carried, free = (complete(runner.lay_out(Case("mamba3", dt, p)).thunk) for dt, p in PREFILLS.values())
    main, final = launches.plan(carried, REFERENCE_GPU, **STEP).launches
    rows = main.local_size[0] // dict(main.defines)["SSM_L"]
    assert (main.kernel, final.kernel) == ("mamba3_lanes", "mamba3_lanes_final")
    assert main.groups[0] == carried["num_seqs"] * carried["heads"] * -(-carried["head_dim"] // rows) > 6
    assert [launch.kernel for launch in launches.plan(free, REFERENCE_GPU, **STEP).launches] == ["mamba3_lanes"]
    decode = complete(runner.lay_out(Case("mamba3", "f32", dict(PREFILLS["prefill-rows-40-every-field-varlen-slots"][1],
                                                                seq=2, cu_seqlens=[0, 1, 1, 2]))).thunk)
    (one,) = launches.plan(decode, REFERENCE_GPU, **STEP).launches
    assert one.groups[0] == decode["num_seqs"] * decode["heads"]


def test_a_wider_state_or_step_input_runs_on_the_host_and_says_why():
    params = dict(SHAPES["f64-rows-17"][1])
    for field in ("state_dtype", "dt_dtype", "param_dtype"):
        thunk = complete(runner.lay_out(Case("mamba3", "f32", dict(params, **{field: "f64"}))).thunk)
        assert f"{field}=f64 runs on the host" in launches.unsupported(thunk, REFERENCE_GPU)


@needs_opencl_cpu
@pytest.mark.parametrize("name", list(SHAPES) + list(PREFILLS))
def test_the_shape_matches_the_float64_reference_and_runs_the_same_bytes_twice(cpu_session, host, name):
    dtype, params = {**SHAPES, **PREFILLS}[name]
    case = Case("mamba3", dtype, params, options=STEP, seed=7)
    passes_and_runs_the_same_bytes_twice(cpu_session, host, case)


#: the token-major fields of mamba3, which a call over a later stretch of tokens reads further along
TOKEN_FIELDS = ("q", "k", "v", "adt", "dt", "trap", "angles", "z", "dst")


@needs_opencl_cpu
def test_two_calls_chained_through_the_states_equal_one_call(cpu_session):
    """Tokens 0..69 then 70..149 of one batch row (the second call reading what the first wrote into the four
    states, on the same arena; at the gpu target each a prefill split over groups) give the outputs and final
    states of one call over 0..149, to f32 rounding."""
    seq, split = 150, 70
    params = dict(batch=1, seq=seq, heads=2, head_dim=40, state_size=64, num_angles=13, **CARRIED, **EVERY)
    laid = runner.lay_out(Case("mamba3", "f32", params, seed=3))
    whole = cpu_session.upload(laid.arena)
    cpu_session.launch(laid.thunk, whole, **STEP)
    want = cpu_session.read(whole, 0, laid.arena.size)
    arena = cpu_session.upload(laid.arena)
    per_token = {r.field: r.nbytes // seq for r in laid.regions if r.field in TOKEN_FIELDS}
    for first, end in ((0, split), (split, seq)):
        part = dict(laid.thunk, seq=end - first, **{f: laid.thunk[f] + first * n for f, n in per_token.items()})
        cpu_session.launch(part, arena, **STEP)
    got = cpu_session.read(arena, 0, laid.arena.size)
    for field in ("dst", "angle_state", "state", "k_state", "v_state"):
        mine, ref = laid.view(got, field), laid.view(want, field)
        if field == "angle_state":  # compared modulo 2pi
            mine, ref = np.cos(mine), np.cos(ref)
        np.testing.assert_allclose(mine, ref, rtol=1e-4, atol=1e-5, err_msg=field)


#: the four state gradients, and every optional input's gradient, of a mamba3_backward case
D_CARRIED = dict(CARRIED, d_angle_state=True, d_state=True, d_k_state=True, d_v_state=True)
D_EVERY = dict(EVERY, d_q_bias=True, d_k_bias=True, d_d=True, d_z=True)
#: name -> (dtype, params): more state rows than one block (blocks at both targets), more tokens than one chunk of
#: checkpoints (SSMB_Q), an empty packed sequence between two, every field; then 16-bit storage with f32 fields
BACKWARD = {
    "backward-every-field-varlen-slots": ("f32", dict(batch=1, seq=41, heads=4, head_dim=9, state_size=12,
                                                      num_angles=5, cu_seqlens=[0, 34, 34, 41], num_seqs=3,
                                                      state_slots=[2, 0, 3], num_slots=4, **D_CARRIED, **D_EVERY)),
    "backward-bf16-f32-fields": ("bf16", dict(batch=2, seq=6, heads=2, head_dim=6, state_size=16, num_angles=8,
                                              dt_dtype="f32", param_dtype="f32", **D_CARRIED, d=True, d_d=True,
                                              z=True, d_z=True, q_bias=True, d_q_bias=True)),
}


@pytest.mark.parametrize("lim", [REFERENCE_GPU, DeviceLimits(1024, 1 << 20, True)], ids=["gpu", "cpu"])
def test_the_backward_runs_on_the_device_in_blocks_of_rows_then_fixed_order_sums(lim):
    thunk = complete(runner.lay_out(Case("mamba3_backward", *BACKWARD["backward-every-field-varlen-slots"])).thunk)
    assert launches.unsupported(thunk, lim) is None
    plan = launches.plan(thunk, lim)
    kernels = [launch.kernel for launch in plan.launches]
    assert kernels == ["mamba3_backward_turn", "mamba3_backward_walk", "mamba3_backward_tokens",
                       "mamba3_backward_angles"] + ["mamba3_backward_reduce"] * 5  # d_q d_k d_q_bias d_k_bias d_d
    assert "block(s)" in plan.notes[0] and not plan.notes[0].startswith("checkpoints every 32 steps, 1 block")
    wide = complete(runner.lay_out(Case("mamba3_backward", "f32", dict(thunk, state_dtype="f64"))).thunk)
    assert "state_dtype=f64 runs on the host" in launches.unsupported(wide, lim)


@needs_opencl_cpu
@pytest.mark.parametrize("name", list(BACKWARD))
def test_the_backward_matches_the_reference_and_the_host_and_runs_the_same_bytes_twice(cpu_session, host, name):
    case = Case("mamba3_backward", *BACKWARD[name], seed=5)
    passes_and_runs_the_same_bytes_twice(cpu_session, host, case)
