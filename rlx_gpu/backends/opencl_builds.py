"""Every OpenCL program built on one device, in this process, each build's diagnostics reported.

``python -m rlx_gpu.backends.opencl_builds --device opencl:P:D [--target cpu|gpu] [--dtypes f32 ...]
[--program LABEL]`` prints one JSON line per program (its label and the diagnostics of its log, Intel's
progress lines and remarks left out) and exits 1 when any program failed to build or said anything. A
driver compiler that crashes takes this process with it, not the caller's: the tests run it as a child,
and a build error names the command that builds its program alone.
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings

from ..errors import KernelBuildError
from ..launches.limits import TARGETS
from ..schedule.ops import DTYPES
from . import opencl
from .programs import every_program


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlx_gpu.backends.opencl_builds")
    parser.add_argument("--device", required=True, help="an OpenCL device spec, opencl:P:D")
    parser.add_argument("--target", choices=TARGETS, action="append", help="kernel target (repeat; default: both)")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, help="only these dtypes (default: all)")
    parser.add_argument("--program", help="only the program of this label (as a build error or warning names it)")
    args = parser.parse_args(argv)
    info = next((i for i in opencl.probe() if i.spec == args.device), None)
    if info is None:
        parser.error(f"no OpenCL device {args.device!r}; there are {', '.join(i.spec for i in opencl.probe())}")
    prims = opencl.OpenCLPrimitives(info)
    bad = 0
    for target in args.target or TARGETS:
        for prog in every_program("opencl", target, tuple(args.dtypes) if args.dtypes else None):
            if args.program and prog.label != args.program:
                continue
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                try:
                    prims.build_program(prog)
                    lines = [line for w in said for line in str(w.message).splitlines()[1:]]
                except KernelBuildError as err:
                    lines = ["build failed:", *err.log.splitlines()]
            bad += bool(lines)
            print(json.dumps({"program": prog.label, "diagnostics": lines}), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
