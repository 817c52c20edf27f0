"""The portable kernel text compiles for CUDA: every family x dtype through NVRTC for sm_80 and sm_90."""
from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings with NVRTC is not installed")

from rlx_gpu.backends import nvrtc, programs  # noqa: E402
from rlx_gpu.errors import KernelBuildError  # noqa: E402
from rlx_gpu.paths import data_dir  # noqa: E402


def test_every_program_compiles_for_every_arch():
    done = nvrtc.check_all()
    assert {(c.program.label, c.arch) for c in done} == {
        (p.label, arch) for p in nvrtc.programs() for arch in ("compute_80", "compute_90")
    }
    assert all(c.ptx_bytes > 1000 for c in done)


@pytest.mark.parametrize("family", programs.FAMILIES)
def test_one_text_for_both_dialects(family):
    cuda = programs.program("cuda", family, "f16").source
    ocl = programs.program("opencl", family, "f16").source
    body = (data_dir("kernels") / f"{family}.cl").read_text()
    assert cuda.endswith(body) and ocl.endswith(body)
    assert cuda.replace(programs.prelude_path("cuda").read_text(), "") == ocl.replace(
        programs.prelude_path("opencl").read_text(), "")


def test_nvrtc_failure_carries_log_and_source():
    prog = programs.program("cuda", "gdn", "f32")
    broken = dataclasses.replace(prog, source=prog.source + "\nKERNEL oops(int x) { undefined_name(x); }\n")
    with pytest.raises(KernelBuildError) as info:
        nvrtc.compile_ptx(broken, "compute_80")
    assert "undefined_name" in info.value.log and "--gpu-architecture=compute_80" in info.value.options


def test_every_body_function_has_a_named_case_in_the_kernel():
    """The kernel names each fn by the emitted define, so a fn without its case cannot slip to the default."""
    from rlx_gpu.launches.body import FN_CODES, fn_defines

    text = programs.program("opencl", "body", "f32").source
    for name, code in fn_defines().items():
        assert f"#define {name} {code}\n" in text
        assert f"case {name}:" in text, f"kernels/body.cl has no case for {name}"
    assert sorted(FN_CODES["unary"].values()) == list(range(len(FN_CODES["unary"])))
