"""A call signature's hot path (``bridge.hot_path``): after a signature's first call ran the whole way, its
later calls skip the checks and lookups and run the bound call. These calls must be the same calls: the
same results (against torch references written here from mamba_ssm's, fla's and torch.nn's formulas),
the state written in place with its version advanced, parameters changed in place seen, and every error
still raised in the caller's terms where a call differs from the signature (another shape, dtype or
tensor type, out-of-range indices).
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

from support.torch_devices import host  # noqa: F401  (fixture)

import rlx_gpu.torch as rt
from rlx_gpu.torch import bridge, state_update
from rlx_gpu.torch.held_views import HeldView

F64 = torch.float64


def r(*shape: int, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype)


def step_reference(state, x, dt, A, B, C, D, z, dt_bias):
    """mamba_ssm's ``selective_state_update_ref`` (dt_softplus, Mamba-2's heads form, one group) in float64."""
    dt = F.softplus(dt + dt_bias)
    state.copy_(state * torch.exp(dt[..., None] * A) + (dt[..., None] * B[:, :, None, :]) * x[..., None])
    return ((state * C[:, :, None, :]).sum(-1) + D * x) * F.silu(z)


def step_arguments(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """x, dt, A, B, C, D, z, dt_bias of one heads-form step (B1 H2 P4 N3); dt, A, D, dt bias per head, broadcast."""
    A = (-r(2, dtype=dtype).abs() - 0.5)[:, None, None].expand(2, 4, 3)
    D, dt_bias = (r(2, dtype=dtype)[:, None].expand(2, 4) for _ in range(2))
    dt = r(1, 2, 1, dtype=dtype).expand(1, 2, 4)
    x, B, C, z = (r(*shape, dtype=dtype) for shape in ((1, 2, 4), (1, 1, 3), (1, 1, 3), (1, 2, 4)))
    return x, dt, A, B, C, D, z, dt_bias


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_a_decode_loop_on_the_hot_path_matches_mamba_ssms_step_and_updates_the_state_in_place(dtype, host,
                                                                                              monkeypatch):
    torch.manual_seed(0)
    checks = []
    check = state_update.check_selective_state_update
    monkeypatch.setattr(state_update, "check_selective_state_update", lambda *a: checks.append(1) or check(*a))
    ours = r(1, 2, 4, 3).to(dtype)
    theirs = ours.to(F64, copy=True)
    for step in range(4):
        x, dt, A, B, C, D, z, dt_bias = step_arguments(dtype)
        version = ours._version
        out = rt.selective_state_update(ours, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=True)
        expected = step_reference(theirs, *(t.to(F64) for t in (x, dt, A, B, C, D, z, dt_bias)))
        tolerance = 1e-12 if dtype == F64 else 1e-5
        assert torch.allclose(out.to(F64), expected, atol=tolerance, rtol=tolerance)
        assert torch.allclose(ours.to(F64), theirs, atol=tolerance, rtol=tolerance)
        assert ours._version > version  # written in place, as its schema declares
    assert len(checks) == 1  # the first call checked the signature; the others took its hot path


def test_a_call_unlike_the_hot_paths_signature_is_checked_in_the_callers_terms(host):
    state = r(3, 2, 4, 3)
    x, dt, A, B, C, D, z, dt_bias = step_arguments(F64)
    rt.selective_state_update(state[:1], x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=True)
    with pytest.raises(ValueError, match="selective_state_update: B"):
        rt.selective_state_update(state[:1], x, dt, A, r(1, 1, 4), C, D=D, z=z, dt_bias=dt_bias, dt_softplus=True)
    with pytest.raises(TypeError, match="selective_state_update"):
        rt.selective_state_update(state[:1], x, dt, A, B.float(), C, D=D, z=z, dt_bias=dt_bias, dt_softplus=True)
    with pytest.raises(IndexError, match=r"state_batch_indices\[0\] = 3 is outside the state pool of 3 entries"):
        rt.selective_state_update(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=True,
                                  state_batch_indices=torch.tensor([3], dtype=torch.int32))


class Marked(torch.Tensor):
    """A tensor subclass: its calls go through torch's dispatcher, never a hot path of plain tensors."""


def test_a_tensor_subclass_leaves_the_hot_path_of_plain_tensors(host, monkeypatch):
    x, dt, A, B, C, D, z, dt_bias = step_arguments(F64)
    state = r(1, 2, 4, 3)
    for _ in range(2):
        rt.selective_state_update(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=True)
    checks = []
    check = state_update.check_selective_state_update
    monkeypatch.setattr(state_update, "check_selective_state_update", lambda *a: checks.append(1) or check(*a))
    expected = step_reference(state.clone(), x, dt, A, B, C, D, z, dt_bias)
    out = rt.selective_state_update(state, x.as_subclass(Marked), dt, A, B, C, D=D, z=z, dt_bias=dt_bias,
                                    dt_softplus=True)
    assert checks == [1]
    assert torch.allclose(out.as_subclass(torch.Tensor), expected, atol=1e-12)


