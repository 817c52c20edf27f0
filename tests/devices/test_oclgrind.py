"""Oclgrind in CI: a representative case of every kernel variant at small shapes under Oclgrind's checkers
must log nothing, and a deliberately broken kernel must be caught (so a clean log means something).
``python tools/oclgrind_check.py --full`` runs every quick case, for a change to the kernel text."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

from support import background
import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "oclgrind_check.py"


def _oclgrind_available() -> bool:
    from rlx_gpu.runtime.registry import status

    return any(d.details.get("platform") == "Oclgrind" for d in status("opencl").devices)


pytestmark = pytest.mark.skipif(not _oclgrind_available(), reason="no Oclgrind OpenCL platform (pip install .[test])")


def test_conformance_cases_are_clean_under_oclgrind():
    for target in background.OCLGRIND_TARGETS:
        done = background.result(f"oclgrind-{target}")  # started with the session, beside the other tests
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        assert f"{target} target, representative cases" in done.stdout and "Oclgrind: no diagnostics" in done.stdout
        # every case ran, and passed
        count = re.search(r"representative cases of \d+: (\d+) case\(s\)", done.stdout)
        ran = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("pass ")]
        assert count and len(ran) == len(set(ran)) == int(count.group(1)), done.stdout[-4000:]


def test_an_off_by_one_write_is_caught():
    done = subprocess.run([sys.executable, str(TOOL), "--demo-broken"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "Invalid write" in done.stdout + done.stderr


def test_the_representative_cases_launch_every_kernel_variant_the_quick_cases_launch():
    from host_fallback.abi import SCAN_OPS
    from rlx_gpu.conformance import catalog
    from rlx_gpu.conformance.representative import plans, representative
    from rlx_gpu.launches import PLANNERS
    from rlx_gpu.launches.limits import TARGETS

    spec = importlib.util.spec_from_file_location("oclgrind_check", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    quick = catalog.cases(quick=True)
    for target in TARGETS:
        planned = plans(tool.oclgrind_spec(), target, quick)
        chosen = representative(planned, [c.dtype for c in quick], target)
        every = set().union(*(kernels for kernels, _, _ in planned))
        assert set().union(*(planned[i][0] for i in chosen)) == every
        for i in chosen:  # none is there for variants the others launch too
            assert planned[i][0] - set().union(*(planned[j][0] for j in chosen if j != i)), (target, quick[i].id)
        assert {quick[i].op for i in chosen} == {c.op for c in quick if c.op in PLANNERS or c.op in SCAN_OPS}
        assert len(chosen) < len(quick) / 4, f"{target}: {len(chosen)} of {len(quick)} cases"
