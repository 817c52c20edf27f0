"""NVRTC builds of the CUDA dialect (no GPU needed): sm_XX cubins, their PTX and ptxas resource usage.

The proof that the portable text in ``kernels/`` is one text for both dialects: the exact source the
OpenCL backend builds, with ``kernels_cuda/prelude.cuh`` in place of the OpenCL prelude, must build a
cubin (NVRTC, then ptxas) for every architecture in ``ARCHS``. ``build`` makes the binary a CUDA
backend loads and ``resource_usage`` reads ptxas's report of it (registers, stack, spills, shared
memory per kernel).
Run ``python -m rlx_gpu.backends.nvrtc [--usage] [--target cpu|gpu]``; it exits non-zero and prints the
NVRTC log and numbered source of any failure.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import KernelBuildError
from ..launches.limits import TARGETS
from ..launches.mma import MMA_FAMILIES, MMA_OF_DTYPE
from . import programs as kernel_programs
from .cubin_cache import CubinCache, CudaBuild, nvrtc_version

#: the architectures every program must build cubins for (A100, H100/H200)
ARCHS = ("sm_80", "sm_90")
CUBIN_ARCH = "sm_90"
INCLUDE_ENV = "CUDA_INCLUDE"  # a directory holding cuda_fp16.h, ahead of every other place
SYSTEM_INCLUDE = "/usr/local/cuda/include"
HEADER = "cuda_fp16.h"  # the one toolkit header the CUDA prelude includes


def include_dir(override: str | None = None, system: str = SYSTEM_INCLUDE) -> str:
    """The directory NVRTC finds ``cuda_fp16.h`` in: ``override`` (``$CUDA_INCLUDE``) when given, else the
    system toolkit's when it has the header, else the headers of the ``nvidia-cuda-runtime`` wheel (or of
    a conda or ``$CUDA_HOME`` toolkit) that ``cuda.pathfinder`` finds. With none, ``system``: the build
    then fails with NVRTC's "cannot open source file" and :func:`_compile` says how to get the header."""
    if override:
        return override
    if os.path.isfile(os.path.join(system, HEADER)):
        return system
    try:
        from cuda import pathfinder
    except ImportError:
        return system
    found = pathfinder.find_nvidia_header_directory("cudart")
    return found if found is not None and os.path.isfile(os.path.join(found, HEADER)) else system


#: IEEE f32 throughout: NVRTC's defaults (no -ftz, precise div/sqrt, no --use_fast_math), said explicitly
OPTIONS = ("-I" + include_dir(os.environ.get(INCLUDE_ENV)), "--std=c++17", "-default-device", "--ftz=false",
           "--prec-div=true", "--prec-sqrt=true")


@dataclass(frozen=True)
class Compiled:
    program: kernel_programs.Program
    arch: str
    ptx_bytes: int
    cubin_bytes: int


@dataclass(frozen=True)
class Usage:
    """ptxas's resource report for one kernel (bytes, except registers)."""

    registers: int
    stack: int
    spill_stores: int
    spill_loads: int
    shared: int


def programs(target: str = "cpu") -> list[kernel_programs.Program]:
    """Every program the backends build at ``target``, in the CUDA dialect; at the gpu target with the
    tensor-core variants of the chunked families (``launches.mma``), which only CUDA builds."""
    mma = [kernel_programs.program("cuda", family, dtype, None, target, (("RLX_MMA", variant),))
           for family in MMA_FAMILIES for dtype, variant in MMA_OF_DTYPE.items()] if target == "gpu" else []
    return kernel_programs.every_program("cuda", target) + mma


def _check(result: tuple) -> tuple:
    from cuda.bindings import nvrtc

    if result[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"NVRTC call failed: {nvrtc.nvrtcGetErrorString(result[0])[1].decode()}")
    return result[1:]


def _fetch(handle, size_fn, get_fn) -> bytes:
    """What ``get_fn`` writes, in a buffer of its own: NVRTC writes into the object it is given, and a
    ``bytes`` of one byte is Python's shared singleton, which would change for the whole process."""
    (size,) = _check(size_fn(handle))
    buf = bytearray(size)
    _check(get_fn(handle, buf))
    return bytes(buf)


def _compile(prog: kernel_programs.Program, arch: str, extra: tuple[str, ...] = ()) -> tuple[object, str]:
    """An NVRTC program handle compiled for ``arch`` and its log; raises KernelBuildError on failure."""
    from cuda.bindings import nvrtc

    options = [f"--gpu-architecture={arch}", *OPTIONS, *extra]
    (handle,) = _check(nvrtc.nvrtcCreateProgram(prog.source.encode(), f"{prog.family}.cu".encode(), 0, [], []))
    status = nvrtc.nvrtcCompileProgram(handle, len(options), [o.encode() for o in options])[0]
    log = _fetch(handle, nvrtc.nvrtcGetProgramLogSize, nvrtc.nvrtcGetProgramLog).decode(errors="replace").rstrip("\x00 ")
    if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        nvrtc.nvrtcDestroyProgram(handle)
        hint = (f" ({HEADER} was not found: pip install nvidia-cuda-runtime, or set {INCLUDE_ENV} to a directory "
                f"holding it)") if HEADER in log and "cannot open" in log else ""
        raise KernelBuildError(f"NVRTC could not compile the {prog.label} for {arch}{hint}", log, options, prog.source)
    return handle, log


