"""Long checks that run beside the rest of the suite, in processes of their own.

Oclgrind's simulation of the representative kernel cases (one process per kernel target) and of the recurrent
reserve's forward and backward (``reserve_oclgrind``), NVRTC's
build of every program (through the session's cubin cache, ``cuda_builds``: minutes only where a
kernel's text changed), each OpenCL implementation's build of every f32 program and the fuzz profile on
each OpenCL implementation (a compiler or kernel that crashes takes only its own process) are
single-threaded. Started as soon as the session has collected its tests (only the checks whose test was selected;
for the whole suite before the collection, ``whole_suite``), at a lower priority, they take the core the tests
leave; the tests that own a check run last and wait for its result. A check is the command a developer runs by hand
(``tools/oclgrind_check.py --targets T``, ``python -m rlx_gpu.backends.nvrtc``, here with the cache,
``tools/fuzz.py --device D``).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO

from support import cuda_builds, reserve_oclgrind
from rlx_gpu.launches.limits import TARGETS
from rlx_gpu.runtime.registry import status

ROOT = Path(__file__).resolve().parents[2]

#: every cpu-target program for both architectures, through the session's cubin cache (``cuda_builds``)
NVRTC_SCRIPT = f"""
import json
from pathlib import Path
from rlx_gpu.backends import nvrtc
done = nvrtc.check_all(directory=Path({str(cuda_builds.directory())!r}))
print(json.dumps([[c.program.label, c.arch, c.ptx_bytes, c.cubin_bytes] for c in done]))
"""

#: every OpenCL implementation here but simulators, its first device (none without pyopencl or a platform: the
#: tests say why); a second build of one implementation (pyopencl's PoCL beside Debian's) is not checked twice
OPENCL_IMPLEMENTATIONS = list({info.details["platform"]: info.spec for info in reversed(status("opencl").devices)
                               if not info.details["simulator"]}.values())[::-1]
#: the command that builds every f32 program at both targets on one OpenCL device
OPENCL_BUILDS = [sys.executable, "-m", "rlx_gpu.backends.opencl_builds", "--dtypes", "f32", "--device"]

#: the kernel targets Oclgrind checks, each in a process of its own (``oclgrind-<target>``)
OCLGRIND_TARGETS = TARGETS
#: Seeds of the fuzz profile on each OpenCL implementation (``fuzz-<spec>``; fewer than the host's: a
#: child compiles the kernels its cases use)
FUZZ_OPENCL_CASES = 120
#: check -> (the test that asserts on it, its command)
CHECKS: dict[str, tuple[str, list[str]]] = {
    **{f"oclgrind-{target}": ("tests/devices/test_oclgrind.py::test_conformance_cases_are_clean_under_oclgrind",
                              [sys.executable, str(ROOT / "tools" / "oclgrind_check.py"), "--targets", target])
       for target in OCLGRIND_TARGETS},
    "oclgrind-rnn-reserve": ("tests/devices/test_rnn_reserve_device.py::test_the_reserve_kernels_are_clean_under_oclgrind",
                             reserve_oclgrind.command("opencl:0:0")),
    "nvrtc": ("tests/devices/test_nvrtc.py::test_every_program_compiles_for_every_arch",
              [sys.executable, "-c", NVRTC_SCRIPT]),
    **{f"fuzz-{spec}": (f"tests/schedule/test_fuzz.py::test_the_profile_on_opencl[{spec}]",
                        [sys.executable, str(ROOT / "tools" / "fuzz.py"), "--device", spec, "--cases",
                         str(FUZZ_OPENCL_CASES), "--batch", str(FUZZ_OPENCL_CASES), "--out",
                         str(Path(tempfile.gettempdir()) / f"rlx-fuzz-{spec.replace(':', '-')}")])
       for spec in OPENCL_IMPLEMENTATIONS},
    **{f"opencl-builds-{spec}": (f"tests/devices/test_opencl_builds.py::test_every_program_builds_cleanly[{spec}]",
                                 OPENCL_BUILDS + [spec]) for spec in OPENCL_IMPLEMENTATIONS},
}

#: how much lower the checks run than the tests (``nice``): the tests keep a core of their own, the checks take the
#: other and whatever the tests leave, and the tests that wait for them run last (``waiting_last``)
NICENESS = 10

_running: dict[str, tuple[subprocess.Popen, IO[str], IO[str]]] = {}


def start(selected: set[str]) -> None:
    """Start every check whose test is among the ``selected`` test ids, its output in temporary files (a pipe
    nobody reads until the test runs would stop a talkative check once full)."""
    for name, (test, argv) in CHECKS.items():
        if test in selected and name not in _running:
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=err, text=True)
            if hasattr(os, "setpriority"):  # set from here (no preexec_fn in a threaded process), before it spawns
                os.setpriority(os.PRIO_PROCESS, proc.pid, NICENESS)
            _running[name] = (proc, out, err)


def whole_suite(config) -> bool:
    """Whether pytest runs the whole suite as the README's command does: its test paths, no test named, no
    ``-k``/``-m``/``--lf``/``--deselect``, not only collecting. Then the checks start before the collection
    (``start_all``), which takes a core for 15 to 25 seconds while the other has nothing to do."""
    import pytest

    return (config.args_source != pytest.Config.ArgsSource.ARGS and not config.option.keyword
            and not config.option.markexpr and not config.getoption("lf", False)
            and not config.getoption("deselect", None) and not config.option.collectonly)


def start_all() -> None:
    """Start every check (``only`` then stops those whose test the collection left out)."""
    start({test for test, _ in CHECKS.values()})


def only(selected: set[str]) -> None:
    """Stop the running checks whose test is not among the ``selected`` test ids."""
    for name in [name for name in _running if CHECKS[name][0] not in selected]:
        _stop(*_running.pop(name))


def waiting_last(items: list) -> list:
    """``items`` (pytest's) with the tests that wait for a check moved to the end, in their order: the checks then
    have the whole run to finish beside the other tests."""
    waiting = {test for test, _ in CHECKS.values()}
    return [i for i in items if i.nodeid not in waiting] + [i for i in items if i.nodeid in waiting]


def result(name: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    """The finished check ``name`` (started now, when the session did not start it)."""
    if name not in _running:
        start({CHECKS[name][0]})
    proc, out, err = _running.pop(name)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, *map(_read_and_close, (out, err)))


def _read_and_close(file: IO[str]) -> str:
    file.seek(0)
    text = file.read()
    file.close()
    return text


def stop_all() -> None:
    """Kill the checks nobody waited for (their test was deselected or the session was interrupted)."""
    for running in _running.values():
        _stop(*running)
    _running.clear()


def _stop(proc: subprocess.Popen, out: IO[str], err: IO[str]) -> None:
    proc.kill()
    proc.wait()
    out.close()
    err.close()
