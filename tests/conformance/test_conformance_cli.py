"""``rlx-gpu conformance`` and ``rlx-gpu bench`` as a user runs them: exit codes, the table, the files."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlx_gpu.backends import programs
from rlx_gpu.cli import main
from rlx_gpu.conformance import catalog
from rlx_gpu.runtime.registry import sessions, status

ROOT = Path(__file__).resolve().parents[2]
needs_opencl = pytest.mark.skipif(not status("opencl").available, reason="no OpenCL platform (pip install .[opencl])")


#: the ops the CLI's report is checked on (every case of every op runs on both devices in test_conformance.py)
REPORTED_OPS = ["lstm", "gated_delta_net", "scan_backward_xs", "matmul"]


@needs_opencl
def test_host_and_opencl_pass_with_table_json_and_markdown(tmp_path, capsys):
    out_json, out_md = tmp_path / "out.json", tmp_path / "out.md"
    code = main(["conformance", "--device", "host", "--device", "opencl", "--ops", *REPORTED_OPS, "--json", str(out_json),
                 "--markdown", str(out_md)])
    out, err = capsys.readouterr()
    assert code == 0, out[-3000:]
    # the op column is as wide as the longest op name
    assert re.search(r"^op +dtype  cases  max \|err\|  worst nmse  nmse bound  status", out, re.M), out[:3000]
    assert "simulator  no" in out and "fp64       yes" in out and "memory" in out and "version" in out
    n = len(catalog.select(catalog.cases(), REPORTED_OPS))
    assert f"host: {n} passed, 0 failed" in out and "opencl:" in out and "FAIL" not in out
    lstm = len(catalog.select(catalog.cases(), ["lstm"]))
    assert f"lstm              {lstm} passed, 0 failed, 0 skipped" in err  # the progress lines (not a TTY)
    data = json.loads(out_json.read_text())
    assert data["format"] == "rlx-gpu-conformance/1" and data["passed"] is True and data["quick"] is False
    assert [d["backend"] for d in data["devices"]] == ["host", "opencl"]
    assert "driver" in data["devices"][1]["details"] and "global_mem_bytes" in data["devices"][1]["details"]
    assert len(data["results"]) == 2 * n
    first = data["results"][0]
    assert set(first) >= {"device", "case", "op", "dtype", "status", "nmse", "max_err", "host_nmse", "bound", "message"}
    # a case passes, or the device has no kernel for it yet (a backward op; a saved forward, issue 36): the device
    # skips it, the host runs it
    assert all(r["status"] == "pass" or (r["device"] != "host" and r["status"] == "skip"
                                         and (r["message"] == f"no device kernel for op {r['op']!r}"
                                              or "writes or reads a saved forward (reserve) yet" in r["message"]))
               for r in data["results"])
    assert {(r["op"], r["dtype"]) for r in data["results"] if r["device"] != "host" and r["host_nmse"] is not None} \
        >= {("gated_delta_net", "bf16"), ("scan_backward_xs", "f16")}  # host parity measured on the device
    md = out_md.read_text()
    assert md.startswith("# rlx-gpu conformance") and "| op | dtype | cases |" in md and "## host" in md


def test_an_unknown_device_is_an_error_listing_the_devices(capsys):
    assert main(["conformance", "--device", "opencl:9:9", "--quick"]) != 0
    err = capsys.readouterr().err
    assert "no device 'opencl:9:9'" in err and "  host " in err
    if status("opencl").available:
        assert status("opencl").devices[0].spec in err


def test_quick_leaves_out_the_large_shapes(tmp_path, capsys):
    out_json = tmp_path / "q.json"
    assert main(["conformance", "--device", "host", "--quick", "--ops", "lstm", "gated_delta_net",
                 "--json", str(out_json)]) == 0
    data = json.loads(out_json.read_text())
    full = catalog.select(catalog.cases(), ["lstm", "gated_delta_net"])
    assert data["quick"] is True and 0 < len(data["results"]) < len(full)
    assert {r["op"] for r in data["results"]} == {"lstm", "gated_delta_net"}


def test_a_zero_tolerance_fails_the_run(tmp_path, monkeypatch, capsys):
    config = tmp_path / "strict.yaml"
    config.write_text("tolerances: {matmul: {f32: 0.0}}\n")
    monkeypatch.setenv("RLX_CONFIG", str(config))
    assert main(["conformance", "--device", "host", "--quick", "--ops", "matmul", "--dtypes", "f32"]) == 1
    out = capsys.readouterr().out
    assert "FAIL 2/2" in out and "NMSE of dst is" in out and "> 0" in out


@needs_opencl
def test_a_wrong_kernel_fails_the_run(monkeypatch, capsys):
    text, good = programs._text, "case RLX_UNARY_EXP: return exp(x);"
    assert good in programs.program("opencl", "body", "f32").source

    def off_by_a_little(path):  # exp one part in a thousand too large, in memory only
        return text(path).replace(good, "case RLX_UNARY_EXP: return exp(x) * (real)1.001;")
    monkeypatch.setattr(programs, "_text", off_by_a_little)
    sessions.cache_clear()  # a fresh session, which has not seen the good kernel
    programs.program.cache_clear()  # and program text read again
    try:
        assert main(["conformance", "--device", "opencl", "--ops", "unary", "--dtypes", "f32", "--quick"]) == 1
    finally:
        sessions.cache_clear()  # and none that keeps the wrong one
        programs.program.cache_clear()
    out = capsys.readouterr().out
    assert "FAIL" in out and "unary-exp" in out and "vs float64 reference: NMSE of dst" in out


@needs_opencl
def test_perf_and_bench_write_the_plot_and_its_json(tmp_path, capsys):
    png = tmp_path / "bench.png"
    assert main(["bench", "--device", "opencl", "--ops", "lstm", "matmul", "--repeat", "2", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    spec = status("opencl").devices[0].spec
    assert "time per run (median)" in out and f"host/{spec}" in out and "torch (CPU)" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(png.with_suffix(".json").read_text())
    assert data["format"] == "rlx-gpu-bench/1" and {c["op"] for c in data["cases"]} == {"lstm", "matmul"}
    lstm = next(c for c in data["cases"] if c["op"] == "lstm")
    assert {"host", spec, "torch (CPU)"} <= set(lstm["seconds"])
    assert main(["conformance", "--device", "opencl", "--ops", "fill", "--dtypes", "f32", "--perf", "--repeat", "2"]) == 0
    assert "time per run (median)" in capsys.readouterr().out


def test_pytest_fails_on_an_absent_test_device():
    env = {**os.environ, "RLX_TEST_DEVICES": "host,opencl:9:9", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/conformance/test_conformance.py",
                           "-k", "fill-9-f32"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0, done.stdout[-2000:]
    assert "1 passed" in done.stdout and " error" in done.stdout and "no device 'opencl:9:9'" in done.stdout


def test_devices_shows_the_support_matrix_of_every_device(capsys):
    from rlx_gpu.runtime.registry import discover

    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    specs = [info.spec for st in discover() if st.available for info in st.devices]
    assert len(specs) >= 2
    for spec in specs:
        assert f"support on {spec} " in out


@needs_opencl
def test_target_forces_the_gpu_kernels_on_an_opencl_device(tmp_path, capsys):
    out_json = tmp_path / "gpu.json"
    assert main(["conformance", "--device", "opencl", "--target", "gpu", "--ops", "selective_scan", "--quick",
                 "--json", str(out_json)]) == 0
    assert "kernel target forced to gpu on opencl:" in capsys.readouterr().out
    assert json.loads(out_json.read_text())["target"] == "gpu"


def test_grad_certifies_only_the_backward_ops_and_says_so(tmp_path, capsys):
    out_json, out_md = tmp_path / "grad.json", tmp_path / "grad.md"
    assert main(["conformance", "--device", "host", "--grad", "--quick", "--dtypes", "f64", "--json", str(out_json),
                 "--markdown", str(out_md)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("certifies the backward ops only (--grad): lstm_backward, gru_backward, rnn_backward, "
                          "selective_scan_backward, mamba2_backward, gated_delta_net_backward, causal_conv1d_backward, "
                          "mamba3_backward, scan_backward, scan_backward_xs")
    data = json.loads(out_json.read_text())
    ops = {r["op"] for r in data["results"]}
    assert data["scope"] == "backward ops" and data["passed"] is True
    assert {"lstm_backward", "gru_backward", "rnn_backward", "scan_backward", "scan_backward_xs"} <= ops
    assert all(op.endswith("_backward") or op.startswith("scan_backward") for op in ops), ops
    grad_ops = [op for op in catalog.SPECS if op.endswith("_backward") or op.startswith("scan_backward")]
    assert len(data["results"]) == len(catalog.select(catalog.cases(quick=True), grad_ops, ["f64"]))
    assert "Certifies the backward ops only (--grad)" in out_md.read_text().splitlines()[2]
    assert main(["conformance", "--device", "host", "--grad", "--ops", "lstm", "gru_backward"]) != 0
    assert "--ops lstm names forward ops" in capsys.readouterr().err
