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


def _count_reserves(monkeypatch, save, load) -> dict[str, int]:
    """Counts of the reserves the host's forward (module ``save``) wrote and its backward (``load``) read, by
    spying on their ``reserve_views``."""
    counts = {"save": 0, "load": 0}
    for name, module in (("save", save), ("load", load)):
        real = module.reserve_views

        def spy(*args, _real=real, _name=name):
            views = _real(*args)
            counts[_name] += views is not None
            return views
        monkeypatch.setattr(module, "reserve_views", spy)
    return counts


def _check_saved_against_recomputed(gradients, counts: dict[str, int], saving: bool) -> None:
    """``gradients(recompute)`` (a training call's, on the host) equal with ``recompute`` False and True within
    rounding; the reserve written and read once (``counts``: ``_count_reserves``') where ``saving``, else never."""
    once = {"save": 1, "load": 1} if saving else {"save": 0, "load": 0}
    saved = gradients(False)
    assert counts == once
    recomputed = gradients(True)
    assert counts == once
    for got, want in zip(saved, recomputed):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


@pytest.fixture
def mamba2_reserves(monkeypatch):
    """Counts of the mamba2 reserves the host's forward wrote (``save``) and its backward read (``load``)."""
    import host_fallback.mamba2_backward
    import host_fallback.ssm
    return _count_reserves(monkeypatch, host_fallback.ssm, host_fallback.mamba2_backward)


def _chunk_scan_grads(recompute: bool, seq_idx: bool = False) -> list[torch.Tensor]:
    from rlx_gpu.torch.ssm import mamba_chunk_scan_combined
    gen = torch.Generator().manual_seed(0)
    b, s, h, p, n = 2, 150, 2, 3, 4
    x, z = (torch.randn(b, s, h, p, generator=gen, dtype=torch.float64) for _ in range(2))
    dt = torch.rand(b, s, h, generator=gen, dtype=torch.float64) * 0.5
    a = -torch.rand(h, generator=gen, dtype=torch.float64) - 0.1
    bc = [torch.randn(b, s, 1, n, generator=gen, dtype=torch.float64) for _ in range(2)]
    d, init = torch.randn(h, generator=gen, dtype=torch.float64), torch.randn(b, h, p, n, generator=gen, dtype=torch.float64)
    leaves = [t.requires_grad_() for t in (x, dt, a, *bc, d, z, init)]
    index = (torch.arange(s) >= 70).to(torch.int32).expand(b, s).contiguous() if seq_idx else None
    y, final = mamba_chunk_scan_combined(*leaves[:5], 64, D=d, z=z, initial_states=init, dt_softplus=True,
                                         seq_idx=index, return_final_states=True, recompute=recompute)
    ((y * y).sum() + (final * final).sum()).backward()
    return [t.grad for t in leaves]


@pytest.mark.parametrize("seq_idx", [False, True], ids=["batch", "seq_idx"])
def test_mamba_chunk_scan_combined_reads_the_saved_forward_unless_asked_to_recompute(seq_idx, mamba2_reserves,
                                                                                    monkeypatch):
    monkeypatch.setenv("RLX_DEVICE", "host")
    _check_saved_against_recomputed(lambda recompute: _chunk_scan_grads(recompute, seq_idx), mamba2_reserves,
                                    not seq_idx)


def test_mamba_chunk_scan_combined_under_no_grad_saves_nothing(mamba2_reserves, monkeypatch):
    monkeypatch.setenv("RLX_DEVICE", "host")
    with torch.no_grad():
        from rlx_gpu.torch.ssm import mamba_chunk_scan_combined
        x = torch.randn(1, 70, 2, 3)
        mamba_chunk_scan_combined(x, torch.rand(1, 70, 2), -torch.rand(2), torch.randn(1, 70, 1, 4),
                                  torch.randn(1, 70, 1, 4), 64)
    assert mamba2_reserves == {"save": 0, "load": 0}


