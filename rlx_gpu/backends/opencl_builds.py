"""OpenCL programs built on one device, in this process, each build's diagnostics reported.

``python -m rlx_gpu.backends.opencl_builds --device opencl:P:D [--target cpu|gpu] [--dtypes f32 ...]`` builds
every program (``programs.every_program``); ``--family F --dtype D [--src-dtype S] [--defines A=1,B=2]`` builds
one, any variant a planner may ask for (the command a build error or warning names). It prints one JSON line
per program (its label and the diagnostics of its log, Intel's progress lines and remarks left out) and exits
1 when any program failed to build or said anything. A driver compiler that crashes takes this process with
it, not the caller's: the tests run it as a child.
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings

from host_fallback.abi import DTYPES

from ..errors import KernelBuildError
from ..launches.limits import TARGETS
from . import opencl
from .programs import FAMILIES, Program, every_program, program


def _defines(text: str) -> tuple[tuple[str, int], ...]:
    pairs = [item.split("=", 1) for item in text.split(",") if item]
    return tuple((name, int(value)) for name, value in pairs)


def chosen(args: argparse.Namespace) -> list[Program]:
    """The programs the arguments name: one (``--family``), or every one at each target."""
    targets = args.target or list(TARGETS)
    if args.family:
        return [program("opencl", args.family, args.dtype, args.src_dtype, t, _defines(args.defines or ""))
                for t in targets]
    return [p for t in targets for p in every_program("opencl", t, tuple(args.dtypes) if args.dtypes else None)]


def build(prims: opencl.OpenCLPrimitives, prog: Program) -> list[str]:
    """The diagnostics of building ``prog`` (the log of a failed build, headed ``build failed:``)."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            prims.build_program(prog)
        except KernelBuildError as err:
            return ["build failed:", *err.log.splitlines()]
    return [line for w in said for line in str(w.message).splitlines()[1:]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlx_gpu.backends.opencl_builds")
    parser.add_argument("--device", required=True, help="an OpenCL device spec, opencl:P:D")
    parser.add_argument("--target", choices=TARGETS, action="append", help="kernel target (repeat; default: both)")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, help="every program of these dtypes (default: all)")
    parser.add_argument("--family", choices=FAMILIES, help="only this family's program (with --dtype)")
    parser.add_argument("--dtype", choices=DTYPES, default="f32")
    parser.add_argument("--src-dtype", choices=DTYPES, help="the cast family's source dtype")
    parser.add_argument("--defines", help="the program's compile-time variant, NAME=VALUE,...")
    args = parser.parse_args(argv)
    found = opencl.probe()
    info = next((i for i in found if i.spec == args.device), None)
    if info is None:
        parser.error(f"no OpenCL device {args.device!r}; there are {', '.join(i.spec for i in found)}")
    prims = opencl.OpenCLPrimitives(info)
    bad = 0
    for prog in chosen(args):
        lines = build(prims, prog)
        bad += bool(lines)
        print(json.dumps({"program": prog.label, "diagnostics": lines}), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
