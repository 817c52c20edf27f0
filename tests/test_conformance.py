"""The conformance suite (``rlx_gpu.conformance``) on every device, one harness for all backends.

Every case of ``catalog.cases()`` runs on every device with guard bytes around every tensor, against a
float64 reference written from ABI.md and against ``host_fallback`` (NaN/Inf positions and NMSE bounds of
``configs/default.yaml``). Devices: ``RLX_TEST_DEVICES`` (comma-separated specs, e.g.
``host,opencl:0:0``); unset, the host and every available device but simulators (CUDA joins when its
backend reports a device). A device named there but absent fails every test, with the list of devices.
Kernel backends run at both targets: their own and the other one forced through ``RLX_TARGET`` (the gpu
kernel shapes on PoCL).
"""
from __future__ import annotations

import os

import pytest

from rlx_gpu.conformance import catalog, devices, runner
from rlx_gpu.runtime.config import default_config_path, load_config
from rlx_gpu.launches.limits import TARGETS
from rlx_gpu.runtime.registry import open_session, status

CONFIG = load_config(default_config_path())
CASES = catalog.cases()
SPECS = [s.strip() for s in os.environ.get(devices.ENV, "").split(",") if s.strip()] or \
    [info.spec for info in devices.default_devices()]


DEVICES = [(spec, None) if spec.split(":")[0] == "host" else (spec, target) for spec in SPECS for target in TARGETS]
DEVICES = list(dict.fromkeys(DEVICES))


@pytest.fixture(scope="module", params=DEVICES, ids=lambda d: d[0] if d[1] is None else f"{d[0]}@{d[1]}")
def session(request):
    spec, target = request.param
    return devices.open_device(devices.find(spec), target)  # an absent device raises here: its tests fail


@pytest.fixture(scope="module")
def host():
    return open_session(status("host").devices[0])


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_case(session, host, case):
    outcome = runner.check(session, case, CONFIG, None if session.info.backend == "host" else host)
    if outcome.status == "skip":
        pytest.skip(outcome.message)
    assert outcome.status == "pass", f"{session.info.spec} {case.id}: {outcome.message}"


def test_every_op_and_dtype_has_cases():
    from rlx_gpu.schedule.ops import DTYPES, SPECS as OPS

    covered = {(c.op, c.dtype) for c in CASES}
    assert covered == {(op, dt) for op in OPS for dt in DTYPES}
    assert {c.id for c in CASES}.__len__() == len(CASES)  # ids are unique