@pytest.mark.parametrize("recompute", [False, True])
def test_selective_scan_fn_reads_the_saved_forward_unless_asked_to_recompute(recompute, monkeypatch):
    import host_fallback.selective_scan_backward
    from rlx_gpu.torch.ssm import selective_scan_fn
    monkeypatch.setenv("RLX_DEVICE", "host")
    counts = {"load": 0}
    real = host_fallback.selective_scan_backward.reserve_views

    def spy(*args):
        views = real(*args)
        counts["load"] += views is not None
        return views
    monkeypatch.setattr(host_fallback.selective_scan_backward, "reserve_views", spy)
    gen = torch.Generator().manual_seed(0)
    b, d, n, s = 2, 6, 4, 100
    u, z = (torch.randn(b, d, s, generator=gen, dtype=torch.float64) for _ in range(2))
    delta = torch.rand(b, d, s, generator=gen, dtype=torch.float64) * 0.5
    a = -torch.rand(d, n, generator=gen, dtype=torch.float64) - 0.1
    bc = [torch.randn(b, n, s, generator=gen, dtype=torch.float64) for _ in range(2)]
    grads = []
    for mode in (recompute, True):
        leaves = [t.clone().requires_grad_() for t in (u, delta, a, *bc, z)]
        y, last = selective_scan_fn(*leaves[:5], z=leaves[5], delta_softplus=True, return_last_state=True,
                                    recompute=mode)
        ((y * y).sum() + (last * last).sum()).backward()
        grads.append([t.grad for t in leaves])
    assert counts == {"load": 0 if recompute else 1}
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


@pytest.fixture
def gdn_reserves(monkeypatch):
    """Counts of the gated_delta_net reserves the host's forward wrote (``save``) and its backward read (``load``)."""
    import host_fallback.gdn
    import host_fallback.gdn_backward
    return _count_reserves(monkeypatch, host_fallback.gdn, host_fallback.gdn_backward)


def _delta_rule_grads(function: str, recompute: bool, packed: bool = False) -> list[torch.Tensor]:
    import rlx_gpu.torch.gdn as gdn
    gen = torch.Generator().manual_seed(0)
    b, s, h, hv, n = (1, 100, 2, 4, 3) if packed else (2, 70, 2, 4, 3)
    q, k = (torch.randn(b, s, h, n, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(b, s, hv, n, generator=gen, dtype=torch.float64)
    g = -torch.rand(b, s, hv, *((n,) if function == "chunk_kda" else ()), generator=gen, dtype=torch.float64) * 0.3
    beta = torch.rand(b, s, hv, generator=gen, dtype=torch.float64)
    init = torch.randn(2 if packed else b, hv, n, n, generator=gen, dtype=torch.float64)
    leaves = [t.requires_grad_() for t in (q, k, v, g, beta, init)]
    cu = torch.tensor([0, 40, 100]) if packed else None
    o, final = getattr(gdn, function)(*leaves[:5], initial_state=init, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu, recompute=recompute)
    ((o * o).sum() + (final * final).sum()).backward()
    return [t.grad for t in leaves]


@pytest.mark.parametrize("function,packed", [("chunk_gated_delta_rule", False), ("chunk_kda", False),
                                             ("chunk_gated_delta_rule", True)])
def test_the_delta_rules_read_the_saved_forward_unless_packed_or_asked_to_recompute(function, packed, gdn_reserves,
                                                                                    monkeypatch):
    monkeypatch.setenv("RLX_DEVICE", "host")
    _check_saved_against_recomputed(lambda recompute: _delta_rule_grads(function, recompute, packed), gdn_reserves,
                                    not packed)


def test_a_delta_rule_under_no_grad_saves_nothing(gdn_reserves, monkeypatch):
    from rlx_gpu.torch.gdn import chunk_gated_delta_rule
    monkeypatch.setenv("RLX_DEVICE", "host")
    with torch.no_grad():
        chunk_gated_delta_rule(*(torch.randn(1, 70, 2, 3) for _ in range(3)), -torch.rand(1, 70, 2),
                               torch.rand(1, 70, 2))
    assert gdn_reserves == {"save": 0, "load": 0}
