"""rlx_gpu.torch.LSTM / GRU / RNN against torch.nn's own modules: state_dict keys and loading, outputs and
final states, and gradients (torch autograd of torch.nn in float32, torch.autograd.gradcheck in float64),
for batch_first, bidirectional, proj_size, relu, unbatched and PackedSequence inputs, dropout between layers."""
from __future__ import annotations

import pytest
import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

import rlx_gpu.torch.nn as rnn
from rlx_gpu.runtime.registry import status
from rlx_gpu.torch import bridge

TORCH = {rnn.LSTM: torch.nn.LSTM, rnn.GRU: torch.nn.GRU, rnn.RNN: torch.nn.RNN}
CASES = [  # (module, constructor keywords) covering every constructor argument the ABI maps
    (rnn.LSTM, dict(num_layers=2, bidirectional=True, proj_size=2)),
    (rnn.LSTM, dict(batch_first=True, bias=False)),
    (rnn.GRU, dict(num_layers=2, batch_first=True, bidirectional=True)),
    (rnn.RNN, dict(num_layers=2, nonlinearity="relu")),
    (rnn.RNN, dict(bidirectional=True)),
]
IN, HIDDEN, BATCH, SEQ = 3, 4, 3, 5


@pytest.fixture(autouse=True)
def _host(monkeypatch):
    monkeypatch.setenv("RLX_DEVICE", "host")


def _pair(cls, kwargs, dtype=torch.float32, seed=0):
    """A torch.nn module and ours loaded from its state_dict."""
    torch.manual_seed(seed)
    ref = TORCH[cls](IN, HIDDEN, dtype=dtype, **kwargs)
    ours = cls(IN, HIDDEN, dtype=dtype, **kwargs)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def _states(module, batch, dtype):
    dirs = 2 if module.bidirectional else 1
    h = torch.randn(module.num_layers * dirs, batch, module.proj_size or HIDDEN, dtype=dtype)
    if module.mode == "LSTM":
        return h, torch.randn(module.num_layers * dirs, batch, HIDDEN, dtype=dtype)
    return h


def _leaves(hx):
    return tuple(t.detach().clone().requires_grad_() for t in (hx if isinstance(hx, tuple) else (hx,)))


def _finals(h):
    return h if isinstance(h, tuple) else (h,)


@pytest.mark.parametrize("cls,kwargs", CASES, ids=lambda c: getattr(c, "__name__", None) or str(c))
def test_loads_a_torch_state_dict_and_matches_torch_with_gradients(cls, kwargs):
    ref, ours = _pair(cls, kwargs)
    assert list(ours.state_dict()) == list(ref.state_dict()) and ours.mode == ref.mode
    assert isinstance(ours, torch.nn.RNNBase) and not isinstance(ours, TORCH[cls])  # Dynamo refuses torch's classes
    shape = (BATCH, SEQ, IN) if kwargs.get("batch_first") else (SEQ, BATCH, IN)
    x = torch.randn(shape)
    hx = _states(ref, BATCH, torch.float32)
    runs = []
    for module in (ref, ours):
        xs, states = x.clone().requires_grad_(), _leaves(hx)
        y, h = module(xs, states if module.mode == "LSTM" else states[0])
        w = torch.linspace(-1, 1, y.numel()).reshape(y.shape)
        loss = (y * w).sum() + sum((f * (k + 2)).sum() for k, f in enumerate(_finals(h)))
        loss.backward()
        runs.append((y, _finals(h), xs.grad, [s.grad for s in states], [p.grad for p in module.parameters()]))
    (y0, h0, dx0, ds0, dp0), (y1, h1, dx1, ds1, dp1) = runs
    assert y1.shape == y0.shape and y1.is_contiguous()
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-6)
    for a, b in zip(h1, h0):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip([dx1, *ds1, *dp1], [dx0, *ds0, *dp0]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cls,kwargs", [
    (rnn.LSTM, dict(num_layers=2, bidirectional=True, proj_size=2)),
    (rnn.GRU, dict(bidirectional=True)),
    (rnn.RNN, dict(num_layers=2, nonlinearity="relu")),
], ids=["lstm", "gru", "rnn_relu"])
def test_gradcheck_in_float64_through_the_module(cls, kwargs):
    """Every parameter, the input and the initial states, through the module's packing and the thunks."""
    torch.manual_seed(1)
    module = cls(2, 3, dtype=torch.float64, **kwargs)
    names = [n for n, _ in module.named_parameters()]
    x = torch.randn(4, 2, 2, dtype=torch.float64, requires_grad=True)
    dirs = 2 if module.bidirectional else 1
    states = [torch.randn(module.num_layers * dirs, 2, w, dtype=torch.float64, requires_grad=True)
              for w in ((module.proj_size or 3, 3) if cls is rnn.LSTM else (3,))]

    def run(x, *tensors):
        params = dict(zip(names, tensors[: len(names)]))
        hx = tuple(tensors[len(names):])
        y, h = torch.func.functional_call(module, params, (x, hx if cls is rnn.LSTM else hx[0]))
        return (y, *_finals(h))

    params = [p.detach().clone().requires_grad_() for p in module.parameters()]
    assert torch.autograd.gradcheck(run, (x, *params, *states), eps=1e-6, atol=1e-7, fast_mode=True)


