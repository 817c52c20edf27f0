"""Code nobody here wrote: Hugging Face transformers' MambaForCausalLM and Mamba2ForCausalLM (tiny random
configs, their pure-torch paths) with their mixers' convolution and scan functions routed to rlx_gpu.torch give
the logits, the greedy generation and the gradients of the unpatched models, on the host and on OpenCL.

The mixers call module-level functions (``causal_conv1d_fn`` and ``causal_conv1d_update`` in both, written with
Dao-AILab causal-conv1d's arguments; ``mamba_selective_scan`` and ``mamba_selective_state_update`` in
modeling_mamba, ``mamba2_chunk_scan`` and ``mamba2_selective_state_update`` in modeling_mamba2, with mamba_ssm's);
the patch replaces exactly those call sites with thin adapters over rlx_gpu.torch. The decode step's convolution
runs on Hugging Face's cache of ``width`` columns in place (``causal_conv1d_update``: the whole buffer shifts).
"""
from __future__ import annotations

import collections

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is in the test extra: "
                                                          "pip install -e '.[test]'")

from transformers.models.mamba import modeling_mamba  # noqa: E402
from transformers.models.mamba2 import modeling_mamba2  # noqa: E402

from rlx_gpu.runtime.registry import status  # noqa: E402
from rlx_gpu.torch import (causal_conv1d_fn, causal_conv1d_update, mamba_chunk_scan_combined,  # noqa: E402
                           selective_scan_fn, selective_state_update)

CALLS: collections.Counter[str] = collections.Counter()


@pytest.fixture(autouse=True)
def one_thread():
    """The models' matrices are tiny: torch's thread pool only contends with other processes on a busy machine
    (a 20-token generate takes seconds with two threads on a loaded two-core machine, 0.2 s with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def mamba_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
               return_last_state=False, **_torch_only_choices):
    CALLS["selective_scan_fn"] += 1
    return selective_scan_fn(hidden_states, dt, A, B, C, D=D, z=z, delta_bias=delta_bias,
                             delta_softplus=delta_softplus, return_last_state=return_last_state)


def state_update(state, hidden_states, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False, z=None, **_):
    CALLS["selective_state_update"] += 1
    return selective_state_update(state, hidden_states, dt, A, B, C, D=D, z=z, dt_bias=dt_bias,
                                  dt_softplus=dt_softplus)


def mamba2_scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
                dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, z=None, seq_idx=None, **_):
    CALLS["mamba_chunk_scan_combined"] += 1
    return mamba_chunk_scan_combined(hidden_states, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias,
                                     initial_states=initial_states, seq_idx=seq_idx, dt_softplus=dt_softplus,
                                     dt_limit=dt_limit, return_final_states=return_final_states)


def conv_fn(hidden_states, weight, bias=None, activation=None, seq_idx=None, **_attention_kwargs):
    CALLS["causal_conv1d_fn"] += 1
    return causal_conv1d_fn(hidden_states, weight, bias, seq_idx=seq_idx, activation=activation)


def conv_update(hidden_states, conv_state, weight, bias=None, activation=None):
    CALLS["causal_conv1d_update"] += 1
    return causal_conv1d_update(hidden_states, conv_state, weight, bias, activation=activation)


def routed(monkeypatch):
    """Route both mixers' convolution and scan calls to rlx_gpu.torch for the rest of the test."""
    for module in (modeling_mamba, modeling_mamba2):
        monkeypatch.setattr(module, "causal_conv1d_fn", conv_fn)
        monkeypatch.setattr(module, "causal_conv1d_update", conv_update)
    monkeypatch.setattr(modeling_mamba, "mamba_selective_scan", mamba_scan)
    monkeypatch.setattr(modeling_mamba, "mamba_selective_state_update", state_update)
    monkeypatch.setattr(modeling_mamba2, "mamba2_chunk_scan", mamba2_scan)
    monkeypatch.setattr(modeling_mamba2, "mamba2_selective_state_update", state_update)
    CALLS.clear()


