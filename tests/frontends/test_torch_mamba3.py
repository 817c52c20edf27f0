"""rlx_gpu.torch.mamba3_siso_combined / mamba3_siso_step (mamba_ssm's Mamba-3 SISO signatures and layouts, ABI.md
§11) against a torch step recurrence written here from §11 (differentiated by torch's autograd): outputs, final
states, gradients of every input and initial state, packed sequences, mixed element types (bf16 activations
beside f32 ADT, DT, Trap, Angles and biases), the decode step, and a call on no tokens."""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from rlx_gpu.torch import mamba3_siso_combined, mamba3_siso_step  # noqa: E402


def _rotate(x, theta):
    a = theta.shape[-1]
    even, odd = x[..., 0:2 * a:2], x[..., 1:2 * a:2]
    turned = torch.stack([even * theta.cos() - odd * theta.sin(), even * theta.sin() + odd * theta.cos()], -1)
    return torch.cat([turned.flatten(-2), x[..., 2 * a:]], -1)


def reference(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, states):
    """``(out, final states)`` of §11 token by token; ``ADT, DT, Trap (B,H,S)`` as the anchor lays them out."""
    heads = V.shape[2]
    rep = heads // Q.shape[2]
    theta, big_s, k_bar, v_bar = states
    outs = []
    for t in range(V.shape[1]):
        lam, alpha, dt = Trap[:, :, t].sigmoid(), ADT[:, :, t].exp(), DT[:, :, t]
        beta, gamma = (1 - lam) * dt * alpha, lam * dt
        theta = theta + math.pi * Angles[:, t].tanh() * dt[..., None]
        q = _rotate(Q[:, t].repeat_interleave(rep, 1) + Q_bias, theta)
        k = _rotate(K[:, t].repeat_interleave(rep, 1) + K_bias, theta)
        v = V[:, t]
        big_s = (alpha[..., None, None] * big_s + beta[..., None, None] * v_bar[..., :, None] * k_bar[..., None, :]
                 + gamma[..., None, None] * v[..., :, None] * k[..., None, :])
        y = torch.einsum("bhpn,bhn->bhp", big_s, q) + D[:, None] * v
        outs.append(y * Z[:, t] * Z[:, t].sigmoid())
        k_bar, v_bar = k, v
    return torch.stack(outs, 1), (theta, big_s, k_bar, v_bar)


def _inputs(B=2, S=9, G=2, H=4, P=3, N=8, A=3, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype)  # noqa: E731
    args = [make(B, S, G, N), make(B, S, G, N), make(B, S, H, P), -make(B, H, S).abs() * 0.5,
            make(B, H, S).abs() * 0.5, make(B, H, S), make(H, N), make(H, N), make(B, S, H, A), make(H),
            make(B, S, H, P)]
    states = [make(B, H, A), make(B, H, P, N), make(B, H, N), make(B, H, P)]
    return args, states


def test_combined_forward_final_states_and_gradients():
    args, states = _inputs()
    leaves = [t.requires_grad_() for t in args + states]
    out, *finals = mamba3_siso_combined(*args, Input_States=states, return_final_states=True)
    want, want_finals = reference(*args, states)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(finals[0].cos(), want_finals[0].cos())
    for got, exp in zip(finals[1:], want_finals[1:]):
        torch.testing.assert_close(got, exp)
    g = torch.Generator().manual_seed(9)
    weights = [torch.randn(t.shape, generator=g, dtype=t.dtype) for t in [out, *finals]]
    ours = torch.autograd.grad(sum((w * t).sum() for w, t in zip(weights, [out, *finals])), leaves)
    theirs = torch.autograd.grad(sum((w * t).sum() for w, t in zip(weights, [want, *want_finals])), leaves)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(a, b, msg=f"gradient of argument {i}")


def test_packed_sequences_equal_separate_calls():
    args, states = _inputs(B=1, S=11)
    cu = torch.tensor([0, 4, 4, 11], dtype=torch.int32)
    pools = [torch.cat([s] * 3) for s in states]
    out, *finals = mamba3_siso_combined(*args, Input_States=pools, return_final_states=True, cu_seqlens=cu)
    for r, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        part = [a[:, lo:hi] if a.dim() == 4 else a[:, :, lo:hi] if a.dim() == 3 else a for a in args]
        alone, *ends = mamba3_siso_combined(*part, Input_States=[p[r:r + 1] for p in pools],
                                            return_final_states=True)
        torch.testing.assert_close(out[:, lo:hi], alone)
        for got, exp in zip(finals[1:], ends[1:]):
            torch.testing.assert_close(got[r:r + 1], exp)
    torch.testing.assert_close(finals[1][1], pools[1][1])  # the empty sequence keeps its state


def test_bf16_activations_beside_f32_parameters_and_steps():
    args, _ = _inputs(dtype=torch.float32, seed=2)
    q, k, v, adt, dt, trap, qb, kb, ang, d, z = args
    low = [t.to(torch.bfloat16) for t in (q, k, v)]
    out, *finals = mamba3_siso_combined(*low, adt, dt, trap, qb, kb, ang, d, z.to(torch.bfloat16),
                                        return_final_states=True)
    zeros = [torch.zeros(s.shape[0], *s.shape[1:]) for s in _inputs(dtype=torch.float32)[1]]
    want, _ = reference(*(t.float() for t in low), adt, dt, trap, qb, kb, ang, d, z.to(torch.bfloat16).float(),
                        zeros)
    assert out.dtype == torch.bfloat16 and all(f.dtype == torch.float32 for f in finals)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)