def test_unsorted_packed_sequence_in_and_out_with_h_n_in_the_callers_order():
    ref, ours = _pair(rnn.LSTM, dict(bidirectional=True, batch_first=True))
    x = torch.randn(4, SEQ, IN)
    lengths = torch.tensor([2, 5, 1, 3])  # unsorted: torch sorts inside and hands h_n back in this order
    hx = _states(ref, 4, torch.float32)
    runs = []
    for module in (ref, ours):
        xs, states = x.clone().requires_grad_(), _leaves(hx)
        packed = pack_padded_sequence(xs, lengths, batch_first=True, enforce_sorted=False)
        y, (h, c) = module(packed, states)
        assert isinstance(y, PackedSequence)
        (y.data.square().sum() + (h * 3).sum() + c.sum()).backward()
        runs.append((y, h, c, xs.grad, states[0].grad, [p.grad for p in module.parameters()]))
    (y0, *rest0), (y1, *rest1) = runs
    assert torch.equal(y1.batch_sizes, y0.batch_sizes) and torch.equal(y1.sorted_indices, y0.sorted_indices)
    assert torch.equal(y1.unsorted_indices, y0.unsorted_indices)
    torch.testing.assert_close(y1.data, y0.data, rtol=1e-5, atol=1e-6)
    for a, b in zip([*rest1[:4], *rest1[4]], [*rest0[:4], *rest0[4]]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_unbatched_input_and_default_states():
    ref, ours = _pair(rnn.GRU, dict(num_layers=2))
    x = torch.randn(SEQ, IN)
    (y0, h0), (y1, h1) = ref(x), ours(x)
    assert y1.shape == (SEQ, HIDDEN) and h1.shape == (2, HIDDEN)
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h1, h0, rtol=1e-5, atol=1e-6)


def test_dropout_runs_a_thunk_per_layer_in_training_and_one_for_all_in_eval():
    ref, ours = _pair(rnn.LSTM, dict(num_layers=3, dropout=0.5, batch_first=True))
    x = torch.randn(BATCH, SEQ, IN)
    bridge.clear_cache()
    ours.eval()
    torch.testing.assert_close(ours(x)[0], ref.eval()(x)[0], rtol=1e-5, atol=1e-6)
    assert [key[0][1].num_layers for key in bridge._cache] == [3]
    ours.train()
    torch.manual_seed(5)
    y, (h, c) = ours(x)
    # the same computation from one-layer torch modules with the dropout masks drawn in the same order
    layers = []
    for layer in range(3):
        one = torch.nn.LSTM(IN if layer == 0 else HIDDEN, HIDDEN, batch_first=True)
        one.load_state_dict({k.replace(f"_l{layer}", "_l0"): v for k, v in ref.state_dict().items()
                             if k.endswith(f"_l{layer}")})
        layers.append(one)
    torch.manual_seed(5)
    out, hs = x, []
    for layer, one in enumerate(layers):
        if layer:
            # torch's batch_first output is a transposed view and a mask is drawn in memory order
            out = torch.nn.functional.dropout(out.contiguous(), 0.5, training=True)
        out, (hl, _) = one(out)
        hs.append(hl)
    torch.testing.assert_close(y, out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h, torch.cat(hs), rtol=1e-5, atol=1e-6)
    assert sorted({key[0][1].num_layers for key in bridge._cache}) == [1, 3]


