"""Table-driven malformed schedules: every failure names the thunk, op and field, and nothing launches."""
from __future__ import annotations

import copy
import json
import pathlib
import random
import re

import numpy as np
import pytest
import yaml

import rlx_gpu
from host_fallback.abi import OPS, regions
from rlx_gpu.schedule.io import parse_text
from rlx_gpu.conformance.cases import lay_out, schedule_of


def _case(op: str, dtype: str = "f32") -> dict:
    thunk, arena_bytes = lay_out(op, dtype)
    return schedule_of(thunk, arena_bytes)


def _bad_values(op: str, field) -> list[tuple[str, object]]:
    """(what, value) pairs that must be rejected for one field."""
    wrong_type = {"offset": "12", "pos": 2.5, "count": "3", "bool": 1, "float": "x", "enum": 7, "dtype": "f8",
                  "elem_size": 3, "shape": "3x5", "strides": [1.5, 1], "offsets": [-1], "xs": [[0, 0]],
                  "bcast": [[0]], "pairs": [[0, 0, 0]], "schedule": [], "opt_schedule": 5, "opt_offset": "12",
                  "limit": [1], "activations": "tanh", "opt_float": "x"}[field.kind]
    out = [("wrong type", wrong_type)]
    if field.kind in ("offset", "pos", "count", "opt_offset"):
        out.append(("negative", -4))
    return out


CASES = [(op, f) for op, spec in OPS.items() for f in spec.fields]


@pytest.mark.parametrize("op,field", CASES, ids=[f"{op}.{f.name}" for op, f in CASES])
def test_each_field_rejects_wrong_type_and_negative(op, field):
    for what, value in _bad_values(op, field):
        sched = _case(op)
        if field.version > 1:
            sched["abi"] = "rlx-thunks/2"
        sched["thunks"][0][field.name] = value
        with pytest.raises(rlx_gpu.ScheduleError) as err:
            rlx_gpu.load_schedule(sched)
        message = str(err.value)
        assert f"thunk 0 ({op}), field '{field.name}" in message, (what, message)


def _offset_regions(op: str):
    thunk = _case(op)["thunks"][0]
    return [r for r in regions(thunk) if "[" not in r.field and r.nbytes > 0]


OFFSET_CASES = [(op, r.field, r.dtype) for op in OPS for r in _offset_regions(op)]


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


@pytest.mark.parametrize("op", list(OPS))
def test_unknown_missing_and_extra_fields(op):
    sched = _case(op)
    sched["thunks"][0]["colour"] = 3
    with pytest.raises(rlx_gpu.ScheduleError, match=rf"thunk 0 \({op}\), field 'colour': unknown field"):
        rlx_gpu.load_schedule(sched)
    sched = _case(op)
    name = OPS[op].fields[0].name
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
    sched["abi"] = "rlx-thunks/3"
    with pytest.raises(rlx_gpu.ScheduleError, match=r"unknown abi 'rlx-thunks/3'"):
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
    before = device.thunks_run
    with pytest.raises(rlx_gpu.ScheduleError, match=r"thunk 1 \(copy\), field 'nbytes'"):
        device.run(bad)
    assert device.thunks_run == before
    device.run(good)
    assert device.thunks_run == before + 1


def test_json_and_yaml_round_trip(tmp_path):
    sched = rlx_gpu.load_schedule(_case("scan_backward_xs"))
    for name in ("s.json", "s.yaml"):
        rlx_gpu.save_schedule(sched, tmp_path / name)
        again = rlx_gpu.load_schedule(tmp_path / name)
        assert again.to_dict() == sched.to_dict()
    assert rlx_gpu.load_schedule((tmp_path / "s.json").read_text()).to_dict() == sched.to_dict()


# ---- untrusted input: malformed sizes, offsets and nesting, each refused at the border ----

def _refused(source, *patterns: str) -> str:
    """Load ``source``, expect a ScheduleError with a short message matching every pattern."""
    with pytest.raises(rlx_gpu.ScheduleError) as err:
        rlx_gpu.load_schedule(source)
    message = str(err.value)
    assert len(message) < 800, message[:200]
    for pattern in patterns:
        assert re.search(pattern, message), (pattern, message)
    return message


