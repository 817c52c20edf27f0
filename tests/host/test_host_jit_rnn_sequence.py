"""host_fallback's whole-sequence gru and rnn kernels (``gru_sequence``, ``gru_sequence_backward``, ``rnn_sequence``,
``rnn_sequence_backward``; where they apply: the ``rnn_sequence`` module): every gradient of an f32 gru_backward and
rnn_backward thunk, reading a reserve and recomputing, against the float64 conformance reference (written from
ABI.md, no host code) on the values the thunk stores, and the plain forward thunk's outputs against the float64
recurrences (test_rnn_host's ``check``), at either tile width and on NumPy's path (``RLX_HOST_JIT=0``); a reserve
written on either path read on the other; the kernels run exactly where they apply, once per layer-direction; and
they refuse shapes that do not fit."""
from __future__ import annotations

import numpy as np
import pytest

import host_fallback
from host_fallback import jit, lstm_sequence, rnn, threads
from host_fallback.abi import complete
from rlx_gpu.conformance.references import REFERENCES
from support.gradient_check import read
from support.host_jit import count_calls
from support.rnn_backward_cases import backward_params, laid_with_reserve, run_forward
from support.rnn_host import check

numba = pytest.importorskip("numba", reason="the jit extra (Numba) is not installed")
from host_fallback import jit_lstm, jit_rnn_sequence  # noqa: E402  (needs Numba)

LANES = sorted(jit_lstm.PANEL_ROWS)
KERNELS = ("gru_sequence", "gru_sequence_backward", "rnn_sequence", "rnn_sequence_backward")
# batch 9: two panels of rows at either width (8 or 6 a panel), the last part-filled; hidden 20: 3H = 60 gates
# and H = 20 columns, each padded to whole tiles
TWO_PANELS = dict(batch=9, seq=7, input_size=5, hidden=20)
CASES = [(op, label, extra) for op in ("gru", "rnn") for label, extra in [
    ("two-layers-bidirectional-carry", {}),
    ("seq_lens-with-a-zero", dict(seq_lens=[5, 2, 0])),
    ("reverse-no-carry", dict(reverse=True, bidirectional=False, carry=False, seq_lens=[4, 1, 5])),
    ("two-panels", dict(TWO_PANELS, seq_lens=[7, 0, 3, 7, 1, 6, 2, 7, 5])),
    ("one-row", dict(batch=1, seq_lens=[4])),  # the forward's dot products of W_hh's rows (no tiles)
]]
#: NMSE of an f32 gradient against float64's.
NMSE = 1e-10


@pytest.fixture
def calls(monkeypatch):
    """Counts each kernel's calls (they still run)."""
    return count_calls(monkeypatch, jit_rnn_sequence, KERNELS)


def _on(monkeypatch, width: int | None) -> None:
    """The kernels at ``width`` lanes, or NumPy's path (``None``)."""
    if width is None:
        monkeypatch.setenv(jit.ENV, "0")
    else:
        monkeypatch.delenv(jit.ENV, raising=False)
        monkeypatch.setenv(jit.WIDTH_ENV, str(width))


def _gradients(thunk: dict, arena: np.ndarray) -> dict[str, np.ndarray]:
    out = arena.copy()
    host_fallback.execute(thunk, out)
    return {f: v for f, v in read(thunk, out).items() if f.startswith("d_") and f != "d_dst"}


def _assert_close(got: dict, want: dict, label: str) -> None:
    assert set(got) == set(want)
    for name, value in want.items():
        err = np.mean((got[name] - value) ** 2) / max(np.mean(value ** 2), 1e-30)
        assert err <= NMSE, (label, name, err)


def _laid(op: str, extra: dict):
    """``laid_with_reserve``'s f32 thunks, the arena with the reserve as the forward wrote it, the arena without,
    and the float64 reference's gradients."""
    thunk, arena, forward = laid_with_reserve(op, "f32", backward_params(op, **extra), seed=5)
    values = read(thunk, arena)
    want = REFERENCES[f"{op}_backward"](complete({k: v for k, v in thunk.items() if k not in ("reserve", "reserve_bytes")}),
                          lambda f: values[f])
    return thunk, arena, forward, {f: v for f, v in want.items() if f.startswith("d_")}


