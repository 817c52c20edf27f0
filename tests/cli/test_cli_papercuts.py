"""What a newcomer met on the command line: one-line errors before any work, said-out-loud defaults,
and reports whose tables, plots and messages say what they mean."""
from __future__ import annotations

import ast
import inspect
import json
import re
import runpy
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

import rlx_gpu
from rlx_gpu import cli
from rlx_gpu.cli import main
from rlx_gpu.conformance import bench
from rlx_gpu.conformance.cases import lay_out
from rlx_gpu.graph.lowering import Executable
from rlx_gpu.runtime.registry import status

from support.cli_errors import one_line_error  # the one rule for a clean CLI error
from support.schedule_files import write_one_thunk

ROOT = Path(__file__).resolve().parents[2]
needs_opencl = pytest.mark.skipif(not status("opencl").available, reason="no OpenCL platform (pip install .[opencl])")


def _export_demo(tmp_path: Path) -> Path:
    out = tmp_path / "demo.json"
    assert main(["export", "demo", "-o", str(out)]) == 0
    return out


def _no_run(monkeypatch):
    """Make any device open fail loudly: a check that must come before the run."""
    def refuse(*args, **kwargs):
        raise AssertionError("the run started before the command line was checked")
    monkeypatch.setattr(cli, "get_device", refuse)


# --- tracebacks that were one-line errors waiting to happen -------------------------------------------------

def test_an_npz_target_is_a_one_line_error_pointing_at_inputs(tmp_path, capsys):
    _export_demo(tmp_path)
    capsys.readouterr()
    assert main(["run", str(tmp_path / "demo.npz"), "--device", "host"]) == 2
    one_line_error(capsys, "InputError", "demo.npz is not a text file", "--inputs")


def test_binary_bytes_named_yaml_are_refused_like_the_json_ones(tmp_path, capsys):
    blob = bytes(range(128, 256)) * 4
    (tmp_path / "b.yaml").write_bytes(blob)
    (tmp_path / "b.json").write_bytes(blob)
    assert main(["run", str(tmp_path / "b.yaml"), "--device", "host"]) == 2
    one_line_error(capsys, "b.yaml is not a text file")
    assert main(["run", str(tmp_path / "b.json"), "--device", "host"]) == 2
    one_line_error(capsys, "ScheduleError", "not UTF-8 text")


def test_run_refuses_an_out_path_in_a_missing_directory_before_running(tmp_path, capsys, monkeypatch):
    _no_run(monkeypatch)
    assert main(["run", "--device", "host", "--out", str(tmp_path / "missing" / "o.npz")]) == 2
    one_line_error(capsys, "--out", "the directory", "missing", "does not exist")


def test_export_refuses_a_missing_directory_in_one_line(tmp_path, capsys):
    assert main(["export", "demo", "-o", str(tmp_path / "missing" / "d.json")]) == 2
    one_line_error(capsys, "-o", "does not exist")
    assert not (tmp_path / "missing").exists()


# --- defaults said out loud, partial inputs refused ---------------------------------------------------------

def test_a_schedule_without_inputs_says_they_are_random_and_names_the_npz_beside_it(tmp_path, capsys):
    schedule = _export_demo(tmp_path)
    capsys.readouterr()
    assert main(["run", str(schedule), "--device", "host"]) == 0
    err = capsys.readouterr().err
    assert "rlx-gpu: warning:" in err and "seeded random numbers" in err, err
    assert f"--inputs {tmp_path / 'demo.npz'}" in err and "x, h0" in err
    assert main(["run", str(schedule), "--device", "host", "--inputs", str(tmp_path / "demo.npz")]) == 0
    assert "random" not in capsys.readouterr().err


def test_inputs_missing_a_tensor_are_refused_naming_it(tmp_path, capsys):
    schedule = _export_demo(tmp_path)
    with np.load(tmp_path / "demo.npz") as npz:
        np.savez(tmp_path / "part.npz", x=npz["x"])
    capsys.readouterr()
    assert main(["run", str(schedule), "--device", "host", "--inputs", str(tmp_path / "part.npz")]) == 2
    one_line_error(capsys, "InputError", "part.npz", "no 'h0'", "x, h0")


@pytest.mark.parametrize("argv", [["run", "--repeat", "0"], ["run", "--repeat", "-2"],
                                  ["bench", "--repeat", "0"], ["conformance", "--perf", "--repeat", "-1"]])
