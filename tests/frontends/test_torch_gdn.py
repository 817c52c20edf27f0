"""rlx_gpu.torch.gdn: fla's chunk_gated_delta_rule, fused_recurrent_gated_delta_rule and chunk_kda with fla's
signatures and conventions, against a float64 torch recurrence written here from the delta rule's math (what
fla's ``naive_recurrent_gated_delta_rule`` computes), and their gradients against torch autograd of it and
float64 finite differences (gradcheck).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from support.torch_devices import device, host  # noqa: F401  (fixtures)

from rlx_gpu.torch import chunk_gated_delta_rule, chunk_kda, fused_recurrent_gated_delta_rule

F64 = torch.float64


def delta_rule_reference(q, k, v, g, beta, scale=None, initial_state=None, l2norm=False, cu_seqlens=None):
    """Per value head ``j`` (key head ``j // (HV/H)``), state ``S [K, V]``: ``S ← exp(g)·S`` (``g [HV]`` or
    per key channel ``[HV, K]``), ``S ← S + k⊗(beta·(v - Sᵀk))``, ``o = scale·Sᵀq``; restarting at each
    sequence."""
    q, k, v, g, beta = (t.to(F64) for t in (q, k, v, g, beta))
    batch, length, heads, key_size = q.shape
    value_heads = v.shape[2]
    if l2norm:
        q, k = (t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    q, k = (t.repeat_interleave(value_heads // heads, dim=2) for t in (q, k))
    scale = key_size ** -0.5 if scale is None else scale
    bounds = ([(b, 0, length) for b in range(batch)] if cu_seqlens is None
              else [(0, int(s), int(e)) for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:])])
    o = torch.zeros_like(v)
    finals = []
    for row, (b, start, end) in enumerate(bounds):
        S = (torch.zeros(value_heads, key_size, v.shape[-1], dtype=F64) if initial_state is None
             else initial_state[row].to(F64))
        for t in range(start, end):
            decay = torch.exp(g[b, t])
            S = S * (decay[:, :, None] if decay.dim() == 2 else decay[:, None, None])
            u = (v[b, t] - torch.einsum("hkv,hk->hv", S, k[b, t])) * beta[b, t, :, None]
            S = S + k[b, t, :, :, None] * u[:, None, :]
            o[b, t] = scale * torch.einsum("hkv,hk->hv", S, q[b, t])
        finals.append(S)
    return o, torch.stack(finals)


def gdn_inputs(batch=2, length=5, heads=1, value_heads=2, key_size=3, value_size=4, per_channel=False, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=F64)

    gate = (batch, length, value_heads, key_size) if per_channel else (batch, length, value_heads)
    return {"q": r(batch, length, heads, key_size), "k": F.normalize(r(batch, length, heads, key_size), dim=-1),
            "v": r(batch, length, value_heads, value_size), "g": F.logsigmoid(r(*gate)),
            "beta": torch.rand(batch, length, value_heads, generator=g, dtype=F64)}


def test_chunk_and_fused_recurrent_are_fla_s_gated_delta_rule(device):
    args = gdn_inputs()
    h0 = torch.randn(2, 2, 3, 4, dtype=F64)
    ref, ref_final = delta_rule_reference(**args, initial_state=h0, scale=0.4, l2norm=True)
    tol = 1e-10 if device == "host" else 1e-4
    for fn in (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule):
        o, final = fn(**args, scale=0.4, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(o, ref, rtol=tol, atol=tol)
        torch.testing.assert_close(final, ref_final, rtol=tol, atol=tol)
    o, final = chunk_gated_delta_rule(**args)  # fla's defaults: scale K^-0.5, no state in, none out
    assert final is None
    torch.testing.assert_close(o, delta_rule_reference(**args)[0], rtol=tol, atol=tol)


def test_cu_seqlens_restart_the_state_per_sequence_and_bf16_keeps_an_f32_state(host):
    args = {k: v[:1].to(torch.bfloat16) for k, v in gdn_inputs(length=7).items()}
    cu = torch.tensor([0, 3, 3, 7], dtype=torch.long)
    h0 = torch.randn(3, 2, 3, 4)
    o, final = fused_recurrent_gated_delta_rule(**args, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    ref, ref_final = delta_rule_reference(**args, initial_state=h0, cu_seqlens=cu)
    assert o.dtype == torch.bfloat16 and final.dtype == torch.float32
    torch.testing.assert_close(o.to(F64), ref, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(final.to(F64), ref_final, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final[1], h0[1])  # an empty sequence passes its state through
    with pytest.raises(ValueError,
                       match=r"initial_state has shape \[2, 2, 3, 4\]; expected \(N, HV, K, V\) = \[3, 2, 3, 4\]"):
        chunk_gated_delta_rule(**args, initial_state=h0[:2], cu_seqlens=cu)


def test_chunk_kda_gates_every_key_channel_and_fuses_fla_s_gate_and_beta(host):
    args = gdn_inputs(per_channel=True)
    ref, ref_final = delta_rule_reference(**args)
    o, final = chunk_kda(**args, output_final_state=True)
    torch.testing.assert_close(o, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, ref_final, rtol=1e-10, atol=1e-10)
    raw, A_log, dt_bias, logits = (torch.randn(*s, dtype=F64) for s in ((2, 5, 2, 3), (2,), (6,), (2, 5, 2)))
    o, _ = chunk_kda(**{**args, "g": raw, "beta": logits}, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                     use_beta_sigmoid_in_kernel=True)
    gate = -A_log.exp()[:, None] * F.softplus(raw + dt_bias.view(2, 3))
    torch.testing.assert_close(o, delta_rule_reference(**{**args, "g": gate, "beta": logits.sigmoid()})[0])


def test_fused_recurrent_takes_g_and_gk_together_and_state_v_first(host):
    args = gdn_inputs()
    gk = F.logsigmoid(torch.randn(2, 5, 2, 3, dtype=F64))
    h0 = torch.randn(2, 2, 3, 4, dtype=F64)
    o, final = fused_recurrent_gated_delta_rule(**args, gk=gk, initial_state=h0.transpose(-1, -2).contiguous(),
                                                output_final_state=True, state_v_first=True)
    ref, ref_final = delta_rule_reference(**{**args, "g": gk + args["g"][..., None]}, initial_state=h0)
    torch.testing.assert_close(o, ref)
    torch.testing.assert_close(final, ref_final.transpose(-1, -2))


def test_what_the_op_cannot_express_is_refused_naming_the_argument(host):
    args = gdn_inputs()
    with pytest.raises(NotImplementedError,
                       match=r"fused_recurrent_gated_delta_rule: gv=a tensor \[2, 5, 2, 4\] is not supported"):
        fused_recurrent_gated_delta_rule(**args, gv=torch.zeros(2, 5, 2, 4, dtype=F64))
    with pytest.raises(NotImplementedError, match="chunk_kda: safe_gate=True is not supported"):
        chunk_kda(**gdn_inputs(per_channel=True), safe_gate=True, lower_bound=-5.0)


@pytest.mark.parametrize("fn,per_channel", [(chunk_gated_delta_rule, False), (chunk_kda, True)])
def test_the_delta_rules_differentiate_q_k_v_g_beta_and_the_initial_state(fn, per_channel, host):
    args = gdn_inputs(per_channel=per_channel)
    leaves = {k: v.detach().clone().requires_grad_() for k, v in
              {**args, "initial_state": torch.randn(2, 2, 3, 4, dtype=F64)}.items()}
    o, final = fn(**leaves, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref, ref_final = delta_rule_reference(**leaves, l2norm=True)
    w, wf = torch.randn_like(o), torch.randn_like(final)
    mine = torch.autograd.grad((w * o).sum() + (wf * final).sum(), list(leaves.values()))
    theirs = torch.autograd.grad((w * ref).sum() + (wf * ref_final).sum(), list(leaves.values()))
    for name, a, b in zip(leaves, mine, theirs):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-8, msg=lambda m: f"d_{name}: {m}")
    tiny = {k: v[:1, :3].detach().clone().requires_grad_() for k, v in args.items()}
    tiny["initial_state"] = torch.randn(1, 2, 3, 4, dtype=F64, requires_grad=True)
    def call(q, k, v, g, beta, h0):
        return fn(q, k, v, g, beta, initial_state=h0, output_final_state=True)

    assert torch.autograd.gradcheck(call, tuple(tiny.values()), fast_mode=True)
