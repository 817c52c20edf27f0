"""host_fallback's whole-sequence lstm kernels (``lstm_sequence``, ``lstm_sequence_backward``): the
layer-directions of an f32-inside lstm and lstm_backward thunk with the default activations and no clip,
peepholes, projection or coupled gates, at small steps.

The forward thunk's outputs and final states against the float64 reference (test_rnn_host's ``check``), and
every gradient of a backward thunk against torch autograd of nn.LSTM in float64 on the values the thunk stores
(independent of both paths), each at either tile width and on NumPy's path (``RLX_HOST_JIT=0``); the kernels
run exactly where they apply, once per layer-direction.
"""
from __future__ import annotations

import numpy as np
import pytest

import host_fallback
from support.gradient_check import read
from host_fallback import jit, lstm_sequence
from support.host_jit import count_calls
from support.rnn_backward_cases import backward_params, laid_backward, torch_gradients
from support.rnn_host import build, check

numba = pytest.importorskip("numba", reason="the jit extra (Numba) is not installed")
from host_fallback import jit_lstm, jit_lstm_sequence  # noqa: E402  (needs Numba)

LANES = sorted(jit_lstm.PANEL_ROWS)
KERNELS = ("lstm_sequence", "lstm_sequence_backward")


@pytest.fixture
def calls(monkeypatch):
    """Counts each whole-sequence kernel's calls (they still run)."""
    return count_calls(monkeypatch, jit_lstm_sequence, KERNELS)


# batch 9: two panels of rows at either width (8 or 6 a panel), the last part-filled; hidden 20: 4H = 80
# gates, at 16 lanes two two-vector tiles and a one-vector one, and dh's 20 columns padded to 32 (or 24)
TWO_PANELS = dict(batch=9, seq=7, input_size=5, hidden=20)
CASES = [
    ("two-layers-bidirectional-carry", {}),  # d_h0 and d_c0 given, their gradients out
    ("seq_lens-with-a-zero", dict(seq_lens=[5, 2, 0])),
    ("reverse-seq_lens", dict(reverse=True, bidirectional=False, seq_lens=[4, 1, 5])),
    ("one-layer-no-carry", dict(num_layers=1, bidirectional=False, carry=False)),
    ("two-panels", dict(TWO_PANELS, seq_lens=[7, 0, 3, 7, 1, 6, 2, 7, 5])),
    ("two-panels-bidirectional-no-carry", dict(TWO_PANELS, carry=False)),
    ("one-row", dict(batch=1, seq_lens=[4])),  # the forward's dot products of W_hh's rows (no tiles)
]
#: NMSE of an f32 gradient against float64's: f32 throughout, the sums in another order than torch's.
NMSE = 1e-10


def _gradients(thunk: dict, arena: np.ndarray) -> dict[str, np.ndarray]:
    out = arena.copy()
    host_fallback.execute(thunk, out)
    return {f: v for f, v in read(thunk, out).items() if f.startswith("d_") and f != "d_dst"}


