"""What a call costs on OpenCL. An OpenCL CPU device's buffers are host memory (fine-grained SVM) that
the host writes and reads in place: a decode step through a ``CallPlan`` is its launches and one wait,
no copy command, and gives bit for bit what the same device gives through ``cl.Buffer`` objects and
copy commands (the path of GPUs and of Oclgrind, whose memory is the simulator's). The launches of a
resident arena keep their kernel arguments set from call to call. On PoCL's threaded driver the wait polls the
launch before it sleeps, with the same results as a wait that sleeps at once."""
from __future__ import annotations

import numpy as np
import pytest

opencl = pytest.importorskip("rlx_gpu.backends.opencl")
from rlx_gpu.backends.core import KernelSession  # noqa: E402
from rlx_gpu.conformance.devices import find  # noqa: E402
from rlx_gpu.runtime.call_plan import CallPlan  # noqa: E402
from rlx_gpu.runtime.config import Config  # noqa: E402
from rlx_gpu.runtime.executor import Device  # noqa: E402
from rlx_gpu.runtime.registry import status  # noqa: E402
from support.call_plan_schedules import mamba2_inputs, named  # noqa: E402
from support.conformance_devices import SPECS  # noqa: E402

#: every OpenCL device under test but a simulator (PoCL and Intel's CPU runtime here)
CPU_DEVICES = [s for s in SPECS if s.split(":")[0] == "opencl" and not find(s).details.get("simulator")]
pytestmark = pytest.mark.skipif(not CPU_DEVICES, reason=f"no OpenCL CPU device among {SPECS}: {status('opencl').reason}")
#: one token of a Mamba-2 decode: the state carried in place, every per-head field
STEP = dict(batch=1, seq=1, heads=2, head_dim=8, state_size=16, dt_bias=True, dt_softplus=True, d=True, z=True,
            carry_state=True, state=True)


def _inputs(sched, seed: int) -> dict[str, np.ndarray]:
    """A step's inputs (no cu_seqlens: one row of one token)."""
    values = mamba2_inputs(sched, seed)
    del values["cu_seqlens"]
    return values


def _counting(monkeypatch, prims) -> dict[str, int]:
    """Counts from now on of pyopencl's copy, map and fill commands, kernel launches, event waits and queue
    finishes, and of the primitives' writes and reads (on shared memory host copies into and out of a buffer)."""
    counts = {"copy": 0, "map": 0, "fill": 0, "launch": 0, "wait": 0, "finish": 0, "write": 0, "read": 0}
    cl = prims.cl
    for owner, name, key in ((cl, "enqueue_copy", "copy"), (cl, "enqueue_map_buffer", "map"),
                             (cl, "enqueue_fill_buffer", "fill"), (cl, "enqueue_nd_range_kernel", "launch"),
                             (cl.Event, "wait", "wait"), (cl.CommandQueue, "finish", "finish"),
                             (prims, "write", "write"), (prims, "read", "read")):
        real = getattr(owner, name)

        def counted(*args, real=real, key=key, **kwargs):
            counts[key] += 1
            return real(*args, **kwargs)
        monkeypatch.setattr(owner, name, counted)
    return counts


@pytest.fixture(scope="module", params=CPU_DEVICES)
def spec_and_session(request):
    """Each OpenCL CPU device and one session on it (its own context, so its programs are built once for the
    module's tests: on Intel's runtime a build takes seconds)."""
    return request.param, KernelSession(opencl.OpenCLPrimitives(find(request.param)))


def test_a_decode_step_on_a_cpu_device_is_its_launch_and_no_copy_command(spec_and_session, monkeypatch):
    spec, shared = spec_and_session
    info = find(spec)
    if not shared.shared:
        pytest.skip(f"{info.name} offers no fine-grained buffer SVM on host-unified memory")
    buffers = KernelSession(opencl.OpenCLPrimitives(info, shared=False))
    assert not buffers.shared
    sched = named("mamba2", "f32", **STEP)
    config = Config(fallback="forbid")
    with CallPlan(sched, Device(shared, config)) as in_place, CallPlan(sched, Device(buffers, config)) as copied:
        state = None
        for plan in (in_place, copied):  # the first call allocates the arena: an upload of its own
            plan(_inputs(sched, 9))
        for seed in range(3):
            values = _inputs(sched, seed)
            if state is not None:
                values["state"] = state
            want = copied(values)
            assert copied.last_report.copies == 2  # the inputs in one copy, state and dst out in another
            counts = _counting(monkeypatch, shared.prims)
            got = in_place(values)
            monkeypatch.undo()
            # the inputs written and the outputs read in place, in the arena: no copy through a staging buffer;
            # one wait, for the launch's event (no clFinish)
            assert counts == {"copy": 0, "map": 0, "fill": 0, "launch": 1, "wait": 1, "finish": 0, "write": 0,
                              "read": 0}
            assert in_place.last_report.copies == 0
            for name in ("state", "dst"):
                np.testing.assert_array_equal(got[name], want[name])
            state = got["state"]
        assert np.abs(state).max() > 0


