"""ABI.md §9.1's saved forward at the schedule border: ``reserve``/``reserve_bytes`` on the recurrent ops and
their backward ops, the minimum (``rlx_gpu.reserve_bytes``, written here from docs/abi.md's layout), a
short reserve refused naming it, the footprint of exactly ``reserve_bytes`` bytes, and the devices' refusal."""
from __future__ import annotations

import re

import pytest

import rlx_gpu
from host_fallback.abi import regions
from rlx_gpu.conformance.cases import SMALL, lay_out, schedule_of
from rlx_gpu.launches import unsupported
from rlx_gpu.launches.limits import REFERENCE_GPU

RNN_OPS = ("lstm", "gru", "rnn", "lstm_backward", "gru_backward", "rnn_backward")
OPS = RNN_OPS + ("mamba2", "mamba2_backward", "selective_scan", "selective_scan_backward", "gated_delta_net",
                 "gated_delta_net_backward")


def _expected(fields: dict) -> int:
    """docs/abi.md's layout: per layer-direction and token the saved arrays in hidden units, the outputs of
    the layers below the top, the clip's byte masks; the end rounded up to 16."""
    op = fields["op"].removesuffix("_backward")
    h, dirs, layers = fields["hidden"], 2 if fields["bidirectional"] else 1, fields["num_layers"]
    width, es = fields.get("proj_size") or h, 8 if fields["dtype"] == "f64" else 4
    # lstm: y, u (4 gates each), h_prev (width), c_prev, c_new, hc (and raw with a projection)
    per_step = {"lstm": 8 * h + width + 3 * h + (h if fields.get("proj_size") else 0),
                "gru": 3 * h + 3 * h + h + h, "rnn": h + h + h}[op]
    gates = {"lstm": 4, "gru": 3, "rnn": 1}[op]
    tokens = fields["batch"] * fields["seq"]
    end = tokens * (layers * dirs * per_step + (layers - 1) * dirs * width) * es + tokens * layers * dirs * gates * h
    return -(-end // 16) * 16


def _schedule(op: str, dtype: str = "f32", **params) -> dict:
    fields = {**SMALL[op], **params}
    need = rlx_gpu.reserve_bytes({"op": op, "dtype": dtype, **fields})
    thunk, nbytes = lay_out(op, dtype, {"reserve": True, "reserve_bytes": need, **fields})
    return schedule_of(thunk, nbytes)


@pytest.mark.parametrize("op", RNN_OPS)
@pytest.mark.parametrize("dtype,extra", [("f32", {}), ("f64", {}), ("bf16", {"num_layers": 3}),
                                         ("f32", {"bidirectional": False})])
def test_the_minimum_follows_the_documented_layout(op, dtype, extra):
    fields = {"op": op, "dtype": dtype, **SMALL[op], **extra}
    assert rlx_gpu.reserve_bytes(fields) == _expected(fields)


@pytest.mark.parametrize("op", ("mamba2", "mamba2_backward"))
@pytest.mark.parametrize("dtype,extra,es", [("f32", {}, 4), ("bf16", {}, 4), ("f64", {}, 8),
                                            ("bf16", {"state_dtype": "f64"}, 8), ("f32", {"param_dtype": "f64"}, 8)])
@pytest.mark.parametrize("seq", (1, 64, 65, 150))
def test_the_minimum_of_mamba2_is_the_states_leaving_each_chunk_of_64_y_and_the_scores(op, dtype, extra, es, seq):
    b, h, p, n = 2, 3, 5, 7
    fields = {"op": op, "dtype": dtype, "batch": b, "seq": seq, "heads": h, "head_dim": p, "state_size": n, **extra}
    end = (b * -(-seq // 64) * h * p * n + b * seq * h * p + b * -(-seq // 64) * h * 64 * 64) * es
    assert rlx_gpu.reserve_bytes(fields) == -(-end // 16) * 16


@pytest.mark.parametrize("op", ("selective_scan", "selective_scan_backward"))
@pytest.mark.parametrize("dtype,extra,es", [("f32", {}, 4), ("bf16", {}, 4), ("f64", {}, 8),
                                            ("f16", {"param_dtype": "f64"}, 8)])
@pytest.mark.parametrize("seq", (1, 32, 33, 100))
def test_the_minimum_of_selective_scan_is_the_states_leaving_each_chunk_of_32(op, dtype, extra, es, seq):
    fields = {"op": op, "dtype": dtype, "batch": 2, "seq": seq, "hidden": 6, "state_size": 5, **extra}
    end = 2 * -(-seq // 32) * 6 * 5 * es
    assert rlx_gpu.reserve_bytes(fields) == -(-end // 16) * 16


@pytest.mark.parametrize("op", ("gated_delta_net", "gated_delta_net_backward"))
@pytest.mark.parametrize("dtype,extra,es", [("f32", {}, 4), ("bf16", {}, 4), ("f64", {}, 8),
                                            ("f16", {"state_dtype": "f64"}, 8),
                                            ("f32", {"value_heads": 6, "value_size": 3}, 4)])
@pytest.mark.parametrize("seq", (1, 32, 33, 100))
def test_the_minimum_of_gated_delta_net_is_per_chunk_of_32_a_state_three_squares_and_u(op, dtype, extra, es, seq):
    fields = {"op": op, "dtype": dtype, "batch": 2, "seq": seq, "heads": 3, "state_size": 5, **extra}
    hv, v = extra.get("value_heads", 3), extra.get("value_size", 5)
    end = 2 * -(-seq // 32) * hv * (5 * v + 3 * 32 * 32 + 32 * v) * es
    assert rlx_gpu.reserve_bytes(fields) == -(-end // 16) * 16


def test_the_minimum_of_a_projecting_lstm_counts_its_width_and_raw_outputs():
    fields = {"op": "lstm", "dtype": "f32", **SMALL["lstm"], "hidden": 6, "proj_size": 3, "num_layers": 2}
    assert rlx_gpu.reserve_bytes(fields) == _expected(fields)


def test_the_minimum_reads_shapes_only_and_ops_without_a_reserve_are_named():
    fields = {"op": "gru", "dtype": "f16", **SMALL["gru"]}
    assert rlx_gpu.reserve_bytes(fields) == rlx_gpu.reserve_bytes({**fields, "clip": 3.0, "x": 1 << 20})
    with pytest.raises(rlx_gpu.ScheduleError, match="op 'fill' has no saved forward.*lstm, gru, rnn, selective_scan, mamba2"):
        rlx_gpu.reserve_bytes({"op": "fill"})
    with pytest.raises(rlx_gpu.ScheduleError, match="rnn needs field 'bidirectional'"):
        rlx_gpu.reserve_bytes({"op": "rnn", "dtype": "f32", "batch": 2})


@pytest.mark.parametrize("op", OPS)
def test_a_short_reserve_is_refused_naming_the_minimum(op):
    sched = _schedule(op)
    thunk = sched["thunks"][0]
    need = thunk["reserve_bytes"]
    rlx_gpu.load_schedule(sched)
    thunk["reserve_bytes"] = need - 1
    with pytest.raises(rlx_gpu.ScheduleError, match=rf"thunk 0 \({op}\), field 'reserve_bytes': expected at least "
                                                    rf"{need} bytes .*got {need - 1}"):
        rlx_gpu.load_schedule(sched)


@pytest.mark.parametrize("op", ("lstm", "rnn_backward"))
def test_reserve_bytes_needs_a_reserve_and_the_offset_is_aligned(op):
    sched = _schedule(op)
    thunk = sched["thunks"][0]
    thunk["reserve"] += 8
    with pytest.raises(rlx_gpu.ScheduleError, match=rf"field 'reserve': offset {thunk['reserve']} is not a multiple of 16"):
        rlx_gpu.load_schedule(sched)
    del thunk["reserve"]
    with pytest.raises(rlx_gpu.ScheduleError, match=re.escape("field 'reserve_bytes': given without reserve")):
        rlx_gpu.load_schedule(sched)


@pytest.mark.parametrize("op", OPS)
def test_the_footprint_is_exactly_reserve_bytes_written_by_the_forward_read_by_the_backward(op):
    sched = _schedule(op)
    thunk = dict(sched["thunks"][0])
    thunk["reserve_bytes"] += 48  # more than the minimum is allowed, and all of it is the footprint
    (r,) = [r for r in regions(thunk) if r.field == "reserve"]
    assert (r.offset, r.nbytes) == (thunk["reserve"], thunk["reserve_bytes"])
    assert r.access == ("r" if op.endswith("_backward") else "w")
    assert "d_reserve" not in {x.field for x in regions(thunk)}


@pytest.mark.parametrize("op", OPS)
def test_the_devices_write_and_read_a_reserve(op):
    """Every op with a saved forward runs on a device with one and without: its device kernels write or read it
    (tests/devices/test_*_reserve_device.py)."""
    thunk = _schedule(op)["thunks"][0]
    assert unsupported(thunk, REFERENCE_GPU) is None
    plain = {k: v for k, v in thunk.items() if k not in ("reserve", "reserve_bytes")}
    assert unsupported(plain, REFERENCE_GPU) is None
