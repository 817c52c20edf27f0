"""tools/gpu_check.py's own logic, here where no GPU is: files written as it goes, exit status by design."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from rlx_gpu.conformance import cases

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_check.py"
FILES = {"log.txt", "summary.md", "results.json"}


def _run(out: Path, *args: str, **env: str) -> tuple[int, list[dict]]:
    environ = {k: v for k, v in os.environ.items() if k not in ("OUT", "RLX_GPU_CHECK_SKIP_CUDA")}
    environ.update(env, PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *args], env=environ, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert "Traceback" not in run.stderr, run.stderr
    return run.returncode, json.loads((out / "results.json").read_text())["rows"]


def _cuda_available() -> bool:
    from rlx_gpu.runtime.registry import status

    return status("cuda").available


def test_skipping_cuda_runs_the_environment_and_exits_zero(tmp_path):
    rc, rows = _run(tmp_path, "--skip-cuda")
    assert rc == 0
    assert FILES == {p.name for p in tmp_path.iterdir()}
    by_section = {r["section"]: r for r in rows if r["item"] == "all"}
    assert set(by_section) == {"build", "conformance", "sanitizer", "ceilings", "bench", "backward", "capture", "mma"}
    assert all(r["status"] == "skip" for r in by_section.values())
    env = json.loads((tmp_path / "results.json").read_text())["env"]
    assert "numpy" in env["packages"] and "python" in env
    summary = (tmp_path / "summary.md").read_text()
    assert summary.startswith("| section | item | status | detail |") and "| build | all | skip |" in summary


def test_the_environment_variable_skips_like_the_flag(tmp_path):
    rc, rows = _run(tmp_path, RLX_GPU_CHECK_SKIP_CUDA="1")
    assert rc == 0 and any(r["section"] == "bench" and r["status"] == "skip" for r in rows)


@pytest.mark.skipif(_cuda_available(), reason="CUDA is available: the sections run for real (tools/gpu_check.py)")
def test_without_cuda_every_cuda_section_fails_with_the_reason(tmp_path):
    rc, rows = _run(tmp_path)
    assert rc == 1
    failed = {r["section"] for r in rows if r["status"] == "fail"}
    assert {"build", "conformance", "sanitizer", "ceilings", "bench", "backward", "capture", "mma"} <= failed
    reason = next(r["detail"] for r in rows if r["section"] == "build")
    assert "cuda backend is unavailable" in reason
    assert "[fail] build" in (tmp_path / "log.txt").read_text()


def test_a_spent_budget_fails_what_did_not_run(tmp_path):
    rc, rows = _run(tmp_path, "--skip-cuda", "--budget", "0")
    assert rc == 1 and rows[0]["section"] == "env" and "budget" in rows[0]["detail"]


def test_the_benchmark_shapes_are_valid_schedules_of_the_issue_sizes():
    sys.path[:0] = [str(ROOT / "tools"), str(ROOT / "benchmarks")]
    import gpu_bench

    from rlx_gpu.conformance import cases
    from rlx_gpu.schedule.io import load_schedule

    floors = {}
    for label, template in gpu_bench.shapes():
        fields = dict(template)
        thunk, nbytes = cases.lay_out(fields.pop("op"), "f32", fields)
        load_schedule(cases.schedule_of(thunk, nbytes))  # validates every field and footprint
        floors[label] = gpu_bench.footprint_bytes(thunk)
    # selective_scan B8 S4096 D4096: x and delta read, dst written (3 x 512 MiB) plus b, c and a
    assert floors["selective_scan B8 S4096 D4096 N16"] == 3 * 8 * 4096 * 4096 * 4 + 2 * 8 * 4096 * 16 * 4 + 4096 * 16 * 4
    # gdn decode carries its state: read once and written once
    state = 64 * 16 * 128 * 128 * 4
    assert floors["gdn decode B64 S1 H16 N128"] == 2 * state + 64 * 16 * (4 * 128 + 2) * 4


def test_the_backward_shapes_are_valid_schedules_with_every_gradient():
    sys.path[:0] = [str(ROOT / "tools"), str(ROOT / "benchmarks")]
    import gpu_backward

    from host_fallback.abi import regions
    from rlx_gpu.conformance import cases
    from rlx_gpu.schedule.io import load_schedule

    for label, template in gpu_backward.shapes():
        fields = gpu_backward.backward_template(template)
        thunk, nbytes = cases.lay_out(fields.pop("op"), "f32", fields)
        load_schedule(cases.schedule_of(thunk, nbytes))
        written = {r.field for r in regions(thunk) if r.writes}
        inputs = {"lstm": {"x", "w_ih", "w_hh", "bias"}, "gru": {"x", "w_ih", "w_hh", "b_ih", "b_hh"},
                  "selective_scan": {"x", "delta", "a", "b", "c"}, "mamba2": {"x", "dt", "a", "b", "c"},
                  "gated_delta_net": {"q", "k", "v", "g", "beta"}}[template["op"]]
        assert written == {f"d_{name}" for name in inputs}, label


def test_the_backward_section_reads_cudnns_reserve_where_autograd_saved_one():
    """cuDNN's reserve size is read off the backward node torch's CUDA RNN leaves (``_saved_result3``), a few views
    below the output; the CPU's RNN saves none (None, not a guess), and our side of the line is defined for the
    section's recurrent shapes."""
    sys.path[:0] = [str(ROOT / "tools"), str(ROOT / "benchmarks")]
    import gpu_backward
    import torch

    import rlx_gpu

    class Node:
        def __init__(self, below=None, reserve=None, name="AsStridedBackward0"):
            self.next_functions = ((below, 0),) if below is not None else ()
            self.name = lambda: name
            if reserve is not None:
                self._saved_result3 = reserve

    class Output:
        grad_fn = Node(Node(Node(reserve=torch.empty(3, 5, dtype=torch.float16), name="CudnnRnnBackward0")))

    assert gpu_backward.saved_reserve_bytes(Output()) == 30
    lstm = torch.nn.LSTM(4, 8, batch_first=True)  # oneDNN's node on the CPU saves a workspace: not cuDNN's
    assert gpu_backward.saved_reserve_bytes(lstm(torch.randn(2, 3, 4))[0]) is None
    for label, template in gpu_backward.shapes():
        if template["op"] in ("lstm", "gru"):
            assert rlx_gpu.reserve_bytes(template) >= template["batch"] * template["seq"] * template["hidden"], label


