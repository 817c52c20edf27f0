"""README.md and the pages of docs/: every code block is marked runnable (and runs as written) or says why
not, the marked shell, model and config blocks run, every relative link reaches a file and heading, and the
README stays a short introduction that keeps the two commands CI runs."""
from __future__ import annotations

import itertools
import re
import shlex
from pathlib import Path

import pytest
import yaml

import rlx_gpu
from rlx_gpu.cli import main
from rlx_gpu.graph.models import examples_dir

ROOT = Path(__file__).resolve().parents[2]
PAGES = {path.relative_to(ROOT).as_posix(): path.read_text()
         for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}
README = PAGES["README.md"]
#: A fenced block with the line before it: ``<!-- runnable -->``, ``<!-- runnable after: rlx-gpu ... -->`` (a
#: command run first, in the same directory), ``<!-- runnable model -->``, ``<!-- runnable config -->`` or
#: ``<!-- not run: why -->``; any other line before it is no marker.
FENCE = re.compile(r"^([^\n]*)\n```(\w+)\n(.*?)^```$", re.M | re.S)
MARK = re.compile(r"<!-- (runnable(?: after: (?P<after>[^>]*?)| (?P<kind>model|config))?|not run: [^>]+) -->$")


def blocks() -> list[tuple[str, str, re.Match | None, str]]:
    """(where, language, marker, code) of every fenced block of every page; ``where`` is ``page:line`` of its code,
    and the code is led by as many blank lines, so a traceback's line numbers are the page's."""
    out = []
    for page, text in PAGES.items():
        for block in FENCE.finditer(text):
            before, lang, code = block.groups()
            line = text.count("\n", 0, block.start(3)) + 1
            out.append((f"{page}:{line}", lang, MARK.fullmatch(before.strip()), "\n" * (line - 1) + code))
    return out


BLOCKS = blocks()
RUNNABLE = [(where, lang, mark, code) for where, lang, mark, code in BLOCKS
            if mark and mark.group(1).startswith("runnable")]
PYTHON = [(where, mark["after"] or "", code) for where, lang, mark, code in RUNNABLE if lang == "python"]
SHELL = [(where, code) for where, lang, mark, code in RUNNABLE if lang in ("sh", "bash")]


def test_every_code_block_of_every_page_is_marked_runnable_or_says_why_not():
    """JSON blocks are docs/abi.md's worked schedules, which tests/project/test_docs.py runs; a fence without a language
    is program output."""
    unmarked = [where for where, lang, mark, code in BLOCKS
                if not mark and not (lang == "json" and where.startswith("docs/abi.md:"))]
    assert not unmarked, f"code blocks without <!-- runnable --> or <!-- not run: why -->: {unmarked}"
    pages = {where.partition(":")[0] for where, _, _ in PYTHON}
    assert {"README.md", "docs/python.md", "docs/torch.md", "docs/onnx.md", "docs/host_fallback.md",
            "docs/abi.md"} <= pages
    assert any(lang == "yaml" and mark["kind"] == "model" for _, lang, mark, _ in RUNNABLE)
    assert any(lang == "yaml" and mark["kind"] == "config" for _, lang, mark, _ in RUNNABLE)


def _setup(after: str) -> None:
    if after:
        args = shlex.split(after)
        assert args[0] == "rlx-gpu" and main(args[1:]) == 0, after


