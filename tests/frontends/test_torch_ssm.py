"""rlx_gpu.torch.ssm: mamba_ssm's selective_scan_fn, mamba_chunk_scan_combined and selective_state_update,
with mamba_ssm's signatures and conventions, against float64 torch recurrences written here from their math
(what mamba_ssm's ``selective_scan_ref`` and ``ssd_minimal_discrete`` compute, step by step), and their
gradients against torch autograd of those recurrences and float64 finite differences (gradcheck).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from support.cupy_double import installed
from support.torch_devices import device, host  # noqa: F401  (fixtures)
from rlx_gpu.runtime.registry import status
from rlx_gpu.torch import (bridge, fused_recurrent_gated_delta_rule, mamba_chunk_scan_combined, selective_scan_fn,
                           selective_state_update)

F64 = torch.float64


def scan_reference(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False):
    """Mamba-1, channel-major: per channel ``h = exp(Δ·A)·h + Δ·B·u``, ``y = C·h``; ``(y + D·u)·silu(z)``."""
    u, delta, A, B, C = (t.to(F64) for t in (u, delta, A, B, C))
    batch, dim, length = u.shape
    if delta_bias is not None:
        delta = delta + delta_bias.to(F64)[:, None]
    if delta_softplus:
        delta = F.softplus(delta)

    def per_channel(M):  # [D,N] fixed, [B,N,L] shared, [B,G,N,L] grouped -> [B,D,N,L]
        if M.dim() == 2:
            return M[None, :, :, None].expand(batch, dim, M.shape[1], length)
        if M.dim() == 3:
            return M[:, None].expand(batch, dim, *M.shape[1:])
        return M.repeat_interleave(dim // M.shape[1], dim=1)

    B, C = per_channel(B), per_channel(C)
    h = u.new_zeros(batch, dim, A.shape[1])
    ys = []
    for t in range(length):
        h = torch.exp(delta[:, :, t, None] * A) * h + delta[:, :, t, None] * B[..., t] * u[:, :, t, None]
        ys.append((h * C[..., t]).sum(-1))
    y = torch.stack(ys, dim=-1)
    if D is not None:
        y = y + D.to(F64)[:, None] * u
    if z is not None:
        y = y * F.silu(z.to(F64))
    return y, h


def ssd_reference(x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                  initial_states=None, seq_idx=None):
    """Mamba-2 step by step: per head ``S = exp(dt·A)·S + (dt·x)⊗B``, ``y = S·C``, ``(y + D·x)·silu(z)``;
    the state restarts where ``seq_idx`` changes. Returns ``(out, final states, states at each sequence end)``."""
    x, dt, A, B, C = (t.to(F64) for t in (x, dt, A, B, C))
    batch, length, heads, head_dim = x.shape
    if dt_bias is not None:
        dt = dt + dt_bias.to(F64)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(dt_limit[0], dt_limit[1])
    B = B.repeat_interleave(heads // B.shape[2], dim=2)
    C = C.repeat_interleave(heads // C.shape[2], dim=2)
    ys, finals, ends = [], [], []
    for b in range(batch):
        S = x.new_zeros(heads, head_dim, B.shape[-1]) if initial_states is None else initial_states[b].to(F64)
        row = []
        for t in range(length):
            if seq_idx is not None and t and seq_idx[b, t] != seq_idx[b, t - 1]:
                ends.append(S)
                S = torch.zeros_like(S)
            S = torch.exp(dt[b, t] * A)[:, None, None] * S + (dt[b, t, :, None] * x[b, t])[..., None] * B[b, t, :, None]
            row.append((S * C[b, t, :, None]).sum(-1))
        ends.append(S)
        finals.append(S)
        ys.append(torch.stack(row))
    y = torch.stack(ys)
    if D is not None:
        y = y + (D.to(F64)[:, None] if D.dim() == 1 else D.to(F64)) * x
    if z is not None:
        y = y * F.silu(z.to(F64))
    return y, torch.stack(finals), torch.stack(ends)


def scan_inputs(batch=2, dim=4, length=5, state=3, b_layout="grouped", dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=F64)

    # u, delta and z are channel-major views of batch-major memory, as a Mamba block makes them
    u, delta, z = (r(batch, length, dim).transpose(1, 2) for _ in range(3))
    layouts = {"grouped": (batch, 2, state, length), "shared": (batch, state, length), "fixed": (dim, state)}
    B, C = r(*layouts[b_layout]), r(*layouts[b_layout])
    A = -torch.rand(dim, state, generator=g, dtype=F64) - 0.2
    return {"u": u.to(dtype), "delta": (0.5 * delta).to(dtype), "A": A, "B": B.to(dtype), "C": C.to(dtype),
            "D": r(dim), "z": z.to(dtype), "delta_bias": 0.3 * r(dim)}


@pytest.mark.parametrize("b_layout", ["grouped", "shared", "fixed"])
def test_selective_scan_fn_is_mamba_ssms_scan_in_its_layouts(b_layout, host):
    args = scan_inputs(b_layout=b_layout)
    out, last = selective_scan_fn(**args, delta_softplus=True, return_last_state=True)
    ref, ref_last = scan_reference(**args, delta_softplus=True)
    assert out.shape == args["u"].shape and last.shape == (2, 4, 3) and out.is_contiguous()
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(last, ref_last, rtol=1e-10, atol=1e-10)
    plain = selective_scan_fn(args["u"], args["delta"], args["A"], args["B"], args["C"])  # the defaults
    torch.testing.assert_close(plain, scan_reference(*(args[k] for k in "u delta A B C".split()))[0])


def test_selective_scan_fn_in_bf16_keeps_the_parameters_f32_and_returns_bf16(device):
    args = scan_inputs(dtype=torch.bfloat16)
    args.update(A=args["A"].float(), D=args["D"].float(), delta_bias=args["delta_bias"].float())
    out, last = selective_scan_fn(**args, delta_softplus=True, return_last_state=True)
    ref, ref_last = scan_reference(**args, delta_softplus=True)
    assert out.dtype == torch.bfloat16 and last.dtype == torch.float32
    torch.testing.assert_close(out.to(F64), ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(last.to(F64), ref_last, rtol=1e-4, atol=1e-4)


def ssd_inputs(batch=2, length=6, heads=4, head_dim=3, groups=2, state=5, seed=1):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=F64)

    return {"x": r(batch, length, heads, head_dim), "dt": r(batch, length, heads),
            "A": -torch.rand(heads, generator=g, dtype=F64) - 0.2,
            "B": r(batch, length, groups, state), "C": r(batch, length, groups, state), "D": r(heads),
            "z": r(batch, length, heads, head_dim), "dt_bias": 0.3 * r(heads),
            "initial_states": r(batch, heads, head_dim, state)}


def test_mamba_chunk_scan_combined_is_mamba_ssms_ssd(device):
    args = ssd_inputs()
    out, final = mamba_chunk_scan_combined(**args, chunk_size=4, dt_softplus=True, return_final_states=True)
    ref, ref_final, _ = ssd_reference(**args, dt_softplus=True)
    assert final.dtype == args["C"].dtype  # mamba_ssm's final states are C's dtype unless state_dtype says
    tol = 1e-10 if device == "host" else 1e-4  # an OpenCL device computes f64 as f64 or refuses it
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    torch.testing.assert_close(final, ref_final, rtol=tol, atol=tol)


def test_the_default_dt_limit_clamps_negative_dt_to_zero_and_D_may_be_per_channel(host):
    args = ssd_inputs()
    del args["initial_states"]
    args["D"] = torch.randn(4, 3, dtype=F64)  # mamba_ssm's D [nheads, headdim]
    out = mamba_chunk_scan_combined(**args, chunk_size=8)  # no softplus: about half of dt is negative
    torch.testing.assert_close(out, ssd_reference(**args)[0], rtol=1e-10, atol=1e-10)
    unbounded = (-float("inf"), float("inf"))
    unclamped = ssd_reference(**args, dt_limit=unbounded)[0]
    assert (out - unclamped).abs().max() > 1e-2
    torch.testing.assert_close(mamba_chunk_scan_combined(**args, chunk_size=8, dt_limit=unbounded), unclamped)
    with pytest.raises(NotImplementedError, match=r"dt_limit=\(-0.5, 1.0\): the op clamps dt to \[lo, hi\]"):
        mamba_chunk_scan_combined(**args, chunk_size=8, dt_limit=(-0.5, 1.0))
    bounded = mamba_chunk_scan_combined(**args, chunk_size=8, dt_softplus=True, dt_limit=(0.1, 0.6))
    torch.testing.assert_close(bounded, ssd_reference(**args, dt_softplus=True, dt_limit=(0.1, 0.6))[0])


def test_seq_idx_packs_sequences_and_the_initial_states_feed_each_rows_first_one(host):
    args = ssd_inputs()
    seq_idx = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 3, 3]], dtype=torch.int32)
    out, final = mamba_chunk_scan_combined(**args, chunk_size=4, seq_idx=seq_idx, dt_softplus=True,
                                           return_final_states=True)
    ref, ref_final, _ = ssd_reference(**args, dt_softplus=True, seq_idx=seq_idx)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, ref_final, rtol=1e-10, atol=1e-10)
    one = {k: v[:1] for k, v in args.items() if k not in ("A", "D", "dt_bias")}
    one.update(A=args["A"], D=args["D"], dt_bias=args["dt_bias"])
    cu = torch.tensor([0, 2, 5, 6])
    out, final, varlen = mamba_chunk_scan_combined(**one, chunk_size=4, seq_idx=seq_idx[:1], cu_seqlens=cu,
                                                   return_final_states=True, return_varlen_states=True)
    _, _, ends = ssd_reference(**one, seq_idx=seq_idx[:1])
    torch.testing.assert_close(varlen, ends, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, ends[-1:], rtol=1e-10, atol=1e-10)


def test_what_the_ops_cannot_express_is_refused_naming_the_argument(host):
    args = scan_inputs()
    with pytest.raises(NotImplementedError, match="selective_scan_fn: A is complex"):
        selective_scan_fn(**{**args, "A": args["A"].to(torch.complex128)})
    ssd = ssd_inputs()
    with pytest.raises(NotImplementedError, match="seq_idx falls from 1 to 0 at \\[0, 3\\]"):
        mamba_chunk_scan_combined(**ssd, chunk_size=4, seq_idx=torch.tensor([[0, 0, 1, 0, 0, 0]] * 2))
    with pytest.raises(NotImplementedError, match="return_varlen_states needs cu_seqlens and seq_idx"):
        mamba_chunk_scan_combined(**ssd, chunk_size=4, return_varlen_states=True)


def state_update_reference(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
    """One step in mamba_ssm's heads form: state [b,h,p,n], x/dt/z [b,h,p], A [h,p,n], B/C [b,g,n]."""
    state, x, dt, A, B, C = (t.to(F64) for t in (state, x, dt, A, B, C))
    if dt_bias is not None:
        dt = dt + dt_bias.to(F64)
    if dt_softplus:
        dt = F.softplus(dt)
    heads = x.shape[1]
    B, C = (M.repeat_interleave(heads // M.shape[1], dim=1)[:, :, None] for M in (B, C))
    new = torch.exp(dt[..., None] * A) * state + (dt * x)[..., None] * B
    out = (new * C).sum(-1)
    if D is not None:
        out = out + D.to(F64) * x
    if z is not None:
        out = out * F.silu(z.to(F64))
    return out, new


@pytest.mark.parametrize("tied", [True, False], ids=["per-head", "per-channel"])
def test_selective_state_update_updates_the_named_slots_in_place_and_no_other(tied, device):
    g = torch.Generator().manual_seed(2)
    batch, heads, head_dim, groups, n = 2, 4, 3, 2, 5
    pool = torch.randn(5, heads, head_dim, n, generator=g)
    before = pool.clone()
    x = torch.randn(batch, heads, head_dim, generator=g)
    if tied:  # Mamba-2 decode passes per-head values broadcast along head_dim (stride-0 views)
        dt = torch.randn(batch, heads, 1, generator=g).expand(-1, -1, head_dim)
        A = (-torch.rand(heads, generator=g))[:, None, None].expand(-1, head_dim, n)
        D = torch.randn(heads, generator=g)[:, None].expand(-1, head_dim)
        dt_bias = torch.randn(heads, generator=g)[:, None].expand(-1, head_dim)
    else:
        dt, A = torch.randn(batch, heads, head_dim, generator=g), -torch.rand(heads, head_dim, n, generator=g)
        D, dt_bias = torch.randn(heads, head_dim, generator=g), torch.randn(heads, head_dim, generator=g)
    B, C = torch.randn(batch, groups, n, generator=g), torch.randn(batch, groups, n, generator=g)
    slots = torch.tensor([3, 1], dtype=torch.int32)
    out = selective_state_update(pool, x, dt, A, B, C, D=D, dt_bias=dt_bias, dt_softplus=True,
                                 state_batch_indices=slots)
    ref, new = state_update_reference(before[slots.long()], x, dt, A, B, C, D=D, dt_bias=dt_bias, dt_softplus=True)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out.to(F64), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[slots.long()].to(F64), new, rtol=1e-5, atol=1e-5)
    untouched = [0, 2, 4]
    assert torch.equal(pool[untouched], before[untouched])
    with pytest.raises(ValueError, match=r"state_batch_indices\[0\] and \[1\] both name state entry 1"):
        selective_state_update(pool, x, dt, A, B, C, state_batch_indices=torch.tensor([1, 1]))


def test_selective_state_update_in_mamba1s_form_continues_selective_scan_fn(host):
    args = scan_inputs(b_layout="shared")
    out, last = selective_scan_fn(**args, delta_softplus=True, return_last_state=True)
    head = {k: (v[..., :-1] if k in ("u", "delta", "z", "B", "C") else v) for k, v in args.items()}
    _, state = selective_scan_fn(**head, delta_softplus=True, return_last_state=True)
    step = selective_state_update(state, args["u"][..., -1], args["delta"][..., -1], args["A"], args["B"][..., -1],
                                  args["C"][..., -1], D=args["D"], z=args["z"][..., -1],
                                  dt_bias=args["delta_bias"], dt_softplus=True)
    torch.testing.assert_close(step, out[..., -1], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state, last, rtol=1e-10, atol=1e-10)


def _leaves(args):
    return {k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in args.items()}


def _grads_agree(leaves, outputs, ref_outputs, weights):
    """The gradients of Σ w·out through rlx_gpu equal those through the float64 reference, leaf by leaf."""
    mine = torch.autograd.grad(sum((w * o).sum() for w, o in zip(weights, outputs)), list(leaves.values()))
    theirs = torch.autograd.grad(sum((w * o).sum() for w, o in zip(weights, ref_outputs)), list(leaves.values()))
    for name, a, b in zip(leaves, mine, theirs):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-8, msg=lambda m: f"d_{name}: {m}")


