"""Batch 0 and empty sequences give empty results, as torch.nn and the anchors do: ``torch.nn.LSTM`` with batch 0
returns an empty output and empty states; a function given sequences of no step returns outputs of no step
shaped as usual and its final state equal to its initial state (the state passes through untouched); a decode
step of batch 0 changes no state.

The references are torch.nn's modules themselves and the identities above (no step: nothing happens).
"""
from __future__ import annotations

import pytest
import torch

from support.torch_devices import host  # noqa: F401  (fixture)

import rlx_gpu.torch as rt

F64 = torch.float64


def r(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=F64)


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_the_modules_return_empty_outputs_and_states_for_batch_0_as_torch_nn(kind, batch_first, host):
    torch.manual_seed(0)
    theirs = getattr(torch.nn, kind)(4, 8, num_layers=2, batch_first=batch_first, dtype=F64)
    ours = getattr(rt, kind)(4, 8, num_layers=2, batch_first=batch_first, dtype=F64)
    ours.load_state_dict(theirs.state_dict())
    x = r(0, 5, 4) if batch_first else r(5, 0, 4)
    expected, expected_states = theirs(x)
    out, states = ours(x)
    assert out.shape == expected.shape == ((0, 5, 8) if batch_first else (5, 0, 8))
    for mine, torchs in zip(states if kind == "LSTM" else (states,),
                            expected_states if kind == "LSTM" else (expected_states,)):
        assert mine.shape == torchs.shape == (2, 0, 8) and mine.dtype == torchs.dtype


def test_selective_scan_fn_of_no_step_returns_an_empty_output_and_a_zero_last_state(host):
    u = r(2, 4, 0)
    out, last = rt.selective_scan_fn(u, u, -r(4, 3).abs(), r(2, 3, 0), r(2, 3, 0), D=r(4), z=u,
                                     return_last_state=True)
    assert out.shape == (2, 4, 0)
    assert torch.equal(last, torch.zeros(2, 4, 3, dtype=F64))  # the state selective_scan_fn starts from


def test_selective_scan_fn_of_batch_0_returns_empty_results(host):
    u = r(0, 4, 6)
    out, last = rt.selective_scan_fn(u, u, -r(4, 3).abs(), r(0, 3, 6), r(0, 3, 6), return_last_state=True)
    assert out.shape == (0, 4, 6) and last.shape == (0, 4, 3)


def test_mamba_chunk_scan_combined_of_no_step_passes_the_initial_states_through(host):
    h0 = r(2, 4, 3, 5)
    out, final = rt.mamba_chunk_scan_combined(r(2, 0, 4, 3), r(2, 0, 4), -r(4).abs(), r(2, 0, 2, 5), r(2, 0, 2, 5), 4,
                                              D=r(4), initial_states=h0, return_final_states=True)
    assert out.shape == (2, 0, 4, 3)
    assert torch.equal(final, h0)


def test_mamba_chunk_scan_combined_of_batch_0_returns_empty_results(host):
    out, final = rt.mamba_chunk_scan_combined(r(0, 6, 4, 3), r(0, 6, 4), -r(4).abs(), r(0, 6, 2, 5), r(0, 6, 2, 5), 4,
                                              return_final_states=True)
    assert out.shape == (0, 6, 4, 3) and final.shape == (0, 4, 3, 5)


@pytest.mark.parametrize("pooled", [False, True])
def test_a_decode_step_of_batch_0_returns_an_empty_output_and_changes_no_state(pooled, host):
    state = r(5 if pooled else 0, 4, 3, 5)
    before = state.clone()
    indices = torch.zeros(0, dtype=torch.int32) if pooled else None
    out = rt.selective_state_update(state, r(0, 4, 3), r(0, 4, 3), -r(4, 3, 5).abs(), r(0, 2, 5), r(0, 2, 5),
                                    state_batch_indices=indices)
    assert out.shape == (0, 4, 3)
    assert torch.equal(state, before)


def gdn(batch: int, steps: int, per_channel: bool = False) -> dict[str, torch.Tensor]:
    gate = (batch, steps, 4, 3) if per_channel else (batch, steps, 4)
    return {"q": r(batch, steps, 2, 3), "k": r(batch, steps, 2, 3), "v": r(batch, steps, 4, 2),
            "g": -r(*gate).abs(), "beta": r(batch, steps, 4).sigmoid()}


FLA = [(rt.chunk_gated_delta_rule, False), (rt.fused_recurrent_gated_delta_rule, False), (rt.chunk_kda, True)]


@pytest.mark.parametrize("fn,per_channel", FLA, ids=[f.__name__ for f, _ in FLA])
def test_fla_s_functions_of_no_step_pass_the_initial_state_through_and_its_gradient_back(fn, per_channel, host):
    h0 = r(2, 4, 3, 2).requires_grad_()
    o, final = fn(**gdn(2, 0, per_channel), initial_state=h0, output_final_state=True)
    assert o.shape == (2, 0, 4, 2)
    assert torch.equal(final, h0)
    weights = r(*final.shape)
    (d_h0,) = torch.autograd.grad((weights * final).sum(), h0)
    assert torch.equal(d_h0, weights)


@pytest.mark.parametrize("fn,per_channel", FLA, ids=[f.__name__ for f, _ in FLA])
def test_fla_s_functions_of_batch_0_return_empty_results(fn, per_channel, host):
    o, final = fn(**gdn(0, 5, per_channel), output_final_state=True)
    assert o.shape == (0, 5, 4, 2) and final.shape == (0, 4, 3, 2)


def test_packed_sequences_that_are_all_empty_pass_every_initial_state_through(host):
    h0 = r(3, 4, 3, 2)
    o, final = rt.chunk_gated_delta_rule(**gdn(1, 0), initial_state=h0, output_final_state=True,
                                         cu_seqlens=torch.tensor([0, 0, 0, 0]))
    assert o.shape == (1, 0, 4, 2)
    assert torch.equal(final, h0)
