"""rlx_gpu.torch.Mamba3, mamba_ssm's Mamba-3 block (SISO): its state_dict names and shapes, the refusal of MIMO,
the forward and its gradients against the block written here in plain torch (float64, ABI.md §11's step
recurrence for the op), decode token by token against the prefill (outputs and the four final states), a
prefill continued by decode steps through an inference cache, packed sequences, a bf16 block, a whole-graph
torch.compile, and 200 training steps of a toy task, on the host and on OpenCL (where the backward thunk
falls back to the host)."""
from __future__ import annotations

import math
import types
import warnings

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from support.torch_devices import device, host  # noqa: E402,F401  (fixtures)

from rlx_gpu.torch import Mamba3, bridge  # noqa: E402

#: mamba_ssm's Mamba3 parameter names (SISO), with their shapes for d_model, d_state=N, expand, headdim=P, G, A.
SMALL = dict(d_model=8, d_state=8, expand=2, headdim=4)


def mamba_ssm_keys(d_model, N, expand, P, G, A, outproj_norm):
    inner, H = expand * d_model, expand * d_model // P
    keys = {"in_proj.weight": (2 * inner + 2 * N * G + 3 * H + A, d_model), "dt_bias": (H,), "B_bias": (H, 1, N),
            "C_bias": (H, 1, N), "B_norm.weight": (N,), "C_norm.weight": (N,), "D": (H,),
            "out_proj.weight": (d_model, inner)}
    return {**keys, "norm.weight": (inner,)} if outproj_norm else keys


def _rms(x, weight, group):
    g = x.unflatten(-1, (-1, group))
    return (g / (g.square().mean(-1, keepdim=True) + 1e-5).sqrt()).flatten(-2) * weight


def _rotate(x, theta):
    """Adjacent pairs (2i, 2i+1), i < A, turned by θ[i] (ABI.md §11, step 3)."""
    out = x.clone()
    for i in range(theta.shape[-1]):
        c, s = theta[..., i].cos(), theta[..., i].sin()
        out[..., 2 * i] = x[..., 2 * i] * c - x[..., 2 * i + 1] * s
        out[..., 2 * i + 1] = x[..., 2 * i] * s + x[..., 2 * i + 1] * c
    return out


