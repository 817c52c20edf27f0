"""The command line as a newcomer meets it: one error style, every target everywhere, quiet pipes, help."""
from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest

import host_fallback
import rlx_gpu
from host_fallback.bound import Bound
from rlx_gpu.cli import main
from rlx_gpu.runtime.registry import status
from support.cli_errors import one_line_error

OPENCL = status("opencl").available
needs_opencl = pytest.mark.skipif(not OPENCL, reason="no OpenCL platform (pip install .[opencl])")

MODEL = """\
dtype: f32
inputs:
  x: {shape}
steps:
  - {{op: lstm, x: x, {args}, out: y}}
outputs: [y]
"""


def _model(tmp_path, shape="[2, 8, 4]", args="hidden: 4"):
    path = tmp_path / "model.yaml"
    path.write_text(MODEL.format(shape=shape, args=args))
    return path


# --- plan and export take what run takes ---------------------------------------------------------------

@pytest.mark.parametrize("target", ["demo", "configs/examples/gdn.yaml"])
def test_plan_takes_a_model_name_or_a_model_file(target, capsys):
    assert main(["plan", target, "--device", "host"]) == 0
    assert "supported on host" in capsys.readouterr().out


def test_export_writes_a_schedule_and_its_inputs_that_run_reproduces(tmp_path, capsys):
    out = tmp_path / "demo.json"
    assert main(["export", "demo", "-o", str(out)]) == 0
    schedule = rlx_gpu.load_schedule(out)
    with np.load(tmp_path / "demo.npz") as npz:
        assert set(npz.files) == set(schedule.inputs)
    assert main(["plan", str(out), "--device", "host"]) == 0
    assert main(["run", str(out), "--inputs", str(tmp_path / "demo.npz"), "--device", "host",
                 "--out", str(tmp_path / "y.npz")]) == 0
    executable, inputs = rlx_gpu.build_model("demo", device="host")
    want = executable.run(**inputs)
    with np.load(tmp_path / "y.npz") as got:
        np.testing.assert_array_equal(got["y"], want["y"])


def test_run_refuses_inputs_that_do_not_fit(tmp_path, capsys):
    out = tmp_path / "demo.json"
    assert main(["export", "demo", "-o", str(out)]) == 0
    np.savez(tmp_path / "bad.npz", x=np.zeros((3, 3)))
    assert main(["run", str(out), "--inputs", str(tmp_path / "bad.npz"), "--device", "host"]) == 2
    one_line_error(capsys, "InputError", "bad.npz", "'x' has shape [3, 3], expected [2, 8, 4]")


# --- one error style for model files, schedules and configs ----------------------------------------------

@pytest.mark.parametrize("shape,args,needles", [
    ("[2, 8, 4]", "hiden: 4", ["steps[0] (lstm)", "unknown key 'hiden'", "did you mean 'hidden'"]),
    ("[2, 8, 4]", "hidden: 4, extra: 1", ["steps[0] (lstm)", "unknown key 'extra'", "hidden"]),
    ("[2, 8]", "hidden: 4", ["steps[0] (lstm)", "x must be a tensor of shape [batch, seq, input_size], got [2, 8]"]),
    ("[2, 0, 4]", "hidden: 4", ["inputs.x", "expected a shape"]),
])
def test_model_file_mistakes_are_one_line_naming_file_key_and_expectation(tmp_path, capsys, shape, args, needles):
    path = _model(tmp_path, shape, args)
    assert main(["run", str(path), "--device", "host"]) == 2
    one_line_error(capsys, "ModelError", str(path), *needles)


def test_an_unknown_model_name_lists_the_examples(capsys):
    assert main(["run", "nosuch", "--device", "host"]) == 2
    one_line_error(capsys, "no model file 'nosuch'", "demo, gdn")


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(rlx_gpu.ModelError, match="hiden"):
        main(["--debug", "run", str(_model(tmp_path, args="hiden: 4")), "--device", "host"])


def test_load_schedule_of_a_missing_file_says_so():
    with pytest.raises(rlx_gpu.ScheduleError, match="no such file: 'model.json'"):
        rlx_gpu.load_schedule("model.json")


