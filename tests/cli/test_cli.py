"""The rlx-gpu command: devices, run --check on every example model, plan."""
from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

import rlx_gpu
from rlx_gpu.cli import main
from rlx_gpu.conformance.cases import lay_out

from support.schedule_files import write_one_thunk


@pytest.mark.parametrize("model", rlx_gpu.list_models())
def test_run_check_passes_on_every_example_model(model, capsys):
    assert main(["run", model, "--device", "host", "--check"]) == 0
    out = capsys.readouterr().out
    assert "against the float64 reference" in out and "FAIL" not in out


def _opencl_available() -> bool:
    from rlx_gpu.runtime.registry import status

    return status("opencl").available


@pytest.mark.skipif(not _opencl_available(), reason="no OpenCL platform (pip install .[opencl])")
@pytest.mark.parametrize("model", rlx_gpu.list_models())
def test_run_check_passes_on_opencl_for_every_example_model(model, capsys, monkeypatch):
    monkeypatch.setenv("RLX_DEVICE", "opencl")
    assert main(["run", model, "--check"]) == 0
    out = capsys.readouterr().out
    assert "device opencl:" in out and "FAIL" not in out


def test_run_writes_outputs_and_a_per_thunk_table(tmp_path, capsys):
    target = tmp_path / "out.npz"
    assert main(["run", "--device", "host", "--out", str(target)]) == 0
    out = capsys.readouterr().out
    assert "backend" in out and "lstm" in out
    executable, inputs = rlx_gpu.build_model("demo")
    want = executable.run(**inputs)
    with np.load(target) as got:
        assert set(got.files) == set(executable.schedule.outputs)
        for name in got.files:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-6)


def test_plan_names_backend_and_reason_for_each_thunk(tmp_path, capsys):
    thunk, n = lay_out("gru", "f16")
    path = write_one_thunk(tmp_path / "s.json", thunk, n)
    assert main(["plan", str(path), "--device", "host"]) == 0
    out = capsys.readouterr().out
    assert "0  gru  f16    host     supported on host" in out


def test_errors_are_reported_without_a_traceback(tmp_path, capsys):
    thunk, n = lay_out("gru", "f16")
    thunk["hidden"] = 0
    path = write_one_thunk(tmp_path / "bad.json", thunk, n)
    assert main(["plan", str(path)]) == 2
    assert f"ScheduleError: {path}: thunk 0 (gru), field 'hidden': expected an int >= 1, got 0" in capsys.readouterr().err


def test_devices_lists_every_backend_and_the_support_matrix(capsys):
    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    for name in ("host", "opencl", "cuda"):
        assert f"{name}: " in out
    assert "support on host" in out and "gated_delta_net" in out


def test_console_script_is_installed():
    exe = shutil.which("rlx-gpu")
    assert exe, "pip install -e . installs the rlx-gpu console script"
    done = subprocess.run([exe, "run", "--device", "host", "--check"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
