"""The OpenCL CPU device the device tests of a family run their cases on (``tests/devices/conftest.py`` opens it at
each kernel target), and the mark that skips them, saying why, where none runs."""
from __future__ import annotations

import pytest

from rlx_gpu.runtime.registry import status

#: the first OpenCL CPU implementation that runs here (PoCL, or Intel's runtime where PoCL cannot build)
OPENCL_CPU = [i.spec for i in status("opencl").devices if not i.details["simulator"]][:1]

needs_opencl_cpu = pytest.mark.skipif(not OPENCL_CPU, reason=f"no OpenCL CPU device: {status('opencl').reason}")

