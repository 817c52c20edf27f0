"""The whole CudaSession driven through the CuPy contract double (tests/support/cupy_double.py): every op and
dtype of the conformance catalog at both kernel targets, cuBLAS through its C API, CUDA graphs, resident
arenas, two devices and allocation failures. Copies, memsets and GEMMs compute real
bytes; kernel launches are checked against their PTX signatures and recorded."""
from __future__ import annotations

import ctypes
import itertools
import sys

import numpy as np
import pytest

pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings with NVRTC is not installed")

from host_fallback.abi import SCAN_OPS, regions  # noqa: E402
from support.cupy_double import ContractError, CUDADriverError, cublas_library, installed  # noqa: E402
from rlx_gpu.conformance import catalog, cases, runner  # noqa: E402
from rlx_gpu.errors import DeviceError  # noqa: E402
from rlx_gpu.runtime import registry  # noqa: E402
from rlx_gpu.runtime.config import load_config  # noqa: E402
from rlx_gpu.runtime.options import RunOptions  # noqa: E402
from rlx_gpu.launches import PLANNERS  # noqa: E402

DISALLOW_REDUCED_PRECISION_REDUCTION = 16  # cublas_api.h
F32_EXACT = {"matmul"}  # cases whose every write a GEMM computes: their results are real here


def _session(spec: str = "cuda:0"):
    st = registry.status("cuda")
    assert st.available, st.reason
    return registry.open_session(next(d for d in st.devices if d.spec == spec))


def _lstm(seq: int = 3) -> dict:
    thunk, _ = cases.lay_out("lstm", "f32", dict(cases.SMALL["lstm"], seq=seq, num_layers=1, bidirectional=False))
    return thunk


def _arena_for(session, thunk, resident=False):
    return session.alloc(max(r.offset + r.nbytes for r in regions(thunk)) + 64, resident=resident)


# ------------------------------------------------------------------------------------------ the double itself
def test_the_double_marshals_kernel_arguments_as_cupy_does(monkeypatch):
    """Python int -> int64, NumPy scalars keep their width, and the PTX parameter list is the judge."""
    from rlx_gpu.backends import programs

    with installed(monkeypatch) as machine:
        session = _session()
        module = session.program(programs.program("cuda", "body", "f32", None, "gpu"))
        fill = session.prims.get_kernel(module, "fill")
        assert fill.params == (("i", 8), ("i", 8), ("i", 8), ("f", 4))  # buf, off, n, value
        buf = session.prims.allocate(64)
        with session.prims.device:
            fill((1,), (32,), (buf.pointer, np.int64(0), np.int64(4), np.float32(1)), stream=session.prims.stream)
            with pytest.raises(ContractError, match=r"packs .*\('f', 8\)"):  # a Python float is a double
                fill((1,), (32,), (buf.pointer, np.int64(0), np.int64(4), 1.0), stream=session.prims.stream)
            with pytest.raises(ContractError, match=r"packs .*\('i', 4\)"):
                fill((1,), (32,), (buf.pointer, np.int32(0), 4, np.float32(1)), stream=session.prims.stream)
            with pytest.raises(TypeError, match="Unsupported type"):
                fill((1,), (32,), (buf, np.int64(0), np.int64(4), np.float32(1)), stream=session.prims.stream)
        with pytest.raises(CUDADriverError, match="CUDA_ERROR_NOT_FOUND"):
            session.prims.get_kernel(module, "no_such_kernel")
        assert [r.kernel for r in machine.launches] == ["fill"]


def test_the_double_refuses_a_cubin_the_cache_did_not_build(monkeypatch):
    """The double judges launches by the PTX beside each cached cubin: a cubin of a cached one's size whose
    bytes differ has no PTX there, and loading it is a contract breach (a real one is found by its digest)."""
    from support import cuda_builds

    from rlx_gpu.backends import programs

    cached = cuda_builds.build(programs.program("cuda", "body", "f32", None, "gpu")).cubin
    with installed(monkeypatch):
        import cupy

        cupy.cuda.function.Module().load(cached)
        with pytest.raises(ContractError, match="did not build"):
            cupy.cuda.function.Module().load(cached[:-1] + bytes([cached[-1] ^ 1]))