@pytest.mark.parametrize("text,needles", [
    ("priority: [opencl, cpu]\n", ["priority: 'cpu' is not a backend", "host, opencl, cuda"]),
    ("overrides: {lstn: host}\n", ["overrides['lstn']: 'lstn' is not an op", "did you mean 'lstm'"]),
    ("overrides: {'lstm:f8': host}\n", ["'f8' is not a dtype", "bf16"]),
    ("overrides: {lstm: hots}\n", ["overrides['lstm']: 'hots' is not a backend", "did you mean 'host'"]),
    ("tolerances: {thunk: {f32: -1}}\n", ["tolerances.thunk.f32: expected an NMSE bound >= 0"]),
    ("devcie: host\n", ["'devcie' is not a config key", "did you mean 'device'"]),
    ("device: gpu\n", ["device: device 'gpu' is not a device spec; expected host | opencl"]),
    ("device: 'opencl:a'\n", ["device 'opencl:a' is not a device spec"]),
])
def test_config_mistakes_are_refused_naming_file_and_key(tmp_path, monkeypatch, capsys, text, needles):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    monkeypatch.setenv("RLX_CONFIG", str(path))
    assert main(["plan", "demo", "--device", "host"]) == 2
    one_line_error(capsys, "ConfigError", f"config {path}", *needles)


