"""Tensors crossing into and out of resident arenas by DLPack, and Graph.compile keeping its weights resident."""
from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

import rlx_gpu
from rlx_gpu.errors import DLPackError
from rlx_gpu.graph.builder import Graph
from rlx_gpu.runtime.config import Config
from rlx_gpu.runtime.registry import status

N = 6


def _scale_schedule(dtype: str) -> dict:
    """``y = x * w`` elementwise, ``w`` resident (no init: written once by the caller)."""
    mul = {"op": "binary", "dtype": dtype, "fn": "mul", "shape": [N], "a_strides": [1], "b_strides": [1],
           "a": 0, "b": 64, "dst": 128}
    spec = {"offset": 0, "dtype": dtype, "shape": [N]}
    return {"abi": "rlx-thunks/1", "arena_bytes": 192, "inputs": ["x", "w"], "outputs": ["y"], "init": [],
            "tensors": {"x": spec, "w": spec | {"offset": 64}, "y": spec | {"offset": 128}}, "thunks": [mul]}


def _devices() -> list:
    devices = [pytest.param("host", id="host")]
    if status("opencl").available:
        devices.append(pytest.param("opencl", id="opencl"))
    return devices


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy()


@pytest.mark.parametrize("spec", _devices())
def test_torch_bf16_in_is_stored_bit_exact(spec):
    device = rlx_gpu.get_device(spec, Config(fallback="forbid"))
    sched = rlx_gpu.load_schedule(_scale_schedule("bf16"))
    x = torch.randn(N, dtype=torch.float64).to(torch.bfloat16)
    w = torch.tensor([1.0, 2.0, -0.5, 4.0, 0.25, -1.0], dtype=torch.bfloat16)
    with device.arena(sched) as arena:
        arena.write("x", x)
        arena.write("w", w)
        device.run(sched, arena)
        assert np.array_equal(arena.read("x").view(np.int16), _bits(x))
        assert np.array_equal(arena.read("y").view(np.int16), _bits(x * w))  # exact: scaling by powers of two
        if spec != "host":
            with pytest.raises(DLPackError, match="no zero-copy host view.*arena.read"):
                arena.view("y")


def test_a_host_view_is_live_and_shares_the_arena():
    device = rlx_gpu.get_device("host")
    sched = rlx_gpu.load_schedule(_scale_schedule("bf16"))
    arena = device.arena(sched)
    arena.write("w", np.full(N, 2.0))
    y = torch.from_dlpack(arena.view("y"))
    assert y.dtype == torch.bfloat16 and y.shape == (N,)
    for step in range(3):
        x = torch.arange(N, dtype=torch.bfloat16) + step
        arena.write("x", x)
        device.run(sched, arena)
        assert torch.equal(y, 2 * x)  # the run wrote through the view: no read, no copy
    y[0] = 7.0
    assert arena.read("y")[0] == 7.0


@pytest.mark.usefixtures("collect_only_new_objects")
def test_a_host_view_outlives_the_freed_arena():
    device = rlx_gpu.get_device("host")
    sched = rlx_gpu.load_schedule(_scale_schedule("f32"))
    arena = device.arena(sched)
    arena.write("y", np.arange(N, dtype=np.float32))
    memory = weakref.ref(arena.handle)
    y = torch.from_dlpack(arena.view("y"))
    arena.free()
    del arena
    gc.collect()
    assert memory() is not None and y.tolist() == list(range(N))
    del y
    gc.collect()
    assert memory() is None


def test_write_refuses_what_it_cannot_take():
    device = rlx_gpu.get_device("host")
    arena = device.arena(rlx_gpu.load_schedule(_scale_schedule("f32")))
    with pytest.raises(DLPackError, match="int64"):
        arena.write("x", torch.arange(N, dtype=torch.int64))
    with pytest.raises(DLPackError, match="contiguous"):
        arena.write("x", torch.zeros(2 * N)[::2])
    with pytest.raises(rlx_gpu.RlxError, match=r"shape \[6\], got values of shape \[3\]"):
        arena.write("x", torch.zeros(3))
    arena.write("x", torch.arange(N, dtype=torch.float64))  # another float dtype is converted
    assert arena.read("x").tolist() == list(range(N))


def _mlp(dtype: str) -> tuple[Graph, np.ndarray]:
    g = Graph(dtype)
    w = np.random.default_rng(0).uniform(-1, 1, (4, 3))
    g.output("y", g.unary("tanh", g.input("x", (2, 4)) @ g.weight("w", w)))
    return g, w


@pytest.mark.parametrize("spec", _devices())
def test_compile_keeps_weights_resident_and_uploads_only_inputs(spec, monkeypatch):
    g, w = _mlp("f32")
    exe = g.compile(spec)
    xs = np.random.default_rng(1).uniform(-1, 1, (3, 2, 4))
    exe.run(x=xs[0])
    arena = exe.plan._arena.handle
    written: list[int] = []
    session = exe.device.session
    real_write = session.write
    monkeypatch.setattr(session, "write", lambda arena, offset, data: (written.append(data.nbytes),
                                                                        real_write(arena, offset, data))[1])
    for x in xs:
        np.testing.assert_allclose(exe.run(x=x)["y"], np.tanh(x @ w), rtol=1e-5, atol=1e-6)
        # on a device: x in, y out, unless its arenas are host memory (an OpenCL CPU device's shared SVM)
        assert exe.plan.last_report.copies == (0 if session.shared else 2)
    # x alone, every run (where the arena is host memory, copied straight into it): the weights stayed on the device
    assert written == ([] if session.shared else [2 * 4 * 4] * len(xs))
    assert exe.plan._arena.handle is arena


def test_compile_takes_torch_bf16_inputs():
    g, w = _mlp("bf16")
    exe = g.compile("host")
    x = torch.randn(2, 4).to(torch.bfloat16)
    got = exe.run(x=x)["y"]
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, exe.run(x=x.float().numpy())["y"])
