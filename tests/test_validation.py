"""Table-driven malformed schedules: every failure names the thunk, op and field, and nothing launches."""
from __future__ import annotations

import copy

import pytest

import rlx_gpu
from host_fallback.layout import regions
from rlx_gpu.schedule.ops import SPECS
from rlx_gpu.conformance.cases import lay_out, schedule_of


def _case(op: str, dtype: str = "f32") -> dict:
    thunk, arena_bytes = lay_out(op, dtype)
    return schedule_of(thunk, arena_bytes)


def _bad_values(op: str, field) -> list[tuple[str, object]]:
    """(what, value) pairs that must be rejected for one field."""
    wrong_type = {"offset": "12", "pos": 2.5, "count": "3", "bool": 1, "float": "x", "enum": 7, "dtype": "f8",
                  "elem_size": 3, "shape": "3x5", "strides": [1.5, 1], "offsets": [-1], "xs": [[0, 0]],
                  "bcast": [[0]], "pairs": [[0, 0, 0]], "schedule": [], "opt_schedule": 5}[field.kind]
    out = [("wrong type", wrong_type)]
    if field.kind in ("offset", "pos", "count"):
        out.append(("negative", -4))
    return out


CASES = [(op, f) for op, spec in SPECS.items() for f in spec.fields]


@pytest.mark.parametrize("op,field", CASES, ids=[f"{op}.{f.name}" for op, f in CASES])
def test_each_field_rejects_wrong_type_and_negative(op, field):
    for what, value in _bad_values(op, field):
        sched = _case(op)
        sched["thunks"][0][field.name] = value
        with pytest.raises(rlx_gpu.ScheduleError) as err:
            rlx_gpu.load_schedule(sched)
        message = str(err.value)
        assert f"thunk 0 ({op}), field '{field.name}" in message, (what, message)


def _offset_regions(op: str):
    thunk = _case(op)["thunks"][0]
    return [r for r in regions(thunk) if "[" not in r.field and r.nbytes > 0]


OFFSET_CASES = [(op, r.field, r.dtype) for op in SPECS for r in _offset_regions(op)]


@pytest.mark.parametrize("op,field,dtype", OFFSET_CASES, ids=[f"{o}.{f}" for o, f, _ in OFFSET_CASES])
def test_offsets_misaligned_or_outside_the_arena(op, field, dtype):
    sched = _case(op)
    if dtype != "u8":  # byte-level slots have no alignment
        bad = copy.deepcopy(sched)
        bad["thunks"][0][field] += 2
        with pytest.raises(rlx_gpu.ScheduleError, match=rf"thunk 0 \({op}\), field '{field}': offset \d+ is not a multiple"):
            rlx_gpu.load_schedule(bad)
    bad = copy.deepcopy(sched)
    bad["thunks"][0][field] = bad["arena_bytes"] - 4 if dtype == "u8" else bad["arena_bytes"]
    with pytest.raises(rlx_gpu.ScheduleError, match=rf"thunk 0 \({op}\), field '{field}': bytes .* outside the arena"):
        rlx_gpu.load_schedule(bad)


@pytest.mark.parametrize("op", list(SPECS))
def test_unknown_missing_and_extra_fields(op):
    sched = _case(op)
    sched["thunks"][0]["colour"] = 3
    with pytest.raises(rlx_gpu.ScheduleError, match=rf"thunk 0 \({op}\), field 'colour': unknown field"):
        rlx_gpu.load_schedule(sched)
    sched = _case(op)
    name = SPECS[op].fields[0].name
    del sched["thunks"][0][name]
    with pytest.raises(rlx_gpu.ScheduleError, match=rf"thunk 0 \({op}\), field '{name}': missing"):
        rlx_gpu.load_schedule(sched)


def test_unknown_op_dtype_and_abi():
    sched = _case("lstm")
    sched["thunks"][0]["op"] = "transformer"
    with pytest.raises(rlx_gpu.ScheduleError, match=r"thunk 0 \(transformer\), field 'op': unknown op"):
        rlx_gpu.load_schedule(sched)
    sched = _case("lstm")
    sched["thunks"][0]["dtype"] = "f8"
    with pytest.raises(rlx_gpu.ScheduleError, match=r"field 'dtype': expected one of f32, f16, bf16, f64, got 'f8'"):
        rlx_gpu.load_schedule(sched)
    sched = _case("lstm")
    sched["abi"] = "rlx-thunks/2"
    with pytest.raises(rlx_gpu.ScheduleError, match=r"unknown abi 'rlx-thunks/2'"):
        rlx_gpu.load_schedule(sched)