def test_a_config_without_tolerances_keeps_the_default_bounds(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("fallback: forbid\ntolerances: {schedule: {f16: 0.5}}\n")
    default = rlx_gpu.load_config()
    config = rlx_gpu.load_config(path)
    assert config.fallback == "forbid" and config.tolerance("schedule", "f16") == 0.5
    for dtype in ("f16", "bf16", "f32"):
        assert config.tolerance("thunk", dtype) == default.tolerance("thunk", dtype)
    assert config.tolerance("schedule", "f32") == default.tolerance("schedule", "f32")


# --- devices: specs checked at once, PYOPENCL_CTX ------------------------------------------------------------

def test_compile_refuses_an_unknown_device_at_once():
    g = rlx_gpu.Graph("f32")
    g.output("y", g.unary("tanh", g.input("x", (4,))))
    with pytest.raises(rlx_gpu.DeviceError, match="'gpu' is not a device spec; expected host"):
        g.compile("gpu")
    with pytest.raises(rlx_gpu.DeviceError, match="not a device spec"):
        g.compile("opencl:x")


@needs_opencl
def test_pyopencl_ctx_picks_the_opencl_device_when_rlx_device_is_unset(monkeypatch):
    monkeypatch.delenv("RLX_DEVICE", raising=False)
    for info in status("opencl").devices:
        platform = info.spec.split(":")[1]
        monkeypatch.setenv("PYOPENCL_CTX", f"{platform}:0")
        assert rlx_gpu.get_device().spec == info.spec.rsplit(":", 1)[0] + ":0"
        # by name: the first platform of that name (two PoCL builds share one)
        monkeypatch.setenv("PYOPENCL_CTX", str(info.details["platform"]).lower())
        first = min(int(d.spec.split(":")[1]) for d in status("opencl").devices
                    if d.details["platform"] == info.details["platform"])
        assert rlx_gpu.get_device().spec.startswith(f"opencl:{first}:")
    monkeypatch.setenv("RLX_DEVICE", "host")
    assert rlx_gpu.get_device().spec == "host"
    monkeypatch.delenv("RLX_DEVICE")
    monkeypatch.setenv("PYOPENCL_CTX", "no-such-platform")
    with pytest.raises(rlx_gpu.DeviceError, match="PYOPENCL_CTX='no-such-platform' names no OpenCL device"):
        rlx_gpu.get_device()


# --- --check on the host compares with float64, not with itself --------------------------------------------

def test_check_on_the_host_uses_the_float64_reference(capsys):
    assert main(["run", "demo", "--device", "host", "--check"]) == 0
    out = capsys.readouterr().out
    assert "float64 reference" in out and "host reference" not in out
    assert main(["run", "scan_cell", "--device", "host", "--check"]) == 0
    out = capsys.readouterr().out
    assert "scan" in out and "not checked" in out  # an op without a reference says so


def test_check_on_the_host_catches_a_wrong_host_kernel(monkeypatch, capsys):
    right = host_fallback.KERNELS["matmul"]

    def off_by_one_percent(thunk, arena, **options):
        right(thunk, arena, **options)
        bound = Bound(thunk, arena)
        bound.store("dst", bound.load("dst") * 1.01)

    monkeypatch.setitem(host_fallback.KERNELS, "matmul", off_by_one_percent)
    assert main(["run", "demo", "--device", "host", "--check"]) == 1
    assert any(line.split()[1:2] == ["matmul"] and "FAIL" in line for line in capsys.readouterr().out.splitlines())


# --- the process: version, help, pipes, warnings ---------------------------------------------------------------

def _rlx_gpu() -> str:
    exe = shutil.which("rlx-gpu")
    assert exe, "pip install -e . installs the rlx-gpu console script"
    return exe


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"rlx-gpu {rlx_gpu.__version__}"


def test_help_names_examples_and_environment_without_markup(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "``" not in out
    for needle in ("RLX_DEVICE", "RLX_CONFIG", "PYOPENCL_CTX", "configs/examples", "rlx-gpu run gdn", "export"):
        assert needle in out
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    plan_help = " ".join(capsys.readouterr().out.split())
    assert "--device DEVICE host | opencl" in plan_help and "model" in plan_help


def test_a_closed_pipe_ends_quietly():
    # the reader is gone before the command writes its first line
    proc = subprocess.Popen([_rlx_gpu(), "devices"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert "BrokenPipeError" not in err and "Traceback" not in err and "Exception ignored" not in err, err


@needs_opencl
def test_warnings_print_as_one_line(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("overrides: {matmul: host}\n")
    env = {**os.environ, "RLX_CONFIG": str(path)}
    done = subprocess.run([_rlx_gpu(), "run", "demo", "--device", "opencl"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines and all(line.startswith("rlx-gpu: warning: ") for line in lines), done.stderr
    assert "UserWarning" not in done.stderr and "cli.py" not in done.stderr


@pytest.mark.parametrize("text,needles", [
    ("inputs: [1, 2]\n", ["inputs: expected a mapping, got list [1, 2]"]),
    ("dtype: f8\n", ["dtype: unknown dtype 'f8'"]),
    ("steps:\n  - {op: lsmt, x: x, out: y}\n", ["steps[0]: unknown op 'lsmt' (did you mean 'lstm'?)"]),
    ("inputs: {x: [2, 3]}\nsteps:\n  - {op: unary, fn: tanh, x: xx, out: y}\n",
     ["steps[0] (unary): x: 'xx' names no tensor defined before this step (defined: x)"]),
    ("inputs: {x: [2, 3]}\noutputs: [y]\n", ["outputs: 'y' is no tensor of the model; defined: x"]),
    ("steps: [oops]\n", ["steps[0]: expected a mapping with op, out"]),
    ("seeed: 1\n", ["unknown key 'seeed' (did you mean 'seed'?)"]),
])
def test_more_model_file_mistakes(tmp_path, capsys, text, needles):
    path = tmp_path / "m.yaml"
    path.write_text(text)
    assert main(["plan", str(path), "--device", "host"]) == 2
    one_line_error(capsys, "ModelError", str(path), *needles)


def test_a_schedule_file_that_does_not_parse_is_one_line(tmp_path, capsys):
    path = tmp_path / "s.json"
    path.write_text('{"abi": "rlx-thunks/1", "arena_bytes": 4')
    assert main(["plan", str(path), "--device", "host"]) == 2
    one_line_error(capsys, "ScheduleError", f"{path}: schedule text is neither JSON")


def test_export_to_yaml_is_read_back_as_a_schedule(tmp_path, capsys):
    out = tmp_path / "gdn.yaml"
    assert main(["export", "gdn", "-o", str(out)]) == 0
    assert "abi: rlx-thunks/1" in out.read_text()
    assert main(["plan", str(out), "--device", "host"]) == 0
    assert "gated_delta_net" in capsys.readouterr().out