def _saved(thunk: dict, forward: dict, arena: np.ndarray) -> np.ndarray:
    start, end = thunk["reserve"], thunk["reserve"] + thunk["reserve_bytes"]
    saved = arena.copy()
    saved[start:end] = run_forward(forward, arena)[start:end]
    return saved


@pytest.mark.parametrize("width", [*LANES, None], ids=[*(f"numba-{n}-lanes" for n in LANES), "numpy"])
@pytest.mark.parametrize("op,label,extra", CASES, ids=[f"{op}-{label}" for op, label, _ in CASES])
def test_both_paths_match_the_float64_reference_with_a_reserve_and_without(op, label, extra, width, calls,
                                                                          monkeypatch):
    _on(monkeypatch, width)
    thunk, arena, forward, want = _laid(op, extra)
    plain = {k: v for k, v in thunk.items() if k not in ("reserve", "reserve_bytes")}
    _assert_close(_gradients(plain, arena), want, "recompute")
    recomputed = dict(calls)
    _assert_close(_gradients(thunk, _saved(thunk, forward, arena)), want, "reserve")
    layer_directions = 2 * (2 if extra.get("bidirectional", True) else 1)
    runs = layer_directions if width else 0
    # the recompute's reverse one call a layer-direction (7 steps: one chunk); with a reserve the forward's too
    assert {k: calls[k] - recomputed[k] for k in KERNELS} == {
        f"{o}_sequence{s}": runs if o == op else 0 for o in ("gru", "rnn") for s in ("", "_backward")}
    assert recomputed[f"{op}_sequence_backward"] == runs


FORWARD = dict(batch=9, seq=7, input_size=5, hidden=20, num_layers=2, bidirectional=True, carry=True)
FORWARD_CASES = [(op, label, dtype, extra) for op in ("gru", "rnn") for label, dtype, extra in [
    ("two-layers-bidirectional-carry", "f32", {}),
    ("seq_lens-with-a-zero", "f32", dict(seq_lens=[7, 0, 3, 7, 1, 6, 2, 7, 5])),
    ("reverse-no-carry", "f32", dict(bidirectional=False, carry=False, reverse=True)),
    ("bf16", "bf16", {}),
    # one row: W_hh·h as dot products of its rows, four at a time and (23 units: a gru's 69 rows, an rnn's 23)
    # the rest one by one, 16 deep and (23) 7 more one by one
    ("one-row", "f32", dict(batch=1)),
    ("one-row-23-units", "f32", dict(batch=1, hidden=23, bidirectional=False)),
]]


@pytest.mark.parametrize("width", [*LANES, None], ids=[*(f"numba-{n}-lanes" for n in LANES), "numpy"])
@pytest.mark.parametrize("op,label,dtype,extra", FORWARD_CASES, ids=[f"{c[0]}-{c[1]}" for c in FORWARD_CASES])
def test_the_forward_thunk_matches_the_reference(op, label, dtype, extra, width, calls, monkeypatch):
    _on(monkeypatch, width)
    shape = {**FORWARD, **extra}
    check(op, dtype, **shape)
    layer_directions = shape["num_layers"] * (2 if shape["bidirectional"] else 1)
    assert calls == {k: layer_directions if width and k == f"{op}_sequence" else 0 for k in KERNELS}


@pytest.mark.parametrize("op", ["gru", "rnn"])
def test_the_forward_s_directions_in_two_threads_match_the_reference(op, calls, monkeypatch):
    """Where a step is wide enough and there are two cores, a layer's directions run at once."""
    _on(monkeypatch, LANES[-1])
    monkeypatch.setattr(rnn, "_PARALLEL_STEP_FLOPS", 0)
    monkeypatch.setattr(threads, "cores", lambda: 2)
    layers: list[int] = []
    run_all = threads.run_all
    monkeypatch.setattr(threads, "run_all", lambda jobs: layers.append(len(jobs)) or run_all(jobs))
    check(op, "f32", **{**FORWARD, "seq_lens": [7, 0, 3, 7, 1, 6, 2, 7, 5]})
    assert layers == [2, 2] and calls[f"{op}_sequence"] == 4


def test_a_batch_below_the_kernels_minimum_takes_numpy_s_loop(calls):
    batch = rnn._SEQUENCE_MIN_BATCH - 1
    check("gru", "f32", **{**FORWARD, "batch": batch, "seq_lens": [7, 0, 3, 5, 1, 7, 2, 6][:batch]})
    assert calls == dict.fromkeys(KERNELS, 0)