def _script():
    sys.path[:0] = [str(ROOT / "tools")]
    import gpu_check

    return gpu_check


def test_the_check_writes_at_most_eight_files_whatever_happens(tmp_path):
    """The lent machine returns at most 8 files: the check writes only those it names."""
    gpu_check = _script()
    assert len(gpu_check.FILES) <= 8 and {"results.json", "log.txt", "summary.md"} <= set(gpu_check.FILES)
    ck = gpu_check.Check(tmp_path, True, 10.0)
    with pytest.raises(ValueError, match="at most 8"):
        ck.write("conformance.txt", "")


def test_a_timed_out_child_keeps_its_output_as_text_and_its_stderr(tmp_path):
    gpu_check = _script()
    code = "import sys, time; print('started', flush=True); sys.stderr.write('progress 3/9\\n'); sys.stderr.flush(); time.sleep(60)"
    text, rc = gpu_check.run_child([sys.executable, "-c", code], 3, gpu_check.child_env())
    assert rc is None and text.startswith("started\n") and "progress 3/9" in text and "b'" not in text
    assert "stopped after 3 s" in text


def test_the_child_environment_prepends_the_checkout(monkeypatch):
    gpu_check = _script()
    monkeypatch.setenv("PYTHONPATH", "/carried/wheels")
    env = gpu_check.child_env(RLX_CUDA_GRAPHS="0")
    assert env["PYTHONPATH"] == os.pathsep.join([str(ROOT), "/carried/wheels"]) and env["RLX_CUDA_GRAPHS"] == "0"


def test_no_child_and_no_section_outlasts_the_budget(tmp_path):
    gpu_check = _script()
    import gpu_bench

    ck = gpu_check.Check(tmp_path, False, 200.0)
    timeout = ck.timeout(0.9)
    assert timeout is not None and timeout <= ck.left() - gpu_check.RESERVE
    ck.budget = 30.0  # under RESERVE + MIN_CHILD, and under what a benchmark needs
    assert ck.timeout(0.45) is None
    gpu_bench.scan_per_step(ck, None, None, [])  # no time left: it says so and touches no session
    assert [r.status for r in ck.rows] == ["fail", "fail"] and "budget" in ck.rows[0].detail


