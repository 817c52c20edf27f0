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
    if re.search(r"^import .*\btorch\b", code, re.M):
        pytest.importorskip("torch")
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