def gated_delta_reference(q, k, v, g, beta, state):
    """fla's naive recurrent gated delta rule, one token (T=1), scale 1/sqrt(K): ``(o, final state)``."""
    S = state.clone() * g[:, 0].exp()[..., None, None]
    k0, v0, q0, b0 = k[:, 0], v[:, 0], q[:, 0], beta[:, 0]
    u = (v0 - (S * k0[..., None]).sum(-2)) * b0[..., None]
    S = S + k0[..., None] * u[..., None, :]
    return ((q0 * k.shape[-1] ** -0.5)[..., None] * S).sum(-2)[:, None], S


@pytest.mark.parametrize("output_final_state", [True, False])
def test_fused_recurrent_gated_delta_rule_on_its_hot_path_matches_flas_step(output_final_state, host):
    torch.manual_seed(1)
    state = r(1, 2, 4, 4)
    for _ in range(3):
        q, k = (F.normalize(r(1, 1, 2, 4), dim=-1) for _ in range(2))
        v, g, beta = r(1, 1, 2, 4), -torch.rand(1, 1, 2, dtype=F64), torch.rand(1, 1, 2, dtype=F64)
        o, final = rt.fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=state,
                                                       output_final_state=output_final_state)
        expected, expected_final = gated_delta_reference(q, k, v, g, beta, state)
        assert torch.allclose(o, expected, atol=1e-12)
        if output_final_state:
            assert torch.allclose(final, expected_final, atol=1e-12)
            state = final
        else:
            assert final is None
            state = expected_final


@pytest.mark.parametrize("batch_first", [True, False])
def test_an_lstm_decode_loop_on_its_hot_path_sees_its_parameters_change_in_place(batch_first, host):
    torch.manual_seed(2)
    theirs = torch.nn.LSTM(4, 5, num_layers=2, batch_first=batch_first, dtype=F64)
    ours = rt.LSTM(4, 5, num_layers=2, batch_first=batch_first, dtype=F64)
    ours.load_state_dict(theirs.state_dict())
    hc_ours = hc_theirs = (r(2, 1, 5), r(2, 1, 5))
    with torch.no_grad():
        for step in range(4):
            if step == 2:  # an optimizer-like step: every parameter changed in place (their versions advance)
                for mine, torchs in zip(ours.parameters(), theirs.parameters()):
                    delta = r(*mine.shape) * 0.1
                    mine.add_(delta)
                    torchs.add_(delta)
            x = r(1, 1, 4)
            y, hc_ours = ours(x, hc_ours)
            expected, hc_theirs = theirs(x, hc_theirs)
            assert torch.allclose(y, expected, atol=1e-12)
            for mine, torchs in zip(hc_ours, hc_theirs):
                assert torch.allclose(mine, torchs, atol=1e-12)


@pytest.mark.parametrize("kind", ["GRU", "RNN", "LSTM list hx", "LSTM unbatched"])
def test_each_recurrent_modules_decode_form_on_its_hot_path_matches_torch_nn(kind, host):
    """GRU and RNN (``hx`` one tensor), an LSTM given ``hx`` as a list, and an unbatched LSTM: each form of
    ``hx`` and input the hot path takes, step after step, against torch.nn with the same parameters."""
    torch.manual_seed(4)
    name = kind.split()[0]
    theirs = getattr(torch.nn, name)(4, 5, batch_first=True, dtype=F64)
    ours = getattr(rt, name)(4, 5, batch_first=True, dtype=F64)
    ours.load_state_dict(theirs.state_dict())
    unbatched = kind.endswith("unbatched")
    lead = () if unbatched else (1,)
    h = r(1, *lead, 5)
    hx_ours = hx_theirs = [h, r(1, *lead, 5)] if kind == "LSTM list hx" else (h, r(1, *lead, 5)) if name == "LSTM" else h
    with torch.no_grad():
        for _ in range(3):
            x = r(*lead, 1, 4)
            y, hx_ours = ours(x, hx_ours)
            expected, hx_theirs = theirs(x, hx_theirs)
            assert y.shape == expected.shape and torch.allclose(y, expected, atol=1e-12)
            assert type(hx_ours) is type(hx_theirs)
            for mine, torchs in zip(*((hx_ours, hx_theirs) if name == "LSTM" else ((hx_ours,), (hx_theirs,)))):
                assert mine.shape == torchs.shape and torch.allclose(mine, torchs, atol=1e-12)
            if kind == "LSTM list hx":
                hx_ours, hx_theirs = list(hx_ours), list(hx_theirs)


