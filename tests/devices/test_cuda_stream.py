"""A call plan on the caller's CUDA stream (``CallPlan.on_stream``), through the CuPy contract double
(tests/support/cupy_double.py): every copy, launch and gemm of a call goes to the stream it is given (torch's
current stream), nothing synchronizes and nothing crosses to the host, so the caller can capture the
call into a CUDA graph of its own and replay it; the double refuses a synchronization or a host copy
inside a capture, and computes the gemms, so a replayed matmul's values are checked too."""
from __future__ import annotations

import sys

import numpy as np
import pytest

pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings with NVRTC is not installed")

import rlx_gpu  # noqa: E402
from support.cupy_double import LEGACY_STREAM, installed  # noqa: E402
from host_fallback.abi import regions  # noqa: E402
from rlx_gpu.conformance.cases import SMALL, lay_out, schedule_of  # noqa: E402
from rlx_gpu.errors import RlxError, RunError  # noqa: E402
from rlx_gpu.runtime.call_plan import CallPlan  # noqa: E402
from rlx_gpu.runtime.config import Config  # noqa: E402

MATMUL = dict(SMALL["matmul"], batch=1, a_batch_stride=0)  # dst[3, 4] = a[3, 5] @ b[4, 5]ᵀ, each stored flat


def _product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a.reshape(3, 5).astype(np.float64) @ b.reshape(4, 5).T).reshape(1, 3, 4)
LSTM = dict(SMALL["lstm"], seq=1, num_layers=1, bidirectional=False)  # one decode step, h0/c0 carried in place


def _schedule(op: str, **params) -> rlx_gpu.Schedule:
    """A one-thunk schedule naming each tensor by its field: what it reads are the inputs, what it writes
    the outputs (a state updated in place is both)."""
    thunk, nbytes = lay_out(op, "f32", params)
    regs = regions(thunk)
    return rlx_gpu.load_schedule(schedule_of(thunk, nbytes) | {
        "tensors": {r.field: {"offset": r.offset, "dtype": r.dtype, "shape": list(r.shape)} for r in regs},
        "inputs": [r.field for r in regs if r.reads], "outputs": [r.field for r in regs if r.writes]})


def _on_device(values: np.ndarray):
    """A CuPy (double) array holding ``values``, written and waited for on the legacy stream."""
    cp = sys.modules["cupy"]
    values = np.ascontiguousarray(values)
    memory = cp.cuda.memory.Memory(values.nbytes)
    cp.cuda.runtime.memcpyAsync(memory.ptr, values.ctypes.data, values.nbytes, cp.cuda.runtime.memcpyHostToDevice,
                                LEGACY_STREAM)
    return cp.ndarray(values.shape, values.dtype, memptr=cp.cuda.memory.MemoryPointer(memory, 0))


def _empty(schedule: rlx_gpu.Schedule, name: str):
    cp = sys.modules["cupy"]
    v = schedule.tensors[name]
    memory = cp.cuda.memory.Memory(v.nbytes)
    return cp.ndarray(v.shape, np.float32, memptr=cp.cuda.memory.MemoryPointer(memory, 0))


def _inputs(schedule: rlx_gpu.Schedule, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.uniform(-1, 1, schedule.tensors[name].shape).astype(np.float32) for name in schedule.inputs}


def _setup(monkeypatch, schedule):
    """The double, a CUDA plan of ``schedule``, a "torch" stream of the double, the inputs and outputs on the device."""
    device = rlx_gpu.get_device("cuda:0", Config(fallback="forbid"))
    cp = sys.modules["cupy"]
    values = _inputs(schedule)
    return (CallPlan(schedule, device), cp.cuda.Stream(non_blocking=True), values,
            {name: _on_device(a) for name, a in values.items()}, {name: _empty(schedule, name) for name in schedule.outputs})


