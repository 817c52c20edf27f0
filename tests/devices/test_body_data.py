"""ABI.md §8's run-time data inside scan bodies: a version-2 thunk in a body is refused with a RunError
naming the scan, the body thunk, the field, the index and the value, on the host and on every OpenCL
device the suite tests; data the scan's inputs give is checked before the scan writes anything."""
from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import host_fallback
import rlx_gpu
from host_fallback.abi import runtime_data
from rlx_gpu.conformance import devices
from rlx_gpu.conformance.cases import lay_out
from rlx_gpu.conformance.fuzz import _nest
from rlx_gpu.runtime.config import Config
from support.body_data_cases import BAD, IDS, SLOTS, body_data_case

ROOT = Path(__file__).resolve().parents[2]
#: The OpenCL devices here (PoCL and Oclgrind): body thunks run through the device's scan memory.
#: every OpenCL device, Oclgrind included, but a runtime rlx_gpu registered itself where another one runs
#: (Intel's: its builds take seconds a program; it samples run-time data through the fuzz profile)
_EVERY_OPENCL = [info for info in devices.every_device() if info.backend == "opencl"]
OPENCL = [info.spec for info in _EVERY_OPENCL if not info.details.get("registered_by_rlx_gpu")] or \
    [info.spec for info in _EVERY_OPENCL][:1]
DEVICES = ["host"] + OPENCL


def _message(scan_op: str, body: str, index: int, op: str, field: str, at: int, value: int, step: int | None) -> str:
    step_text = "" if step is None else f" at step {step}"
    return (rf"thunk 0 \({scan_op}\), field '{body}' → thunk {index} \({op}\){step_text}, "
            rf"field '{field}'\[{at}\] = {value}:")


@pytest.fixture(scope="module", params=DEVICES)
def device(request):
    return rlx_gpu.get_device(request.param, Config(fallback="allow"))


@pytest.mark.parametrize("op,params,bad,field,at,value", BAD, ids=IDS)
@pytest.mark.parametrize("scan_op", ["scan", "scan_backward_xs"])
def test_given_data_is_refused_before_the_scan_writes_anything(device, scan_op, op, params, bad, field, at, value):
    """Bad values in the body's init, or in the last row of an xs input: refused before the first step,
    the scan's outputs (trajectory, final carry, dxs) and the rest of a resident arena unchanged."""
    good = params[field]
    body = "body" if scan_op == "scan" else "body_vjp"
    for feed, rows, step in (("init", [bad], None), ("xs", [good, good, bad], 2)):
        sched, arena = body_data_case(scan_op, op, params, feed, rows)
        with pytest.raises(rlx_gpu.RunError, match=_message(scan_op, body, 1, op, field, at, value, step)):
            device.run(sched, arena)
        resident = device.arena(sched)
        device.session.write(resident.handle, 0, arena)
        with pytest.raises(rlx_gpu.RunError):
            device.run(sched, resident)
        assert np.array_equal(device.session.read(resident.handle, 0, arena.size), arena)
        resident.free()


@pytest.mark.parametrize("op,params,bad,field,at,value", BAD, ids=IDS)
def test_computed_data_is_refused_before_its_body_thunk(device, op, params, bad, field, at, value):
    """Values a body thunk copies into place at step 1, or a carry: read just before their thunk."""
    good = params[field]
    sched, arena = body_data_case("scan", op, params, "computed", [good, bad, good])
    with pytest.raises(rlx_gpu.RunError, match=_message("scan", "body", 2, op, field, at, value, 1)):
        device.run(sched, arena)
    sched, arena = body_data_case("scan", op, params, "carry", [bad])
    with pytest.raises(rlx_gpu.RunError, match=_message("scan", "body", 1, op, field, at, value, 0)):
        device.run(sched, arena)


@pytest.mark.parametrize("feed", ["init", "xs", "computed", "carry"])
def test_good_data_in_a_body_is_not_refused(device, feed):
    rows = [[2, 0, 3], [1, 3, 0], [0, 2, 1]] if feed != "carry" else [[2, 0, 3]]
    sched, arena = body_data_case("scan", "selective_scan", SLOTS, feed, rows)
    want = rlx_gpu.get_device("host").run(sched, arena)
    assert np.array_equal(device.run(sched, arena), want)


def test_a_nested_scan_names_every_level():
    sched, arena = body_data_case("scan", *BAD[0][:2], "init", [BAD[0][2]])
    nested = dict(_nest(random.Random(0), dict(sched), 2, []), abi="rlx-thunks/2")
    with pytest.raises(rlx_gpu.RunError, match=r"thunk 0 \(scan\), field 'body' → thunk 0 \(scan\) at step 0, "
                                               r"field 'body' → thunk 0 \(scan\) at step 0, field 'body' → thunk 1 "
                                               r"\(selective_scan\), field 'state_slots'\[2\] = 2147483647"):
        rlx_gpu.get_device("host").run(nested)


def test_the_host_fallback_entry_point_refuses_body_data_with_a_data_error():
    sched, arena = body_data_case("scan", *BAD[0][:2], "xs", [[0, 1, 2], BAD[0][2]])
    before = arena.copy()
    with pytest.raises(runtime_data.DataError, match=r"field 'body' → thunk 1 \(selective_scan\) at step 1, "):
        host_fallback.execute(sched["thunks"][0], arena)
    assert np.array_equal(arena, before)


_CHILD = """
import sys, numpy as np, rlx_gpu
sys.path.insert(0, "tests")
from support.body_data_cases import BAD, body_data_case
from rlx_gpu.runtime.config import Config
dev = rlx_gpu.get_device(sys.argv[1], Config(fallback="allow"))
for op, params, bad, field, at, value in BAD:
    sched, arena = body_data_case("scan", op, params, "init", [bad])
    try:
        dev.run(sched, arena)
        print("ran", op, field)
    except rlx_gpu.RunError:
        print("refused", op, field)
"""


@pytest.mark.parametrize("spec", OPENCL)
def test_the_opencl_segfault_is_a_run_error(spec):
    """The issue's SIGSEGV (a slot index 2**31-1 reaching a kernel): in a child process, so a crash fails this test."""
    done = subprocess.run([sys.executable, "-c", _CHILD, spec], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("refused") == len(BAD), done.stdout


@pytest.mark.parametrize("spec", OPENCL)
def test_a_direct_launch_on_a_device_checks_the_data_too(spec):
    """``session.launch`` (one thunk on a device arena, as host_fallback.execute on the host) refuses first."""
    op, params, bad, field, at, value = BAD[0]
    thunk, nbytes = lay_out(op, "f32", params)
    r = next(r for r in host_fallback.regions(thunk) if r.field == field)
    arena = np.zeros(nbytes, np.uint8)
    arena[r.offset: r.offset + r.nbytes] = np.asarray(bad, "<i4").view(np.uint8)
    session = rlx_gpu.get_device(spec).session
    dev_arena = session.upload(arena)
    with pytest.raises(runtime_data.DataError, match=rf"field '{field}'\[{at}\] = {value}"):
        session.launch(thunk, dev_arena)
    assert np.array_equal(session.read(dev_arena, 0, nbytes), arena)
