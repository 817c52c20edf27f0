"""The host's recurrent backward without a saved forward, checkpointed in chunks of steps
(host_fallback/rnn_backward_passes.py; every thunk here past ``KEPT_WHOLE_ROWS``, which keeps a short one's every
step instead: the last tests): its gradients against the float64 conformance reference (written from
ABI.md, no host code) across chunk boundaries (a sequence shorter than a chunk, one chunk exactly, a last chunk
of one step or a few, lengths ending on either side of a boundary, both directions, two layers), against the
backward reading a reserve (the whole sequence as one chunk), the same bytes on every run, and the memory it
holds against the forward's."""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import host_fallback
import rlx_gpu
from host_fallback import rnn_backward_checkpoints, rnn_backward_passes
from host_fallback.abi import complete, forward_thunk, regions
from host_fallback.rnn_backward_passes import MIN_CHUNK_STEPS, chunk_steps, reserve_chunk_steps, time_chunks
from rlx_gpu.conformance.references import REFERENCES
from support.gradient_check import read
from support.rnn_backward_cases import backward_params, laid_backward

K = MIN_CHUNK_STEPS  # the chunk of every sequence below (up to K*K steps)


@pytest.fixture(autouse=True)
def checkpointed(monkeypatch):
    """Every thunk checkpoints (none within ``KEPT_WHOLE_ROWS``) but where a test sets it again."""
    monkeypatch.setattr(rnn_backward_passes, "KEPT_WHOLE_ROWS", 0)


def _gradients(thunk: dict, arena: np.ndarray) -> dict[str, np.ndarray]:
    out = arena.copy()
    host_fallback.execute(thunk, out)
    return {f: v for f, v in read(thunk, out).items() if f.startswith("d_") and f != "d_dst"}


def _reference(thunk: dict, arena: np.ndarray) -> dict[str, np.ndarray]:
    values = read(thunk, arena)
    return REFERENCES[thunk["op"]](complete(thunk), lambda f: values[f])


@pytest.mark.parametrize("seq", [1, 7, 300])
def test_the_chunks_cover_the_steps_in_order_about_sqrt_seq_apart(seq):
    steps = chunk_steps(seq)
    chunks = time_chunks(seq, steps)
    assert chunks[0][0] == 0 and chunks[-1][1] == seq
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    assert all(0 < t1 - t0 <= steps for t0, t1 in chunks)
    assert steps == max(K, int(np.ceil(np.sqrt(seq))))


SEQS = [(10, None), (K, None), (K + 1, None), (2 * K + 5, [2 * K + 5, K, K + 1, 0]),
        (3 * K - 1, [K - 1, 3 * K - 1, 2 * K, 1])]
CASES = [(op, seq, lens) for op in ("lstm", "gru", "rnn") for seq, lens in SEQS]


@pytest.mark.parametrize("op,seq,lens", CASES, ids=[f"{op}-S{seq}{'-lens' if lens else ''}" for op, seq, lens in CASES])
def test_the_chunked_gradients_match_the_float64_reference(op, seq, lens):
    extra = dict(seq=seq, batch=4, **({"seq_lens": lens} if lens else {}))
    thunk, arena = laid_backward(op, "f64", backward_params(op, **extra), seed=5)
    got, want = _gradients(thunk, arena), _reference(thunk, arena)
    assert set(got) == set(want)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-9, atol=1e-11, err_msg=f"{op} {name}")


FIELDS = [("lstm", dict(peepholes=True, clip=0.8)), ("lstm", dict(proj_size=2, w_hr=True, reverse=True,
                                                                 bidirectional=False)),
          ("lstm", dict(input_forget=True, num_layers=3)), ("gru", dict(linear_before_reset=False, clip=0.5)),
          ("rnn", dict(relu=True, bidirectional=False, num_layers=1))]


@pytest.mark.parametrize("lens", [False, True], ids=["every-step", "lens"])
@pytest.mark.parametrize("op,extra", FIELDS, ids=[f"{op}-{'.'.join(e)}" for op, e in FIELDS])
def test_version_2_fields_across_chunks_match_the_float64_reference(op, extra, lens):
    """With lengths the checkpoint pass runs the backward's own recurrences; without, the plain forward's loops
    (rnn_backward_checkpoints), which must leave the inputs (the carried states among them) as they were."""
    seq = 2 * K + 3
    extra = dict(extra, seq_lens=[seq, K, 0, K + 2]) if lens else extra
    thunk, arena = laid_backward(op, "f64", backward_params(op, seq=seq, batch=4, **extra))
    inputs = {f: v.copy() for f, v in read(thunk, arena).items() if not f.startswith("d_") or f == "d_dst"}
    out = arena.copy()
    host_fallback.execute(thunk, out)
    got, want = read(thunk, out), _reference(thunk, arena)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-9, atol=1e-11, err_msg=f"{op} {name}")
    for name, value in inputs.items():  # read only: h0 and c0 keep the initial states
        np.testing.assert_array_equal(got[name], value, err_msg=f"{op} {name}")