def test_clear_cache_drops_the_hot_paths_and_calls_run_the_whole_way_again(host, monkeypatch):
    x, dt, A, B, C, D, z, dt_bias = step_arguments(F64)
    state = r(1, 2, 4, 3)
    rt.selective_state_update(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=True)
    rt.clear_cache()
    checks = []
    check = state_update.check_selective_state_update
    monkeypatch.setattr(state_update, "check_selective_state_update", lambda *a: checks.append(1) or check(*a))
    expected = step_reference(state.clone(), x, dt, A, B, C, D, z, dt_bias)
    out = rt.selective_state_update(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=True)
    assert checks == [1] and torch.allclose(out, expected, atol=1e-12)


def test_a_module_converted_to_another_dtype_refuses_the_input_it_took_before(host):
    torch.manual_seed(3)
    ours = rt.LSTM(4, 5, batch_first=True)
    x = torch.randn(1, 1, 4)
    with torch.no_grad():
        for _ in range(2):
            ours(x)
        ours.double()
        with pytest.raises(ValueError, match=r"input dtype \(torch.float32\) does not match weight dtype"):
            ours(x)


@pytest.mark.usefixtures("collect_only_new_objects")
def test_clear_cache_lets_a_parameter_changed_through_data_be_seen_and_frees_the_step_plans(host):
    """A parameter written through ``.data`` (no new version: its stamp is unchanged) is seen after
    ``clear_cache()``, which drops the step's route and bound plan too (its arena freed: no plan of the
    call stays alive)."""
    x, dt, A, B, C, D, z, dt_bias = step_arguments(F64)
    A = torch.nn.Parameter(A[:, :1, :1].clone()).expand(2, 4, 3)  # a Mamba-2 block's A: a parameter, broadcast
    state = r(1, 2, 4, 3)
    with torch.no_grad():
        for _ in range(2):
            rt.selective_state_update(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=True)
        plan = weakref.ref(bridge._last.plan)
        A._base.data.mul_(2.0)  # through .data: torch counts no new version
        rt.clear_cache()
        gc.collect()
        assert plan() is None
        expected = step_reference(state.clone(), x, dt, A, B, C, D, z, dt_bias)
        out = rt.selective_state_update(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=True)
    assert torch.allclose(out, expected, atol=1e-12)


@pytest.mark.usefixtures("collect_only_new_objects")
def test_a_held_view_follows_the_tensors_memory_and_does_not_keep_it_alive():
    view = HeldView()
    t = torch.zeros(3, 4)
    view(t)[1, 2] = 5.0
    assert view(t) is view(t) and t[1, 2] == 5.0  # kept, and written through
    t.set_(torch.zeros(3, 4))  # the same tensor, new memory
    view(t)[0, 0] = 7.0
    assert t[0, 0] == 7.0 and t[1, 2] == 0.0
    other = torch.ones(3, 4)  # another tensor: its own view
    assert view(other)[0, 0] == 1.0 and view(t)[0, 0] == 7.0
    held = weakref.ref(t)
    del t
    gc.collect()
    assert held() is None


def test_a_state_given_new_memory_between_hot_steps_is_updated_where_it_lies_now(host):
    x, dt, A, B, C, D, z, dt_bias = step_arguments(F64)
    state = r(1, 2, 4, 3)
    expected_state = state.clone()
    with torch.no_grad():
        for step in range(4):
            if step == 2:  # the same tensor object, its memory swapped (what a cache reallocation does)
                fresh = state.clone()
                state.set_(fresh)
            expected = step_reference(expected_state, x, dt, A, B, C, D, z, dt_bias)
            out = rt.selective_state_update(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=True)
            assert torch.allclose(out, expected, atol=1e-12) and torch.allclose(state, expected_state, atol=1e-12)