def build(prog: kernel_programs.Program, arch: str = CUBIN_ARCH, extra: tuple[str, ...] = ()) -> CudaBuild:
    """Compile ``prog`` for ``arch`` (``sm_XX``) once, keeping the cubin, the PTX and ptxas's ``-v`` report
    (``extra``: further NVRTC options, after the project's)."""
    from cuda.bindings import nvrtc

    handle, log = _compile(prog, arch, ("--ptxas-options=-v", *extra))
    try:
        cubin = _fetch(handle, nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN)
        ptx = _fetch(handle, nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX).decode().rstrip("\x00")
        return CudaBuild(cubin, ptx, log)
    finally:
        nvrtc.nvrtcDestroyProgram(handle)


_ENTRY = re.compile(r"Compiling entry function '(\w+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def resource_usage(log: str) -> dict[str, Usage]:
    """Per kernel, ptxas's report in a :func:`build` log (``--ptxas-options=-v``)."""
    usage, name, frame = {}, None, None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            name, frame = m.group(1), None
        elif (m := _FRAME.search(line)) and name:
            frame = tuple(int(g) for g in m.groups())
        elif (m := _REGS.search(line)) and name and frame:
            smem = _SMEM.search(line)
            usage[name] = Usage(int(m.group(1)), *frame, int(smem.group(1)) if smem else 0)
            name = None
    return usage


_PARAMS = re.compile(r"\.entry (\w+)\(([^)]*)\)")
_PARAM = re.compile(r"\.param \.(?:align \d+ )?\.?([a-z]+)(\d+)")


def parameters(ptx: str) -> dict[str, tuple[tuple[str, int], ...]]:
    """Per kernel in ``ptx``, each parameter in order as (``"f"`` for floating point else ``"i"``, bytes):
    what a launcher must pack (pointers are 8-byte integers)."""
    out = {}
    for name, params in _PARAMS.findall(ptx):
        out[name] = tuple(("f" if kind == "f" else "i", int(bits) // 8) for kind, bits in _PARAM.findall(params))
    return out


#: f32 instructions that flush subnormals when they carry ``.ftz``. The MUFU approximations (ex2, lg2,
#: rcp, rsqrt, sin, cos ``.approx.ftz``) are left out: libdevice's accurate expf/logf/tanhf apply them
#: to range-reduced arguments, where a flush cannot occur, and they appear with -ftz=false too.
_FTZ = re.compile(r"^\s*(?:@!?%p\d+\s+)?((?:add|sub|mul|fma|mad|div|sqrt|min|max|abs|neg|cvt|setp|testp|set|selp)"
                  r"[.\w]*\.ftz[.\w]*f32)\b", re.M)


def flushing_instructions(ptx: str) -> list[str]:
    """The f32 arithmetic instructions of ``ptx`` that flush subnormals to zero (``.ftz``)."""
    return _FTZ.findall(ptx)


def check_all(archs: tuple[str, ...] = ARCHS, target: str = "cpu", directory: Path | None = None) -> list[Compiled]:
    """Build every program for every arch (``sm_XX``) through a :class:`CubinCache` on ``directory``
    (``None``: no disk cache, every program compiled); the first failure raises KernelBuildError."""
    out = []
    for arch in archs:
        cache = CubinCache(arch, OPTIONS, build, nvrtc_version(), directory)
        for p in programs(target):
            built = cache.built(p)
            out.append(Compiled(p, arch, len(built.ptx), len(built.cubin)))
    return out


def usage_table(target: str) -> list[tuple[kernel_programs.Program, str, Usage]]:
    """(program, kernel, usage) for every kernel of every family x dtype x variant at ``target`` (sm_90)."""
    rows = []
    for prog in programs(target):
        if prog.src_dtype is None:
            for kernel, use in sorted(resource_usage(build(prog).log).items()):
                rows.append((prog, kernel, use))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlx_gpu.backends.nvrtc")
    parser.add_argument("--usage", action="store_true", help=f"print ptxas resource usage at {CUBIN_ARCH}")
    parser.add_argument("--target", default="cpu", choices=TARGETS)
    args = parser.parse_args(argv)
    try:
        if args.usage:
            print("| program | kernel | registers | stack B | spill st/ld B | shared B |\n|---|---|---|---|---|---|")
            for prog, kernel, u in usage_table(args.target):
                print(f"| {prog.label} | {kernel} | {u.registers} | {u.stack} | {u.spill_stores}/{u.spill_loads} | {u.shared} |")
            return 0
        done = check_all(target=args.target)
    except KernelBuildError as err:
        print(err, file=sys.stderr)
        return 1
    for c in done:
        print(f"ok  {c.program.label:<45} {c.arch}  {c.ptx_bytes:>8} bytes of PTX  {c.cubin_bytes:>8} bytes of cubin")
    print(f"{len(done)} programs compiled through NVRTC")
    return 0


if __name__ == "__main__":
    sys.exit(main())
