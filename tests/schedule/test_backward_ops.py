"""The backward ops of ABI.md §9 at the schedule border: the version that has them, their fields and
cross-field rules, their footprints (written from the ABI's shapes), and where they run."""
from __future__ import annotations

import copy
import re
from dataclasses import replace

import numpy as np
import pytest

import rlx_gpu
from host_fallback.abi import regions
from rlx_gpu.conformance.cases import SMALL, lay_out, schedule_of
from rlx_gpu.launches import unsupported
from rlx_gpu.launches.limits import REFERENCE_GPU, TARGETS

BACKWARD = ("lstm_backward", "gru_backward", "rnn_backward", "selective_scan_backward", "mamba2_backward",
            "gated_delta_net_backward")


def _schedule(op: str, dtype: str = "f32", **params) -> dict:
    thunk, nbytes = lay_out(op, dtype, {**SMALL[op], **params})
    return schedule_of(thunk, nbytes)


def _refused(sched: dict, op: str, field: str, message: str) -> None:
    with pytest.raises(rlx_gpu.ScheduleError, match=rf"thunk 0 \({op}\), field '{re.escape(field)}'.*{message}"):
        rlx_gpu.load_schedule(sched)


@pytest.mark.parametrize("op", BACKWARD)
def test_a_backward_op_is_of_version_2(op):
    sched = _schedule(op)
    assert sched["abi"] == "rlx-thunks/2"
    loaded = rlx_gpu.load_schedule(sched)
    assert loaded.to_dict()["thunks"] == sched["thunks"]  # defaults not written back
    _refused(dict(sched, abi="rlx-thunks/1"), op, "op", f"{op} is an op of rlx-thunks/2")


@pytest.mark.parametrize("op", BACKWARD)
def test_missing_and_extra_fields(op):
    sched = _schedule(op)
    del sched["thunks"][0]["d_dst"]
    _refused(sched, op, "d_dst", "missing")
    sched = _schedule(op)
    sched["thunks"][0]["dst"] = 0  # the forward's output is no field of its backward
    _refused(sched, op, "dst", "unknown field")
    sched = _schedule(op)
    first_gradient = next(f for f in sched["thunks"][0] if f.startswith("d_") and f != "d_dst")
    del sched["thunks"][0][first_gradient]
    _refused(sched, op, first_gradient, "missing")


def _by_field(op: str, dtype: str = "f32", **params) -> dict:
    thunk = _schedule(op, dtype, **params)["thunks"][0]
    return {r.field: (r.shape, r.dtype, r.access) for r in regions(thunk)}


def test_lstm_footprint_with_projection_and_peepholes():
    L, D, B, S, I, H, P = 2, 2, 2, 5, 3, 4, 3  # SMALL["lstm"] with proj_size 3
    got = _by_field("lstm_backward", "bf16", proj_size=P, w_hr=True, d_w_hr=True, peepholes=True,
                    d_peepholes=True, seq_lens=[5, 1])
    w_ih = D * 4 * H * (I + (L - 1) * D * P)
    for name, shape, access in [("x", (B, S, I), "r"), ("d_x", (B, S, I), "w"), ("d_w_ih", (w_ih,), "w"),
                                ("d_w_hh", (L * D, 4 * H, P), "w"), ("d_bias", (L * D, 4 * H), "w"),
                                ("d_peepholes", (L * D, 3 * H), "w"), ("d_w_hr", (L * D, P, H), "w"),
                                ("h0", (L * D, B, P), "r"), ("c0", (L * D, B, H), "r"),
                                ("d_h0", (L * D, B, P), "rw"), ("d_c0", (L * D, B, H), "rw"),
                                ("d_dst", (B, S, D * P), "r")]:
        assert got[name] == (shape, "bf16", access), name
    assert got["seq_lens"] == ((B,), "i32", "r") and "d_seq_lens" not in got and "dst" not in got


def test_gru_and_rnn_footprints_without_carry_have_no_state_gradient():
    for op in ("gru_backward", "rnn_backward"):
        got = _by_field(op, carry=False)
        assert not {"h0", "d_h0"} & set(got), op
        assert got["d_x"] == ((2, 5, 3), "f32", "w")
    assert {"d_b_ih", "d_b_hh"} <= set(_by_field("gru_backward"))


def test_state_space_footprints_follow_state_and_param_dtypes():
    got = _by_field("selective_scan_backward", "bf16", carry_state=True, state=True, d_state=True,
                    state_dtype="f32", param_dtype="f32", d=True, d_d=True, z=True, d_z=True)
    B, S, H, N = 2, 7, 6, 4
    assert got["d_state"] == ((B, H, N), "f32", "rw") and got["state"] == ((B, H, N), "f32", "r")
    assert got["d_a"] == ((H, N), "f32", "w") and got["d_d"] == ((H,), "f32", "w")
    assert got["d_z"] == ((B, S, H), "bf16", "w") and got["d_delta"] == ((B, S, H), "bf16", "w")
    got = _by_field("gated_delta_net_backward", value_heads=4, value_size=6)
    assert got["d_v"] == ((2, 7, 4, 6), "f32", "w") and got["d_state"] == ((2, 4, 8, 6), "f32", "rw")
    assert got["d_q"] == ((2, 7, 2, 8), "f32", "w") and got["d_beta"] == ((2, 7, 4), "f32", "w")
    got = _by_field("mamba2_backward", dt_bias=True, d_dt_bias=True)
    assert got["d_dt_bias"] == ((2,), "f32", "w") and got["d_dt"] == ((2, 7, 2), "f32", "w")


