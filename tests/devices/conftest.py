"""Fixtures of the device tests: the OpenCL CPU device at each kernel target and the host session beside it."""
from __future__ import annotations

import pytest

from rlx_gpu.conformance.devices import find, open_device
from rlx_gpu.launches.limits import TARGETS
from rlx_gpu.runtime.registry import open_session, status
from support.opencl_cpu import OPENCL_CPU


@pytest.fixture(scope="module", params=TARGETS)
def cpu_session(request):
    """The OpenCL CPU device opened at each kernel target."""
    return open_device(find(OPENCL_CPU[0]), request.param)


@pytest.fixture(scope="module")
def host():
    return open_session(status("host").devices[0])