def test_a_repeat_below_one_is_a_usage_error(argv, capsys, monkeypatch):
    _no_run(monkeypatch)
    with pytest.raises(SystemExit) as done:
        main(argv + ["--device", "host"])
    assert done.value.code == 2
    assert "expected a whole number >= 1" in capsys.readouterr().err


def test_debug_is_accepted_after_the_command_too(tmp_path):
    model = tmp_path / "m.yaml"
    model.write_text("inputs: {x: [2, 3]}\nsteps:\n  - {op: unary, fn: tanh, x: xx, out: y}\n")
    for argv in (["--debug", "plan", str(model)], ["plan", str(model), "--debug"]):
        with pytest.raises(rlx_gpu.ModelError, match="'xx' names no tensor"):
            main(argv + ["--device", "host"])
    assert main(["plan", str(model), "--device", "host"]) == 2  # without it: the one-line error


# --- messages that name where a setting came from -----------------------------------------------------------

def test_an_unusable_device_names_the_setting_that_chose_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RLX_DEVICE", "opencl:9:9")
    assert main(["plan", "demo"]) == 2
    one_line_error(capsys, "DeviceError", "'opencl:9:9' (chosen by RLX_DEVICE)")
    monkeypatch.delenv("RLX_DEVICE")
    monkeypatch.delenv("PYOPENCL_CTX", raising=False)
    config = tmp_path / "cfg.yaml"
    config.write_text("device: 'opencl:9:9'\n")
    monkeypatch.setenv("RLX_CONFIG", str(config))
    assert main(["plan", "demo"]) == 2
    one_line_error(capsys, f"(chosen by device: in the config {config})")


def test_a_yaml11_string_tolerance_says_why_and_how_to_write_it(tmp_path, monkeypatch, capsys):
    config = tmp_path / "cfg.yaml"
    config.write_text("tolerances: {thunk: {f32: 1e-20}}\n")
    monkeypatch.setenv("RLX_CONFIG", str(config))
    assert main(["plan", "demo", "--device", "host"]) == 2
    err = one_line_error(capsys, "ConfigError", "tolerances.thunk.f32", "'1e-20'", "a string", "YAML 1.1")
    suggestion = re.search(r"write 1e-20 as (\S+)", err).group(1)
    assert yaml.safe_load(f"x: {suggestion}") == {"x": 1e-20}  # the spelling offered is a float