def block_reference(p, u, H, P, N, G, A, outproj_norm):
    """The block on ``u [B, L, d_model]`` with the parameters ``p`` (state_dict names): ``(out, (θ, S, k̄, v̄))``."""
    b, length, _ = u.shape
    inner = H * P
    z, x, Bm, C, dd_dt, dd_a, trap, ang = (u @ p["in_proj.weight"].T).split(
        [inner, inner, G * N, G * N, H, H, H, A], -1)
    z, x = z.reshape(b, length, H, P), x.reshape(b, length, H, P)
    Bm = _rms(Bm.reshape(b, length, G, N), p["B_norm.weight"], N).repeat_interleave(H // G, 2)
    C = _rms(C.reshape(b, length, G, N), p["C_norm.weight"], N).repeat_interleave(H // G, 2)
    dt = F.softplus(dd_dt + p["dt_bias"])
    decay = torch.where(dd_a >= 0, 1 + dd_a, 1 / (1 - dd_a.clamp(max=0)))
    a = torch.minimum(-decay, torch.full_like(decay, -1e-4))
    theta, S = u.new_zeros(b, H, A), u.new_zeros(b, H, P, N)
    k_bar, v_bar = u.new_zeros(b, H, N), u.new_zeros(b, H, P)
    ys = []
    for t in range(length):
        lam, step = torch.sigmoid(trap[:, t]), dt[:, t]
        alpha = torch.exp(a[:, t] * step)
        beta, gamma = ((1 - lam) * step * alpha)[..., None, None], (lam * step)[..., None, None]
        theta = theta + math.pi * torch.tanh(ang[:, t, None, :]) * step[..., None]
        q = _rotate(C[:, t] + p["C_bias"][:, 0], theta)
        k = _rotate(Bm[:, t] + p["B_bias"][:, 0], theta)
        v = x[:, t]
        S = alpha[..., None, None] * S + beta * v_bar[..., None] * k_bar[..., None, :] + gamma * v[..., None] * k[
            ..., None, :]
        y = (S * q[..., None, :]).sum(-1) + p["D"][:, None] * v
        ys.append(y if outproj_norm else y * F.silu(z[:, t]))
        k_bar, v_bar = k, v
    y = torch.stack(ys, 1).flatten(-2)
    if outproj_norm:
        y = _rms(y, p["norm.weight"], P) * F.silu(z.flatten(-2))
    return y @ p["out_proj.weight"].T, (theta, S, k_bar, v_bar)


def _randomised(module, seed):
    """``module`` with every parameter drawn at random (biases and norm weights away from their 1s)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            scale = 0.5 if "proj" in name else 0.3
            param.copy_(torch.randn(param.shape, generator=g, dtype=param.dtype) * scale
                        + (0 if "proj" in name or name == "dt_bias" else 1))
    return module


@pytest.mark.parametrize("ngroups,rope_fraction,outproj_norm", [(1, 0.5, False), (2, 1.0, True)])
def test_parameters_carry_mamba_ssm_names_and_shapes(ngroups, rope_fraction, outproj_norm):
    m = Mamba3(16, d_state=8, expand=2, headdim=4, ngroups=ngroups, rope_fraction=rope_fraction,
               is_outproj_norm=outproj_norm)
    A = int(8 * rope_fraction) // 2
    want = mamba_ssm_keys(16, 8, 2, 4, ngroups, A, outproj_norm)
    assert {k: tuple(v.shape) for k, v in m.state_dict().items()} == want
    assert m.dt_bias.dtype == m.B_bias.dtype == torch.float32 and torch.equal(m.C_bias, torch.ones(8, 1, 8))
    dt = F.softplus(m.dt_bias)
    assert bool(((dt >= 1e-4) & (dt <= 0.1 + 1e-6)).all())  # mamba_ssm's dt_min..dt_max initialisation
    m.load_state_dict({k: torch.randn(shape) for k, shape in want.items()})  # strict: every key, no other


def test_mimo_is_refused_with_the_reason():
    with pytest.raises(NotImplementedError, match=r"is_mimo=True, mimo_rank=4.*SISO.*ABI.md §11"):
        Mamba3(16, d_state=8, headdim=4, is_mimo=True)
    assert Mamba3(16, d_state=8, headdim=4, mimo_rank=4).mimo_rank == 1  # unused without is_mimo, as in mamba_ssm


@pytest.mark.parametrize("ngroups,rope_fraction,outproj_norm", [(1, 0.5, False), (2, 1.0, False), (2, 0.5, True)])
def test_forward_and_gradients_equal_the_block_in_plain_torch(ngroups, rope_fraction, outproj_norm, host):
    m = _randomised(Mamba3(8, d_state=8, expand=2, headdim=4, ngroups=ngroups, rope_fraction=rope_fraction,
                           is_outproj_norm=outproj_norm, dtype=torch.float64).double(), seed=ngroups)
    u = torch.randn(2, 7, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out = m(u)
    params = dict(m.named_parameters())
    want, _ = block_reference(params, u, m.nheads, 4, 8, ngroups, m.num_rope_angles, outproj_norm)
    torch.testing.assert_close(out, want)
    w = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    leaves = [u, *params.values()]
    ours = torch.autograd.grad((w * out).sum(), leaves)
    theirs = torch.autograd.grad((w * want).sum(), leaves)
    for name, a, b in zip(["u", *params], ours, theirs):
        torch.testing.assert_close(a, b, msg=lambda msg: f"d {name}: {msg}")


def test_decode_token_by_token_equals_the_prefill(device):
    """Outputs and the four final states (θ compared mod 2π) on the host and on OpenCL, f32."""
    m = _randomised(Mamba3(**SMALL, ngroups=2, layer_idx=0), seed=3)
    u = torch.randn(3, 9, 8, generator=torch.Generator().manual_seed(4))
    params = types.SimpleNamespace(key_value_memory_dict={}, seqlen_offset=0)
    with torch.no_grad():
        prefill = m(u, inference_params=params)
        cache = m.allocate_inference_cache(3, 9)
        decoded = torch.stack([m.step(u[:, t], *cache)[0] for t in range(9)], 1)
    torch.testing.assert_close(decoded, prefill, rtol=1e-5, atol=1e-5)
    finals = params.key_value_memory_dict[0]
    assert [tuple(s.shape) for s in cache] == [(3, 4, 2), (3, 4, 4, 8), (3, 1, 4, 8), (3, 4, 4)]
    torch.testing.assert_close(cache[0].cos(), finals[0].cos(), rtol=1e-5, atol=1e-5)
    for got, want in zip(cache[1:], finals[1:]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    _, (theta, S, k_bar, v_bar) = block_reference({k: v.double() for k, v in m.named_parameters()}, u.double(),
                                                  m.nheads, 4, 8, 2, m.num_rope_angles, False)
    torch.testing.assert_close(finals[1].double(), S, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(finals[2][:, 0].double(), k_bar, rtol=1e-4, atol=1e-4)


def test_a_prefill_continued_by_decode_steps_through_inference_params(host):
    """mamba_ssm's generation loop: a prompt at ``seqlen_offset`` 0, then one token per call, equals one prefill."""
    m = _randomised(Mamba3(**SMALL, is_outproj_norm=True, layer_idx=5, dtype=torch.float64).double(), seed=6)
    u = torch.randn(2, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    params = types.SimpleNamespace(key_value_memory_dict={}, seqlen_offset=0)
    with torch.no_grad():
        whole = m(u)
        parts = [m(u[:, :5], inference_params=params)]
        for t in range(5, 8):
            params.seqlen_offset = t
            parts.append(m(u[:, t:t + 1], inference_params=params))
    torch.testing.assert_close(torch.cat(parts, 1), whole)
    assert all(s.dtype == torch.float64 for s in params.key_value_memory_dict[5])


def test_packed_sequences_equal_separate_calls_and_bf16_decode_equals_its_prefill(host):
    m = _randomised(Mamba3(**SMALL, ngroups=2), seed=9)
    u = torch.randn(1, 11, 8, generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        packed = m(u, cu_seqlens=torch.tensor([0, 4, 11], dtype=torch.int32))
        torch.testing.assert_close(packed, torch.cat([m(u[:, :4]), m(u[:, 4:])], 1), rtol=1e-5, atol=1e-5)
        low = Mamba3(**SMALL, dtype=torch.bfloat16)  # bf16 weights beside f32 dt_bias, biases, D and states
        prefill = low(u.bfloat16())
        cache = low.allocate_inference_cache(1, 11)
        decoded = torch.stack([low.step(u[:, t].bfloat16(), *cache)[0] for t in range(11)], 1)
    assert prefill.dtype == torch.bfloat16 and all(s.dtype == torch.float32 for s in cache)
    torch.testing.assert_close(decoded.float(), prefill.float(), rtol=2e-2, atol=2e-2)


def test_the_block_compiles_whole_forward_and_backward(host):
    m = _randomised(Mamba3(**SMALL), seed=11)
    u = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(12))
    torch._dynamo.reset()
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)  # a graph break raises
    got = compiled(u)
    got.square().sum().backward()
    grads = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    want = m(u)
    want.square().sum().backward()
    torch.testing.assert_close(got, want)
    for a, p in zip(grads, m.parameters()):
        torch.testing.assert_close(a, p.grad)


def test_two_hundred_training_steps_learn_a_delayed_copy(device):
    """Adam on ``y_t = u_{t-2}`` (a recall the block's state must carry): the loss falls well below its start.
    On OpenCL the forward and the backward thunk both run on the device: nothing falls back to the host."""
    torch.manual_seed(0)
    bridge.clear_cache()
    m = Mamba3(**SMALL)
    opt = torch.optim.Adam(m.parameters(), lr=2e-2)
    u = torch.randn(8, 12, 8, generator=torch.Generator().manual_seed(8))
    target = F.pad(u, (0, 0, 2, 0))[:, :-2]
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(200):
            loss = F.mse_loss(m(u), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0], (losses[0], losses[-1])
    fallbacks = [str(w.message) for w in caught if "fall back to the host" in str(w.message)]
    assert not fallbacks, fallbacks
    assert {e.device.spec.split(":")[0] for e in bridge._cache.values()} == {device}
