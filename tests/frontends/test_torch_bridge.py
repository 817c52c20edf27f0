"""rlx_gpu.torch.bridge: compiled once per signature, tensors in and out in their own dtype and device."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from rlx_gpu.errors import RlxError
from rlx_gpu.graph.builder import Graph
from rlx_gpu.torch import bridge


def _scaled(shape, dtype, counter):
    def build():
        counter.append(1)
        g = Graph(dtype)
        g.output("y", g.input("x", shape) * 3.0)
        return g
    return build


def test_a_signature_compiles_once_and_16_bit_outputs_stay_16_bit(monkeypatch):
    monkeypatch.setenv("RLX_DEVICE", "host")
    bridge.clear_cache()
    builds: list[int] = []
    x = torch.randn(2, 3, dtype=torch.bfloat16)
    for _ in range(3):
        y = bridge.run_graph(("scale", 3.0), _scaled((2, 3), "bf16", builds), {"x": x})["y"]
    assert builds == [1] and y.dtype == torch.bfloat16
    torch.testing.assert_close(y, x * 3.0, rtol=0, atol=0)  # ×3 of a bf16 value rounds as torch rounds it
    bridge.run_graph(("scale", 3.0), _scaled((4, 3), "bf16", builds), {"x": torch.randn(4, 3).bfloat16()})
    assert builds == [1, 1]  # another shape is another signature


def test_strided_inputs_are_read_as_their_values(monkeypatch):
    monkeypatch.setenv("RLX_DEVICE", "host")
    x = torch.arange(12.0).reshape(3, 4).t()  # a transposed view
    y = bridge.run_graph("scale", _scaled((4, 3), "f32", []), {"x": x})["y"]
    torch.testing.assert_close(y, x * 3.0)


def test_device_follows_the_tensors():
    assert bridge.device_for(torch.zeros(1), 2.0) is None
    with pytest.raises(NotImplementedError, match="tensors on meta have no rlx_gpu backend"):
        bridge.device_for(torch.zeros(1, device="meta"))
    with pytest.raises(RlxError, match="lie on different devices"):
        bridge.device_for(torch.zeros(1), torch.zeros(1, device="meta"))
    with pytest.raises(NotImplementedError, match="tensor x is torch.int64"):
        bridge.rlx_dtype(torch.zeros(1, dtype=torch.int64), "tensor x")


def test_importing_rlx_gpu_does_not_import_torch():
    code = "import sys, rlx_gpu, rlx_gpu.graph.builder; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_the_default_device_is_part_of_the_signature(monkeypatch):
    bridge.clear_cache()
    builds: list[int] = []
    x = torch.ones(2)
    monkeypatch.setenv("RLX_DEVICE", "host")
    bridge.run_graph("scale", _scaled((2,), "f32", builds), {"x": x})
    monkeypatch.setenv("RLX_DEVICE", "opencl")
    y = bridge.run_graph("scale", _scaled((2,), "f32", builds), {"x": x})["y"]
    assert builds == [1, 1]
    assert [e.device.spec.split(":")[0] for e in bridge._cache.values()] == ["host", "opencl"]
    torch.testing.assert_close(y, x * 3.0)



def test_a_backward_schedule_holds_the_backward_thunk_and_not_the_forward_it_recomputes(monkeypatch):
    from rlx_gpu.torch import LSTM, chunk_gated_delta_rule

    monkeypatch.setenv("RLX_DEVICE", "host")
    bridge.clear_cache()
    q = torch.randn(1, 6, 1, 4, requires_grad=True)
    state = torch.randn(1, 1, 4, 4, requires_grad=True)
    o, final = chunk_gated_delta_rule(q, q, torch.randn(1, 6, 1, 4), -torch.rand(1, 6, 1), torch.rand(1, 6, 1),
                                      initial_state=state, output_final_state=True)
    (o.sum() + final.sum()).backward()
    y, _ = LSTM(3, 4)(torch.randn(5, 2, 3, requires_grad=True))
    y.sum().backward()
    backward = [[t.op for t in exe.schedule.thunks] for key, exe in bridge._cache.items() if key[0][0] == "backward"]
    assert len(backward) == 2
    for ops in backward:
        assert [op for op in ops if op.endswith("_backward")] and not {"gated_delta_net", "lstm"} & set(ops), ops
