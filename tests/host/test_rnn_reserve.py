"""The host's lstm/gru/rnn with a saved forward (ABI.md §9.1): a training forward writes the reserve, the
backward reads it instead of running the forward again. Its gradients against the backward that recomputes
(equal to rounding: the recompute's checkpoint pass runs the plain forward's loops, and the compiled small lstm's
forward rounds differently), its outputs against the forward without a reserve, and the same bytes on every run."""
from __future__ import annotations

import numpy as np
import pytest

import host_fallback
from host_fallback.abi import regions
from support.gradient_check import read
from support.rnn_backward_cases import backward_params, laid_with_reserve, run_forward

_ACTIVATIONS = [["hard_sigmoid", 0.2, 0.5], ["elu", 1.0, 0.0], ["softsign", 0.0, 0.0],
                ["sigmoid", 0.0, 0.0], ["scaled_tanh", 1.5, 0.7], ["tanh", 0.0, 0.0]]
CASES = [
    *[(op, {}) for op in ("lstm", "gru", "rnn")],
    *[(op, dict(seq_lens=[5, 2, 0])) for op in ("lstm", "gru", "rnn")],
    *[(op, dict(clip=0.5)) for op in ("lstm", "gru", "rnn")],
    ("rnn", dict(reverse=True, bidirectional=False, seq_lens=[4, 1, 5], relu=True)),
    ("gru", dict(linear_before_reset=False, clip=0.8, seq_lens=[3, 5, 1])),
    ("lstm", dict(peepholes=True)), ("lstm", dict(proj_size=2, w_hr=True)), ("lstm", dict(input_forget=True)),
    ("lstm", dict(activations=_ACTIVATIONS)), ("lstm", dict(num_layers=1, carry=False)),
]
IDS = [f"{op}-{'.'.join(k for k in e) or 'base'}" for op, e in CASES]


def _without_reserve(thunk: dict) -> dict:
    return {k: v for k, v in thunk.items() if k not in ("reserve", "reserve_bytes")}


def _laid(op: str, dtype: str, extra: dict) -> tuple[dict, np.ndarray, dict]:
    return laid_with_reserve(op, dtype, backward_params(op, **extra))


def _gradients(thunk: dict, arena: np.ndarray) -> dict[str, np.ndarray]:
    out = arena.copy()
    host_fallback.execute(thunk, out)
    return {f: v for f, v in read(thunk, out).items() if f.startswith("d_") and f != "d_dst"}


@pytest.mark.parametrize("dtype", ["f64", "f32", "bf16"])
@pytest.mark.parametrize("op,extra", CASES, ids=IDS)
def test_gradients_read_from_the_reserve_match_the_recomputed_ones(op, extra, dtype):
    thunk, arena, forward = _laid(op, dtype, extra)
    start, end = thunk["reserve"], thunk["reserve"] + thunk["reserve_bytes"]
    saved = arena.copy()
    saved[start:end] = run_forward(forward, arena)[start:end]
    got, expected = _gradients(thunk, saved), _gradients(_without_reserve(thunk), arena)
    assert set(got) == set(expected)
    for name in expected:  # the same recurrences but for the checkpoint pass's rounding: a few units of the last place
        tol = (1e-12 if dtype == "f64" else 1e-5) * (np.abs(expected[name]).max() + 1e-30)
        np.testing.assert_allclose(got[name], expected[name], rtol=0, atol=tol, err_msg=name)


@pytest.mark.parametrize("op,extra", CASES, ids=IDS)
def test_the_forward_writing_a_reserve_gives_the_outputs_of_one_without(op, extra):
    _, arena, forward = _laid(op, "f64", extra)
    with_reserve, without = run_forward(forward, arena), run_forward(_without_reserve(forward), arena)
    for r in regions(_without_reserve(forward)):
        if r.writes:
            np.testing.assert_allclose(read(forward, with_reserve)[r.field], read(forward, without)[r.field],
                                       rtol=1e-12, atol=1e-12, err_msg=r.field)


@pytest.mark.parametrize("op,extra", [CASES[0], CASES[4], CASES[8], CASES[12]], ids=[IDS[0], IDS[4], IDS[8], IDS[12]])
def test_the_reserve_and_the_gradients_are_the_same_bytes_on_every_run(op, extra):
    thunk, arena, forward = _laid(op, "f32", extra)
    first, second = run_forward(forward, arena), run_forward(forward, arena)
    assert np.array_equal(first, second)
    start, end = thunk["reserve"], thunk["reserve"] + thunk["reserve_bytes"]
    arena[start:end] = first[start:end]
    runs = [arena.copy(), arena.copy()]
    for run in runs:
        host_fallback.execute(thunk, run)
    assert np.array_equal(runs[0], runs[1])
