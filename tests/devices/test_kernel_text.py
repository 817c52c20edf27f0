"""What the kernel texts say about themselves holds: every source file their comments name exists, the
activation codes they name are those of the one table the programs' defines carry, and no work-item
returns before a barrier (the macros: test_kernel_macros.py)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from rlx_gpu.backends import programs
from rlx_gpu.launches.activation_codes import activation_defines
from rlx_gpu.launches.limits import gate_variant
from rlx_gpu.paths import data_dir

ROOT = Path(__file__).resolve().parents[2]
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


def test_the_activation_codes_come_from_the_one_table():
    """The kernels name every code of launches/activation_codes.py's table and no other, type none of their
    numbers, and the recurrent programs define each one."""
    codes = activation_defines()
    texts = "".join(path.read_text() for path in data_dir("kernels").glob("*.cl"))
    named = set(re.findall(r"\bRNN_ACT_[A-Z_]+\b", texts))
    assert named == set(codes), f"the kernels name {sorted(named - set(codes))} beyond the table and leave out " \
                                f"{sorted(set(codes) - named)}"
    typed = re.findall(r"#\s*define\s+(RNN_ACT_[A-Z_]+)\s", texts)
    assert not typed, f"the kernels define {typed}: the table's codes come with the program's defines"
    source = programs.program("opencl", "rnn", "f32", None, "cpu", gate_variant(1)).source
    missing = [name for name, code in codes.items() if f"#define {name} {code}\n" not in source]
    assert not missing, f"the rnn program does not define {missing}"


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
    meets = re.compile(r"\bBARRIER\(|_barrier\(")  # a function that meets one says so (test_kernel_macros.py)
    found = []
    for kernel in re.finditer(r"^KERNEL\w* (\w+)\(.*?^}", text, re.S | re.M):
        body = _gpu_lines(kernel.group(0).splitlines())
        returns = [n for n, line in enumerate(body) if re.search(r"\breturn\b", line.split("/*")[0])]
        if returns and any(meets.search(line) for line in body[returns[0]:]):
            found.append(f"{kernel.group(1)}: {body[returns[0]].strip()}")
    assert not found, f"kernels/{path.name}: a return before a barrier in " + "; ".join(found)