def test_the_double_copies_and_multiplies_real_bytes(monkeypatch):
    with installed(monkeypatch) as machine:
        session = _session()
        rng = np.random.default_rng(3)
        a, b = rng.standard_normal((3, 5)), rng.standard_normal((5, 4))
        t = dict(op="matmul", dtype="f64", a=0, b=128, dst=320, batch=1, m=3, k=5, n=4, trans_a=False, trans_b=False,
                 a_batch_stride=0, b_batch_stride=0)
        arena = session.alloc(448)
        session.write(arena, 0, a.view(np.uint8).reshape(-1))
        session.write(arena, 128, b.view(np.uint8).reshape(-1))
        session.launch(t, arena)
        got = session.read(arena, 320, 96).view(np.float64).reshape(3, 4)
        np.testing.assert_allclose(got, a @ b, rtol=1e-13)
        session.zero(arena, 320, 96)
        assert not session.read(arena, 320, 96).any()
        assert not machine.launches  # a matmul is one cuBLAS call, no kernel
        lib = cublas_library(machine)  # the C API refuses what cuBLAS refuses
        one = np.ones(1, np.float64)
        status = lib.cublasGemmStridedBatchedEx(next(iter(machine.handles)), 0, 0, 3, 4, 5, one.ctypes.data, arena.buffer.ptr,
                                                1, 2, 0, arena.buffer.ptr, 1, 5, 0, one.ctypes.data, arena.buffer.ptr, 1, 3,
                                                0, 1, 70, -1)
        assert status == 7, machine.errors  # lda 2 < m 3: CUBLAS_STATUS_INVALID_VALUE


# ------------------------------------------------------------------------------------------ the catalog
#: the dtypes swept per kernel target: every one at the gpu target, whose cubins the suite builds anyway;
#: f32 at the cpu target, whose cubins are built here (~12 s) — its f16/bf16/f64 kernels take the
#: same parameter kinds and widths as f32's (tests/devices/test_ptxas.py checks f32 and f64 of every planner)
SWEPT = {"gpu": ("f32", "f16", "bf16", "f64"), "cpu": ("f32",)}


#: The ops a device runs (the scans drive their body ops there); the others fall back to the host.
DEVICE_OPS = set(PLANNERS) | set(SCAN_OPS)


def _one_case_per_op_dtype(dtypes: tuple[str, ...]) -> list[catalog.Case]:
    picked = {}
    for case in catalog.cases(quick=True):
        if case.dtype in dtypes and case.op in DEVICE_OPS and not case.refused:  # refused: no launch at all
            picked.setdefault((case.op, case.dtype, case.family), case)
    return list(picked.values())


@pytest.mark.parametrize("target", sorted(SWEPT))
def test_every_op_and_dtype_of_the_catalog_plans_and_launches(monkeypatch, target):
    """Each launch is checked against its kernel's PTX parameters by the double; GEMMs compute, so the
    matmul cases must also pass their reference comparison."""
    monkeypatch.setenv("RLX_TARGET", target)
    config = load_config(None)
    with installed(monkeypatch) as machine:
        session = _session()
        assert session.limits.target == target
        ran = set()
        for case in _one_case_per_op_dtype(SWEPT[target]):
            before = len(machine.launches)
            laid = runner.lay_out(case)
            if case.op in F32_EXACT and case.dtype in ("f32", "f64"):
                outcome = runner.check(session, case, config)
                assert outcome.status == "pass", (case.id, outcome.detail)
            else:
                runner._run(session, laid.thunk, laid.arena, case.options, config)
            assert len(machine.launches) > before or case.op == "matmul", case.id
            ran.add((case.op, case.dtype))
        assert {op for op, _ in ran} >= set(cases.SMALL) & DEVICE_OPS and {dt for _, dt in ran} == set(SWEPT[target])
        assert sum(h["gemms"] for h in machine.handles.values()) > 0


