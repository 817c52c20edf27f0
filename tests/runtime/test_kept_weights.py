"""Staged weights kept on a resident arena (``LaunchPlan.staging``, ``backends.core.KeptScratch``).

On OpenCL the recurrent plans stage W_ih and W_hh transposed into scratch. On a resident arena that
scratch is kept between runs and the staging launches are skipped, until a write overlaps the weights:
``arena.write`` of a weight, or a thunk of the schedule that writes them. Every run here is compared
with the host backend (NumPy kernels, no staging) running the same schedule and the same writes, and
the launches each run enqueued are counted, so a test cannot pass with nothing kept.
"""
from __future__ import annotations

import base64

import numpy as np
import pytest

import rlx_gpu
from host_fallback.abi import regions
from rlx_gpu.conformance.cases import lay_out
from rlx_gpu.runtime.config import Config
from rlx_gpu.runtime.registry import status
from rlx_gpu.schedule.model import ABI_V1

pytestmark = pytest.mark.skipif(not status("opencl").available, reason="needs an OpenCL device (PoCL)")

STAGING = {"transpose_real", "rnn_w_t"}


def _schedule(op: str, batch: int = 12, layers: int = 1, bidirectional: bool = False, scaled: bool = False) -> tuple:
    """A carried decode step of ``op`` (S=1, I=5, H=8) naming every field; ``scaled`` puts a thunk
    first that writes ``w_ih = w_src * scale`` (``w_src`` from init, ``scale`` an input). At B=12 the
    per-step kernel runs (W_ih staged for the gemm by transpose_real, W_hh by rnn_w_t), at B=2 the
    persistent one (both staged by rnn_w_t: it projects the input itself)."""
    params = dict(batch=batch, seq=1, input_size=5, hidden=8, num_layers=layers, bidirectional=bidirectional, carry=True)
    thunk, arena_bytes = lay_out(op, "f32", params)
    regs = {r.field: r for r in regions(thunk)}
    tensors = {f: {"offset": r.offset, "dtype": "f32", "shape": list(r.shape)} for f, r in regs.items()}
    rng = np.random.default_rng(1)
    init, thunks, inputs = [], [thunk], ["x"]
    for field in ("w_ih", "w_hh", "bias", "b_ih", "b_hh"):
        if field in regs:
            values = rng.uniform(-0.5, 0.5, regs[field].shape).astype(np.float32)
            init.append({"offset": regs[field].offset, "b64": base64.b64encode(values.tobytes()).decode()})
    if scaled:
        w = regs["w_ih"]
        src, scale = arena_bytes, arena_bytes + -(-w.nbytes // 64) * 64
        tensors |= {"w_src": {"offset": src, "dtype": "f32", "shape": list(w.shape)},
                    "scale": {"offset": scale, "dtype": "f32", "shape": [1]}}
        values = rng.uniform(-0.5, 0.5, w.shape).astype(np.float32)
        init.append({"offset": src, "b64": base64.b64encode(values.tobytes()).decode()})
        n = w.nbytes // 4
        thunks = [{"op": "binary", "dtype": "f32", "fn": "mul", "shape": [n], "a": src, "a_strides": [1],
                   "b": scale, "b_strides": [0], "dst": w.offset}, thunk]
        inputs.append("scale")
        arena_bytes = scale + 64
    sched = rlx_gpu.load_schedule({"abi": ABI_V1, "arena_bytes": arena_bytes, "tensors": tensors,
                                   "inputs": inputs, "outputs": ["dst"], "init": init, "thunks": thunks})
    return sched, regs


def _counting(device) -> list[str]:
    """Record the kernel name of every launch ``device`` enqueues from now on."""
    names: list[str] = []
    prims = device.session.prims
    enqueue = prims.enqueue

    def counted(kernel, launch, args):
        names.append(launch.kernel)
        enqueue(kernel, launch, args)

    prims.enqueue = counted
    return names


def _pair(sched):
    gpu = rlx_gpu.get_device("opencl", Config(fallback="forbid"))
    host = rlx_gpu.get_device("host")
    return gpu, gpu.arena(sched), host, host.arena(sched)


def _step(pair, sched, **inputs) -> None:
    """Write ``inputs`` to both arenas, run both, and check the outputs and carried state agree."""
    gpu, garena, host, harena = pair
    for name, values in inputs.items():
        garena.write(name, values)
        harena.write(name, values)
    gpu.run(sched, garena)
    host.run(sched, harena)
    for name in ("dst", "h0", "c0"):
        if name in sched.tensors:
            np.testing.assert_allclose(garena.read(name), harena.read(name), rtol=2e-5, atol=2e-6, err_msg=name)


@pytest.mark.parametrize("op", ["lstm", "gru"])
@pytest.mark.parametrize("batch", [2, 12])
def test_staged_weights_are_kept_and_restaged_after_arena_write(op, batch):
    sched, regs = _schedule(op, batch)
    pair = _pair(sched)
    names = _counting(pair[0])
    rng = np.random.default_rng(2)
    x = lambda: rng.standard_normal((batch, 1, 5)).astype(np.float32)  # noqa: E731
    _step(pair, sched, x=x())
    staging = STAGING & set(names)  # the first run stages
    assert staging == (STAGING if batch == 12 else {"rnn_w_t"})
    assert names.count("rnn_w_t") == (1 if batch == 12 else 2)
    names.clear()
    _step(pair, sched, x=x())
    _step(pair, sched, x=x())
    assert not STAGING & set(names) and {"rnn_step", "rnn_persist"} & set(names)  # later runs reuse them
    for field in ("w_ih", "w_hh"):
        names.clear()
        _step(pair, sched, x=x(), **{field: rng.uniform(-0.5, 0.5, regs[field].shape).astype(np.float32)})
        assert staging <= set(names), field  # a write to a weight restages (and the outputs agree)
        names.clear()
        _step(pair, sched, x=x())
        assert not STAGING & set(names)
    names.clear()
    _step(pair, sched, x=x(), h0=rng.standard_normal(regs["h0"].shape).astype(np.float32))
    assert not STAGING & set(names)  # a write elsewhere (the state) keeps them
    pair[1].free()
    assert not pair[1].handle


def test_an_earlier_thunk_writing_the_weights_restages_them():
    sched, _ = _schedule("lstm", scaled=True)
    pair = _pair(sched)
    names = _counting(pair[0])
    rng = np.random.default_rng(3)
    for scale in (1.0, 1.0, -2.0, 0.5):
        names.clear()
        _step(pair, sched, x=rng.standard_normal((12, 1, 5)).astype(np.float32), scale=np.array([scale], np.float32))
        assert "transpose_real" in names  # the weights were rewritten by thunk 0 on every run


@pytest.mark.parametrize("op", ["lstm", "gru"])
def test_every_layer_and_direction_keeps_its_own_staged_weights(op):
    sched, regs = _schedule(op, layers=2, bidirectional=True)
    pair = _pair(sched)
    names = _counting(pair[0])
    rng = np.random.default_rng(4)
    for run in range(4):
        names.clear()
        extra = {"w_hh": rng.uniform(-0.5, 0.5, regs["w_hh"].shape).astype(np.float32)} if run == 2 else {}
        _step(pair, sched, x=rng.standard_normal((12, 1, 5)).astype(np.float32), **extra)
        assert names.count("rnn_w_t") == (2 if run in (0, 2) else 0)  # one staging per layer when stale


def test_the_copying_path_stages_on_every_run():
    sched, _ = _schedule("lstm")
    gpu = rlx_gpu.get_device("opencl", Config(fallback="forbid"))
    names = _counting(gpu)
    arena = sched.pristine_arena()
    for _ in range(2):
        names.clear()
        arena = gpu.run(sched, arena)
        assert STAGING <= set(names)
    expected = rlx_gpu.get_device("host").run(sched, rlx_gpu.get_device("host").run(sched, sched.pristine_arena()))
    np.testing.assert_allclose(sched.tensors["dst"].read(arena), sched.tensors["dst"].read(expected), rtol=2e-5, atol=2e-6)