RULES = [
    ("lstm_backward", dict(peepholes=True), "d_peepholes", "missing: peepholes is given"),
    ("lstm_backward", dict(d_peepholes=True), "d_peepholes", "given without peepholes"),
    ("lstm_backward", dict(proj_size=3, w_hr=True), "d_w_hr", "missing"),
    ("lstm_backward", dict(proj_size=2), "w_hr", "needs the projection weights"),  # the forward's rule
    ("selective_scan_backward", dict(d_state=True), "d_state", "given without state"),
    ("selective_scan_backward", dict(carry_state=True, state=True), "d_state", "missing"),
    ("mamba2_backward", dict(d_z=True), "d_z", "given without z"),
    ("gru_backward", dict(reverse=True), "reverse", "bidirectional = false"),
    ("rnn_backward", dict(relu=True, activations=[["tanh", 0, 0]] * 2), "relu", "must be false"),
]


@pytest.mark.parametrize("op,params,field,message", RULES, ids=[f"{r[0]}.{'.'.join(r[1])}" for r in RULES])
def test_cross_field_rules(op, params, field, message):
    sched = _schedule(op, **params)
    if "missing" in message:  # lay_out places the gradient of every input it places
        del sched["thunks"][0][field]
    _refused(sched, op, field, message)


def test_the_state_gradient_may_not_share_bytes_with_the_state():
    sched = _schedule("lstm_backward")
    sched["thunks"][0]["d_h0"] = sched["thunks"][0]["h0"]
    _refused(sched, "lstm_backward", "d_h0", "overlaps h0")


@pytest.mark.parametrize("op", ("lstm_backward", "gru_backward", "rnn_backward"))
def test_the_recurrent_backward_ops_have_device_kernels(op):
    thunk = _schedule(op)["thunks"][0]
    for target in TARGETS:
        assert unsupported(thunk, replace(REFERENCE_GPU, target=target)) is None


def test_a_backward_op_without_a_host_kernel_runs_nowhere_yet_and_says_so():
    """Every backward op the host lacks is refused by name; mamba2_backward runs there, through a schedule."""
    import host_fallback

    for op in (op for op in BACKWARD if op not in host_fallback.KERNELS):
        sched = _schedule(op)
        with pytest.raises(rlx_gpu.DeviceError, match=rf"thunk 0 \({op}, f32\): no backend runs it yet"):
            rlx_gpu.get_device("host").run(rlx_gpu.load_schedule(sched), np.zeros(sched["arena_bytes"], np.uint8))
    sched = _schedule("mamba2_backward")
    arena = np.zeros(sched["arena_bytes"], np.uint8)
    for r in regions(sched["thunks"][0]):  # every input 0.5
        if r.reads:
            arena[r.offset: r.offset + r.nbytes] = np.full(r.nbytes // 4, 0.5, np.float32).view(np.uint8)
    out = rlx_gpu.get_device("host").run(rlx_gpu.load_schedule(sched), arena)
    for r in regions(sched["thunks"][0]):
        if r.field.startswith("d_") and r.field != "d_dst":
            assert np.all(out[r.offset: r.offset + r.nbytes].view(np.float32) != 0), r.field


def test_seq_lens_of_a_backward_thunk_are_checked_before_it_runs():
    sched = _schedule("gru_backward", seq_lens=[5, 6])
    arena = np.zeros(sched["arena_bytes"], np.uint8)
    r = next(r for r in regions(sched["thunks"][0]) if r.field == "seq_lens")
    arena[r.offset: r.offset + 8] = np.array([5, 6], "<i4").view(np.uint8)
    before = copy.deepcopy(arena)
    with pytest.raises(rlx_gpu.RunError, match=r"seq_lens.*\[1\] = 6"):
        rlx_gpu.get_device("host").run(rlx_gpu.load_schedule(sched), arena)
    assert np.array_equal(arena, before)


#: The backward ops whose forward names its state even without a carried one (version 1's unused offset),
#: with the flag that carries it and the state gradients §9 defines only with that flag.
FLAGGED = [("lstm_backward", "carry", ("d_h0", "d_c0")), ("gru_backward", "carry", ("d_h0",)),
           ("rnn_backward", "carry", ("d_h0",)), ("gated_delta_net_backward", "carry_state", ("d_state",))]


@pytest.mark.parametrize("op,flag,grads", FLAGGED, ids=[f[0] for f in FLAGGED])
def test_state_gradients_exist_only_with_a_carried_state(op, flag, grads):
    """§9: without a carried state there is no d_h0 / d_c0 / d_state to give; with one each is required."""
    sched = _schedule(op, **{flag: False})
    assert not set(grads) & set(sched["thunks"][0]), "the catalog lays out no state gradient without the flag"
    given = copy.deepcopy(sched)
    for name in grads:
        given["thunks"][0][name] = 0  # the unused offset, as a version-1 producer writes it
    loaded = rlx_gpu.load_schedule(sched)
    assert loaded.to_dict()["thunks"] == sched["thunks"] and not set(grads) & {r.field for r in regions(loaded.thunks[0])}
    arena = np.random.default_rng(0).uniform(-1, 1, sched["arena_bytes"] // 4).astype(np.float32).view(np.uint8)
    host = rlx_gpu.get_device("host")
    np.testing.assert_array_equal(host.run(loaded, arena), host.run(given, arena))
    carried = _schedule(op, **{flag: True})
    del carried["thunks"][0][grads[-1]]
    _refused(carried, op, grads[-1], f"missing: {flag} = true needs it")