def test_a_wrong_state_shape_is_refused_with_torchs_message():
    ours = rnn.LSTM(IN, HIDDEN, num_layers=2)
    with pytest.raises(RuntimeError, match=r"Expected hidden\[0\] size \(2, 3, 4\), got \[1, 3, 4\]"):
        ours(torch.randn(SEQ, BATCH, IN), (torch.zeros(1, BATCH, HIDDEN), torch.zeros(2, BATCH, HIDDEN)))
    with pytest.raises(TypeError, match=r"LSTM: hx must be a tuple \(h_0, c_0\)"):
        ours(torch.randn(SEQ, BATCH, IN), torch.zeros(2, BATCH, HIDDEN))


def test_bf16_runs_in_bf16_near_the_float32_result():
    ref, ours = _pair(rnn.GRU, dict(batch_first=True))
    x = torch.randn(BATCH, SEQ, IN)
    y32 = ref(x)[0]
    y16, h16 = ours.bfloat16()(x.bfloat16())
    assert y16.dtype == h16.dtype == torch.bfloat16
    torch.testing.assert_close(y16.float(), y32, rtol=0, atol=3e-2)


def test_opencl_runs_the_modules_forward_and_backward():
    if not status("opencl").available:
        pytest.fail(f"OpenCL is unavailable: {status('opencl').reason}")
    ref, ours = _pair(rnn.LSTM, dict(batch_first=True))
    x = torch.randn(2, SEQ, IN)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLX_DEVICE", "opencl")
        xs = x.clone().requires_grad_()
        y, _ = ours(xs)
        y.sum().backward()
    xr = x.clone().requires_grad_()
    ref(xr)[0].sum().backward()
    assert [e.device.spec.split(":")[0] for e in bridge._cache.values()][-2:] == ["opencl", "opencl"]
    torch.testing.assert_close(y, ref(x)[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(xs.grad, xr.grad, rtol=1e-4, atol=1e-5)


def test_weights_are_packed_again_after_an_optimizer_step_and_for_a_new_module_in_old_memory():
    """The packing and the call plan's copy of the weights follow every parameter's version: an optimizer
    step (in-place updates) is seen at the next call, and a module built where a dead one's parameters
    lay (same addresses, version 0) gets its own weights, not the dead one's."""
    torch.manual_seed(5)
    x = torch.randn(2, 3, IN)
    for _ in range(3):  # each round frees the last round's modules, whose memory the next may reuse
        ref, ours = _pair(rnn.LSTM, dict(batch_first=True), seed=int(torch.randint(0, 1000, ())))
        for step in range(2):
            torch.testing.assert_close(ours(x)[0], ref(x)[0], rtol=1e-5, atol=1e-6)
            for module in (ref, ours):
                module.zero_grad()
                module(x)[0].square().sum().backward()
                torch.optim.SGD(module.parameters(), lr=0.5).step()
        del ref, ours


def test_selective_state_update_advances_the_states_version_as_an_in_place_op_does():
    """selective_state_update writes its state in place and says so to autograd (the version advances),
    as an in-place torch operation does."""
    from rlx_gpu.torch import selective_state_update

    state = torch.zeros(1, 4, 3)
    before = state._version
    selective_state_update(state, torch.randn(1, 4), torch.rand(1, 4), -torch.rand(4, 3), torch.randn(1, 3),
                           torch.randn(1, 3))
    assert state._version > before and state.abs().sum() > 0


def test_a_state_space_parameter_changed_in_place_is_seen_and_an_unchanged_one_is_not_copied_again():
    """D and dt_bias as module parameters cross into the call's arena once per version: an in-place update
    (as an optimizer's) is seen at the next call; the call before and after it agree with fresh tensors."""
    from rlx_gpu.torch import mamba_chunk_scan_combined

    torch.manual_seed(6)
    x, dt, A = torch.randn(1, 4, 2, 3), torch.rand(1, 4, 2), -torch.rand(2)
    Bm, Cm = torch.randn(1, 4, 1, 5), torch.randn(1, 4, 1, 5)
    D, bias = torch.nn.Parameter(torch.randn(2)), torch.nn.Parameter(torch.randn(2))

    def run(d, b):
        with torch.no_grad():
            return mamba_chunk_scan_combined(x, dt, A, Bm, Cm, 4, D=d, dt_bias=b, dt_softplus=True)

    first = run(D, bias)
    torch.testing.assert_close(run(D, bias), first)
    assert bridge.last_report() is not None
    with torch.no_grad():
        D.add_(1.0)
        bias.mul_(-1.0)
    torch.testing.assert_close(run(D, bias), run(D.detach().clone(), bias.detach().clone()))
    assert not torch.allclose(run(D, bias), first)
