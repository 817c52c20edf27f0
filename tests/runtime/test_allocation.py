"""Every allocation failure on every device is a DeviceError naming the size, the device and what was
being allocated: real failures under an address-space limit (a subprocess with ``RLIMIT_AS``) and
pyopencl's out-of-memory errors as the OpenCL runtime raises them.

A session's test arena is 3 GiB, or the device's largest allocation where that is smaller (PoCL reports
a fraction of the machine's memory): either way more than the 1 GiB the address-space cap leaves, so the
allocation itself fails rather than the session's size check."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from rlx_gpu.errors import DeviceError
from rlx_gpu.runtime.registry import open_session, status
from rlx_gpu.units import human_bytes

resource = pytest.importorskip("resource", reason="RLIMIT_AS is POSIX")
needs_opencl = pytest.mark.skipif(not status("opencl").available, reason="no OpenCL platform (pip install .[opencl])")

#: Runs in a fresh interpreter: open the devices, cap the address space 1 GiB above what is mapped,
#: then print one line per attempt: the error's class and message.
UNDER_LIMIT = textwrap.dedent("""
    import os, resource, sys
    import rlx_gpu
    from rlx_gpu.runtime.registry import open_session, status
    sessions = {{name: open_session(status(name).devices[0]) for name in {names!r}}}
    mapped = int(open(f"/proc/{{os.getpid()}}/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (mapped + (1 << 30), resource.getrlimit(resource.RLIMIT_AS)[1]))
    fill = {{"op": "fill", "dtype": "f32", "dst": 0, "n": 4, "value": 1.0}}
    body = {{"arena_bytes": 3 << 30, "thunks": [fill]}}
    scan = {{"op": "scan", "dtype": "f32", "body": body, "body_input_off": 0, "body_output_off": 0,
            "outer_init_off": 0, "outer_final_off": 0, "length": 1, "carry_bytes": 16, "save_trajectory": False,
            "xs_inputs": [], "bcast_inputs": [], "num_checkpoints": 0}}
    attempts = {{
        "host arena": lambda: rlx_gpu.get_device("host").run({{"abi": "rlx-thunks/1", "arena_bytes": 8 << 30,
                                                              "thunks": [fill]}}),
        "host body arena": lambda: rlx_gpu.get_device("host").run({{"abi": "rlx-thunks/1", "arena_bytes": 64,
                                                                   "thunks": [scan]}}),
        "session arena": lambda: [s.alloc(min(3 << 30, s.info.details.get("max_alloc_bytes", 3 << 30)),
                                          "a test arena") for s in sessions.values()],
    }}
    for s in sessions.values():  # PoCL's largest allocation follows the memory free when it is asked
        print("session size", "|", min(3 << 30, s.info.details.get("max_alloc_bytes", 3 << 30)))
    for label, attempt in attempts.items():
        try:
            attempt()
            print(label, "|", "no error")
        except Exception as err:
            print(label, "|", type(err).__name__, "|", err)
""")


def _under_limit(*backends: str) -> dict[str, str]:
    code = UNDER_LIMIT.format(names=list(backends))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return dict(line.split(" | ", 1) for line in done.stdout.splitlines())


def test_an_allocation_beyond_the_address_space_limit_is_a_device_error_on_the_host():
    out = _under_limit("host")
    assert out["host arena"].startswith("DeviceError | could not allocate 8.0 GiB (8589934592 bytes) for the "
                                        "arena of this schedule (arena_bytes) on the host"), out
    assert out["host body arena"].startswith("DeviceError | could not allocate 3.0 GiB (3221225472 bytes) for the "
                                             "scratch and body arenas of thunk 0 (scan) on host"), out
    assert out["session arena"].startswith("DeviceError | could not allocate 3.0 GiB (3221225472 bytes) for a "
                                           "test arena on host"), out


@needs_opencl
def test_an_allocation_beyond_the_address_space_limit_is_a_device_error_on_opencl():
    out = _under_limit("opencl")
    device = status("opencl").devices[0]
    size = int(out["session size"])  # the child's: PoCL's largest allocation follows the memory free then
    assert size > 1 << 30, f"{device.name} allows allocations of at most {size} bytes: too small for this test"
    assert out["session arena"].startswith(f"DeviceError | could not allocate {human_bytes(size)} ({size} bytes) "
                                           "for a test arena on "), out
    assert f"({device.spec})" in out["session arena"]


@needs_opencl
@pytest.mark.parametrize("kind", ["MemoryError", "LogicError", "RuntimeError"])
def test_pyopencls_out_of_memory_errors_are_device_errors(monkeypatch, kind):
    import pyopencl as cl
    from pyopencl import _cl

    session = open_session(status("opencl").devices[0])
    record = _cl._ErrorRecord(msg="clCreateBuffer failed: MEM_OBJECT_ALLOCATION_FAILURE",
                              code=cl.status_code.MEM_OBJECT_ALLOCATION_FAILURE, routine="clCreateBuffer")

    def refuse(*args, **kwargs):
        raise getattr(cl, kind)(record)
    monkeypatch.setattr(cl, "Buffer", refuse)  # a device with memory of its own
    monkeypatch.setattr(cl, "svm_empty", refuse)  # a CPU device's shared memory (fine-grained SVM)
    with pytest.raises(DeviceError, match=r"could not allocate 1\.5 KiB \(1536 bytes\) for a scan body arena on "
                                          r".*\(opencl:.*MEM_OBJECT_ALLOCATION_FAILURE") as caught:
        session.alloc(1536, "a scan body arena")
    assert isinstance(caught.value.__cause__, MemoryError)


@needs_opencl
def test_other_opencl_errors_pass_unchanged(monkeypatch):
    import pyopencl as cl
    from pyopencl import _cl

    session = open_session(status("opencl").devices[0])
    record = _cl._ErrorRecord(msg="clCreateBuffer failed: INVALID_VALUE", code=cl.status_code.INVALID_VALUE,
                              routine="clCreateBuffer")

    def refuse(*args, **kwargs):
        raise cl.LogicError(record)
    monkeypatch.setattr(cl, "Buffer", refuse)
    monkeypatch.setattr(cl, "svm_empty", refuse)
    with pytest.raises(cl.LogicError, match="INVALID_VALUE"):
        session.alloc(64)
    np.testing.assert_array_equal(open_session(status("host").devices[0]).alloc(4), np.zeros(4, np.uint8))
