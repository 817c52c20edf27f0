"""tools/gpu_check.py's own logic, here where no GPU is: files written as it goes, exit status by design."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "gpu_check.py"
FILES = {"log.txt", "summary.md", "results.json", "env.json"}


def _run(out: Path, *args: str, **env: str) -> tuple[int, list[dict]]:
    environ = {k: v for k, v in os.environ.items() if k not in ("OUT", "RLX_GPU_CHECK_SKIP_CUDA")}
    environ.update(env, PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *args], env=environ, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert "Traceback" not in run.stderr, run.stderr
    return run.returncode, json.loads((out / "results.json").read_text())


def _cuda_available() -> bool:
    from rlx_gpu.runtime.registry import status

    return status("cuda").available


def test_skipping_cuda_runs_the_environment_and_exits_zero(tmp_path):
    rc, rows = _run(tmp_path, "--skip-cuda")
    assert rc == 0
    assert FILES <= {p.name for p in tmp_path.iterdir()}
    by_section = {r["section"]: r for r in rows if r["item"] == "all"}
    assert set(by_section) == {"build", "conformance", "sanitizer", "ceilings", "bench"}
    assert all(r["status"] == "skip" for r in by_section.values())
    env = json.loads((tmp_path / "env.json").read_text())
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
    assert {"build", "conformance", "sanitizer", "ceilings", "bench"} <= failed
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