@pytest.mark.parametrize("reserve_chunks", [1, 3], ids=["reserve-whole", "reserve-in-3-chunks"])
@pytest.mark.parametrize("dtype", ["f64", "f32"])
@pytest.mark.parametrize("op", ["lstm", "gru", "rnn"])
def test_the_chunked_gradients_match_the_ones_read_from_a_reserve(op, dtype, reserve_chunks, monkeypatch):
    """The reserve is read a chunk of at least ``RESERVE_CHUNK_ROWS`` rows at a time: here the whole sequence, or
    chunks of K steps (a long sequence's several)."""
    if reserve_chunks > 1:
        monkeypatch.setattr(rnn_backward_passes, "RESERVE_CHUNK_ROWS", 4 * K)
    params = backward_params(op, seq=2 * K + 5, batch=4, seq_lens=[2 * K + 5, K, 1, 2 * K])
    assert len(time_chunks(params["seq"], reserve_chunk_steps(params["seq"], 4))) == reserve_chunks
    need = rlx_gpu.reserve_bytes({"op": op, "dtype": dtype, **params})
    saved, arena = laid_backward(op, dtype, {**params, "reserve": True, "reserve_bytes": need})
    forward = dict(forward_thunk(saved), dst=-(-arena.size // 16) * 16)
    dst = next(r for r in regions(forward) if r.field == "dst")
    longer = np.zeros(dst.offset + dst.nbytes, np.uint8)
    longer[:arena.size] = arena
    host_fallback.execute(forward, longer)  # writes the reserve (and carries the states in place: not kept)
    start, end = saved["reserve"], saved["reserve"] + saved["reserve_bytes"]
    with_reserve = arena.copy()
    with_reserve[start:end] = longer[start:end]
    plain = {k: v for k, v in saved.items() if k not in ("reserve", "reserve_bytes")}
    got, want = _gradients(plain, arena), _gradients(saved, with_reserve)
    tol = 1e-12 if dtype == "f64" else 1e-5
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=0, atol=tol * np.abs(value).max(), err_msg=name)


@pytest.mark.parametrize("op", ["lstm", "gru", "rnn"])
def test_the_chunked_backward_gives_the_same_bytes_on_every_run(op):
    thunk, arena = laid_backward(op, "f32", backward_params(op, seq=2 * K + 5, batch=4, seq_lens=[9, 2 * K + 5, 0, K]))
    runs = [arena.copy(), arena.copy()]
    for run in runs:
        host_fallback.execute(thunk, run)
    assert np.array_equal(runs[0], runs[1])


def _peak(thunk: dict, arena: np.ndarray) -> int:
    work = arena.copy()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        host_fallback.execute(thunk, work)
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("op", ["lstm", "gru", "rnn"])
def test_the_backward_holds_within_twice_the_forward_s_memory_at_a_long_sequence(op):
    """Every step's gates (lstm: 8 arrays of [seq, batch, hidden] a layer-direction) would be several
    times the forward's layer outputs; a chunk's are a small part of them."""
    params = backward_params(op, seq=768, batch=8, input_size=32, hidden=32, carry=False, clip=1.0)
    thunk, arena = laid_backward(op, "f32", params)
    assert _peak(thunk, arena) <= 2 * _peak(forward_thunk(thunk), arena)


@pytest.mark.parametrize("op", ["lstm", "gru", "rnn"])
def test_within_kept_whole_rows_every_step_is_kept_and_nothing_is_checkpointed(op, monkeypatch):
    """Up to ``KEPT_WHOLE_ROWS`` rows the forward that writes a reserve runs into the backward's own arrays (no
    checkpoint pass); one row more, the checkpoint pass runs."""
    seen: list[int] = []
    checkpoint_pass = rnn_backward_checkpoints.checkpoint_pass
    monkeypatch.setattr(rnn_backward_checkpoints, "checkpoint_pass", lambda *a, **k: seen.append(1) or
                        checkpoint_pass(*a, **k))
    seq, batch = 2 * K + 3, 4
    thunk, arena = laid_backward(op, "f64", backward_params(op, seq=seq, batch=batch), seed=5)
    for rows, checkpoints in ((seq * batch, False), (seq * batch - 1, True)):
        monkeypatch.setattr(rnn_backward_passes, "KEPT_WHOLE_ROWS", rows)
        seen.clear()
        got, want = _gradients(thunk, arena), _reference(thunk, arena)
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-9, atol=1e-11, err_msg=f"{op} {name} {rows}")
        assert bool(seen) == checkpoints, rows


@pytest.mark.parametrize("op", ["lstm", "gru", "rnn"])
def test_kept_whole_the_backward_gives_the_same_bytes_on_every_run(op, monkeypatch):
    monkeypatch.setattr(rnn_backward_passes, "KEPT_WHOLE_ROWS", 4096)
    thunk, arena = laid_backward(op, "f32", backward_params(op, seq=2 * K + 5, batch=4, seq_lens=[9, 2 * K + 5, 0, K]))
    runs = [arena.copy(), arena.copy()]
    for run in runs:
        host_fallback.execute(thunk, run)
    assert np.array_equal(runs[0], runs[1])
