"""rlx_gpu.torch's LSTM, GRU and RNN in training save their forward (ABI.md §9.1's reserve) for the backward
to read; ``recompute=True``, eval mode and ``torch.no_grad()`` save none. Gradients against torch.nn's."""
from __future__ import annotations

import pytest
import torch

import host_fallback.rnn_reserve
from rlx_gpu.torch import nn as rnn

MODULES = {"LSTM": rnn.LSTM, "GRU": rnn.GRU, "RNN": rnn.RNN}


@pytest.fixture
def reserves(monkeypatch):
    """Counts of the reserves the host wrote (``save``) and read (``load``)."""
    counts = {"save": 0, "load": 0}
    for name in counts:
        real = getattr(host_fallback.rnn_reserve, name)

        def spy(*args, _real=real, _name=name):
            counts[_name] += 1
            return _real(*args)
        monkeypatch.setattr(host_fallback.rnn_reserve, name, spy)
    return counts


@pytest.mark.parametrize("name", MODULES)
@pytest.mark.parametrize("recompute", [False, True])
def test_training_reads_the_saved_forward_unless_asked_to_recompute(name, recompute, reserves, monkeypatch):
    monkeypatch.setenv("RLX_DEVICE", "host")
    torch.manual_seed(0)
    ours = MODULES[name](5, 6, num_layers=2, bidirectional=True, batch_first=True, recompute=recompute).double()
    ref = getattr(torch.nn, name)(5, 6, num_layers=2, bidirectional=True, batch_first=True).double()
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    grads = []
    for module in (ours, ref):
        xs = x.clone().requires_grad_()
        y, _ = module(xs)
        (y * y).sum().backward()
        grads.append([xs.grad, *(p.grad for p in module.parameters())])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    assert reserves == ({"save": 0, "load": 0} if recompute else {"save": 1, "load": 1})


def test_eval_mode_and_no_grad_save_nothing(reserves, monkeypatch):
    monkeypatch.setenv("RLX_DEVICE", "host")
    module = rnn.GRU(5, 6, batch_first=True)
    x = torch.randn(2, 3, 5, requires_grad=True)
    with torch.no_grad():
        module(x)
    module.eval()
    module(x)[0].sum().backward()  # eval with autograd: the backward recomputes
    assert reserves == {"save": 0, "load": 0} and x.grad is not None