# ------------------------------------------------------------------------------------------ cuBLAS and graphs
def test_the_recurrent_loop_with_its_gemms_is_captured_and_replayed(monkeypatch):
    with installed(monkeypatch) as machine:
        session = _session()
        thunk = _lstm(seq=4)
        arena = _arena_for(session, thunk)
        run = session.runner(thunk, RunOptions(rnn_kernel="step"))
        for _ in range(3):
            run(arena)
        counts = session.prims.graphs.counts
        assert counts["captured"] == 1 and counts["replayed"] == 1, counts
        assert machine.graph_counts == {"captured": 1, "launched": 2}
        assert not session.prims.graphs._refused
        (handle,) = machine.handles.values()  # the session's one cuBLAS handle
        replayed = [r.kernel for r in machine.launches if r.replayed]
        assert replayed.count("rnn_step") == 8 and handle["gemms"] >= 3  # the projection in every run
        assert handle["math"] == DISALLOW_REDUCED_PRECISION_REDUCTION  # no 16-bit split-K reductions, no TF32
        assert handle["stream"] == session.prims.stream.ptr and handle["workspace"][1] == 32 << 20


def test_a_scan_body_of_one_thunk_replays_a_graph_per_step(monkeypatch):
    with installed(monkeypatch) as machine:
        session = _session()
        length = 6
        thunk, nbytes = cases.lay_out("scan", "f32", cases.scan_case("scan", "f32", length=length))
        arena = session.alloc(nbytes)
        session.runner(thunk, RunOptions())(arena)
        counts = session.prims.graphs.counts
        assert counts["captured"] >= 1 and counts["replayed"] >= length - 3, counts
        assert any(r.replayed for r in machine.launches)


def test_resident_runs_keep_the_staged_weights(monkeypatch):
    """W_hhᵀ is staged on the first run of a resident arena and kept; a write to W_hh stages it again."""
    with installed(monkeypatch) as machine:
        session = _session()
        thunk = _lstm(seq=2)
        arena = _arena_for(session, thunk, resident=True)
        run = session.runner(thunk, RunOptions(rnn_kernel="step"))
        staged = []
        for step in range(4):
            if step == 3:
                session.write(arena, thunk["w_hh"], np.zeros(4, np.uint8))
            before = len(machine.launches)
            run(arena)
            staged.append(sum(r.kernel == "rnn_w_t" for r in machine.launches[before:]))
        assert staged == [1, 0, 0, 1], staged


# ------------------------------------------------------------------------------------------ devices and memory
def test_a_session_on_the_second_device_keeps_its_device_current(monkeypatch):
    with installed(monkeypatch, devices=2) as machine:
        session = _session("cuda:1")
        assert machine.device == 0  # opening it left CuPy's current device alone
        thunk = _lstm(seq=4)
        arena = _arena_for(session, thunk)
        session.write(arena, 0, np.ones(16, np.uint8))
        run = session.runner(thunk, RunOptions(rnn_kernel="step"))
        for _ in range(3):
            run(arena)
        assert session.read(arena, 0, 16).tolist() == [1] * 16
        assert {r.device for r in machine.launches} == {1} and machine.allocated[0] == 0
        assert [h["device"] for h in machine.handles.values()] == [1]
        assert session.prims.graphs.counts["replayed"] == 1, (session.prims.graphs.counts, session.prims.graphs._refused)


def test_an_allocation_the_device_cannot_hold_is_a_device_error(monkeypatch):
    with installed(monkeypatch, memory_bytes=64 << 20):
        session = _session()
        with pytest.raises(DeviceError) as info:
            session.alloc(48 << 20, "the arena of this schedule")
        text = str(info.value)
        assert "the arena of this schedule" in text and "50331648 bytes (48.0 MiB)" in text and "(cuda:0)" in text
        assert "cudaErrorMemoryAllocation" in text and isinstance(info.value.__cause__, RuntimeError)


def test_the_cublas_wrappers_of_cupy_refuse_a_capture(monkeypatch):
    """Why the backend calls cuBLAS's C API: CuPy's wrapper points the handle at the current stream
    first, and that refuses while the stream captures."""
    with installed(monkeypatch) as machine:
        cp = sys.modules["cupy"]
        stream = cp.cuda.Stream(non_blocking=True)
        handle = cp.cuda.cublas.create()
        stream.begin_capture()
        with stream, pytest.raises(NotImplementedError, match="during stream capture"):
            cp.cuda.cublas.gemmStridedBatchedEx(handle, *itertools.repeat(0, 22))
        stream.end_capture()
        assert machine.graph_counts["captured"] == 1
        out = ctypes.c_void_p()
        assert cublas_library(machine).cublasCreate_v2(ctypes.addressof(out)) == 0 and out.value
