"""README.md: the blocks marked runnable run as written, and the README links what a clone has."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

import rlx_gpu
from rlx_gpu.cli import main
from rlx_gpu.graph.models import examples_dir

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
MARKED = re.findall(r"<!-- runnable( after: [^>]*| model)? -->\n```(\w+)\n(.*?)```", README, re.S)
PYTHON = [(how.removeprefix(" after: ").strip(), code) for how, lang, code in MARKED if lang == "python"]


def test_the_readme_marks_its_examples_runnable():
    assert len(PYTHON) >= 3 and any(lang == "yaml" for _, lang, _ in MARKED)


@pytest.mark.parametrize("setup,code", PYTHON, ids=[f"block{i}" for i in range(len(PYTHON))])
def test_runnable_python_block(setup, code, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    if setup:
        args = shlex.split(setup)
        assert args[0] == "rlx-gpu" and main(args[1:]) == 0
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})


def test_the_model_file_example_builds_and_is_the_bundled_demo(tmp_path):
    (text,) = [code for how, lang, code in MARKED if how == " model"]
    assert yaml.safe_load(text) == yaml.safe_load((examples_dir() / "demo.yaml").read_text())
    path = tmp_path / "model.yaml"
    path.write_text(text)
    executable, inputs = rlx_gpu.build_model(path, device="host")
    assert executable.run(**inputs)["y"].shape == (2, 8, 6)


def test_the_readme_links_the_abi_reference_that_ships_in_the_repo():
    assert "../shared" not in README and "](docs/abi.md)" in README
    assert (ROOT / "docs" / "abi.md").is_file()


def test_benchmarks_import_nothing_from_tests():
    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        imports = re.findall(r"^\s*(?:from|import) (tests\b[\w.]*)", script.read_text(), re.M)
        assert not imports, f"{script.name} imports {imports}: a benchmark runs from an installed package"


def test_the_readme_reaches_the_command_line_early_and_keeps_reference_tables_in_docs():
    lines = README.splitlines()
    assert next(i for i, line in enumerate(lines) if line == "## The command line") < 100
    table_rows = [len(list(rows)) for is_row, rows in __import__("itertools").groupby(
        lines, key=lambda line: line.startswith("|")) if is_row]
    assert max(table_rows) <= 20, f"a table of {max(table_rows)} rows belongs in docs/"
    assert "](docs/kernels.md)" in README and (ROOT / "docs" / "kernels.md").is_file()
    assert "| gemm |" in (ROOT / "docs" / "kernels.md").read_text()


def test_the_extras_table_agrees_with_what_runs_where():
    extras = README.split("## Extras")[1].split("\n## ")[0]
    assert "not built" not in extras and "| `torch` |" in extras
    assert "pip install -e \".[bench]\"" in extras and "rlx_gpu[" not in README
    assert "tools/oclgrind_check.py --full" in README.split("## Tests")[1]