def test_a_call_on_a_stream_copies_launches_and_multiplies_there_and_waits_for_nothing(monkeypatch):
    schedule = _schedule("matmul", **MATMUL)
    with installed(monkeypatch) as machine:
        plan, stream, values, ins, outs = _setup(monkeypatch, schedule)
        with stream:  # torch's current stream, as CuPy sees it
            plan.on_stream(ins, outs, stream.ptr)  # the first call binds and uploads the arena
            machine.log.clear()
            report = plan.on_stream(ins, outs, stream.ptr, stamps={"b": "b1"})
            assert machine.log == [("D2D", stream.ptr)] * 2 + [("gemm", stream.ptr), ("D2D", stream.ptr)]
            assert report.copies == 3
            machine.log.clear()
            plan.on_stream({"a": ins["a"]}, outs, stream.ptr, stamps={"b": "b1"})  # b's stamp holds: not copied
            assert machine.log == [("D2D", stream.ptr), ("gemm", stream.ptr), ("D2D", stream.ptr)]
        session = plan.device.session
        (handle,) = machine.handles.values()  # the cuBLAS handle is back on the session's stream, with its workspace
        assert handle["stream"] == session.prims.own_stream.ptr and handle["workspace"] is not None
        stream.synchronize()
        np.testing.assert_allclose(outs["dst"].get(), _product(values["a"], values["b"]), rtol=1e-6)


def test_a_call_captured_on_the_callers_stream_replays_with_the_inputs_of_the_replay(monkeypatch):
    schedule = _schedule("matmul", **MATMUL)
    with installed(monkeypatch) as machine:
        plan, stream, values, ins, outs = _setup(monkeypatch, schedule)
        with stream:
            plan.on_stream(ins, outs, stream.ptr, stamps={"b": "b1"})  # eager: binds; b's stamp kept
            machine.log.clear()
            stream.begin_capture()  # the double refuses any synchronization or host copy from here on
            try:
                plan.on_stream(ins, outs, stream.ptr, stamps={"b": "b1"})
            finally:
                graph = stream.end_capture()
            # captured: every input copied whatever its stamp (a replay reads the inputs as they are then)
            assert machine.log == [("D2D", stream.ptr)] * 2 + [("gemm", stream.ptr), ("D2D", stream.ptr)]
            new_a = np.full_like(values["a"], 0.5)
            sys.modules["cupy"].cuda.runtime.memcpyAsync(ins["a"].data.ptr, new_a.ctypes.data, new_a.nbytes, 1,
                                                         LEGACY_STREAM)
            graph.launch(stream)
        stream.synchronize()
        np.testing.assert_allclose(outs["dst"].get(), _product(new_a, values["b"]), rtol=1e-6)
        assert plan.device.session.prims.graphs.counts["captured"] == 0  # no graph of the session's own


def test_a_recurrent_decode_step_is_captured_on_the_callers_stream(monkeypatch):
    """An LSTM step: input projection (cuBLAS), the step kernels, h0/c0 updated in place; its launches
    and gemms all on the caller's stream, recorded in the capture and replayed there."""
    schedule = _schedule("lstm", **LSTM)
    with installed(monkeypatch) as machine:
        plan, stream, _, ins, outs = _setup(monkeypatch, schedule)
        with stream:
            plan.on_stream(ins, outs, stream.ptr)
            before, machine.log[:] = len(machine.launches), []
            stream.begin_capture()
            try:
                plan.on_stream(ins, outs, stream.ptr)
            finally:
                graph = stream.end_capture()
            assert len(machine.launches) == before  # recorded, not run
            graph.launch(stream)
            graph.launch(stream)
        replayed = machine.launches[before:]
        assert replayed and all(r.replayed and r.stream == stream.ptr for r in replayed)
        assert {s for _, s in machine.log} == {stream.ptr} and "gemm" in {k for k, _ in machine.log}
        assert {k for k, _ in machine.log} <= {"D2D", "gemm", "memset"}


