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
