"""Oclgrind in CI: the OpenCL conformance cases at small shapes under Oclgrind's checkers must log nothing,
and a deliberately broken kernel must be caught (so a clean log means something)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parent.parent / "tools" / "oclgrind_check.py"


def _oclgrind_available() -> bool:
    from rlx_gpu.runtime.registry import status

    return any(d.details.get("platform") == "Oclgrind" for d in status("opencl").devices)


pytestmark = pytest.mark.skipif(not _oclgrind_available(), reason="no Oclgrind OpenCL platform (pip install .[test])")


def test_conformance_cases_are_clean_under_oclgrind():
    done = subprocess.run([sys.executable, str(TOOL)], capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "Oclgrind: no diagnostics" in done.stdout


def test_an_off_by_one_write_is_caught():
    done = subprocess.run([sys.executable, str(TOOL), "--demo-broken"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "Invalid write" in done.stdout + done.stderr
