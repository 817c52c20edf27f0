"""``HostCall``: a host call plan called by a caller that writes the inputs into their arena places itself (the
torch hot paths'). Its calls must be the plan's own calls: the same outputs as ``CallPlan.call`` on the same
values, a stamped input written only when its stamp changed (the plan's stamps, which both ways of calling
share), and a freed plan refused."""
from __future__ import annotations

import numpy as np
import pytest

import rlx_gpu
from rlx_gpu.errors import RlxError
from rlx_gpu.runtime.call_plan import CallPlan
from rlx_gpu.runtime.host_call import HostCall, places

N = 16


def _scale() -> rlx_gpu.Schedule:
    """``y = x * w`` over N f32 values, x, w and y side by side."""
    return rlx_gpu.load_schedule({
        "abi": "rlx-thunks/1", "arena_bytes": 512, "inputs": ["x", "w"], "outputs": ["y"], "init": [],
        "tensors": {name: {"offset": offset, "dtype": "f32", "shape": [N]} for name, offset in
                    {"x": 0, "w": 64, "y": 128}.items()},
        "thunks": [{"op": "binary", "dtype": "f32", "fn": "mul", "shape": [N], "a_strides": [1], "b_strides": [1],
                    "a": 0, "b": 64, "dst": 128}]})


def _writer(place: np.ndarray, log: list[str], name: str, of=lambda arg: arg):
    """A writer of ``place`` from ``of(arg)``, noting ``name`` in ``log`` on each write."""
    def put(arg) -> None:
        log.append(name)
        place[...] = of(arg)
    return put


def test_a_host_call_writes_through_the_callers_writers_and_keeps_the_plans_stamps():
    x, w = np.arange(N, dtype=np.float32), np.full(N, 2, np.float32)
    with CallPlan(_scale(), rlx_gpu.get_device("host")) as plan:
        assert places(plan) is None  # not called yet: no arena to write
        plan({"x": x, "w": w})
        arena, log = places(plan), []
        call = HostCall(plan, [(0, _writer(arena["x"], log, "x"))],
                        [("w", 1, _writer(arena["w"], log, "w", lambda pair: pair[0]), lambda pair: pair[1])], (), {}, [0])
        y, = call((x, (w, "v1")))
        np.testing.assert_array_equal(y, 2 * x)
        assert log == ["x", "w"]  # the plan's own call gave w no stamp: written
        w2 = np.full(N, 5, np.float32)
        y, = call((x + 1, (w2, "v1")))  # the same stamp: w is not written again
        np.testing.assert_array_equal(y, 2 * (x + 1))
        assert log == ["x", "w", "x"]
        y, = call((x, (w2, "v2")))  # a new stamp: written
        np.testing.assert_array_equal(y, 5 * x)
        assert not np.shares_memory(y, plan._arena.handle)  # a new array of the caller's
        # the plan's own call sees the stamp the host call recorded, and the host call the plan's
        np.testing.assert_array_equal(plan({"x": x}, {"w": "v2"})["y"], 5 * x)
        plan({"x": x, "w": np.full(N, 3, np.float32)}, {"w": "v3"})
        y, = call((x, (w2, "v3")))
        np.testing.assert_array_equal(y, 3 * x)  # v3 is what the plan's call wrote: not written again
    with pytest.raises(RlxError, match="freed"):
        call((x, (w, "v4")))


def test_a_host_call_is_a_host_plans():
    x = np.ones(N, np.float32)
    with CallPlan(_scale(), rlx_gpu.get_device("host")) as plan:
        with pytest.raises(RlxError, match="HostCall binds a plan whose arena is host memory"):
            HostCall(plan, [], [], (), {}, [0])
        plan({"x": x, "w": x})
        HostCall(plan, [], [], (), {}, [0])


def _shared_device():
    """An OpenCL CPU device whose arena is host memory (``Session.shared``: PoCL, Intel's CPU runtime)."""
    from rlx_gpu.runtime.registry import status
    for info in status("opencl").devices if status("opencl").available else ():
        if info.cpu and not info.details.get("simulator") and "unusable" not in info.details:
            device = rlx_gpu.get_device(info.spec)
            if device.session.shared:
                return device
    pytest.fail("no OpenCL CPU device of shared memory (PoCL or Intel's CPU runtime) to run on")


def test_a_host_call_on_a_device_of_shared_memory_waits_writes_and_notes_what_it_wrote():
    """On an OpenCL CPU device whose arena is host memory the caller's writers write the arena in place (after the
    launches before are done), and a write marks kept scratch staged from those bytes stale; an unchanged stamp
    writes nothing and marks nothing."""
    from rlx_gpu.backends.core import KeptScratch
    x, w = np.arange(N, dtype=np.float32), np.full(N, 2, np.float32)
    with CallPlan(_scale(), _shared_device()) as plan:
        plan({"x": x, "w": w})
        arena, log = places(plan, shared=True), []
        assert places(plan) is None  # without ``shared``: the host's plans only
        w_writer = _writer(arena["w"], log, "w", lambda pair: pair[0])
        call = HostCall(plan, [(0, _writer(arena["x"], log, "x"))], [("w", 1, w_writer, lambda pair: pair[1])], (),
                        {}, [0])
        y, = call((x, (w, "v1")))  # the plan's own call gave w no stamp: written
        np.testing.assert_array_equal(y, 2 * x)
        kept = plan._arena.handle.kept
        reads_x, reads_w = KeptScratch(None, ((0, 64),), True), KeptScratch(None, ((64, 64),), True)
        kept.update({"x": reads_x, "w": reads_w})
        try:
            for step in range(1, 3):
                y, = call((x + step, (w, "v1")))
                np.testing.assert_array_equal(y, 2 * (x + step))
            assert log == ["x", "w", "x", "x"] and not reads_x.fresh and reads_w.fresh
        finally:
            kept.clear()
