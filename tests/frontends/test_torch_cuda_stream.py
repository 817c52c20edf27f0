"""rlx_gpu.torch's CUDA path, where torch has no CUDA: every function and module called on CUDA tensors
goes through ``bridge.run_on_stream`` (inputs converted and made dense by torch ops, outputs allocated by
``torch.empty``, the call handed to ``CallPlan.on_stream`` with torch's current stream) and gives what the
ordinary path gives. Here CPU tensors stand for CUDA ones (``bridge.on_cuda`` answers yes), torch's
current stream is a stand-in, and ``CallPlan.on_stream`` is replaced by a check of what it is handed and a
host run of the same plan: the device side of the path is tests/devices/test_cuda_stream.py's."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

import rlx_gpu.torch as rt
from rlx_gpu.runtime.call_plan import CallPlan
from rlx_gpu.torch import bridge, state_update

STREAM = 0x5EED


def _as_cuda(monkeypatch) -> list[CallPlan]:
    """Tensors taken for CUDA ones from now on; returns the plans ``on_stream`` was called on, in order."""
    calls: list[CallPlan] = []
    # a CUDA tensor's call signature is never a CPU tensor's (bridge.call_key), so no hot path the CPU calls
    # before kept may take the stand-ins' calls
    rt.clear_cache()
    for module in (bridge, state_update):
        monkeypatch.setattr(module, "on_cuda", lambda t: isinstance(t, torch.Tensor))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=STREAM))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())

    def on_stream(plan, inputs, outputs, stream, stamps=None):
        tensors = plan.schedule.tensors
        assert stream == STREAM and set(outputs) == set(plan.outputs)
        for name, t in {**inputs, **outputs}.items():  # what the stream path takes: no conversion there
            v = tensors[name]
            assert t.is_contiguous() and bridge.DTYPES[t.dtype] == v.dtype and tuple(t.shape) == v.shape, name
        got = plan({name: bridge.host_array(t) for name, t in inputs.items()}, stamps)
        for name, t in outputs.items():
            t.copy_(bridge.tensor(got[name], t.device))
        calls.append(plan)
    monkeypatch.setattr(CallPlan, "on_stream", on_stream)
    return calls


def _decode_steps():
    """One decode step of each op family; each call returns its outputs and carried states (cloned)."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g)
    H, P, N = 2, 4, 3
    m2 = dict(x=rand(1, H, P), dt=rand(1, H)[..., None].expand(1, H, P),
              A=(-torch.rand(H, generator=g))[:, None, None].expand(H, P, N), B=rand(1, 1, N), C=rand(1, 1, N),
              D=rand(H)[:, None].expand(H, P), dt_bias=rand(H)[:, None].expand(H, P))
    m2_state = rand(1, H, P, N)
    m1 = dict(x=rand(2, 5), dt=rand(2, 5), A=-torch.rand(5, N, generator=g), B=rand(2, N), C=rand(2, N), D=rand(5),
              z=rand(2, 5), dt_bias=rand(5))
    m1_pool, rows = rand(4, 5, N), torch.tensor([3, 1], dtype=torch.int32)
    q, k = rand(1, 1, 2, 4), rand(1, 1, 2, 4)
    v, gate, beta, gdn_state = rand(1, 1, 2, 5), -torch.rand(1, 1, 2, generator=g), torch.rand(1, 1, 2, generator=g), rand(1, 2, 4, 5)
    torch.manual_seed(1)
    lstm = rt.LSTM(3, 4, batch_first=True)
    x, h, c = rand(1, 1, 3), rand(1, 1, 4), rand(1, 1, 4)

    def mamba2():
        state = m2_state.clone()
        return rt.selective_state_update(state, **m2, dt_softplus=True), state

    def mamba1_pool():
        pool = m1_pool.clone()
        return rt.selective_state_update(pool, **m1, dt_softplus=True, state_batch_indices=rows), pool

    def gdn():
        return rt.fused_recurrent_gated_delta_rule(q, k, v, gate, beta=beta, initial_state=gdn_state,
                                                   output_final_state=True)

    def lstm_step():
        with torch.no_grad():
            y, (h1, c1) = lstm(x, (h, c))
        return y, h1, c1
    return {"selective_state_update mamba2": mamba2, "selective_state_update mamba1 pool": mamba1_pool,
            "fused_recurrent_gated_delta_rule": gdn, "LSTM": lstm_step}


@pytest.mark.parametrize("label", list(_decode_steps()))
def test_a_decode_step_on_cuda_tensors_takes_the_stream_path_and_gives_the_ordinary_result(monkeypatch, label):
    monkeypatch.setenv("RLX_DEVICE", "host")
    step = _decode_steps()[label]
    expected = step()
    calls = _as_cuda(monkeypatch)
    got = step()
    assert len(calls) == 1, label  # one call plan, reached through CallPlan.on_stream
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