def tiny(kind: str):
    torch.manual_seed(0)
    if kind == "mamba":
        config = transformers.MambaConfig(vocab_size=48, hidden_size=16, state_size=4, num_hidden_layers=2,
                                          intermediate_size=32, time_step_rank=4, conv_kernel=3, use_mambapy=False)
        return transformers.MambaForCausalLM(config).eval()
    config = transformers.Mamba2Config(vocab_size=48, hidden_size=16, num_heads=4, head_dim=8, expand=2, n_groups=2,
                                       state_size=4, chunk_size=4, num_hidden_layers=2, conv_kernel=3)
    return transformers.Mamba2ForCausalLM(config).eval()


#: the rlx_gpu.torch function each model's prefill and decode go through
ROUTES = {"mamba": ("selective_scan_fn", "selective_state_update"),
          "mamba2": ("mamba_chunk_scan_combined", "selective_state_update")}
DEVICES = ["host", "opencl"]


def on(device, monkeypatch):
    if device == "opencl" and not status("opencl").available:
        pytest.fail(f"OpenCL is unavailable: {status('opencl').reason}")
    monkeypatch.setenv("RLX_DEVICE", device)
PROMPT = torch.tensor([[3, 17, 5, 9, 30, 2, 11], [8, 1, 44, 7, 7, 19, 25]])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_routed_logits_match_the_unpatched_model(kind, device, monkeypatch):
    model = tiny(kind)
    with torch.no_grad():
        expected = model(PROMPT).logits
        on(device, monkeypatch)
        routed(monkeypatch)
        got = model(PROMPT).logits
    assert CALLS[ROUTES[kind][0]] == CALLS["causal_conv1d_fn"] == 2  # one convolution and scan per layer
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_routed_generate_matches_20_tokens_token_for_token(kind, device, monkeypatch):
    model = tiny(kind)
    settings = {"max_new_tokens": 20, "do_sample": False, "pad_token_id": 0}
    expected = model.generate(PROMPT, **settings)
    on(device, monkeypatch)
    routed(monkeypatch)
    got = model.generate(PROMPT, **settings)
    prefill, decode = ROUTES[kind]
    assert CALLS[prefill] == CALLS["causal_conv1d_fn"] == 2
    assert CALLS[decode] == CALLS["causal_conv1d_update"] == 2 * 19  # the caches are updated in place each step
    assert got.shape == (2, PROMPT.shape[1] + 20)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_one_optimizer_step_through_rlx_gpu_gives_the_same_gradients(kind, device, monkeypatch):
    on(device, monkeypatch)
    grads, after = [], []
    for route in (False, True):
        model = tiny(kind).train()
        if route:
            routed(monkeypatch)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = model(PROMPT, labels=PROMPT).loss
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        optimizer.step()
        after.append({n: p.detach().clone() for n, p in model.named_parameters()})
    assert CALLS[ROUTES[kind][0]] == CALLS["causal_conv1d_fn"] == 2
    assert grads[0].keys() == grads[1].keys() and any("A_log" in n for n in grads[1])
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-3, atol=1e-5, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(after[1][name], after[0][name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_the_routed_model_compiles_whole_to_the_unpatched_loss_and_gradients(kind, monkeypatch):
    """The model under torch.compile(fullgraph=True): no graph break around rlx_gpu's ops, the same loss and
    gradients as the unpatched eager model."""
    monkeypatch.setenv("RLX_DEVICE", "host")
    model = tiny(kind).train()
    loss = model(PROMPT, labels=PROMPT).loss
    loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    routed(monkeypatch)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)  # a graph break raises
    got = compiled(PROMPT, labels=PROMPT).loss
    got.backward()
    assert CALLS[ROUTES[kind][0]] == CALLS["causal_conv1d_fn"] == 2  # traced once per layer
    torch.testing.assert_close(got, loss, rtol=1e-5, atol=1e-6)
    for name, grad in expected.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, rtol=1e-3, atol=1e-5,
                                   msg=lambda m: f"{name}: {m}")
