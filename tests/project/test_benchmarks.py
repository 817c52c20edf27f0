"""Benchmark scripts run end to end at a tiny size. No figure of time is asserted (on a shared machine it
is noise); what a script checks besides timing (agreement with torch) and what it prints are."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_torch_decode_benchmark_prints_every_case_agreeing_with_torch_and_the_training_ratio():
    tiny = ["--quick", "--runs", "2", "--rounds", "1", "--warmup", "0", "--train-steps", "1", "--train-runs", "1"]
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "torch_decode.py"), *tiny, "--devices", "host"],
                          capture_output=True, text=True, timeout=600)  # the OpenCL column: the devices' own tests
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    header = next(line for line in lines if line.startswith("case "))
    assert all(f in header for f in ("host/torch (≤ 1.0x)", "overhead µs (≤ 30)", "OpenCL/torch (≤ 2.0x)"))
    cases = ("selective_state_update Mamba-2 B1 H8 P64 N64", "selective_state_update Mamba-1 B1 D1536 N16",
             "fused_recurrent_gated_delta_rule T1 B1 H8 K=V=64", "rlx_gpu.torch.LSTM one step B1 I=H=256",
             "mamba3_siso_step B1 H8 P64 N64 A16", "causal_conv1d_update B1 D1536 W4",
             "selective_state_update Mamba-2 B4 of a pool of 16", "causal_conv1d_update B4 D1536 W4 of a pool of 16")
    for case in cases:
        row = next(line for line in lines if line.startswith(case))
        host_diff, opencl_diff = row.split()[-3::2]  # "max |diff| host / OpenCL"
        assert float(host_diff) < 1e-4 and opencl_diff == "—", row
        assert re.search(r"\d+\.\d\dx [✓✗] +[\d.]+ [✓✗]", row), row  # the host ratio and overhead, each judged
    training = next(line for line in lines if line.startswith("character LSTM language model"))
    ratio = r"torch\.nn\.LSTM [\d.]+ ms, rlx_gpu\.torch\.LSTM [\d.]+ ms: [\d.]+x [✓✗] \(target ≤ 1\.5x\)$"
    assert re.search(ratio, training), training


def test_the_opencl_decode_events_benchmark_splits_each_step_into_its_launch_s_parts():
    from rlx_gpu.runtime.registry import status

    cpu = [d for d in status("opencl").devices if not d.details.get("simulator")]
    if not cpu:
        pytest.skip("no OpenCL device but a simulator: the script times a real one")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "opencl_decode_events.py"), "--quick", "--steps",
                           "3", "--warmup", "1", "--opencl", cpu[0].spec], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert "| case | before | enqueue | queued→start | kernel | end→seen | after | step | torch |" in lines
    for case in ("selective_state_update Mamba-2", "selective_state_update Mamba-1", "fused_recurrent_gated_delta_rule"):
        row = next(line for line in lines if line.startswith(f"| {case}"))
        values = [float(v) for v in row.strip("| ").split(" | ")[1:]]
        assert len(values) == 8 and values[3] > 0 and values[6] > 0 and values[7] > 0, row  # kernel, step, torch