def test_the_decode_step_is_the_first_token_of_a_combined_call():
    args, states = _inputs(S=1, seed=3)
    out, *finals = mamba3_siso_combined(*args, Input_States=states, return_final_states=True)
    q, k, v, adt, dt, trap, qb, kb, ang, d, z = args
    step, step_states = mamba3_siso_step(q[:, 0], k[:, 0], v[:, 0], adt[..., 0], dt[..., 0], trap[..., 0], qb, kb,
                                         ang[:, 0], d, z[:, 0], Input_States=states)
    torch.testing.assert_close(step, out[:, 0])
    for got, exp in zip(step_states, finals):
        torch.testing.assert_close(got, exp)


def test_a_call_on_no_tokens_returns_an_empty_output_and_the_states_as_given():
    args, states = _inputs(S=0)
    out, *finals = mamba3_siso_combined(*args, Input_States=states, return_final_states=True)
    assert out.shape == (2, 0, 4, 3)
    for got, exp in zip(finals, states):
        torch.testing.assert_close(got, exp)


def test_the_custom_op_passes_opcheck_and_compiles_whole():
    args, states = _inputs(B=1, S=6, G=1, H=2, P=3, N=4, A=2, dtype=torch.float32, seed=5)
    q, k, v, adt, dt, trap, qb, kb, ang, d, z = args
    fields = [q, k, v, adt.transpose(1, 2), dt.transpose(1, 2), trap.transpose(1, 2), ang, qb, kb, d, z, *states, None]
    for t in fields[:-1]:
        t.requires_grad_()
    checks = ("test_schema", "test_faketensor", "test_autograd_registration")
    result = torch.library.opcheck(torch.ops.rlx_gpu.mamba3.default, tuple(fields), test_utils=checks)
    assert set(result.values()) == {"SUCCESS"}, result
    compiled = torch.compile(lambda *a: mamba3_siso_combined(*a), fullgraph=True)
    torch.testing.assert_close(compiled(*args), mamba3_siso_combined(*args))


def _step_of(args, t):
    """Token ``t`` of a combined call's arguments in the step's layout."""
    q, k, v, adt, dt, trap, qb, kb, ang, d, z = args
    return q[:, t], k[:, t], v[:, t], adt[..., t], dt[..., t], trap[..., t], qb, kb, ang[:, t], d, z[:, t]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_decode_loop_on_the_hot_path_matches_the_reference_and_sees_its_parameters_change(dtype, monkeypatch):
    """After a signature's first step ran the whole way (its checks once), later steps take its hot path
    (``bridge.hot_path``: each tensor written straight into the bound call's arena): the same outputs and states
    as §11's recurrence, the states given left as they were, a bias changed in place by an optimizer seen, and a
    step of another signature or a bad one checked in the caller's terms."""
    from rlx_gpu.torch import mamba3 as frontend
    checks = []
    check = frontend.check_mamba3_siso_step
    monkeypatch.setattr(frontend, "check_mamba3_siso_step", lambda *a: checks.append(1) or check(*a))
    args, states = _inputs(B=2, S=5, G=1, H=4, P=3, N=8, A=2, dtype=dtype, seed=6)
    q_bias = torch.nn.Parameter(args[6].clone())
    args[6] = q_bias
    tolerance = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-5)
    with torch.no_grad():
        for t in range(5):
            if t == 3:
                q_bias.add_(0.5)  # an optimizer's step: a new version, written again
            given = [s.clone() for s in states]
            kept = [s.clone() for s in given]
            out, states = mamba3_siso_step(*_step_of(args, t), Input_States=given)
            want, want_states = reference(*(a[:, t:t + 1] if a.dim() == 4 else a[..., t:t + 1] if a.dim() == 3 else a
                                            for a in args), [s.to(torch.float64) for s in given])
            torch.testing.assert_close(out.double(), want[:, 0].double(), **tolerance)
            for got, exp in zip(states[1:], want_states[1:]):
                torch.testing.assert_close(got.double(), exp.double(), **tolerance)
            torch.testing.assert_close(torch.cos(states[0]).double(), torch.cos(want_states[0]).double(), **tolerance)
            for before, after in zip(kept, given):
                assert torch.equal(before, after)
        assert len(checks) == 1  # the first step's; the others ran the hot path
        wider, wider_states = _inputs(B=3, S=1, G=1, H=4, P=3, N=8, A=2, dtype=dtype, seed=7)
        mamba3_siso_step(*_step_of(wider, 0), Input_States=wider_states)
        assert len(checks) == 2
        bad = list(_step_of(args, 0))
        bad[9] = bad[9][:3]
        with pytest.raises(ValueError, match=r"^mamba3_siso_step: D has shape \[3\]; expected \(nheads,\) = \[4\]"):
            mamba3_siso_step(*bad, Input_States=states)


def test_a_call_without_states_returns_tensors_that_alias_nothing():
    """The op's five returns are distinct tensors (torch.library: no return may alias an input or another
    return), on the bound call's path too."""
    args, _ = _inputs(B=1, S=3, G=1, H=2, P=3, N=4, A=2, dtype=torch.float32, seed=8)
    q, k, v, adt, dt, trap, qb, kb, ang, d, z = args
    fields = [q, k, v, adt.transpose(1, 2), dt.transpose(1, 2), trap.transpose(1, 2), ang, qb, kb, d, z, *[None] * 4,
              None]
    for _ in range(2):  # the second call on the signature's bound call
        out = torch.ops.rlx_gpu.mamba3(*fields)
        assert len({id(t) for t in out}) == len(out)
