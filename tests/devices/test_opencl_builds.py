"""Every OpenCL implementation here (PoCL, Intel's CPU runtime) builds every program cleanly, in a process of
its own; a build error or warning names the command that builds its program alone.

Each implementation is a second compiler of the same text: clang's warnings (a constant operand of `||`, a
loop `#pragma unroll` cannot unroll) are kept out of the text, and a compiler that crashes fails the test
with its command rather than killing the suite.
"""
from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from support import background
from rlx_gpu.backends import opencl, programs
from rlx_gpu.errors import KernelBuildError, KernelBuildWarning
from rlx_gpu.launches.limits import TARGETS
from rlx_gpu.runtime.registry import status

ROOT = Path(__file__).resolve().parents[2]
IMPLEMENTATIONS = background.OPENCL_IMPLEMENTATIONS
needs_opencl = pytest.mark.skipif(not IMPLEMENTATIONS, reason=f"no OpenCL device: {status('opencl').reason}")


@needs_opencl
@pytest.mark.parametrize("spec", IMPLEMENTATIONS)
def test_every_program_builds_cleanly(spec):
    done = background.result(f"opencl-builds-{spec}")
    command = " ".join(background.OPENCL_BUILDS[1:] + [spec])
    assert done.returncode >= 0, f"the build process died of signal {-done.returncode}; alone: python {command}\n" \
                                 + done.stderr[-3000:]
    built = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    said = [f"{b['program']}:\n" + "\n".join(b["diagnostics"]) for b in built if b["diagnostics"]]
    assert not said, "\n".join(said)[:6000]
    assert [b["program"] for b in built] == [p.label for t in TARGETS for p in programs.every_program("opencl", t, ("f32",))]
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_build_log_s_diagnostics_leave_out_intel_s_progress_lines_and_remarks():
    intel = ("Compilation started\nCompilation done\nLinking started\nLinking done\nDevice build started\n"
             "Options used by backend compiler: -cl-std=CL1.2\nDevice build done\n"
             "Kernel \"rnn_step\" was successfully vectorized (16)\nKernel \"rnn_persist\" was not vectorized\nDone.\n"
             "remark: <unknown>:0:0: Loop was 8-way vectorized1 gathers\n")
    assert opencl.diagnostics(intel) == []
    clang = "input.cl:285:33: warning: use of logical '||' with constant operand\n    const int a = b || (0 && c);\n"
    assert opencl.diagnostics(intel + clang) == clang.splitlines()


@needs_opencl
@pytest.mark.parametrize("spec", IMPLEMENTATIONS)
def test_a_build_warning_and_a_build_error_name_the_program_and_the_command_that_builds_it_alone(spec):
    info = next(i for i in opencl.probe() if i.spec == spec)
    prims = opencl.OpenCLPrimitives(info)
    real = programs.program("opencl", "cast", "f32", "f16", "gpu")
    warned = programs.Program("opencl", "cast", "f32", "f16", real.source + "\nint rlx_w(int a) { return a || 2; }\n",
                              "gpu")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        prims.build_program(warned)
    message = "\n".join(str(w.message) for w in said if w.category is KernelBuildWarning)
    assert "constant operand" in message and real.label in message
    command = opencl.reproduce_command(info.spec, real)
    assert command in message
    broken = programs.Program("opencl", "cast", "f32", "f16", real.source + "\nint rlx_broken(\n", "gpu")
    with pytest.raises(KernelBuildError) as err:
        prims.build_program(broken)
    assert command in str(err.value)
    # the command builds that program (from the kernel text, so cleanly) in a process of its own
    done = subprocess.run([sys.executable, *command.split()[1:]], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout) == {"program": real.label, "diagnostics": []}