@pytest.mark.parametrize("where,setup,code", PYTHON, ids=[where for where, _, _ in PYTHON])
def test_runnable_python_block(where, setup, code, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _setup(setup)
    exec(compile(code, str(ROOT / where.partition(":")[0]), "exec"), {"__name__": "readme"})


@pytest.mark.parametrize("where,code", SHELL, ids=[where for where, _ in SHELL])
def test_runnable_shell_block_runs_each_command_with_exit_code_0(where, code, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    commands = [line for line in code.splitlines() if line.strip() and not line.startswith("#")]
    assert commands
    for line in commands:
        args = shlex.split(line)
        assert args[0] == "rlx-gpu", f"{where}: a runnable shell block runs rlx-gpu commands only, not {line!r}"
        assert main(args[1:]) == 0, line


def test_the_model_file_example_builds_and_is_the_bundled_demo(tmp_path):
    (text,) = [code for _, lang, mark, code in RUNNABLE if mark["kind"] == "model"]
    assert yaml.safe_load(text) == yaml.safe_load((examples_dir() / "demo.yaml").read_text())
    path = tmp_path / "model.yaml"
    path.write_text(text)
    executable, inputs = rlx_gpu.build_model(path, device="host")
    assert executable.run(**inputs)["y"].shape == (2, 8, 6)


@pytest.mark.parametrize("code", [code for _, _, mark, code in RUNNABLE if mark["kind"] == "config"])
def test_the_config_examples_load(code, tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(code)
    config = rlx_gpu.load_config(path)
    assert config.source == str(path) and config.device in code


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces as ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    without_code = re.sub(r"^```.*?^```$", "", text, flags=re.M | re.S)
    return {slug(h) for h in re.findall(r"^#{1,6} (.*)$", without_code, re.M)}


def test_slugs_follow_github():
    assert slug("On a GPU: `tools/gpu_check.py`") == "on-a-gpu-toolsgpu_checkpy"
    assert slug("4. State-space and linear-attention ops") == "4-state-space-and-linear-attention-ops"


@pytest.mark.parametrize("page", list(PAGES))
def test_every_relative_link_reaches_a_file_and_its_heading(page):
    text = re.sub(r"^```.*?^```$", "", PAGES[page], flags=re.M | re.S)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    broken = []
    for link in links:
        if re.match(r"[a-z]+:", link):
            continue
        target, _, anchor = link.partition("#")
        path = (ROOT / page).parent / target if target else ROOT / page
        if not path.resolve().is_file() or not path.resolve().is_relative_to(ROOT):
            broken.append(f"{link} (no file)")
        elif anchor and anchor not in anchors(path.read_text()):
            broken.append(f"{link} (no heading #{anchor})")
    assert not broken, f"{page}: {broken}"


def test_the_readme_keeps_the_two_commands_and_ci_runs_the_test_command_verbatim():
    run = "python3 -m venv .venv && . .venv/bin/activate && pip install -e \".[opencl]\" && rlx-gpu run --check"
    test = "python3 -m venv .venv && . .venv/bin/activate && pip install -e \".[test]\" && python -m pytest -q"
    shell = [code.strip() for where, lang, mark, code in BLOCKS if where.startswith("README.md:") and lang == "sh"]
    assert shell[:2] == [run, test]
    assert test in (ROOT / ".ci" / "run").read_text().splitlines()


def test_the_readme_is_a_short_introduction_and_the_reference_lives_in_docs():
    lines = README.splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move reference text to docs/"
    sections = re.findall(r"^## (.*)$", README, re.M)
    assert sections[:6] == ["What runs where", "Choosing a device", "From PyTorch", "From ONNX", "Certify a device",
                            "For runtimes: `host_fallback`"]
    assert "Where the docs are" in sections
    table_rows = [len(list(rows)) for is_row, rows in itertools.groupby(lines, key=lambda l: l.startswith("|"))
                  if is_row]
    assert max(table_rows) <= 14, f"a table of {max(table_rows)} rows belongs in docs/"
    for page in PAGES:
        if page.startswith("docs/"):
            assert f"]({page})" in README, f"the README does not link {page}"
    assert "| gemm |" in PAGES["docs/kernels.md"] and "../shared" not in README


def test_the_readme_says_plainly_that_cuda_has_never_run_on_a_gpu():
    assert "**The CUDA backend has never run on a GPU.**" in README
    assert "never run on a GPU" in README.split("## What runs where")[1].split("\n## ")[0]


def test_the_check_wording_says_when_it_fails():
    for page in ("README.md", "docs/cli.md"):
        assert "exceeds the `schedule`" in PAGES[page].replace("\n", " ").replace("  ", " ")
        assert "passes the `schedule` bound" not in PAGES[page].replace("\n", " ")


def test_benchmarks_import_nothing_from_tests():
    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        imports = re.findall(r"^\s*(?:from|import) (tests\b[\w.]*)", script.read_text(), re.M)
        assert not imports, f"{script.name} imports {imports}: a benchmark runs from an installed package"


def test_the_extras_table_agrees_with_what_runs_where():
    extras = README.split("## Extras")[1].split("\n## ")[0]
    assert "not built" not in extras and "| `torch` |" in extras
    assert "pip install -e \".[bench]\"" in extras and "rlx_gpu[" not in README
    assert "tools/oclgrind_check.py --full" in PAGES["docs/testing.md"]