def test_a_decode_loop_of_parameters_writes_them_again_only_when_they_change(host, monkeypatch):
    """The hot path writes its tensors into the plan's arena itself (``written``, ``runtime.host_call``), a
    parameter only when its stamp changed: a parameter changed in place between steps is seen, an unchanged
    one is not written again, and the plan's own call path is not taken after the first call."""
    from rlx_gpu.runtime.call_plan import CallPlan
    torch.manual_seed(3)
    A_log, D, dt_bias = (torch.nn.Parameter(r(2)) for _ in range(3))
    ours = r(1, 2, 4, 3)
    theirs = ours.clone()
    calls = []
    call = CallPlan.call
    monkeypatch.setattr(CallPlan, "call", lambda self, *a, **k: calls.append(1) or call(self, *a, **k))
    rt.clear_cache()  # the signature's first call runs the whole way here
    with torch.no_grad():
        A = (-A_log.exp())[:, None, None].expand(2, 4, 3)  # a new tensor (no parameter): written every step
        for step in range(5):
            if step == 3:
                D.add_(0.5)  # in place: its version advances, so its stamp changes
                dt_bias.mul_(-1.0)
            x, dt, _, B, C, _, z, _ = step_arguments(F64)
            Dh, bias = D[:, None].expand(2, 4), dt_bias[:, None].expand(2, 4)
            out = rt.selective_state_update(ours, x, dt, A, B, C, D=Dh, z=z, dt_bias=bias, dt_softplus=True)
            expected = step_reference(theirs, x, dt, A, B, C, Dh, z, bias)
            assert torch.allclose(out, expected, atol=1e-12)
            assert torch.allclose(ours, theirs, atol=1e-12)
    assert len(calls) == 1  # the first call's; the others wrote the arena themselves


def test_the_written_path_reads_a_strided_input_and_mamba_1s_form(host):
    """Mamba-1's form (state [batch, dim, dstate]) with x and z strided views of a wider tensor: the hot path
    writes each through a view of its own strides."""
    torch.manual_seed(4)
    dim, dstate = 6, 3
    A, D, dt_bias = -r(dim, dstate).abs() - 0.5, r(dim), r(dim)
    ours = r(1, dim, dstate)
    theirs = ours.clone()
    for _ in range(4):
        xz, dt, B, C = r(1, 2 * dim), r(1, dim), r(1, dstate), r(1, dstate)
        x, z = xz[:, :dim], xz[:, dim:]
        out = rt.selective_state_update(ours, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=True)
        expected = step_reference(theirs[:, None], x[:, None], dt[:, None], A[None], B[:, None], C[:, None], D[None],
                                  z[:, None], dt_bias[None])[:, 0]
        assert torch.allclose(out, expected, atol=1e-12)
        assert torch.allclose(ours, theirs, atol=1e-12)


def test_a_lazily_negated_or_zero_input_of_the_hot_paths_signature_is_written_as_its_values(host):
    """A step's dense inputs are moved into the arena by their bytes; one whose negation is lazy (its neg bit,
    which the signature does not tell) has the bytes of its values' opposite, and a zero tensor no bytes at
    all: each is written as its values."""
    torch.manual_seed(5)
    ours = r(1, 2, 4, 3)
    theirs = ours.clone()
    for step in range(4):
        x, dt, A, B, C, D, z, dt_bias = step_arguments(F64)
        if step == 3:
            x = torch._efficientzerotensor(x.shape, dtype=F64)
            assert x.stride() == (8, 4, 1) and x.data_ptr() == 0
        given = torch._neg_view(-x) if step == 2 else x  # the values of x, its bytes those of -x
        assert given.is_neg() == (step == 2) and given.is_contiguous()
        out = rt.selective_state_update(ours, given, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=True)
        expected = step_reference(theirs, x, dt, A, B, C, D, z, dt_bias)
        assert torch.allclose(out, expected, atol=1e-12)
        assert torch.allclose(ours, theirs, atol=1e-12)


def test_mamba_1s_large_a_is_read_where_it_lies_call_after_call(host):
    """Mamba-1's form with an A of 16 KiB or more: the hot path hands it to the kernel as it lies (as the call
    plan's own ``call`` does) rather than copying it into the arena, so even a parameter changed through
    ``.data`` (which its version, the stamp of a copied parameter, does not see) is read as it is now."""
    torch.manual_seed(6)
    dim, dstate = 320, 16  # A: 20 KiB of float32
    A = torch.nn.Parameter(-torch.rand(dim, dstate) - 0.5, requires_grad=False)
    D, dt_bias = torch.randn(dim), torch.randn(dim)
    ours = torch.randn(1, dim, dstate)
    theirs = ours.to(F64)
    for step in range(4):
        if step == 2:
            A.data.mul_(0.5)
        x, dt, B, C, z = torch.randn(1, dim), torch.randn(1, dim), torch.randn(1, dstate), torch.randn(1, dstate), \
            torch.randn(1, dim)
        out = rt.selective_state_update(ours, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=True)
        expected = step_reference(theirs[:, None], *(t.to(F64) for t in (x[:, None], dt[:, None], A[None], B[:, None],
                                                                         C[:, None], D[None], z[:, None],
                                                                         dt_bias[None])))[:, 0]
        assert torch.allclose(out.to(F64), expected, atol=1e-4, rtol=1e-4)
        assert torch.allclose(ours.to(F64), theirs, atol=1e-4, rtol=1e-4)