def test_on_a_stream_a_plans_scratch_is_its_own(monkeypatch):
    """A chunked Mamba-2 uses scratch: on a caller's stream it is kept with the plan's arena (a captured
    graph points into it) instead of the session's shared scratch, which another plan's larger run frees."""
    schedule = _schedule("mamba2", batch=1, seq=300, heads=2, head_dim=16, state_size=16)
    with installed(monkeypatch):
        plan, stream, _, ins, outs = _setup(monkeypatch, schedule)
        plan.on_stream(ins, outs, stream.ptr)
        (kept,) = plan._arena.handle.kept.values()
        assert kept.buffer.nbytes > 0 and kept.reads == () and plan.device.session._scratch is None


def test_integer_tensors_are_checked_on_an_eager_call_and_refuse_a_capture(monkeypatch):
    schedule = _schedule("mamba2", batch=1, seq=7, heads=2, head_dim=4, state_size=4, cu_seqlens=[0, 3, 7])
    with installed(monkeypatch) as machine:
        plan, stream, values, ins, outs = _setup(monkeypatch, schedule)
        ins["cu_seqlens"] = _on_device(np.array([0, 3, 7], np.int32))
        with stream:
            plan.on_stream(ins, outs, stream.ptr)
            machine.log.clear()
            plan.on_stream(ins, outs, stream.ptr)  # eager: cu_seqlens read back from the arena and checked
            assert ("D2H", stream.ptr) in machine.log and ("sync", stream.ptr) in machine.log
            ins["cu_seqlens"] = _on_device(np.array([0, 3, 9], np.int32))
            with pytest.raises(RunError, match=r"thunk 0 \(mamba2\).*cu_seqlens"):
                plan.on_stream(ins, outs, stream.ptr)
            stream.begin_capture()
            try:
                with pytest.raises(RunError, match=r"'cu_seqlens'.*capture cannot"):
                    plan.on_stream(ins, outs, stream.ptr)
            finally:
                graph = stream.end_capture()
        assert graph.ops == []  # refused before anything was enqueued


def test_a_capture_before_any_eager_call_on_the_stream_is_refused(monkeypatch):
    schedule = _schedule("matmul", **MATMUL)
    with installed(monkeypatch):
        plan, stream, _, ins, outs = _setup(monkeypatch, schedule)
        stream.begin_capture()
        try:
            with pytest.raises(RlxError, match="once eagerly"):
                plan.on_stream(ins, outs, stream.ptr)
        finally:
            stream.end_capture()


def test_the_stream_path_refuses_host_memory_and_wrong_outputs(monkeypatch):
    schedule = _schedule("matmul", **MATMUL)
    with installed(monkeypatch):
        plan, stream, values, ins, outs = _setup(monkeypatch, schedule)
        with pytest.raises(RlxError, match="input 'a' lies in host memory"):
            plan.on_stream(dict(ins, a=values["a"]), outs, stream.ptr)
        with pytest.raises(RlxError, match=r"outputs \[\] given; the plan's outputs are \['dst'\]"):
            plan.on_stream(ins, {}, stream.ptr)
        with pytest.raises(RlxError, match=r"input 'b' is f32 \[4, 5\], expected f32 \[20\]"):
            plan.on_stream(dict(ins, b=_on_device(values["b"].reshape(4, 5))), outs, stream.ptr)
    with pytest.raises(RlxError, match="runs on a CUDA device; this plan runs on host"):
        CallPlan(schedule, rlx_gpu.get_device("host")).on_stream({}, {}, 0)


def test_torchs_default_stream_is_the_legacy_stream(monkeypatch):
    """torch's default stream reports ``cuda_stream == 0``, which DLPack refuses as ambiguous: the plan
    asks its producers for the legacy stream's DLPack name (1), and enqueues on the legacy stream."""
    schedule = _schedule("matmul", **MATMUL)
    with installed(monkeypatch) as machine:
        plan, _, values, ins, outs = _setup(monkeypatch, schedule)
        plan.on_stream(ins, outs, 0)
        machine.log.clear()
        plan.on_stream(ins, outs, 0)
        assert machine.log == [("D2D", LEGACY_STREAM)] * 2 + [("gemm", LEGACY_STREAM), ("D2D", LEGACY_STREAM)]
        np.testing.assert_allclose(outs["dst"].get(), _product(values["a"], values["b"]), rtol=1e-6)
