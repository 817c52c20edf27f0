"""ABI.md §8's shared parts: both labels, defaults, version-2 fields refused under version 1, the
cross-field rules, integer tensors and their run-time check (RunError, nothing written)."""
from __future__ import annotations

import copy
import json
import re

import numpy as np
import pytest

import host_fallback
import rlx_gpu
from host_fallback.abi import FORWARD_OPS, OPS, regions, runtime_data
from rlx_gpu.conformance.cases import lay_out, schedule_of

# the ops with version-2 fields that version 1 has too (backward ops: tests/schedule/test_backward_ops.py; an op of version 2
# alone, causal_conv1d, has no version-1 form to compare)
V2_OPS = tuple(op for op in FORWARD_OPS if OPS[op].version == 1)


def _schedule(op: str, **params) -> dict:
    from rlx_gpu.conformance.cases import SMALL
    thunk, nbytes = lay_out(op, "f32", {**SMALL[op], **params})
    return schedule_of(thunk, nbytes)


@pytest.mark.parametrize("op", V2_OPS)
def test_a_version_1_schedule_relabelled_2_is_the_same_schedule(op):
    v1 = _schedule(op)
    v2 = dict(v1, abi="rlx-thunks/2")
    one, two = rlx_gpu.load_schedule(v1), rlx_gpu.load_schedule(v2)
    assert dict(one.thunks[0].fields) == dict(two.thunks[0].fields)
    assert one.to_dict()["thunks"] == v1["thunks"]  # v2 defaults are not written back
    assert two["abi"] == "rlx-thunks/2" and one["abi"] == "rlx-thunks/1"
    arena = np.random.default_rng(0).uniform(-1, 1, v1["arena_bytes"] // 4).astype(np.float32).view(np.uint8)
    dev = rlx_gpu.get_device("host")
    assert np.array_equal(dev.run(one, arena), dev.run(two, arena))


@pytest.mark.parametrize("op,field", [(op, f.name) for op in V2_OPS for f in OPS[op].fields if f.version > 1])
def test_a_version_2_field_under_version_1_is_refused_naming_field_and_version(op, field):
    sched = _schedule(op)
    sched["thunks"][0][field] = OPS[op].defaults[field] if not callable(OPS[op].defaults[field]) else 1
    with pytest.raises(rlx_gpu.ScheduleError, match=rf"thunk 0 \({op}\), field '{field}': is a field of rlx-thunks/2"):
        rlx_gpu.load_schedule(sched)


@pytest.mark.parametrize("op", V2_OPS)
def test_a_field_given_at_its_default_is_the_field_absent(op):
    sched = dict(_schedule(op), abi="rlx-thunks/2")
    plain = rlx_gpu.load_schedule(sched)
    given = copy.deepcopy(sched)
    for name, value in OPS[op].defaults.items():
        if name in ("num_seqs", "num_slots"):  # no default value: counts (>= 1) given with their tensor
            continue
        value = value(plain.thunks[0]) if callable(value) else value
        given["thunks"][0][name] = json.loads(json.dumps(value))
    explicit = rlx_gpu.load_schedule(given)
    assert dict(explicit.thunks[0].fields) == dict(plain.thunks[0].fields)
    assert explicit.to_dict()["thunks"] == plain.to_dict()["thunks"]


RULES = [
    ("selective_scan", dict(groups=4), "groups", "does not divide hidden"),
    ("mamba2", dict(groups=3), "groups", "does not divide heads"),
    ("mamba2", dict(cu_seqlens=[0, 7], num_seqs=1), "cu_seqlens", "batch = 1"),
    ("mamba2", dict(batch=1, cu_seqlens=[0, 7]), None, None),
    ("mamba2", dict(carry_state=True), "state", "needs the state offset"),
    ("selective_scan", dict(state=True), "state", "without carry_state"),
    ("gated_delta_net", dict(state_slots=[0, 1], num_slots=2, carry_state=False), "state_slots", "carry_state"),
    ("gated_delta_net", dict(state_slots=[0, 1]), "num_slots", "needs num_slots"),
    ("gated_delta_net", dict(num_slots=3), "num_slots", "without state_slots"),
    ("gated_delta_net", dict(value_heads=3), "value_heads", "multiple of heads"),
    ("mamba2", dict(dt_limit=[0.5, 0.5]), "dt_limit", "0 <= lo < hi"),
    ("mamba2", dict(dt_limit=[-1, None]), "dt_limit", "0 <= lo < hi"),
    ("mamba2", dict(dt_limit=[0, None]), None, None),
    ("lstm", dict(reverse=True), "reverse", "bidirectional = false"),
    ("gru", dict(clip=-1.0), "clip", ">= 0"),
    ("rnn", dict(activations=[["tanh", 0, 0]]), "activations", "expected 1 per direction"),
    ("rnn", dict(activations=[["cosh", 0, 0]] * 2), "activations[0]", "unknown activation 'cosh'"),
    ("rnn", dict(relu=True, activations=[["tanh", 0, 0]] * 2), "relu", "must be false"),
    ("lstm", dict(proj_size=4, w_hr=True), "proj_size", "0 < proj_size < hidden"),
    ("lstm", dict(proj_size=2), "w_hr", "needs the projection weights"),
    ("lstm", dict(w_hr=True), "w_hr", "without proj_size"),
]


@pytest.mark.parametrize("op,params,field,message", RULES, ids=[f"{r[0]}.{'.'.join(r[1])}" for r in RULES])
def test_the_cross_field_rules(op, params, field, message):
    params = {"bidirectional": True, **params} if op in ("lstm", "gru", "rnn") else params
    sched = dict(_schedule(op, **params), abi="rlx-thunks/2")
    if params.get("carry_state") and "state" not in params:
        del sched["thunks"][0]["state"]  # lay_out places every region the thunk has, state included
    if field is None:
        rlx_gpu.load_schedule(sched)
        return
    with pytest.raises(rlx_gpu.ScheduleError, match=rf"thunk 0 \({op}\), field '{re.escape(field)}'.*{message}"):
        rlx_gpu.load_schedule(sched)


def test_state_dtype_must_be_at_least_as_wide():
    sched = _schedule("mamba2", carry_state=True, state=True)
    sched = dict(sched, abi="rlx-thunks/2")
    sched["thunks"][0]["dtype"] = "f32"
    sched["thunks"][0]["state_dtype"] = "bf16"
    with pytest.raises(rlx_gpu.ScheduleError, match=r"field 'state_dtype': bf16 cannot hold a f32 thunk"):
        rlx_gpu.load_schedule(sched)


def test_regions_follow_state_dtype_param_dtype_and_the_row_count():
    t = {**_schedule("mamba2", batch=1, cu_seqlens=[0, 2, 7], carry_state=True, state=True, state_slots=[1, 0],
                     num_slots=4)["thunks"][0], "dtype": "bf16", "state_dtype": "f32", "param_dtype": "f32"}
    by = {r.field: r for r in regions(t)}
    assert by["state"].shape == (4, 2, 4, 4) and by["state"].dtype == "f32" and by["state"].access == "rw"
    assert by["a"].dtype == "f32" and by["x"].dtype == "bf16"
    assert (by["cu_seqlens"].shape, by["cu_seqlens"].dtype) == ((3,), "i32")
    assert by["state_slots"].shape == (2,)


BAD_DATA = [
    ("mamba2", dict(batch=1, cu_seqlens=[1, 3, 7]), "cu_seqlens", 0, 1),
    ("mamba2", dict(batch=1, cu_seqlens=[0, 5, 3, 7]), "cu_seqlens", 2, 3),
    ("mamba2", dict(batch=1, cu_seqlens=[0, 3, 6]), "cu_seqlens", 2, 6),
    ("gated_delta_net", dict(state_slots=[0, 3], num_slots=3), "state_slots", 1, 3),
    ("gated_delta_net", dict(state_slots=[1, 1], num_slots=3), "state_slots", 1, 1),
    ("gated_delta_net", dict(state_slots=[-1, 1], num_slots=3), "state_slots", 0, -1),
    ("lstm", dict(seq_lens=[5, 6]), "seq_lens", 1, 6),
    ("gru", dict(seq_lens=[-2, 1]), "seq_lens", 0, -2),
]


def _int_arena(sched: dict, params: dict) -> np.ndarray:
    arena = np.random.default_rng(1).standard_normal(sched["arena_bytes"] // 4).astype(np.float32).view(np.uint8)
    arena = arena.copy()
    for r in regions(sched["thunks"][0]):
        if r.dtype == "i32":
            arena[r.offset: r.offset + r.nbytes] = np.asarray(params[r.field], "<i4").view(np.uint8)
    return arena


@pytest.mark.parametrize("op,params,field,index,value", BAD_DATA,
                         ids=[f"{r[0]}.{r[2]}[{r[3]}]={r[4]}" for r in BAD_DATA])
def test_integer_tensors_out_of_their_rules_raise_run_error_and_write_nothing(op, params, field, index, value):
    sched = dict(_schedule(op, **params), abi="rlx-thunks/2")
    arena = _int_arena(sched, params)
    before = arena.copy()
    dev = rlx_gpu.get_device("host")
    with pytest.raises(rlx_gpu.RunError, match=rf"thunk 0 \({op}\), field '{field}'\[{index}\] = {value}:"):
        dev.run(sched, arena)
    assert np.array_equal(arena, before)
    resident = dev.arena(sched)
    resident.flush()
    dev.session.write(resident.handle, 0, arena)
    with pytest.raises(rlx_gpu.RunError):
        dev.run(sched, resident)
    assert np.array_equal(dev.session.read(resident.handle, 0, arena.size), before)  # nothing written
    with pytest.raises(runtime_data.DataError):  # the host fallback entry point checks them too
        host_fallback.execute(sched["thunks"][0], arena.copy())


def test_integer_tensors_an_earlier_thunk_writes_are_checked_when_their_thunk_comes():
    params = dict(batch=1, cu_seqlens=[0, 3, 7])
    sched = dict(_schedule("mamba2", **params), abi="rlx-thunks/2")
    thunk = sched["thunks"][0]
    cu = next(r for r in regions(thunk) if r.field == "cu_seqlens")
    bad = sched["arena_bytes"]
    sched["arena_bytes"] += 64
    sched["init"] = [{"offset": bad, "b64": __import__("base64").b64encode(
        np.asarray([0, 9, 7], "<i4").tobytes()).decode()}]
    sched["thunks"] = [dict(op="copy", dtype="f32", src=bad, dst=cu.offset, nbytes=cu.nbytes), thunk]
    arena = np.zeros(sched["arena_bytes"], np.uint8)
    with pytest.raises(rlx_gpu.RunError, match=r"thunk 1 \(mamba2\), field 'cu_seqlens'\[2\] = 7"):
        rlx_gpu.get_device("host").run(sched, arena)


def test_the_tensors_table_spells_integer_tensors_i32():
    params = dict(seq_lens=[5, 2])
    sched = dict(_schedule("gru", **params), abi="rlx-thunks/2")
    r = next(r for r in regions(sched["thunks"][0]) if r.field == "seq_lens")
    sched["tensors"] = {"lengths": {"offset": r.offset, "dtype": "i32", "shape": [2]}}
    assert rlx_gpu.load_schedule(sched).tensors["lengths"].nbytes == 8
    sched["tensors"]["lengths"]["dtype"] = "i64"
    with pytest.raises(rlx_gpu.ScheduleError, match=r"expected one of f32, f16, bf16, f64, i32"):
        rlx_gpu.load_schedule(sched)


def test_a_nested_body_takes_its_holders_label():
    from rlx_gpu.conformance.cases import scan_case
    fields = scan_case("scan", "f32")
    thunk, nbytes = lay_out("scan", "f32", fields)
    sched = schedule_of(thunk, nbytes)
    sched["thunks"][0]["body"]["abi"] = "rlx-thunks/2"
    with pytest.raises(rlx_gpu.ScheduleError, match=r"nested body takes the label of the schedule that holds it"):
        rlx_gpu.load_schedule(sched)


#: Every number of ABI.md §8 with a bound (a fill value is data: NaN there is a value to write).
KNOBS = [
    ("lstm", "clip", lambda v: v),
    ("gru", "clip", lambda v: v),
    ("rnn", "clip", lambda v: v),
    ("gated_delta_net", "scale", lambda v: v),
    ("mamba2", "dt_limit", lambda v: [v, None]),
    ("mamba2", "dt_limit", lambda v: [0.0, v]),
    ("lstm", "activations", lambda v: [["affine", v, 0.0]] * 6),
    ("lstm", "activations", lambda v: [["affine", 1.0, v]] * 6),
]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("op,field,given", KNOBS, ids=[f"{k[0]}.{k[1]}{i}" for i, k in enumerate(KNOBS)])
def test_a_non_finite_knob_is_refused_naming_thunk_field_and_value(op, field, given, value):
    sched = dict(_schedule(op), abi="rlx-thunks/2")
    sched["thunks"][0][field] = given(value)
    with pytest.raises(rlx_gpu.ScheduleError, match=rf"thunk 0 \({op}\), field '{field}(\[\d\])*'.*{value}"):
        rlx_gpu.load_schedule(sched)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_fill_value_may_be_non_finite(value):
    """A fill value is data, not a knob: NaN and inf are values to write."""
    out = rlx_gpu.get_device("host").run(schedule_of(dict(op="fill", dtype="f32", dst=0, n=4, value=value), 16))
    np.testing.assert_array_equal(out.view(np.float32), np.full(4, value, np.float32))


def test_causal_conv1d_is_an_op_of_version_2_with_its_width_rule():
    sched = _schedule("causal_conv1d")
    assert sched["abi"] == "rlx-thunks/2"
    with pytest.raises(rlx_gpu.ScheduleError, match=r"thunk 0 \(causal_conv1d\), field 'op': .*rlx-thunks/2"):
        rlx_gpu.load_schedule(dict(sched, abi="rlx-thunks/1"))
    for width in (1, 9):
        with pytest.raises(rlx_gpu.ScheduleError, match=rf"field 'width': {width} is outside 2 <= width <= 8"):
            rlx_gpu.load_schedule(_schedule("causal_conv1d", width=width))
    with pytest.raises(rlx_gpu.ScheduleError, match=r"field 'state_slots': state slots need carry_state"):
        rlx_gpu.load_schedule(_schedule("causal_conv1d", state_slots=[1, 0], num_slots=2))