@pytest.mark.parametrize("op,field", [("lstm", "w_ih"), ("gru", "b_hh"), ("rnn", "w_hh"), ("lstm", "c0")])
def test_recurrent_element_counts_name_the_input(op, field):
    sched = _case(op)
    thunk = sched["thunks"][0]
    expected = next(r for r in regions(thunk) if r.field == field)
    count = expected.nbytes // 4
    sched["tensors"] = {"weights": {"offset": thunk[field], "dtype": "f32", "shape": [count - 1]}}
    with pytest.raises(rlx_gpu.ScheduleError,
                       match=rf"field '{field}': input 'weights' has {count - 1} elements, expected {count}"):
        rlx_gpu.load_schedule(sched)
    sched["tensors"]["weights"]["shape"] = [count]
    rlx_gpu.load_schedule(sched)


def test_scan_family_cross_field_rules():
    sched = _case("scan")
    sched["thunks"][0]["num_checkpoints"] = sched["thunks"][0]["length"] + 1
    with pytest.raises(rlx_gpu.ScheduleError, match=r"field 'num_checkpoints': 7 checkpoints exceed length 6"):
        rlx_gpu.load_schedule(sched)
    sched = _case("scan_backward")
    sched["thunks"][0]["forward_body"] = None
    with pytest.raises(rlx_gpu.ScheduleError, match=r"field 'forward_body': 2 checkpoints of 6 steps need"):
        rlx_gpu.load_schedule(sched)
    sched = _case("scan")
    body = sched["thunks"][0]["body"]
    body["tensors"] = {n: {"offset": 0, "dtype": "f32", "shape": [4]} for n in ("h", "x", "extra", "out")}
    body["inputs"], body["outputs"] = ["h", "x", "extra"], ["out"]
    with pytest.raises(rlx_gpu.ScheduleError, match=r"body takes 3 inputs \(h, x, extra\), expected 2"):
        rlx_gpu.load_schedule(sched)
    body["inputs"] = ["h", "x"]
    body["tensors"]["out"] = {"offset": sched["thunks"][0]["body_output_off"], "dtype": "f32", "shape": [3]}
    with pytest.raises(rlx_gpu.ScheduleError, match=r"field 'body_output_off': body output 'out' is 12 bytes at "
                                                    r"body_output_off=32, but the step writes 16 \(carry_bytes=16\)"):
        rlx_gpu.load_schedule(sched)


def test_scan_backward_xs_rules():
    sched = _case("scan_backward_xs")
    sched["thunks"][0]["xs_idx"] = 1
    with pytest.raises(rlx_gpu.ScheduleError, match=r"field 'xs_idx': 1 names no xs input; there are 1"):
        rlx_gpu.load_schedule(sched)
    sched = _case("scan_backward_xs")
    sched["thunks"][0]["per_step_bytes"] = 8
    with pytest.raises(rlx_gpu.ScheduleError, match=r"field 'per_step_bytes': 8 differs from xs input 0's 16"):
        rlx_gpu.load_schedule(sched)


def test_nested_body_errors_name_the_path():
    sched = _case("scan")
    sched["thunks"][0]["body"]["thunks"][0]["fn"] = "pow"
    with pytest.raises(rlx_gpu.ScheduleError, match=r"thunk 0 \(scan\), field 'body' → thunk 0 \(binary\), field 'fn'"):
        rlx_gpu.load_schedule(sched)


def test_copy_ranges_must_not_overlap():
    sched = schedule_of(dict(op="copy", dtype="f32", src=0, dst=8, nbytes=16), 64)
    with pytest.raises(rlx_gpu.ScheduleError, match=r"field 'dst': range \[8, 24\) overlaps src range \[0, 16\)"):
        rlx_gpu.load_schedule(sched)


def test_nothing_launches_for_an_invalid_schedule():
    device = rlx_gpu.get_device("host")
    good = _case("copy")
    bad = copy.deepcopy(good)
    bad["thunks"].append(dict(bad["thunks"][0], nbytes=-1))
    before = device.launches
    with pytest.raises(rlx_gpu.ScheduleError, match=r"thunk 1 \(copy\), field 'nbytes'"):
        device.run(bad)
    assert device.launches == before
    device.run(good)
    assert device.launches == before + 1


def test_json_and_yaml_round_trip(tmp_path):
    sched = rlx_gpu.load_schedule(_case("scan_backward_xs"))
    for name in ("s.json", "s.yaml"):
        rlx_gpu.save_schedule(sched, tmp_path / name)
        again = rlx_gpu.load_schedule(tmp_path / name)
        assert again.to_dict() == sched.to_dict()
    assert rlx_gpu.load_schedule((tmp_path / "s.json").read_text()).to_dict() == sched.to_dict()
