"""host_fallback lstm_backward / gru_backward / rnn_backward (ABI.md §9) against float64 central finite
differences of the conformance reference's forward, and against torch autograd of nn.LSTM/GRU/RNN in float64.

Every ``d_`` output is checked, the initial state's gradients included, along a random direction per
input (one directional derivative covers every element of it: an error in any element shows unless
it is orthogonal to a random vector). The version-2 cases run for the fields the float64 reference
implements (``reference_rnn.V2_FIELDS``), and every such field has one.
"""
from __future__ import annotations

import numpy as np
import pytest

import host_fallback
from host_fallback.abi import OPS
from rlx_gpu.conformance.references import V2_FIELDS
from support.gradient_check import check_finite_differences, copy_inputs, read
from support.rnn_backward_cases import backward_params, laid_backward, torch_gradients

SEQ_LENS = [5, 2, 0]  # a full row, a short one, an empty one (its final state is its initial state)


def _backward(thunk: dict, arena: np.ndarray) -> dict[str, np.ndarray]:
    out = arena.copy()
    host_fallback.execute(thunk, out)
    return {f: v for f, v in read(thunk, out).items() if f.startswith("d_") and f != "d_dst"}


def _check_finite_differences(op: str, params: dict, seed: int = 0) -> None:
    thunk, arena = laid_backward(op, "f64", params, seed)
    check_finite_differences(thunk, arena, _backward(thunk, arena), seed)


V1 = [
    ("lstm", {}), ("gru", {}), ("rnn", {}), ("rnn", dict(relu=True, num_layers=1)),
    ("gru", dict(bidirectional=False, carry=False)), ("lstm", dict(num_layers=1, carry=False)),
]


@pytest.mark.parametrize("op,extra", V1, ids=[f"{op}-{'.'.join(map(str, e.items())) or 'base'}" for op, e in V1])
def test_every_gradient_matches_central_finite_differences(op, extra):
    _check_finite_differences(op, backward_params(op, **extra))


_ACTIVATIONS = {
    "lstm": [["hard_sigmoid", 0.2, 0.5], ["elu", 1.0, 0.0], ["softsign", 0.0, 0.0],
             ["sigmoid", 0.0, 0.0], ["scaled_tanh", 1.5, 0.7], ["tanh", 0.0, 0.0]],
    "gru": [["leaky_relu", 0.01, 0.0], ["scaled_tanh", 1.5, 0.7], ["sigmoid", 0.0, 0.0], ["affine", 0.7, 0.1]],
    "rnn": [["softplus", 0.0, 0.0], ["thresholded_relu", 0.1, 0.0]],
}
#: (op, the version-2 fields a case exercises, its params)
V2 = [
    *[(op, {"seq_lens"}, dict(seq_lens=SEQ_LENS)) for op in ("lstm", "gru", "rnn")],
    *[(op, {"reverse", "seq_lens"}, dict(reverse=True, bidirectional=False, seq_lens=[4, 1, 5]))
      for op in ("lstm", "gru", "rnn")],
    *[(op, {"clip"}, dict(clip=0.5)) for op in ("lstm", "gru", "rnn")],
    *[(op, {"activations"}, dict(activations=_ACTIVATIONS[op])) for op in ("lstm", "gru", "rnn")],
    ("gru", {"linear_before_reset"}, dict(linear_before_reset=False)),
    ("gru", {"linear_before_reset", "clip", "seq_lens"}, dict(linear_before_reset=False, clip=0.8, seq_lens=[3, 5, 1])),
    ("lstm", {"peepholes"}, dict(peepholes=True)),
    ("lstm", {"input_forget", "peepholes"}, dict(input_forget=True, peepholes=True)),
    ("lstm", {"proj_size", "w_hr"}, dict(proj_size=3, w_hr=True)),
    ("lstm", {"proj_size", "w_hr", "peepholes", "seq_lens", "clip"},
     dict(proj_size=2, w_hr=True, peepholes=True, seq_lens=[1, 5, 3], clip=0.7)),
]
V2_RUN = [case for case in V2 if case[1] <= V2_FIELDS.get(case[0], frozenset())]


def test_version_2_fields_match_central_finite_differences():
    """Every case of a field the reference implements, and a case for every such field."""
    for op, fields, extra in V2_RUN:
        _check_finite_differences(op, backward_params(op, **extra))
    # the saved forward (reserve) changes no gradient: test_rnn_reserve checks it against the recomputed ones
    for op in ("lstm", "gru", "rnn"):
        for field in V2_FIELDS.get(op, frozenset()) & set(OPS[op].defaults) - {"reserve", "reserve_bytes"}:
            assert any(op == o and field in fields for o, fields, _ in V2_RUN), f"no backward case of {op} {field}"


# --- torch autograd -----------------------------------------------------------------------------------
TORCH = [("lstm", {}), ("gru", {}), ("rnn", {}), ("rnn", dict(relu=True)), ("lstm", dict(seq_lens=[5, 2, 3])),
         ("gru", dict(seq_lens=[1, 5, 4]))]
TORCH_PROJ = [("lstm", dict(proj_size=3, w_hr=True))]


@pytest.mark.parametrize("op,extra", TORCH + TORCH_PROJ,
                         ids=[f"{op}-{'.'.join(e) or 'base'}" for op, e in TORCH + TORCH_PROJ])
def test_every_gradient_matches_torch_autograd(op, extra):
    thunk, arena = laid_backward(op, "f64", backward_params(op, **extra), seed=3)
    grads = _backward(thunk, arena)
    want = torch_gradients(op, thunk, read(thunk, arena))
    assert set(want) == set(grads)
    for name, value in want.items():
        np.testing.assert_allclose(grads[name], value, rtol=1e-10, atol=1e-12, err_msg=f"{op} {name}")


# --- dtypes and determinism ---------------------------------------------------------------------------
#: NMSE of each gradient of a 16-bit / f32 thunk against the f64 backward on the same stored inputs: the
#: outputs are rounded once (bf16 2^-8, f16 2^-11 relative) and everything before that is f32.
NMSE = {"f32": 1e-10, "f16": 1e-6, "bf16": 1e-4}


@pytest.mark.parametrize("dtype", list(NMSE))
@pytest.mark.parametrize("op,extra", [("lstm", dict(seq_lens=SEQ_LENS, proj_size=3, w_hr=True)), ("gru", {})],
                         ids=["lstm", "gru"])
def test_each_dtype_accumulates_in_f32_and_gives_the_same_bytes_twice(op, extra, dtype):
    params = backward_params(op, **extra)
    thunk, arena = laid_backward(op, dtype, params)
    first, second = arena.copy(), arena.copy()
    host_fallback.execute(thunk, first)
    host_fallback.execute(thunk, second)
    assert np.array_equal(first, second)
    wide, wide_arena = laid_backward(op, "f64", params)
    copy_inputs(thunk, arena, wide, wide_arena)  # the f64 thunk gets the values the narrow one stores
    want, got = _backward(wide, wide_arena), read(thunk, first)
    for name, value in want.items():
        err = np.mean((got[name] - value) ** 2) / max(np.mean(value ** 2), 1e-30)
        assert err <= NMSE[dtype], (name, err)