def test_the_build_section_names_kernels_from_the_ptx(tmp_path, monkeypatch):
    """Through the CuPy double: every kernel of every gpu program (kernels compiled out by an ``#if`` are
    not in the module, and get_function of one is CUDA_ERROR_NOT_FOUND), build.md written as it goes."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings with NVRTC is not installed")
    from support import cuda_builds
    from support.cupy_double import installed

    from rlx_gpu.backends import nvrtc

    gpu_check = _script()
    with installed(monkeypatch):
        ck = gpu_check.Check(tmp_path, False, 300.0)
        gpu_check.build(ck, {})
    assert [r.status for r in ck.rows] == ["ok"], ck.rows
    table = (tmp_path / "build.md").read_text().splitlines()[2:]
    entries = {(p.label, name) for p in nvrtc.programs("gpu") for name in nvrtc.parameters(cuda_builds.build(p).ptx)}
    assert {tuple(cell.strip() for cell in row.split("|")[1:3]) for row in table} == entries and len(table) == len(entries)
    assert any(name == "mamba2_lanes" for _, name in entries)


@pytest.mark.skipif(_cuda_available(), reason="CUDA is available: the section captures for real (tools/gpu_capture.py)")
def test_the_capture_section_names_a_torch_without_cuda(tmp_path):
    """The decode-step capture needs torch's CUDA (its streams and CUDAGraph); without it the section says
    so in one failed row rather than a traceback."""
    gpu_check = _script()
    import gpu_capture

    assert [label for label, _ in gpu_capture.CASES] == [
        "selective_state_update mamba2 B1 H8 P64 N64", "fused_recurrent_gated_delta_rule T1 B1 H8 K=V=64",
        "rlx_gpu.torch.LSTM one step B1 I=H=256"]
    ck = gpu_check.Check(tmp_path, False, 60.0)
    gpu_capture.decode_steps(ck, {})
    assert [(r.section, r.status) for r in ck.rows] == [("capture", "fail")] and "has no CUDA device" in ck.rows[0].detail


def test_the_mma_section_plans_its_shapes_on_the_tensor_cores_and_draws_one_input_in_every_dtype():
    """tools/gpu_mma.py without a GPU: each shape's chunk kernels take the variant each column names (FMA f32,
    MMA bf16, TF32) on an sm_90 device's limits, and the dtypes it compares see the same inputs, rounded."""
    import dataclasses

    _script()
    import gpu_bench
    import gpu_mma

    from rlx_gpu import launches
    from rlx_gpu.launches.limits import REFERENCE_GPU

    chunk = {"mamba2_chunk_scan", "gated_delta_net_chunk_out", "mamba3_chunk_scan", "mamba2_backward_chunk",
             "gdn_chunk_back_grads", "gdn_chunk_back_pass", "mamba3_cb_chunk"}
    assert {template["op"] for _, template in gpu_mma.shapes()} == {"mamba2", "gated_delta_net", "mamba3"}
    assert [(label, template["op"]) for label, template in gpu_mma.backward_shapes()] == [
        (f"{label} backward", f"{template['op']}_backward") for label, template in gpu_mma.shapes()]
    for _, template in gpu_mma.shapes() + gpu_mma.backward_shapes():
        params = {k: v for k, v in template.items() if k != "op"}
        for dtype, mma in gpu_mma.RUNS_OF:
            thunk, _ = cases.lay_out(template["op"], dtype, params)
            plan = launches.plan(thunk, dataclasses.replace(REFERENCE_GPU, mma=mma), ssm_kernel="chunked")
            assert {dict(item.defines).get("RLX_MMA", 0) for item in plan.launches if item.kernel in chunk} == {mma}
    small = dict(op="gated_delta_net", batch=1, seq=70, heads=2, value_heads=4, state_size=8, value_size=8,
                 gate_per_channel=False, carry_state=False)
    (t32, a32), (t16, a16) = (gpu_mma.lay_out(small, dt, 3) for dt in ("f32", "bf16"))
    for field in ("q", "k", "v", "g", "beta"):
        x32 = gpu_bench._fields(t32, a32)[field]
        assert np.array_equal(x32.astype(ml_dtypes.bfloat16), gpu_bench._fields(t16, a16)[field]), field
    assert (gpu_bench._fields(t32, a32)["g"] < 0).all()
    assert np.allclose(np.linalg.norm(gpu_bench._fields(t32, a32)["k"], axis=-1), 1, atol=1e-6)
    mamba3 = dict(next(t for _, t in gpu_mma.shapes() if t["op"] == "mamba3"), batch=1, seq=70, heads=2)
    (m32, b32), (m16, b16) = (gpu_mma.lay_out(mamba3, dt, 4) for dt in ("f32", "bf16"))
    f32, f16 = gpu_bench._fields(m32, b32), gpu_bench._fields(m16, b16)
    assert all(np.array_equal(f32[f].astype(ml_dtypes.bfloat16), f16[f]) for f in ("q", "v", "q_bias"))
    assert all(np.array_equal(f32[f], f16[f]) for f in ("adt", "dt", "angles"))  # f32 beside bf16
    assert (f32["adt"] < 0).all() and (f32["dt"] > 0).all()