def test_a_simulator_s_buffers_stay_its_own():
    """Oclgrind's memory is the simulator's (its checks cover every copy), so its buffers stay ``cl.Buffer``."""
    simulators = [d for d in status("opencl").devices if d.details.get("simulator")]
    if not simulators:
        pytest.skip("no OpenCL simulator here")
    for info in simulators:
        prims = opencl.OpenCLPrimitives(info)
        assert not prims.shared and not opencl.shares_host_memory(prims.cl, prims.device)


def test_the_launches_of_a_resident_arena_keep_their_arguments_set(spec_and_session, monkeypatch):
    """pyopencl sets a kernel's arguments through ``Kernel._set_arg_multi``: once for the first call of a plan
    (and again where another arena's launch of the same kernel set others in between), not on every call."""
    device = Device(spec_and_session[1], Config(fallback="forbid"))
    sched = named("mamba2", "f32", **STEP)
    values = _inputs(sched, 0)
    cl = device.session.prims.cl
    sets = []
    real = cl.Kernel._set_arg_multi
    monkeypatch.setattr(cl.Kernel, "_set_arg_multi", lambda self, *args: (sets.append(1), real(self, *args))[1])
    with CallPlan(sched, device) as one, CallPlan(sched, device) as other:
        first = one(values)
        assert sets and one.last_report.records[0].op == "mamba2"
        sets.clear()
        for _ in range(3):
            one(values)
        assert sets == []
        np.testing.assert_array_equal(other(values)["dst"], first["dst"])  # its own arena: set again
        assert sets
        sets.clear()
        again = one(values)  # the kernel holds the other arena's arguments: set back
        assert sets
        np.testing.assert_array_equal(again["state"], other(values)["state"])  # the same inputs, state included


def test_a_wait_polls_the_launch_on_pocl_s_threaded_driver_alone():
    """Polling (``polls_launches``) is chosen by the device: PoCL's ``pthread-`` devices, not Intel's runtime (its
    own threads spin), not Oclgrind, not a GPU, not PoCL's ``basic`` driver (it runs a launch in the
    thread that enqueues it)."""
    listed = status("opencl").devices
    for info in listed:
        prims = opencl.OpenCLPrimitives(info)
        platform, name = info.details["platform"], prims.device.name
        assert prims.polls == (platform == "Portable Computing Language" and name.startswith("pthread")), info
        if "Intel" in platform or info.details.get("simulator"):
            assert not prims.polls

    class Device:  # the properties polls_launches reads, of a device that is not a threaded PoCL CPU device
        def __init__(self, kind: int, platform: str, name: str):
            self.type, self.name = kind, name
            self.platform = type("Platform", (), {"name": platform})()

    cl = opencl._cl()
    assert opencl.polls_launches(cl, Device(cl.device_type.CPU, opencl.POCL, "pthread-znver5"))
    assert not opencl.polls_launches(cl, Device(cl.device_type.GPU, opencl.POCL, "pthread-like GPU"))
    assert not opencl.polls_launches(cl, Device(cl.device_type.CPU, opencl.POCL, "basic-znver5"))
    assert not opencl.polls_launches(cl, Device(cl.device_type.CPU, "Intel(R) OpenCL", "pthread"))


class _Event:
    """An event whose status info runs through ``statuses`` (then stays at the last), counting the looks."""

    def __init__(self, *statuses: int):
        self.statuses, self.looks = list(statuses), 0

    def get_info(self, what):
        assert what == "status"
        self.looks += 1
        return self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]


def test_settle_polls_until_the_launch_completes_fails_or_the_time_is_up():
    done = _Event(3, 2, 1, 1, 0)  # queued, submitted, running, complete
    opencl.settle(done, "status", seconds=60)
    assert done.looks == 5
    failed = _Event(-5)  # an error status: the caller's wait raises it
    opencl.settle(failed, "status", seconds=60)
    assert failed.looks == 1
    stuck = _Event(1)  # still running after the time: the caller's wait sleeps for it
    opencl.settle(stuck, "status", seconds=1e-3)
    assert stuck.looks > 1


def test_a_polled_wait_gives_what_a_sleeping_wait_gives(spec_and_session):
    """On every OpenCL CPU device (polling forced on where the device does not choose it, and off), the steps of
    a decode loop give the same bits and the state carried in the arena matches from step to step."""
    spec, session = spec_and_session
    sched = named("mamba2", "f32", **STEP)
    config = Config(fallback="forbid")
    chosen = session.prims.polls
    other = KernelSession(opencl.OpenCLPrimitives(find(spec)))
    other.prims.polls = not chosen
    with CallPlan(sched, Device(session, config)) as mine, CallPlan(sched, Device(other, config)) as theirs:
        state = {}
        for seed in range(4):
            values = {**_inputs(sched, seed), **state}
            got, want = mine(values), theirs(values)
            for name in ("state", "dst"):
                np.testing.assert_array_equal(got[name], want[name])
            state = {"state": got["state"]}
        assert np.abs(got["state"]).max() > 0
