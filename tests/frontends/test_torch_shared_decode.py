"""Decode steps of rlx_gpu.torch on an OpenCL CPU device whose arena is host memory (``Session.shared``: PoCL,
Intel's CPU runtime): the hot path writes its tensors into the arena itself (``written``, ``runtime.host_call``)
and copies the carried state in and out. Each step must still be the op's own: against float64 references
written from mamba_ssm's and fla's formulas, the caller's state written back every step, and a state the caller
changed between steps, or another state tensor, read as it is now."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import rlx_gpu.torch as rt
from rlx_gpu.runtime.call_plan import CallPlan
from rlx_gpu.runtime.registry import status
from rlx_gpu.torch import bridge

F64 = torch.float64


def _cpu_devices() -> list[str]:
    """The first OpenCL CPU device of each platform (PoCL, Intel's CPU runtime), simulators left out."""
    found: dict[str, str] = {}
    for info in status("opencl").devices if status("opencl").available else ():
        if info.cpu and not info.details.get("simulator") and "unusable" not in info.details:
            found.setdefault(str(info.details.get("platform")), info.spec)
    return list(found.values()) or ["none"]


@pytest.fixture(params=_cpu_devices())
def shared(request, monkeypatch):
    """RLX_DEVICE: an OpenCL CPU device of shared memory (none fails, never skips)."""
    if request.param == "none":
        pytest.fail("no OpenCL CPU device to run on")
    monkeypatch.setenv("RLX_DEVICE", request.param)
    rt.clear_cache()
    yield request.param
    rt.clear_cache()


def r(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


def mamba_reference(state, x, dt, A, B, C, D, z, dt_bias):
    """mamba_ssm's ``selective_state_update_ref`` (dt_softplus, Mamba-2's heads form, one group), in float64."""
    dt = F.softplus(dt + dt_bias)
    state.copy_(state * torch.exp(dt[..., None] * A) + (dt[..., None] * B[:, :, None, :]) * x[..., None])
    return ((state * C[:, :, None, :]).sum(-1) + D * x) * F.silu(z)


def mamba_step(heads: int, dim: int, dstate: int):
    """The tensors of one step (f32): Mamba-1's form (``heads`` 0: state ``[1, dim, dstate]``) or Mamba-2's
    (dt, A, D, dt bias per head, broadcast along dim), and the same as float64 in the heads form."""
    g = torch.Generator().manual_seed(heads * 100 + dim)
    if heads:
        A = (-torch.rand(heads, generator=g) - 0.5)[:, None, None].expand(heads, dim, dstate)
        D, dt_bias = (torch.randn(heads, generator=g)[:, None].expand(heads, dim) for _ in range(2))
    else:
        A, D, dt_bias = -torch.rand(dim, dstate, generator=g) - 0.5, torch.randn(dim, generator=g), r(dim)
    lead = (heads,) if heads else ()

    def step():
        dt = r(1, heads, 1).expand(1, heads, dim) if heads else r(1, dim)
        x, z = r(1, *lead, dim), r(1, *lead, dim)
        B, C = (r(1, 1, dstate) if heads else r(1, dstate) for _ in range(2))
        ours = (x, dt, A, B, C, D, z, dt_bias)
        wide = [t.to(F64) for t in ours]
        if not heads:  # one head: the reference's heads form
            wide = [t[:, None] for t in wide[:2]] + [wide[2][None], wide[3][:, None], wide[4][:, None],
                                                      wide[5][None], wide[6][:, None], wide[7][None]]
        return ours, wide
    return step


def run_mamba(state: torch.Tensor, theirs: torch.Tensor, step, heads: int) -> None:
    """One step on both sides: the output and the caller's state after it against the float64 reference."""
    (x, dt, A, B, C, D, z, dt_bias), wide = step()
    version = state._version
    out = rt.selective_state_update(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=True)
    expected = mamba_reference(theirs if heads else theirs[:, None], *wide)
    assert torch.allclose(out.to(F64), expected if heads else expected[:, 0], atol=2e-5, rtol=1e-5)
    assert torch.allclose(state.to(F64), theirs, atol=2e-5, rtol=1e-5)  # written back on every step
    assert state._version > version  # in place, as the op's schema declares


@pytest.mark.parametrize("heads, dim, dstate", [(2, 4, 3), (0, 6, 4)], ids=["mamba2", "mamba1"])
def test_a_decode_loop_on_a_device_of_shared_memory_is_the_ops_step_with_the_state_changed_between(
        heads, dim, dstate, shared, monkeypatch):
    """Steps on the hot path (the plan's own call only on the first): a state changed in place by the caller
    between steps, or swapped for another tensor (two sequences taking turns), is read as it is now."""
    torch.manual_seed(heads)
    calls = []
    call = CallPlan.call
    monkeypatch.setattr(CallPlan, "call", lambda self, *a, **k: calls.append(1) or call(self, *a, **k))
    shape = (1, heads, dim, dstate) if heads else (1, dim, dstate)
    ours, other = r(*shape), r(*shape)
    theirs, other_theirs = ours.to(F64), other.to(F64)
    step = mamba_step(heads, dim, dstate)
    with torch.no_grad():
        for n in range(8):
            if n == 3:  # in place between steps: its version advances
                ours.mul_(0.5)
                theirs.mul_(0.5)
            if n == 5:
                ours[0, 0] = 1.0
                theirs[0, 0] = 1.0
            if n >= 6:  # another sequence's state, then this one's again
                run_mamba(other, other_theirs, step, heads)
            run_mamba(ours, theirs, step, heads)
    assert len(calls) == 1
    assert bridge.last_report().records[0].backend == "opencl"


def test_an_inference_tensors_state_is_written_on_every_step(shared):
    """A state made under ``torch.inference_mode`` (no version counter to advance): each step reads it as it is
    and writes it back."""
    step = mamba_step(2, 4, 3)
    with torch.inference_mode():
        ours = r(1, 2, 4, 3)
        theirs = ours.to(F64)
        for n in range(4):
            if n == 2:
                ours.add_(1.0)
                theirs.add_(1.0)
            (x, dt, A, B, C, D, z, dt_bias), wide = step()
            out = rt.selective_state_update(ours, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=True)
            assert torch.allclose(out.to(F64), mamba_reference(theirs, *wide), atol=2e-5, rtol=1e-5)
            assert torch.allclose(ours.to(F64), theirs, atol=2e-5, rtol=1e-5)


def gated_delta_reference(q, k, v, g, beta, state):
    """fla's naive recurrent gated delta rule, one token (T=1), scale 1/sqrt(K): ``(o, final state)``."""
    S = state * g[:, 0].exp()[..., None, None]
    k0, v0, q0, b0 = k[:, 0], v[:, 0], q[:, 0], beta[:, 0]
    u = (v0 - (S * k0[..., None]).sum(-2)) * b0[..., None]
    S = S + k0[..., None] * u[..., None, :]
    return ((q0 * k.shape[-1] ** -0.5)[..., None] * S).sum(-2)[:, None], S


def test_fused_recurrent_gated_delta_rules_final_state_passed_back_is_the_next_steps_initial_state(shared):
    """The final state returned and passed back as the next initial state, one changed in place before it is
    passed back, a new initial state, or the state of an earlier step: each is read as it is."""
    torch.manual_seed(7)
    state = r(1, 2, 4, 4) * 0.1
    theirs = state.to(F64)
    earlier = None
    with torch.no_grad():
        for n in range(8):
            q, k = (F.normalize(r(1, 1, 2, 4), dim=-1) for _ in range(2))
            v, g, beta = r(1, 1, 2, 4), -torch.rand(1, 1, 2), torch.rand(1, 1, 2)
            if n == 3:
                state.mul_(0.5)
                theirs = theirs * 0.5
            if n == 5:  # a new tensor
                state = r(1, 2, 4, 4) * 0.1
                theirs = state.to(F64)
            if n == 7:  # a state returned two steps before
                state, theirs = earlier
            o, final = rt.fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=state,
                                                           output_final_state=True)
            expected, expected_final = gated_delta_reference(*(t.to(F64) for t in (q, k, v, g, beta)), theirs)
            assert torch.allclose(o.to(F64), expected, atol=1e-5)
            assert torch.allclose(final.to(F64), expected_final, atol=1e-5)
            if n == 5:
                earlier = (final, expected_final)
            state, theirs = final, expected_final
    assert bridge.last_report().records[0].backend == "opencl"
