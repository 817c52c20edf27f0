"""torch.func's grad transforms through rlx_gpu.torch's ops: ``torch.func.grad`` and ``torch.func.vjp`` of a
loss give what ``torch.autograd.grad`` of the same loss gives (float64), for the recurrent modules through
``torch.func.functional_call`` and for the scan functions; ``vmap`` runs an op once per example or is
refused with torch's error, never answered wrongly.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from support.torch_devices import host  # noqa: F401  (fixture)

import rlx_gpu.torch as rt

F64 = torch.float64


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def assert_grads_agree(loss, tensors):
    """``torch.func.grad`` of ``loss(*tensors)`` against every argument equals ``torch.autograd.grad`` of it."""
    theirs = torch.func.grad(loss, argnums=tuple(range(len(tensors))))(*tensors)
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    ours = torch.autograd.grad(loss(*leaves), leaves)
    for i, (a, b) in enumerate(zip(theirs, ours)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m: f"argument {i}: {m}")


@pytest.mark.parametrize("length", [1, 4], ids=["decode", "sequence"])
def test_grad_through_an_lstm_by_functional_call_is_torch_nns(length, host):
    """The gradient of the parameters given to ``functional_call`` (two layers, a decode step and a
    sequence) equals autograd's, and torch.nn.LSTM's under the same transform."""
    ours = rt.LSTM(4, 8, batch_first=True, num_layers=2).double()
    theirs = torch.nn.LSTM(4, 8, batch_first=True, num_layers=2).double()
    theirs.load_state_dict(ours.state_dict())
    x, h, c = randn(2, length, 4, seed=0), randn(2, 2, 8, seed=1), randn(2, 2, 8, seed=2)
    params = {k: v.detach().clone() for k, v in ours.named_parameters()}

    def loss(module):
        def of(p, x):
            y, (hn, cn) = torch.func.functional_call(module, p, (x, (h, c)))
            return y.square().sum() + (hn * cn).sum()
        return of

    grads = torch.func.grad(loss(ours), argnums=(0, 1))(params, x)
    expected = torch.func.grad(loss(theirs), argnums=(0, 1))(params, x)
    leaves = [t.detach().clone().requires_grad_() for t in (*params.values(), x)]
    auto = torch.autograd.grad(loss(ours)(dict(zip(params, leaves)), leaves[-1]), leaves)
    for name, a, b, c in zip([*params, "x"], [*grads[0].values(), grads[1]], auto,
                             [*expected[0].values(), expected[1]]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m: f"d_{name}: {m}")
        torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-10, msg=lambda m: f"d_{name} against torch: {m}")


def test_grad_through_a_gru(host):
    gru = rt.GRU(3, 5, batch_first=True).double()
    params = {k: v.detach().clone() for k, v in gru.named_parameters()}
    h = randn(1, 2, 5, seed=3)

    def loss(x, h, *weights):
        y, hn = torch.func.functional_call(gru, dict(zip(params, weights)), (x, h))
        return y.square().sum() + hn.sum()
    assert_grads_agree(loss, [randn(2, 4, 3, seed=4), h, *params.values()])


def test_grad_through_selective_scan_fn(host):
    batch, dim, length, state = 2, 3, 4, 2
    u, delta, z = (randn(batch, dim, length, seed=s) for s in range(3))
    A = -torch.rand(dim, state, generator=torch.Generator().manual_seed(5), dtype=F64) - 0.2
    B, C = randn(batch, state, length, seed=6), randn(batch, state, length, seed=7)

    def loss(u, delta, A, B, C, D, z):
        out, last = rt.selective_scan_fn(u, delta, A, B, C, D=D, z=z, delta_softplus=True, return_last_state=True)
        return out.square().sum() + last.sum()
    assert_grads_agree(loss, [u, 0.5 * delta, A, B, C, randn(dim, seed=8), z])


def test_grad_through_mamba_chunk_scan_combined(host):
    batch, length, heads, head_dim, state = 1, 5, 2, 3, 4

    def loss(x, dt, A, B, C, h0):
        out, final = rt.mamba_chunk_scan_combined(x, dt, A, B, C, 4, initial_states=h0, dt_softplus=True,
                                                  return_final_states=True)
        return out.square().sum() + final.sum()
    assert_grads_agree(loss, [randn(batch, length, heads, head_dim, seed=0), randn(batch, length, heads, seed=1),
                              -torch.rand(heads, dtype=F64) - 0.2, randn(batch, length, 1, state, seed=2),
                              randn(batch, length, 1, state, seed=3), randn(batch, heads, head_dim, state, seed=4)])


def test_grad_through_chunk_gated_delta_rule(host):
    batch, length, heads, key, value = 1, 5, 2, 3, 4

    def loss(q, k, v, g, beta, h0):
        o, final = rt.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        return o.square().sum() + final.sum()
    k = F.normalize(randn(batch, length, heads, key, seed=1), dim=-1)
    assert_grads_agree(loss, [randn(batch, length, heads, key, seed=0), k, randn(batch, length, heads, value, seed=2),
                              F.logsigmoid(randn(batch, length, heads, seed=3)),
                              torch.sigmoid(randn(batch, length, heads, seed=4)), randn(batch, heads, key, value, seed=5)])


def test_vjp_of_causal_conv1d_fn_is_autograds(host):
    x, weight, bias = randn(2, 3, 6, seed=0), randn(3, 4, seed=1), randn(3, seed=2)
    cotangent = randn(2, 3, 6, seed=3)
    out, pullback = torch.func.vjp(lambda *t: rt.causal_conv1d_fn(*t, activation="silu"), x, weight, bias)
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
    expected = rt.causal_conv1d_fn(*leaves, activation="silu")
    torch.testing.assert_close(out, expected.detach(), rtol=0, atol=0)
    for a, b in zip(pullback(cotangent), torch.autograd.grad(expected, leaves, cotangent)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_vmap_loops_over_an_op_or_refuses_it(host):
    """No op has a batching rule: torch's fallback runs an op of plain tensor arguments once per example
    (warning of the cost), and refuses one with a ``Tensor[]`` (the recurrent ops' weights), naming it."""
    x, weight = randn(2, 1, 3, 6, seed=0), randn(3, 4, seed=1)
    batched = torch.func.vmap(rt.causal_conv1d_fn, in_dims=(0, None))(x, weight)
    torch.testing.assert_close(batched, torch.stack([rt.causal_conv1d_fn(row, weight) for row in x]), rtol=0, atol=0)
    gru = rt.GRU(3, 5, batch_first=True).double()
    with pytest.raises(RuntimeError, match="Batching rule not implemented for rlx_gpu::gru"):
        torch.func.vmap(gru)(randn(2, 1, 4, 3, seed=2))


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # torch.func.jvp's own
def test_forward_mode_ad_is_refused_naming_the_op_and_argument_not_answered_with_a_zero_tangent(host):
    """No op has a forward derivative: ``torch.func.jvp`` and a tangent under ``forward_ad.dual_level`` raise
    (through a module's latest path and a function's direct route alike) instead of a zero tangent; a call of
    no tangent inside a dual level still runs."""
    import torch.autograd.forward_ad as fwAD

    lstm = rt.LSTM(3, 5, batch_first=True).double()
    x, hc = randn(1, 1, 3, seed=0), (randn(1, 1, 5, seed=1), randn(1, 1, 5, seed=2))
    with torch.no_grad():
        for _ in range(3):  # the module's latest path made
            lstm(x, hc)
    with pytest.raises(NotImplementedError, match=r"rlx_gpu::lstm: forward-mode AD .*argument 'x'"):
        torch.func.jvp(lambda t: lstm(t, hc)[0], (x,), (torch.ones_like(x),))
    u, delta = randn(1, 4, 6, seed=3), randn(1, 4, 6, seed=4).abs()
    A, B, C = -randn(4, 3, seed=5).abs(), randn(1, 3, 6, seed=6), randn(1, 3, 6, seed=7)
    with fwAD.dual_level():
        with pytest.raises(NotImplementedError, match="rlx_gpu::selective_scan: forward-mode AD"):
            rt.selective_scan_fn(u, fwAD.make_dual(delta, torch.ones_like(delta)), A, B, C)
        with pytest.raises(NotImplementedError, match="rlx_gpu::lstm: forward-mode AD"):
            lstm(fwAD.make_dual(x, torch.ones_like(x)), hc)
        torch.testing.assert_close(rt.selective_scan_fn(u, delta, A, B, C),
                                   rt.selective_scan_fn(u, delta, A, B, C), rtol=0, atol=0)
        assert lstm(x, hc)[0].shape == (1, 1, 5)


def test_a_second_derivative_is_refused_and_the_first_kept(host):
    """The backward ops have no derivative: a gradient made with ``create_graph=True`` is the plain gradient, and
    differentiating it again (autograd, nested ``torch.func.grad``) raises naming the backward op, where torch's
    fallback warned and gave zeros."""
    u, delta = randn(1, 4, 6, seed=0).requires_grad_(), randn(1, 4, 6, seed=1).abs()
    A, B, C = -randn(4, 3, seed=2).abs(), randn(1, 3, 6, seed=3), randn(1, 3, 6, seed=4)
    y = rt.selective_scan_fn(u, delta, A, B, C, delta_softplus=True)
    g, = torch.autograd.grad(y.square().sum(), u, create_graph=True)
    torch.testing.assert_close(g.detach(), torch.autograd.grad(y.square().sum(), u, retain_graph=True)[0],
                               rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="rlx_gpu::selective_scan_backward has no derivative"):
        torch.autograd.grad(g.sum(), u, allow_unused=True)
    lstm, x = rt.LSTM(3, 4, batch_first=True).double(), randn(2, 5, 3, seed=5).requires_grad_()
    g, = torch.autograd.grad(lstm(x)[0].sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="rlx_gpu::lstm_backward has no derivative"):
        g.sum().backward()
    with pytest.raises(RuntimeError, match="rlx_gpu::selective_scan_backward has no derivative"):
        torch.func.grad(lambda t: torch.func.grad(
            lambda s: rt.selective_scan_fn(s, delta, A, B, C).square().sum())(t).sum())(u.detach())