def test_wrapping_products_are_exact():
    thunk = dict(op="selective_scan", dtype="f32", x=0, delta=0, a=0, b=0, c=0, dst=1024, batch=2**32,
                 seq=2**32, hidden=1, state_size=1)
    _refused(schedule_of(thunk, 1536), r"thunk 0 \(selective_scan\), field 'x': bytes \[0, 73786976294838206464\)")
    sched = dict(_case("copy"), tensors={"big": {"offset": 0, "dtype": "f32", "shape": [2**63]}})
    _refused(sched, r"tensor 'big', field 'shape\[0\]': 9223372036854775808 exceeds the limit 281474976710656")
    sched = dict(_case("copy"), arena_bytes=2**64)
    _refused(sched, r"field 'arena_bytes': 18446744073709551616 exceeds the limit 281474976710656 .*'arena_bytes'")


def test_num_layers_is_bounded_before_any_list_is_built():
    sched = _case("lstm")
    sched["thunks"][0]["num_layers"] = 2**40
    _refused(sched, r"thunk 0 \(lstm\), field 'num_layers': 1099511627776 exceeds the limit 4096 .*'num_layers'")


def _alias_bomb(levels: int = 9) -> str:
    lines = ['  l0: &l0 ["xxxxxxxx", "xxxxxxxx", "xxxxxxxx", "xxxxxxxx", "xxxxxxxx", "xxxxxxxx"]']
    lines += [f"  l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines)


def test_an_alias_bomb_is_reported_without_expanding_it():
    text = (f"abi: rlx-thunks/1\narena_bytes: 64\nmeta:\n{_alias_bomb()}\n"
            "thunks:\n  - {op: fill, dtype: f32, dst: *l8, n: 1, value: 0}\n")
    assert len(text) < 1024
    _refused(text, r"thunk 0 \(fill\), field 'dst': expected a byte offset >= 0, got list \[\[\[")


@pytest.mark.parametrize("text,patterns", [
    ('{"abi": "rlx-thunks/1", "arena_bytes": 64, "thunks": [{"op": "fill", "dtype": "f3',
     [r"neither JSON \(Unterminated string starting at: line 1 column 79", r"nor YAML"]),
    ('{"abi": "rlx-thunks/1",\n "arena_bytes": 64,\n "thunks": [\n', [r"line 4 column 1"]),
    ("[" * 5000, [r"nested too deeply"]),
    ("x" * 300, [r"schedule: expected an object, got str 'xxxx"]),
    ('{"abi": "rlx-thunks/1", "arena_bytes": 64, "thunks": [], "arena_bytes": 128}', [r"duplicate key 'arena_bytes'"]),
    ("abi: rlx-thunks/1\narena_bytes: 64\nthunks: []\narena_bytes: 128\n", [r"duplicate key 'arena_bytes'"]),
    ("abi: rlx-thunks/1\narena_bytes: 64\nthunks: []\n1: 2\n", [r"keys must be strings, got int 1"]),
    ("base: &b {arena_bytes: 64}\nschedule:\n  <<: *b\n", [r"merge keys"]),
    ('{"abi": "rlx-thunks/1", "arena_bytes": 1' + "0" * 5000 + ', "thunks": []}', [r"neither JSON"]),
], ids=["truncated-json", "truncated-json-lines", "brackets", "300-chars", "duplicate-json", "duplicate-yaml",
        "mixed-key-types", "merge-key", "5000-digit-int"])
def test_malformed_text_is_one_schedule_error(text, patterns):
    _refused(text, *patterns)


def test_bytes_and_paths():
    noise = bytes(random.Random(9).randrange(256) for _ in range(300))
    _refused(noise, r"not UTF-8 text")
    _refused(noise.decode("latin-1"), r"neither JSON .* nor YAML|expected an object, got str")
    _refused(pathlib.Path("/nonexistent/schedule.json"), r"no such file: '/nonexistent/schedule.json'")


@pytest.mark.parametrize("edit,patterns", [
    (lambda s: s["thunks"][0].update(op=["lstm"]), [r"thunk 0 \(\['lstm'\]\), field 'op': unknown op"]),
    (lambda s: s.update(outputs=5), [r"field 'outputs': expected a list of tensor names, got 5"]),
    (lambda s: s.update(init=True), [r"field 'init': expected a list of \{offset, b64\} blocks, got bool True"]),
    (lambda s: s.update(init=False), [r"field 'init': expected a list of \{offset, b64\} blocks, got bool False"]),
    (lambda s: s.update(outputs=0), [r"field 'outputs': expected a list of tensor names, got 0"]),
    (lambda s: s.update(init=[{"offset": 0, "b64": "AAé="}]), [r"field 'init\[0\].b64': not valid base64"]),
    (lambda s: s["thunks"][0].update(value=10**400), [r"thunk 0 \(fill\), field 'value': <int of 1329 bits> is "
                                                      r"beyond the range of a float"]),
    (lambda s: s["thunks"][0].update(n=float("inf")), [r"thunk 0 \(fill\), field 'n': expected an int >= 0, got "
                                                       r"float inf"]),
    (lambda s: s.update(init=[{"offset": 0, "b64": "AAAA"}, {"offset": 2, "b64": "AAAA"}]),
     [r"field 'init\[1\]': overlaps init\[0\]"]),
], ids=["op-list", "outputs-int", "init-bool", "init-false", "outputs-0", "non-ascii-base64", "int-beyond-float",
        "inf-count", "init-overlap"])
def test_wrong_types_are_schedule_errors(edit, patterns):
    sched = _case("fill")
    edit(sched)
    _refused(sched, *patterns)
    _refused(json.dumps(sched).replace("Infinity", "1e400"), *patterns)


def _nested_scans(depth: int) -> dict:
    base = _case("scan")
    thunk = base["thunks"][0]
    for _ in range(depth - 1):
        outer = copy.deepcopy(base["thunks"][0])
        outer["body"]["thunks"] = [dict(thunk, outer_init_off=0, outer_final_off=0)]
        thunk = outer
    return dict(base, thunks=[thunk])


def test_nesting_is_bounded_by_the_depth_limit():
    _refused(json.dumps(_nested_scans(150)), r"nest deeper than 32 levels \(limit 'nesting_depth'\)")
    text = ("abi: rlx-thunks/1\narena_bytes: 64\nthunks:\n- &s {op: scan, dtype: f32, body: {arena_bytes: 64, "
            "thunks: [*s]}, body_input_off: 0, body_output_off: 16, outer_init_off: 0, "
            "outer_final_off: 16, "
            "length: 1, carry_bytes: 16, save_trajectory: false, xs_inputs: [], bcast_inputs: [], num_checkpoints: 0}\n")
    _refused(text, r"nest deeper than 32 levels")


@pytest.mark.parametrize("op,field,shift", [("unary", "dst", 2), ("unary", "dst", -2), ("gated_delta_net", "dst", 4),
                                            ("gated_delta_net", "state", 8), ("lstm", "c0", 4), ("matmul", "dst", 0)])
def test_partial_overlap_of_writes_and_reads_is_refused(op, field, shift):
    sched = _case(op, "f16")
    thunk = sched["thunks"][0]
    source = {"unary": "x", "gated_delta_net": "q", "lstm": "h0", "matmul": "a"}[op]
    thunk[field] = thunk[source] + shift if shift >= 0 else thunk[source] - shift
    if op == "unary" and shift < 0:
        thunk[field], thunk["x"] = thunk["x"], thunk["x"] + 2
    _refused(sched, rf"thunk 0 \({op}\), field '\w+': \w+ \[\d+, \d+\) .*overlaps")


def test_scan_body_slots_may_not_overlap():
    sched = _case("scan")
    sched["thunks"][0]["body_output_off"] = sched["thunks"][0]["body_input_off"] + 4
    _refused(sched, r"thunk 0 \(scan\), field 'body_output_off': body slot \[4, 20\) overlaps body_input_off \[0, 16\)")
    sched = _case("scan")
    sched["thunks"][0]["xs_inputs"][0][0] = 8
    _refused(sched, r"field 'xs_inputs\[0\]': body slot \[8, 24\) overlaps body_input_off")
    sched = _case("scan_backward_xs")
    sched["thunks"][0]["body_d_output_off"] = sched["thunks"][0]["body_x_offs"][0]
    _refused(sched, r"field 'body_d_output_off': body_vjp slot")


def test_in_place_forms_the_abi_allows_still_run():
    device = rlx_gpu.get_device("host")
    x = np.linspace(-2, 2, 37).astype(np.float16)
    arena = np.zeros(128, np.uint8)
    arena[:74] = x.view(np.uint8)
    unary = dict(op="unary", dtype="f16", x=0, dst=0, n=37, fn="tanh")
    out = device.run(schedule_of(unary, 128), arena)
    np.testing.assert_array_equal(out[:74].view(np.float16), np.tanh(x.astype(np.float32)).astype(np.float16))
    binary = dict(op="binary", dtype="f32", fn="mul", a=0, b=0, dst=0, shape=[3, 5], a_strides=[5, 1], b_strides=[5, 1])
    rlx_gpu.load_schedule(schedule_of(binary, 64))
    transposed = schedule_of(dict(binary, a_strides=[1, 3], b=64), 128)
    _refused(transposed, r"field 'dst': dst \[0, 60\) \(written\) overlaps a")
    rlx_gpu.load_schedule(schedule_of(dict(op="cast", dtype="bf16", src=0, dst=0, n=8, src_dtype="f16"), 64))
    _refused(schedule_of(dict(op="cast", dtype="f32", src=0, dst=0, n=8, src_dtype="f16"), 64), r"field 'dst'")
    scan = _case("scan")
    scan["thunks"][0].update(save_trajectory=False, outer_final_off=scan["thunks"][0]["outer_init_off"])
    rlx_gpu.load_schedule(scan)
    scan["thunks"][0]["outer_final_off"] += 4
    _refused(scan, r"field 'outer_final_off': outer_final_off \[\d+, \d+\) \(written\) overlaps outer_init_off")


def test_a_megabyte_of_pathological_text_is_refused():
    thunk = json.dumps(dict(op="fill", dtype="f32", dst=0, n=16, value=0.5))
    count = 1_000_000 // (len(thunk) + 2)
    text = ('{"abi": "rlx-thunks/1", "arena_bytes": 64, "thunks": [' + ", ".join([thunk] * count)
            + ', {"op": "fill", "dtype": "f32", "dst": 0, "n": 17, "value": 0}]}')
    assert len(text) > 900_000
    _refused(text, rf"thunk {count} \(fill\), field 'dst': bytes \[0, 68\)")
    _refused("[" * 1_000_000, r"nested too deeply")
    _refused("- " * 500_000, r"neither YAML \(.*maximum nesting depth")


def test_declared_scan_steps_and_thunk_count_are_bounded():
    scan = _case("scan")
    scan["thunks"][0].update(length=2**25, save_trajectory=False, xs_inputs=[])
    _refused(scan, r"field 'length': length 33554432 declares 33554432 body executions .*'scan_steps'")
    inner = _case("scan")["thunks"][0] | dict(length=4097, save_trajectory=False, xs_inputs=[], outer_init_off=0,
                                              outer_final_off=0)
    outer = _case("scan")
    outer["thunks"][0].update(length=4096, save_trajectory=False, xs_inputs=[])
    outer["thunks"][0]["body"]["thunks"] = [inner]
    _refused(outer, r"thunk 0 \(scan\), field 'length': length 4096 declares 16785408 body executions")
    scan = ("{op: scan, dtype: f32, body: {arena_bytes: 64, thunks: [" + ", ".join(["*u"] * 300) + "]}, "
            "body_input_off: 0, body_output_off: 16, outer_init_off: 0, outer_final_off: 16, length: 1, "
            "carry_bytes: 16, save_trajectory: false, xs_inputs: [], bcast_inputs: [], num_checkpoints: 0}")
    text = ("abi: rlx-thunks/1\narena_bytes: 64\nmeta: [&u {op: fill, dtype: f32, dst: 0, n: 4, value: 1}]\n"
            f"thunks: [&s {scan}, " + ", ".join(["*s"] * 299) + "]\n")
    _refused(text, r"^thunk \d+ \(scan\): the schedule has more than 65536 thunks .*'thunks'")


@pytest.mark.parametrize("scalar", ["0", "-0", "12", "-12", "012", "0x1F", "1_000", "1:20", "1.5", ".inf", "yes", "No",
                                    "on", "OFF", "null", "~", "true", "False", "f32", "_x", "x1", "rlx-thunks/1",
                                    "2001-12-14", "1e5", "+3", "y", "é", "0o17", "²", "--1"])
def test_yaml_scalars_resolve_as_pyyaml_does(scalar):
    text = f"v: {scalar}\n"
    expected = yaml.load(text, Loader=yaml.SafeLoader)["v"]
    value = parse_text(text)["v"]
    assert type(value) is type(expected) and value == expected