def test_selective_scan_fn_differentiates_every_argument_and_the_last_state(host):
    leaves = _leaves(scan_inputs())
    out, last = selective_scan_fn(**leaves, delta_softplus=True, return_last_state=True)
    ref, ref_last = scan_reference(**leaves, delta_softplus=True)
    _grads_agree(leaves, (out, last), (ref, ref_last), (torch.randn_like(out), torch.randn_like(last)))
    tiny = _leaves(scan_inputs(batch=1, dim=2, length=3, state=2, b_layout="shared"))
    assert torch.autograd.gradcheck(
        lambda *t: selective_scan_fn(*t, delta_softplus=True, return_last_state=True), tuple(tiny.values()),
        fast_mode=True)


def test_mamba_chunk_scan_combined_differentiates_every_argument_and_the_initial_states(host):
    leaves = _leaves(ssd_inputs())
    out, final = mamba_chunk_scan_combined(**leaves, chunk_size=4, dt_softplus=True, return_final_states=True)
    ref, ref_final, _ = ssd_reference(**leaves, dt_softplus=True)
    _grads_agree(leaves, (out, final), (ref, ref_final), (torch.randn_like(out), torch.randn_like(final)))
    tiny = _leaves(ssd_inputs(batch=1, length=3, heads=2, head_dim=1, groups=1, state=2))
    seq_idx = torch.tensor([[0, 1, 1]])
    assert torch.autograd.gradcheck(
        lambda x, dt, A, B, C, D, z, dt_bias, h0: mamba_chunk_scan_combined(
            x, dt, A, B, C, 4, D=D, z=z, dt_bias=dt_bias, initial_states=h0, seq_idx=seq_idx, dt_softplus=True,
            return_final_states=True), tuple(tiny.values()), fast_mode=True)


