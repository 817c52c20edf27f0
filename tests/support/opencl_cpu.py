"""The OpenCL CPU device the device tests of a family run their cases on (``tests/devices/conftest.py`` opens it at
each kernel target), and the mark that skips them, saying why, where none runs."""
from __future__ import annotations

import numpy as np
import pytest

from rlx_gpu.conformance import runner
from rlx_gpu.conformance.catalog import Case
from rlx_gpu.runtime.config import default_config_path, load_config
from rlx_gpu.runtime.registry import status

#: the first OpenCL CPU implementation that runs here (PoCL, or Intel's runtime where PoCL cannot build)
OPENCL_CPU = [i.spec for i in status("opencl").devices if not i.details["simulator"]][:1]

needs_opencl_cpu = pytest.mark.skipif(not OPENCL_CPU, reason=f"no OpenCL CPU device: {status('opencl').reason}")


def passes_and_runs_the_same_bytes_twice(session, host, case: Case) -> tuple[np.ndarray, np.ndarray]:
    """``case`` passes its conformance check on ``session`` (the float64 reference, the ``host``) and two runs
    give the same bytes; returns the arena as laid out and as run."""
    outcome = runner.check(session, case, load_config(default_config_path()), host)
    assert outcome.status == "pass", outcome.message
    laid = runner.lay_out(case)
    runs = []
    for _ in range(2):
        arena = session.upload(laid.arena)
        session.launch(laid.thunk, arena)
        runs.append(session.read(arena, 0, laid.arena.size))
    assert np.array_equal(runs[0], runs[1]), f"{case.op} at the {session.limits.target} target: two runs differ"
    return laid.arena, runs[0]