@pytest.mark.parametrize("where", ["schedule", "config", "model"])
def test_yaml_errors_give_line_and_column_without_pyyaml_internals(where, tmp_path, monkeypatch, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("fallback: [warn,\nx: 1\n" if where != "schedule" else "abi: rlx-thunks/1\nthunks: [\n")
    if where == "config":
        monkeypatch.setenv("RLX_CONFIG", str(path))
        argv = ["plan", "demo", "--device", "host"]
    elif where == "schedule":
        argv = ["plan", str(path), "--device", "host"]
    else:
        argv = ["plan", str(path), "--device", "host"]
        path.write_text("steps: [\n  {op: lstm\n")
    assert main(argv) == 2
    err = one_line_error(capsys, "line ", "column ")
    assert "<unicode string>" not in err and "<file>" not in err


def test_schedule_errors_name_the_file(tmp_path):
    thunk, n = lay_out("gru", "f16")
    thunk["hidden"] = 0
    path = write_one_thunk(tmp_path / "bad.json", thunk, n)
    for source in (path, str(path)):
        with pytest.raises(rlx_gpu.ScheduleError) as err:
            rlx_gpu.load_schedule(source)
        assert str(err.value).startswith(f"{path}: thunk 0 (gru), field 'hidden'")
    with pytest.raises(rlx_gpu.ScheduleError) as err:  # text names no file, so none is named
        rlx_gpu.load_schedule(path.read_text())
    assert str(err.value).startswith("thunk 0 (gru)")


def test_install_hints_name_the_checkout_form_no_index_refuses():
    hints = []
    for source in (ROOT / "rlx_gpu").rglob("*.py"):
        hints += [f"{source.name}: {m}" for m in re.findall(r"pip install '?rlx_gpu\[", source.read_text())]
    assert not hints, f"rlx_gpu is on no package index; a hint says `pip install -e \".[extra]\"`: {hints}"
    assert 'pip install -e ".[bench]"' in bench.INSTALL_HINT


# --- reports that say what they mean ------------------------------------------------------------------------

def test_counts_are_singular_for_one(tmp_path, capsys):
    thunk, n = lay_out("fill", "f32")
    path = write_one_thunk(tmp_path / "one.json", thunk, n)
    assert main(["run", str(path), "--device", "host"]) == 0
    out = capsys.readouterr().out
    assert "1 thunk," in out and "1 thunks" not in out
    assert main(["export", str(path), "-o", str(tmp_path / "again.json")]) == 0
    out = capsys.readouterr().out
    assert "(1 thunk," in out and "1 thunks" not in out


@needs_opencl
def test_every_column_of_the_device_check_has_a_label(tmp_path, capsys):
    model = tmp_path / "tanh.yaml"
    model.write_text("inputs: {x: [2, 3]}\nsteps:\n  - {op: unary, fn: tanh, x: x, out: y}\noutputs: [y]\n")
    assert main(["run", str(model), "--device", "opencl", "--check"]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = lines.index("check against the host reference:")
    header, rule, row = lines[at + 1: at + 4]
    assert header.split()[-1] == "result" and row.split()[-1] == "ok"
    assert len(rule.split()) == len(re.split(r"\s{2,}", header.strip())), (header, rule)  # a label per column


def _table_after(lines: list[str], first: str) -> tuple[list[str], list[str]]:
    """The column labels of the first table of errors whose header starts with ``first``, and its first row's cells."""
    at = next(i for i, line in enumerate(lines) if line.startswith(first) and "max |err|" in line)
    return re.split(r"\s{2,}", lines[at].strip()), lines[at + 2].split()


def test_each_bound_stands_beside_the_figure_it_bounds_and_says_what_it_bounds(capsys):
    assert main(["conformance", "--device", "host", "--quick", "--ops", "lstm", "--dtypes", "f32"]) == 0
    columns, row = _table_after(capsys.readouterr().out.splitlines(), "op ")
    assert columns == ["op", "dtype", "cases", "max |err|", "worst nmse", "nmse bound", "status"]
    assert float(row[columns.index("worst nmse")]) <= float(row[columns.index("nmse bound")]) and row[-1] == "ok"
    assert main(["run", "demo", "--device", "host", "--check"]) == 0  # each thunk against float64
    columns, row = _table_after(capsys.readouterr().out.splitlines(), "#  op")
    assert columns[columns.index("nmse bound") - 1] == "nmse" and "bound" not in columns
    assert float(row[columns.index("nmse")]) <= float(row[columns.index("nmse bound")])


@pytest.mark.parametrize("example", sorted((ROOT / "configs" / "examples").glob("*.py")), ids=lambda p: p.name)
def test_each_example_help_prints_the_whole_first_paragraph_of_its_docstring(example, monkeypatch, capsys):
    doc = ast.get_docstring(ast.parse(example.read_text()))
    paragraph = " ".join(doc.split("\n\n")[0].replace("``", "").split())
    monkeypatch.setattr(sys, "argv", [str(example), "--help"])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(example), run_name="__main__")
    shown = " ".join(capsys.readouterr().out.split())
    assert done.value.code == 0 and paragraph.endswith(".")
    assert paragraph in shown, f"--help of {example.name} shows {shown[:400]!r}"


def _description(script: Path) -> str | None:
    """The description a script's ArgumentParser shows, when it is made from the module docstring."""
    tree = ast.parse(script.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "ArgumentParser":
            given = next((k.value for k in node.keywords if k.arg == "description"), None)
            if given is not None and "__doc__" in ast.unparse(given):
                return eval(compile(ast.Expression(given), str(script), "eval"), {"__doc__": ast.get_docstring(tree)})
    return None


def test_every_script_describes_itself_with_the_whole_first_paragraph():
    scripts = sorted(p for folder in ("configs/examples", "tools", "benchmarks") for p in (ROOT / folder).glob("*.py"))
    described = {p.relative_to(ROOT).as_posix(): _description(p) for p in scripts}
    assert "tools/kernel_table.py" in described and "configs/examples/serve_mamba2.py" in described
    cut = [name for name, text in described.items() if text is not None
           and " ".join(text.split()) != " ".join(ast.get_docstring(ast.parse((ROOT / name).read_text()))
                                                   .split("\n\n")[0].replace("``", "").split())]
    assert not cut, f"--help shows less than the first paragraph of the docstring: {cut}"


def test_run_help_says_check_fails_when_the_nmse_exceeds_its_bound(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "exit 1 when an NMSE exceeds its bound in the config's tolerances" in shown and "passes" not in shown


def test_conformance_markdown_rows_have_as_many_cells_as_the_header(tmp_path):
    md = tmp_path / "c.md"
    assert main(["conformance", "--device", "host", "--quick", "--ops", "fill", "--dtypes", "f32",
                 "--markdown", str(md)]) == 0
    rows = [line for line in md.read_text().splitlines() if line.startswith("|")]
    cells = [len(re.split(r"(?<!\\)\|", row)) - 2 for row in rows]
    assert len(rows) == 3 and cells == [7, 7, 7], rows
    assert r"max \|err\|" in rows[0]


def test_the_package_exports_what_all_names_and_no_stray_annotations():
    assert not hasattr(rlx_gpu, "annotations")
    modules = {name for name, value in vars(rlx_gpu).items() if inspect.ismodule(value)}
    public = {name for name in dir(rlx_gpu) if not name.startswith("_")} - modules
    assert public == set(rlx_gpu.__all__) - {"__version__"}


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_sixteen_bit_outputs_come_back_as_float32_holding_the_stored_values(dtype):
    g = rlx_gpu.Graph(dtype=dtype)
    g.output("y", g.unary("tanh", g.input("x", (3, 5))))
    y = g.compile("host").run(x=np.linspace(-2, 2, 15).reshape(3, 5))["y"]
    storage = {"f16": np.float16, "bf16": __import__("ml_dtypes").bfloat16}[dtype]
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y.astype(storage).astype(np.float32), y)  # exactly 16-bit values, widened
    doc = Executable.run.__doc__
    assert "float32 for f32, f16 and bf16" in doc and "storage dtype" in doc


# --- rlx-gpu bench ------------------------------------------------------------------------------------------

def test_bench_without_matplotlib_says_so_first_and_still_writes_json_and_table(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    plot = tmp_path / "b.png"
    assert main(["bench", "--device", "host", "--ops", "matmul", "--repeat", "1", "--plot", str(plot)]) == 0
    out, err = capsys.readouterr()
    assert err.startswith("rlx-gpu: warning: drawing the plot needs matplotlib"), err
    assert 'pip install -e ".[bench]"' in err and "rlx_gpu[" not in err
    assert not plot.exists()
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["format"] == bench.FORMAT and len(data["cases"]) == 3
    assert "time per run (median)" in out and all(row["case"] in out for row in data["cases"])


def _timings(order):
    rows = [{"case": "lstm-a-f32", "seconds": {"opencl:1:0": 2e-3, "host": 1e-3, "torch (CPU)": 4e-3}},
            {"case": "matmul-b-f32", "seconds": {"host": 5e-4, "opencl:1:0": 1e-3}}]
    rows = [{**row, "seconds": dict(sorted(row["seconds"].items(), reverse=order))} for row in rows]
    return {"format": bench.FORMAT, "devices": [{"spec": "opencl:1:0", "name": "PoCL"}], "cases": rows}


def test_the_bench_table_has_the_torch_column_and_no_host_against_host():
    text = bench.table(_timings(False))
    header = text.splitlines()[1].split()
    assert header == ["case", "opencl:1:0", "host", "torch", "(CPU)", "host/opencl:1:0"]
    assert "host/host" not in text and "0.50x" in text
    assert text.splitlines()[4].split()[-2:] == ["—", "0.50x"]  # matmul: no torch anchor


def test_bench_series_and_colours_do_not_depend_on_the_order_timings_came_in():
    assert bench.series(_timings(False)) == bench.series(_timings(True)) == ["opencl:1:0", "host", "torch (CPU)"]
    colours = bench.colours(["opencl:1:0", "host", "torch (CPU)"])
    assert colours == bench.colours(["torch (CPU)", "host", "opencl:1:0"])
    assert len(set(colours.values())) == 3
    two = bench.colours(["opencl:0:0", "opencl:1:0"])
    assert two["opencl:0:0"] != two["opencl:1:0"]


def test_the_bench_plot_has_no_overlapping_labels():
    data = _timings(False)
    data["cases"] = [{"case": f"gated_delta_net-per_channel.carry-1x16x2x256-{i}-f32",
                      "seconds": {"opencl:1:0": 10.0 ** (-i % 3 - 3), "host": 2e-4}} for i in range(24)]
    fig = bench.figure(data)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    for labels in (ax.get_yticklabels(), [t for t in ax.get_xticklabels() if t.get_text()]):
        boxes = [t.get_window_extent(renderer) for t in labels]
        assert len(boxes) >= 2
        assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:]), labels
    legend = ax.get_legend().get_window_extent(renderer)
    assert not legend.overlaps(ax.get_window_extent(renderer))