@pytest.mark.parametrize("op", ["gru", "rnn"])
def test_one_row_takes_the_kernel_at_one_step_up_to_its_bound(op, calls, monkeypatch):
    """A decode step of one row copies nothing of W_hh: the kernel at 40 units, NumPy's loop past the bound."""
    shape = {**FORWARD, "hidden": 40, "seq": 1, "batch": 1, "bidirectional": False}
    check(op, "f32", **shape)
    assert calls[f"{op}_sequence"] == 2
    monkeypatch.setattr(lstm_sequence, "MAX_ROW_HIDDEN", 39)
    check(op, "f32", **shape)
    assert calls[f"{op}_sequence"] == 2


@pytest.mark.parametrize("op", ["gru", "rnn"])
def test_a_reserve_written_on_either_path_is_read_on_the_other(op, monkeypatch):
    thunk, arena, forward, want = _laid(op, dict(seq_lens=[5, 2, 0]))
    for writer, reader in ((None, LANES[-1]), (LANES[-1], None)):
        _on(monkeypatch, writer)
        saved = _saved(thunk, forward, arena)
        _on(monkeypatch, reader)
        _assert_close(_gradients(thunk, saved), want, f"written {writer}, read {reader}")


@pytest.mark.parametrize("op,extra", [("gru", dict(linear_before_reset=False)), ("gru", dict(clip=0.5)),
                                      ("rnn", dict(relu=True)), ("rnn", dict(clip=0.5)),
                                      ("gru", dict(activations=[["sigmoid", 0, 0], ["relu", 0, 0]] * 2)),
                                      ("rnn", dict(batch=3, hidden=4))],
                         ids=["gru-not-linear_before_reset", "gru-clip", "rnn-relu", "rnn-clip", "gru-relu",
                              "rnn-a-step-past-the-bound"])
def test_numpy_s_steps_run_where_the_kernels_do_not_apply(op, extra, calls, monkeypatch):
    if "hidden" in extra:
        monkeypatch.setattr(lstm_sequence, "MAX_BACKWARD_STEP", 3 * 4 * 4 - 1)
    thunk, arena, forward = laid_with_reserve(op, "f32", backward_params(op, **extra))
    host_fallback.execute(thunk, _saved(thunk, forward, arena))
    assert calls == dict.fromkeys(KERNELS, 0)


def test_f64_keeps_numpy_s_steps(calls):
    thunk, arena, forward = laid_with_reserve("gru", "f64", backward_params("gru"))
    host_fallback.execute(thunk, _saved(thunk, forward, arena))
    assert calls == dict.fromkeys(KERNELS, 0)


def test_the_kernels_refuse_shapes_that_do_not_fit_before_writing():
    S, B, H, f32 = 3, 2, 4, np.float32
    seq = lambda *shape: np.zeros(shape, f32)  # noqa: E731
    lens, kept = np.empty(0, np.int64), seq(S, B, H)
    out = np.full((S, B, H), 7, f32)
    with pytest.raises(ValueError, match="gru_sequence: the arrays' shapes do not fit together"):
        jit_rnn_sequence.gru_sequence(seq(S, B, 3 * H), seq(3 * H, H + 1), seq(3 * H), seq(B, H), lens, False, out,
                                      True, kept, kept, 16)
    with pytest.raises(ValueError, match="rnn_sequence: the arrays' shapes do not fit together"):
        jit_rnn_sequence.rnn_sequence(seq(S, B, H), seq(H, H), seq(B + 1, H), lens, False, out, True, kept, 16)
    assert np.all(out == 7)
    grads = np.full((S, B, 3 * H), 7, f32)
    with pytest.raises(ValueError, match="gru_sequence_backward: the arrays' shapes do not fit together"):
        jit_rnn_sequence.gru_sequence_backward(seq(S, B, 3 * H), kept, kept, seq(3 * H, H), seq(S, B, H + 1),
                                               seq(B, H), lens, False, grads, grads, 16)
    with pytest.raises(ValueError, match="rnn_sequence_backward: the arrays' shapes do not fit together"):
        jit_rnn_sequence.rnn_sequence_backward(seq(S, B, H), seq(H, H), seq(S, B, H), seq(B, H), lens, False,
                                               grads, 16)
    assert np.all(grads == 7)
