"""Compile every kernel family x dtype with the CUDA prelude through NVRTC (no GPU needed).

The proof that the portable text in ``kernels/`` is one text for both dialects: the exact source the
OpenCL backend builds, with ``kernels_cuda/prelude.cuh`` in place of the OpenCL prelude, must compile
to PTX for every architecture in ``ARCHS``. Run ``python -m rlx_gpu.backends.nvrtc``; it exits non-zero
and prints the NVRTC log and numbered source of any failure.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from ..errors import KernelBuildError
from ..schedule.ops import DTYPES
from .programs import FAMILIES, Program, program

ARCHS = ("compute_80", "compute_90")
CUDA_INCLUDE = os.environ.get("CUDA_INCLUDE", "/usr/local/cuda/include")


@dataclass(frozen=True)
class Compiled:
    program: Program
    arch: str
    ptx_bytes: int


def programs() -> list[Program]:
    """Every program the backends build: each family for each dtype, plus each cast variant."""
    out = [program("cuda", fam, dt) for fam in FAMILIES for dt in DTYPES]
    out += [program("cuda", "body", dt, src) for dt in DTYPES for src in DTYPES]
    return out


def _check(result: tuple) -> tuple:
    from cuda.bindings import nvrtc

    if result[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"NVRTC call failed: {nvrtc.nvrtcGetErrorString(result[0])[1].decode()}")
    return result[1:]


def compile_ptx(prog: Program, arch: str) -> bytes:
    """PTX of ``prog`` for ``arch``; raises KernelBuildError with NVRTC's log on failure."""
    from cuda.bindings import nvrtc

    options = [f"--gpu-architecture={arch}", f"-I{CUDA_INCLUDE}", "--std=c++17", "-default-device"]
    (handle,) = _check(nvrtc.nvrtcCreateProgram(prog.source.encode(), f"{prog.family}.cu".encode(), 0, [], []))
    try:
        status = nvrtc.nvrtcCompileProgram(handle, len(options), [o.encode() for o in options])[0]
        (size,) = _check(nvrtc.nvrtcGetProgramLogSize(handle))
        log = b" " * size
        _check(nvrtc.nvrtcGetProgramLog(handle, log))
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise KernelBuildError(f"NVRTC could not compile the {prog.label} for {arch}",
                                   log.decode(errors="replace").rstrip("\x00 "), options, prog.source)
        (size,) = _check(nvrtc.nvrtcGetPTXSize(handle))
        ptx = b" " * size
        _check(nvrtc.nvrtcGetPTX(handle, ptx))
        return ptx
    finally:
        nvrtc.nvrtcDestroyProgram(handle)


def check_all(archs: tuple[str, ...] = ARCHS) -> list[Compiled]:
    """Compile every program for every arch; the first failure raises KernelBuildError."""
    return [Compiled(p, arch, len(compile_ptx(p, arch))) for p in programs() for arch in archs]


def main() -> int:
    try:
        done = check_all()
    except KernelBuildError as err:
        print(err, file=sys.stderr)
        return 1
    for c in done:
        print(f"ok  {c.program.label:<45} {c.arch}  {c.ptx_bytes:>8} bytes of PTX")
    print(f"{len(done)} programs compiled through NVRTC")
    return 0


if __name__ == "__main__":
    sys.exit(main())