def _within_lengths_flipped(a: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``a [batch, seq, ...]`` with each row's first ``lengths[row]`` steps in reverse order."""
    out = a.copy()
    for row, n in enumerate(lengths.astype(int)):
        out[row, :n] = a[row, :n][::-1]
    return out


def _torch_reference(thunk: dict, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``torch_gradients`` of the thunk, for the fields torch's LSTM lacks too: ``reverse`` (one direction) as
    torch's over each row's valid steps in reverse order, and rows of length 0 (which torch's packed sequences
    refuse) left out of torch's batch: such a row has no step, so its final state is its initial one (the
    final state's gradient passes to it unchanged) and its input gets none."""
    if "h0" not in values:  # no carry: zero initial states, whose gradients the thunk does not give
        states = (thunk["num_layers"] * (2 if thunk["bidirectional"] else 1), values["x"].shape[0], thunk["hidden"])
        zeros = {f: np.zeros(states) for f in ("h0", "c0", "d_h0", "d_c0")}
        grads = _torch_reference(thunk, {**values, **zeros})
        return {f: g for f, g in grads.items() if f not in ("d_h0", "d_c0")}
    lengths = values.get("seq_lens", np.full(values["x"].shape[0], values["x"].shape[1]))
    if thunk.get("reverse"):
        assert not thunk["bidirectional"]
        flipped = {f: _within_lengths_flipped(values[f], lengths) for f in ("x", "d_dst")}
        grads = _torch_reference({**thunk, "reverse": False}, {**values, **flipped})
        grads["d_x"] = _within_lengths_flipped(grads["d_x"], lengths)
        return grads
    running = np.flatnonzero(lengths > 0)
    batch_axis = {"x": 0, "d_dst": 0, "seq_lens": 0, "h0": 1, "c0": 1, "d_h0": 1, "d_c0": 1}
    part = {f: np.take(v, running, axis=batch_axis[f]) if f in batch_axis else v for f, v in values.items()}
    grads = torch_gradients("lstm", thunk, part)
    d_x = np.zeros_like(values["x"])
    d_x[running] = grads["d_x"]
    grads["d_x"] = d_x
    for state in ("h0", "c0"):
        if f"d_{state}" in grads:
            full = values[f"d_{state}"].copy()  # the final state's gradient, for the rows that never ran
            full[:, running] = grads[f"d_{state}"]
            grads[f"d_{state}"] = full
    return grads


def _check_against_torch(extra: dict) -> int:
    """Every gradient of an f32 lstm_backward against torch's in float64; returns the layer-directions."""
    params = backward_params("lstm", **extra)
    thunk, arena = laid_backward("lstm", "f32", params, seed=5)
    got = _gradients(thunk, arena)
    want = _torch_reference(thunk, read(thunk, arena))
    assert set(got) == set(want)
    for name, value in want.items():
        err = np.mean((got[name] - value) ** 2) / max(np.mean(value ** 2), 1e-30)
        assert err <= NMSE, (name, err)
    return params["num_layers"] * (2 if params["bidirectional"] else 1)


@pytest.mark.parametrize("width", [*LANES, None], ids=[*(f"numba-{n}-lanes" for n in LANES), "numpy"])
@pytest.mark.parametrize("label,extra", CASES, ids=[c[0] for c in CASES])
def test_both_paths_match_torch_autograd(label, extra, width, calls, monkeypatch):
    if width is None:
        monkeypatch.setenv(jit.ENV, "0")
    else:
        monkeypatch.setenv(jit.WIDTH_ENV, str(width))
    layer_directions = _check_against_torch(extra)
    runs = layer_directions if width else 0
    assert calls == dict.fromkeys(KERNELS, runs)


@pytest.mark.parametrize("label,extra", [
    ("clip", dict(clip=0.5)),
    ("peepholes", dict(peepholes=True)),
    ("input_forget", dict(input_forget=True)),
    ("proj_size", dict(proj_size=3, w_hr=True)),
    ("another activation", dict(activations=[["sigmoid", 0, 0], ["relu", 0, 0], ["tanh", 0, 0]] * 2)),
    ("a step past the bound", dict(batch=3, hidden=4)),
], ids=lambda v: v if isinstance(v, str) else "")
def test_numpy_s_path_runs_where_the_kernels_do_not_apply(label, extra, calls, monkeypatch):
    if label == "a step past the bound":
        monkeypatch.setattr(lstm_sequence, "MAX_STEP", 3 * 4 * 4 - 1)
        monkeypatch.setattr(lstm_sequence, "MAX_BACKWARD_STEP", 3 * 4 * 4 - 1)
    thunk, arena = laid_backward("lstm", "f32", backward_params("lstm", **extra))
    host_fallback.execute(thunk, arena)
    forward = {k: v for k, v in extra.items() if k != "w_hr"}
    thunk, arena, _, _ = build("lstm", "f32", **{**FORWARD, **dict(batch=3, hidden=4), **forward})
    host_fallback.execute(thunk, arena)
    assert calls == dict.fromkeys(KERNELS, 0)


def test_f64_keeps_numpy_s_path(calls):
    thunk, arena = laid_backward("lstm", "f64", backward_params("lstm"))
    host_fallback.execute(thunk, arena)
    assert calls == dict.fromkeys(KERNELS, 0)


def test_without_numba_numpy_s_path_runs(monkeypatch, calls):
    monkeypatch.setattr(jit, "_kernels", lambda: None)  # as after a failed import
    _check_against_torch({})
    assert calls == dict.fromkeys(KERNELS, 0)


FORWARD = dict(batch=9, seq=7, input_size=5, hidden=20, num_layers=2, bidirectional=True, carry=True)
FORWARD_CASES = [
    ("two-layers-bidirectional-carry", "f32", {}),
    ("seq_lens-with-a-zero", "f32", dict(seq_lens=[7, 0, 3, 7, 1, 6, 2, 7, 5])),
    ("reverse-no-carry", "f32", dict(bidirectional=False, carry=False, reverse=True)),
    ("f16", "f16", dict(seq_lens=[7, 0, 3, 7, 1, 6, 2, 7, 5])),
    ("bf16", "bf16", {}),
    # one row: W_hh·h as dot products of its rows, 20 deep (a whole 16 lanes and 4 one by one), and 37
    ("one-row", "f32", dict(batch=1)),
    ("one-row-37-units", "f32", dict(batch=1, hidden=37, bidirectional=False)),
    # f32 storage: the states updated where they lie and the top layer written into dst; f16: copied in and out
    ("one-row-one-direction", "f32", dict(batch=1, bidirectional=False)),
    ("one-row-f16", "f16", dict(batch=1, bidirectional=False)),
]


@pytest.mark.parametrize("width", [*LANES, None], ids=[*(f"numba-{n}-lanes" for n in LANES), "numpy"])
@pytest.mark.parametrize("label,dtype,extra", FORWARD_CASES, ids=[c[0] for c in FORWARD_CASES])
def test_the_forward_thunk_matches_the_reference(label, dtype, extra, width, calls, monkeypatch):
    if width is None:
        monkeypatch.setenv(jit.ENV, "0")
    else:
        monkeypatch.setenv(jit.WIDTH_ENV, str(width))
    shape = {**FORWARD, **extra}
    check("lstm", dtype, **shape)
    layer_directions = shape["num_layers"] * (2 if shape["bidirectional"] else 1)
    assert calls == {"lstm_sequence": layer_directions if width else 0, "lstm_sequence_backward": 0}


def test_directions_forced_into_two_threads_take_the_step_route(calls):
    check("lstm", "f32", options={"parallel_directions": True}, **FORWARD)
    assert calls == dict.fromkeys(KERNELS, 0)


def test_the_kernels_refuse_shapes_that_do_not_fit_before_writing():
    S, B, H, f32 = 3, 2, 4, np.float32
    seq = lambda *shape: np.zeros(shape, f32)  # noqa: E731
    lens = np.empty(0, np.int64)
    forward = dict(u=seq(S, B, 4 * H), w_hh=seq(4 * H, H), h=seq(B, H), c=seq(B, H), out=np.full((S, B, H), 7, f32))
    for field, bad in [("w_hh", seq(4 * H, H + 1)), ("h", seq(B + 1, H)), ("out", np.full((S, B + 1, H), 7, f32))]:
        args = {**forward, field: bad}
        with pytest.raises(ValueError, match="lstm_sequence: the arrays' shapes do not fit together"):
            jit_lstm_sequence.lstm_sequence(args["u"], args["w_hh"], args["h"], args["c"], lens, False, args["out"],
                                            False, seq(0, 0, 0), seq(0, 0, 0), seq(0, 0, 0), 16)
        assert np.all(args["out"] == 7)
    with pytest.raises(ValueError, match="the kept arrays' shapes are not out's"):
        jit_lstm_sequence.lstm_sequence(forward["u"], forward["w_hh"], forward["h"], forward["c"], lens, False,
                                        forward["out"], True, seq(S, B, H), seq(S, B, H), seq(0, 0, 0), 16)
    dz = np.full((S, B, 4 * H), 7, f32)
    with pytest.raises(ValueError, match="lstm_sequence_backward: the arrays' shapes do not fit together"):
        jit_lstm_sequence.lstm_sequence_backward(seq(S, B, 4 * H), seq(S, B, H), seq(S, B, H), seq(4 * H, H),
                                                 seq(S, B, H + 1), seq(B, H), seq(B, H), lens, False, dz, 16)
    assert np.all(dz == 7)
    with pytest.raises(ValueError, match="lanes must be 8 or 16"):
        jit_lstm_sequence.lstm_sequence_backward(seq(S, B, 4 * H), seq(S, B, H), seq(S, B, H), seq(4 * H, H),
                                                 seq(S, B, H), seq(B, H), seq(B, H), lens, False, dz, 4)


@pytest.mark.parametrize("seq,batch,runs", [(1, 9, False), (2, 9, True), (1, 1, True)],
                         ids=["one-step", "two-steps", "one-step-of-one-row"])
def test_a_short_forward_call_takes_the_kernel_where_its_steps_repay_the_copy_of_w_hh(seq, batch, runs, calls):
    """40 units: one step a call keeps the step route (decode), two take the kernel
    (``rnn._SEQUENCE_UNITS_PER_STEP``); a batch of one row copies nothing of W_hh and takes it at one step."""
    check("lstm", "f32", **{**FORWARD, "hidden": 40, "seq": seq, "batch": batch, "bidirectional": False})
    assert calls["lstm_sequence"] == (2 if runs else 0)


def test_one_row_wider_than_the_bound_keeps_numpy_s_step_route(calls, monkeypatch):
    monkeypatch.setattr(lstm_sequence, "MAX_ROW_HIDDEN", 39)
    check("lstm", "f32", **{**FORWARD, "hidden": 40, "seq": 1, "batch": 1, "bidirectional": False})
    assert calls["lstm_sequence"] == 0