def test_the_mma_section_runs_through_the_cupy_double(tmp_path, monkeypatch):
    """Its runs, reads and table through the CuPy double, at small shapes (the double records kernels and
    runs none, and has no timing events: the outputs agree trivially and each run counts 1 ms; the numbers
    come from a GPU)."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings with NVRTC is not installed")
    from support.cupy_double import installed

    gpu_check = _script()
    import gpu_mma

    fewer = {"mamba2": {"batch": 1, "heads": 2}, "gated_delta_net": {"heads": 2, "value_heads": 4},
             "mamba3": {"batch": 1, "heads": 2, "head_dim": 16, "state_size": 32, "num_angles": 8}}
    small = [(label, dict(template, seq=70, **fewer[template["op"]])) for label, template in gpu_mma.shapes()]
    monkeypatch.setattr(gpu_mma, "shapes", lambda: small)
    monkeypatch.setattr(gpu_mma, "events_ms", lambda stream, fn, runs: (fn(), 1.0)[1])
    monkeypatch.setenv("RLX_TARGET", "gpu")
    with installed(monkeypatch) as machine:
        ck = gpu_check.Check(tmp_path, False, 300.0)
        gpu_mma.benchmarks(ck, {})
    assert [(r.section, r.status) for r in ck.rows] == [("mma", "ok")] * 2 * len(small), ck.rows
    assert len((tmp_path / "mma.md").read_text().splitlines()) == 2 + 2 * len(small)
    assert {"mamba2_chunk_scan", "gated_delta_net_chunk_out", "mamba3_chunk_scan", "mamba2_backward_chunk",
            "gdn_chunk_back_grads", "gdn_chunk_back_pass", "mamba3_cb_chunk"} <= {r.kernel for r in machine.launches}
    assert "(d_" in ck.rows[-1].detail  # a backward row names its worst gradient


def test_the_mma_section_names_the_worst_field_and_fails_a_non_finite_one():
    _script()
    import gpu_mma

    want = {"d_x": np.ones(8, np.float32), "d_a": np.full(2, 4.0, np.float32)}
    near = {"d_x": want["d_x"] * (1 + 1e-3), "d_a": want["d_a"] * (1 + 1e-2)}
    err, field = gpu_mma.worst(near, want)
    assert field == "d_a" and err == pytest.approx(1e-4, rel=1e-3)
    assert gpu_mma.worst(dict(near, d_x=np.where(np.arange(8) == 3, np.nan, 1).astype(np.float32)), want) == (
        float("inf"), "d_x")


def test_the_mma_section_times_an_anchors_backward_alone_with_our_output_gradient(monkeypatch):
    """The backward rows' anchor: its forward once, then the backward alone through the kept graph, each call
    taking our ``d_dst`` as its output's gradient (a CPU stand-in for the CUDA anchor)."""
    torch = pytest.importorskip("torch")
    _script()
    import gpu_mma

    x = torch.arange(6, dtype=torch.float32).reshape(2, 3).requires_grad_()
    calls = []
    monkeypatch.setattr(gpu_mma, "_anchor", lambda t, fields, grad: calls.append(grad) or ("anchor", lambda: (x * x, None)))
    monkeypatch.setattr(gpu_mma, "torch_ms", lambda fn: [fn() for _ in range(3)] and 1.5)
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self: self)
    d_dst = np.linspace(-1, 1, 6, dtype=np.float32)
    assert gpu_mma._anchor_ms({"op": "mamba2_backward"}, {"d_dst": d_dst}) == ("anchor", 1.5)
    assert calls == [True]
    assert torch.allclose(x.grad, 3 * 2 * x.detach() * torch.from_numpy(d_dst).reshape(2, 3))
    monkeypatch.setattr(gpu_mma, "_anchor", lambda t, fields, grad: ("anchor", lambda: 1 / 0))
    name, ms = gpu_mma._anchor_ms({"op": "mamba2_backward"}, {"d_dst": d_dst})
    assert name == "anchor (ZeroDivisionError)" and ms != ms
