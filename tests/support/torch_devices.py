"""Fixtures of the rlx_gpu.torch tests: the default device CPU tensors run on (``RLX_DEVICE``)."""
from __future__ import annotations

import pytest

from rlx_gpu.runtime.registry import status


@pytest.fixture(params=["host", "opencl"])
def device(request, monkeypatch):
    """Each test once on the host and once on OpenCL (a missing OpenCL platform fails, never skips)."""
    if request.param == "opencl" and not status("opencl").available:
        pytest.fail(f"OpenCL is unavailable: {status('opencl').reason}")
    monkeypatch.setenv("RLX_DEVICE", request.param)
    return request.param


@pytest.fixture
def host(monkeypatch):
    monkeypatch.setenv("RLX_DEVICE", "host")
