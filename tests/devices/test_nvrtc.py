"""The portable kernel text compiles for CUDA: every family x dtype to NVRTC cubins for sm_80 and sm_90."""
from __future__ import annotations

import dataclasses
import json

from support import background
import pytest

pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings with NVRTC is not installed")

from rlx_gpu.backends import nvrtc, programs  # noqa: E402
from rlx_gpu.errors import KernelBuildError  # noqa: E402
from rlx_gpu.paths import data_dir  # noqa: E402


def test_every_program_compiles_for_every_arch():
    done = background.result("nvrtc")  # nvrtc.check_all() in a process of its own, beside the other tests
    assert done.returncode == 0, done.stderr[-4000:]
    compiled = json.loads(done.stdout)
    assert {(label, arch) for label, arch, _, _ in compiled} == {
        (p.label, arch) for p in nvrtc.programs() for arch in ("sm_80", "sm_90")
    }
    assert all(ptx_bytes > 1000 and cubin_bytes > 1000 for _, _, ptx_bytes, cubin_bytes in compiled)


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
        nvrtc.build(broken, "sm_80")
    assert "undefined_name" in info.value.log and "--gpu-architecture=sm_80" in info.value.options


def test_every_body_function_has_a_named_case_in_the_kernel():
    """The kernel names each fn by the emitted define, so a fn without its case cannot slip to the default."""
    from rlx_gpu.launches.body import FN_CODES, fn_defines

    text = programs.program("opencl", "body", "f32").source
    for name, code in fn_defines().items():
        assert f"#define {name} {code}\n" in text
        assert f"case {name}:" in text, f"kernels/body.cl has no case for {name}"
    assert sorted(FN_CODES["unary"].values()) == list(range(len(FN_CODES["unary"])))


def test_an_empty_build_log_leaves_pythons_one_byte_constant_alone():
    """NVRTC writes into the buffer it is given; an empty log is one byte, and ``b" " * 1`` is Python's
    shared ``b" "``: written into, it would become ``b"\\x00"`` for the whole process."""
    clean = 'extern "C" __global__ void one(int *p) { *p = 1; }\n'  # compiles without a warning
    prog = dataclasses.replace(programs.program("cuda", "body", "f32"), source=clean)
    handle, log = nvrtc._compile(prog, "compute_90")
    from cuda.bindings import nvrtc as bindings

    bindings.nvrtcDestroyProgram(handle)
    assert log == ""  # the case that corrupted it: a log of size 1
    assert b" "[0] == 32 and b"x y".split(b" ") == [b"x", b"y"]


def test_without_a_system_toolkit_the_wheel_headers_are_used(tmp_path):
    """No cuda_fp16.h under the system path: the nvidia-cuda-runtime wheel's headers (cuda.pathfinder)."""
    import os

    found = nvrtc.include_dir(None, system=str(tmp_path))
    assert found != str(tmp_path) and os.path.isfile(os.path.join(found, "cuda_fp16.h"))
    assert nvrtc.include_dir("/given/by/CUDA_INCLUDE", system=str(tmp_path)) == "/given/by/CUDA_INCLUDE"
    prog = programs.program("cuda", "body", "f16")
    options = ["--gpu-architecture=compute_90", "-I" + found, *nvrtc.OPTIONS[1:]]
    from cuda.bindings import nvrtc as bindings

    (handle,) = nvrtc._check(bindings.nvrtcCreateProgram(prog.source.encode(), b"body.cu", 0, [], []))
    try:
        status = bindings.nvrtcCompileProgram(handle, len(options), [o.encode() for o in options])[0]
        assert status == bindings.nvrtcResult.NVRTC_SUCCESS
    finally:
        bindings.nvrtcDestroyProgram(handle)


def test_a_missing_header_says_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setattr(nvrtc, "OPTIONS", ("-I" + str(tmp_path), *nvrtc.OPTIONS[1:]))
    with pytest.raises(KernelBuildError, match="pip install nvidia-cuda-runtime"):
        nvrtc.build(programs.program("cuda", "body", "f16"), "sm_90")
