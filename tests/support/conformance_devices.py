"""The devices the device tests run on: ``RLX_TEST_DEVICES`` (comma-separated specs, e.g.
``host,opencl:0:0``), or, unset, the host and every available device but simulators (one per OpenCL
implementation); and which of them
run every case and which only the representative ones."""
from __future__ import annotations

import functools
import os

from rlx_gpu.conformance import devices



def _one_per_implementation() -> list[str]:
    """The default devices, one per OpenCL implementation: a second build of the same one (pyopencl's bundled
    PoCL beside Debian's, where both build here) compiles the same text with the same compiler family, so
    it would only run every case twice; the first one listed stands for both."""
    seen, out = set(), []
    for info in devices.default_devices():
        platform = info.details.get("platform")
        if platform is not None and platform in seen:
            continue
        seen.add(platform)
        out.append(info.spec)
    return out


SPECS = [s.strip() for s in os.environ.get(devices.ENV, "").split(",") if s.strip()] or _one_per_implementation()


def is_second(spec: str) -> bool:
    """A runtime rlx_gpu registered itself (Intel's OpenCL CPU runtime): a second compiler of the same text,
    two seconds a program build, so it runs the representative f32 cases rather than every case."""
    try:
        return bool(devices.find(spec).details.get("registered_by_rlx_gpu"))
    except Exception:  # an absent device: test_conformance's test_case reports it
        return False


#: The OpenCL devices the per-kernel test files run on: every one but a runtime rlx_gpu registered itself
#: (covered by test_conformance's representative cases, the build check and the fuzz profile), which stands
#: in only where no other OpenCL device is tested.
KERNEL_OPENCL = [s for s in SPECS if s.split(":")[0] == "opencl" and not is_second(s)] or \
    [s for s in SPECS if s.split(":")[0] == "opencl"][:1]


@functools.lru_cache(maxsize=None)
def opened(spec: str, target: str):
    """The test process's one session on device ``spec`` at kernel ``target``: a session builds its programs in a
    context of its own, so the test files that run on a runtime slow to build (Intel's, seconds a program) share
    its builds. An absent device raises here."""
    return devices.open_device(devices.find(spec), target)