def test_calls_on_cuda_tensors_compile_for_cuda_and_launch_the_ops_kernels(monkeypatch):
    """Through the CuPy contract double (which records launches, not their results): the device of a call
    is the tensors' (``bridge.device_for``; answered "cuda:0" here, as for tensors on cuda:0, which a CPU
    build of torch cannot make), and each function's op compiles for CUDA and launches its kernel there."""
    with installed(monkeypatch) as machine:
        monkeypatch.setattr(bridge, "device_for", lambda *tensors: "cuda:0")
        bridge.clear_cache()
        scan = scan_inputs(dtype=torch.float32)
        scan.update(A=scan["A"].float(), D=scan["D"].float(), delta_bias=scan["delta_bias"].float())
        out, last = selective_scan_fn(**scan, delta_softplus=True, return_last_state=True)
        ssd = {k: v.float() for k, v in ssd_inputs().items()}
        y, final = mamba_chunk_scan_combined(**ssd, chunk_size=4, return_final_states=True)
        q = torch.randn(1, 5, 1, 3)
        o, state = fused_recurrent_gated_delta_rule(q, q, torch.randn(1, 5, 2, 4), -torch.rand(1, 5, 2),
                                                    beta=torch.rand(1, 5, 2), output_final_state=True)
        kernels = [r.kernel for r in machine.launches]
        assert kernels == ["selective_scan_lanes", "mamba2_lanes", "gated_delta_net_lanes"]
        assert {exe.device.spec for exe in bridge._cache.values()} == {"cuda:0"}
        assert (out.shape, last.shape, y.shape, final.shape, o.shape, state.shape) == (
            (2, 4, 5), (2, 4, 3), (2, 6, 4, 3), (2, 4, 3, 5), (1, 5, 2, 4), (1, 2, 3, 4))
        bridge.clear_cache()  # their arenas belong to the double's device


def test_gradients_on_opencl_equal_the_references(monkeypatch):
    """On an OpenCL default device the forward runs on the device and the backward thunk where it has a
    kernel (the host, until a device kernel exists: the fallback the config allows)."""
    if not status("opencl").available:
        pytest.fail(f"OpenCL is unavailable: {status('opencl').reason}")
    monkeypatch.setenv("RLX_DEVICE", "opencl")
    leaves = _leaves({k: v.float() for k, v in ssd_inputs().items()})
    out, final = mamba_chunk_scan_combined(**leaves, chunk_size=4, dt_softplus=True, return_final_states=True)
    ref, ref_final, _ = ssd_reference(**leaves, dt_softplus=True)
    weights = (torch.randn_like(out), torch.randn_like(final))
    mine = torch.autograd.grad(sum((w * o).sum() for w, o in zip(weights, (out, final))), list(leaves.values()))
    theirs = torch.autograd.grad(sum((w.double() * o).sum() for w, o in zip(weights, (ref, ref_final))),
                                 list(leaves.values()))
    for name, a, b in zip(leaves, mine, theirs):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-3, atol=1e-3, msg=lambda m: f"d_{name}: {m}")
