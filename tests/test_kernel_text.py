"""What the kernel texts say about themselves holds: every source file their comments name exists, and
the recurrent family is written as functions over its compile-time gate count, not as multi-line
macros expanded inside the kernels (DESIGN.md principle 14)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from rlx_gpu.paths import data_dir

ROOT = Path(__file__).resolve().parent.parent
TEXTS = sorted(data_dir("kernels").glob("*.cl")) + [data_dir("kernels_opencl") / "prelude.cl",
                                                    data_dir("kernels_cuda") / "prelude.cuh"]
#: a source file named in a comment: repository-relative, package-relative or a kernel text's bare name
NAMED = re.compile(r"[\w/]+\.(?:py|cl|cuh)\b")
SEARCHED = (ROOT, ROOT / "rlx_gpu", data_dir("kernels"))


@pytest.mark.parametrize("path", TEXTS, ids=lambda p: p.name)
def test_kernel_texts_name_only_files_that_exist(path):
    names = NAMED.findall(path.read_text())
    missing = [name for name in names if not any((folder / name).is_file() for folder in SEARCHED)]
    assert not missing, f"{path.name} names {missing}: no such file; name the module that does it now"


@pytest.mark.parametrize("name", ["rnn_cell.cl", "rnn.cl", "rnn_backward.cl"])
def test_recurrent_kernels_have_no_macro_bodies(name):
    text = (data_dir("kernels") / name).read_text()
    continued = [n for n, line in enumerate(text.splitlines(), 1) if line.rstrip().endswith("\\")]
    assert not continued, (f"kernels/{name} has {len(continued)} macro continuation lines, the first at line "
                           f"{continued[0]}; write a function (a gate-count variant: RNN_GATES) instead")


def _gpu_lines(lines: list[str]) -> list[str]:
    """``lines`` as the gpu target compiles them: the ``#else`` branch of ``#ifdef RLX_TARGET_GPU`` left out."""
    kept, stack = [], []  # per open #if: whether its current branch is the cpu target's
    for line in lines:
        word = line.strip().split(" ")[0]
        if word in ("#if", "#ifdef", "#ifndef"):
            stack.append([line.strip() == "#ifdef RLX_TARGET_GPU", False])
        elif word == "#else" and stack:
            stack[-1][1] = stack[-1][0]
        elif word == "#endif" and stack:
            stack.pop()
        elif not any(cpu for _, cpu in stack):
            kept.append(line)
    return kept


@pytest.mark.parametrize("path", sorted(data_dir("kernels").glob("*.cl")), ids=lambda p: p.name)
def test_no_work_item_returns_before_a_barrier(path):
    """OpenCL leaves undefined a barrier that a work-item of the group never reaches, a returned one too:
    Intel's CPU runtime ran mamba2_chunk_state's vectorized form into a segfault on a group that returned
    early. A group with nothing to do walks empty loops to every barrier instead."""
    text = path.read_text()
    barrier_macros = {m.group(1) for m in re.finditer(r"#define (\w+)\([^)]*\)((?:.*\\\n)*.*)", text)
                      if "BARRIER()" in m.group(2)}
    meets = re.compile(r"\bBARRIER\(\)|\b(" + "|".join(barrier_macros or {"BARRIER"}) + r")\(")
    found = []
    for kernel in re.finditer(r"^KERNEL\w* (\w+)\(.*?^}", text, re.S | re.M):
        body = _gpu_lines(kernel.group(0).splitlines())
        returns = [n for n, line in enumerate(body) if re.search(r"\breturn\b", line.split("/*")[0])]
        if returns and any(meets.search(line) for line in body[returns[0]:]):
            found.append(f"{kernel.group(1)}: {body[returns[0]].strip()}")
    assert not found, f"kernels/{path.name}: a return before a barrier in " + "; ".join(found)
