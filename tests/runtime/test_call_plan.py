"""CallPlan: a schedule called repeatedly on one device gives what ``Device.run`` gives, moves only the
inputs that changed (stamps), keeps the run-time data checks, the fallback warning and thread safety,
and on a device sends its inputs in few copies; on the host, OpenCL and the NumPy double of the core."""
from __future__ import annotations

import gc
import threading
import warnings

import ml_dtypes
import numpy as np
import pytest

import rlx_gpu
from support.call_plan_schedules import mamba2_inputs, named
from support.numpy_device import open_double
from rlx_gpu.errors import InputError, RlxError, RunError
from rlx_gpu.runtime.call_plan import CallPlan
from rlx_gpu.runtime.config import Config
from rlx_gpu.runtime.executor import Device
from rlx_gpu.runtime.registry import status

N = 16
#: A Mamba-2 step of two packed sequences: every optional input, an integer tensor, the state carried in place.
MAMBA2 = dict(batch=1, seq=7, heads=2, head_dim=4, state_size=4, dt_bias=True, dt_softplus=True, d=True, z=True,
              carry_state=True, state=True, cu_seqlens=[0, 3, 7])


def _devices(*, double_fallback: str = "allow") -> list:
    devices = [pytest.param(lambda: rlx_gpu.get_device("host"), id="host")]
    if status("opencl").available:
        devices.append(pytest.param(lambda: rlx_gpu.get_device("opencl", Config(fallback="forbid")), id="opencl"))
    # the double runs none of these ops: the overrides send them to the host, copying their footprint each run
    devices.append(pytest.param(lambda: Device(open_double(), Config(fallback=double_fallback, overrides={
        "binary": "host", "mamba2": "host"})), id="double"))
    return devices


def _binary(fn: str, a: int, b: int, dst: int, tensors: dict[str, int], inputs: list[str], outputs: list[str],
            arena_bytes: int = 512) -> rlx_gpu.Schedule:
    """One elementwise ``dst = a fn b`` over N f32 values; ``tensors`` names offsets."""
    return rlx_gpu.load_schedule({
        "abi": "rlx-thunks/1", "arena_bytes": arena_bytes, "inputs": inputs, "outputs": outputs, "init": [],
        "tensors": {name: {"offset": offset, "dtype": "f32", "shape": [N]} for name, offset in tensors.items()},
        "thunks": [{"op": "binary", "dtype": "f32", "fn": fn, "shape": [N], "a_strides": [1], "b_strides": [1],
                    "a": a, "b": b, "dst": dst}]})


def _scale() -> rlx_gpu.Schedule:
    """``y = x * w`` with x, w, y side by side."""
    return _binary("mul", 0, 64, 128, {"x": 0, "w": 64, "y": 128}, ["x", "w"], ["y"])


def _counting_writes(device: Device, but: int) -> list[tuple[int, int]]:
    """The (offset, nbytes) of every host-to-device copy of the double from now on, but those at offset
    ``but`` (the binary thunk's host fallback writing its dst back)."""
    prims, copies = device.session.prims, []
    write = prims.write

    def counted(buffer: np.ndarray, offset: int, data: np.ndarray) -> None:
        if offset != but:
            copies.append((offset, data.size))
        write(buffer, offset, data)
    prims.write = counted
    return copies


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("make", _devices())
def test_a_plan_gives_what_device_run_gives_call_after_call(make, dtype):
    device = make()
    sched = named("mamba2", dtype, **MAMBA2)
    arena = sched.pristine_arena()
    storage = {"f32": np.float32, "bf16": ml_dtypes.bfloat16}[dtype]
    with CallPlan(sched, device) as plan:
        assert plan.inputs == tuple(sched.inputs) and plan.outputs == tuple(sched.outputs) == ("state", "dst")
        state, previous = None, None
        for seed in range(3):
            values = mamba2_inputs(sched, seed)  # float64: the plan rounds to nearest even as write does
            if state is not None:
                values["state"] = state  # the state the last call returned, carried
            for name, v in values.items():
                sched.tensors[name].write(arena, v)
            arena = device.run(sched, arena)
            got = plan(values)
            assert list(got) == ["state", "dst"]
            for name, out in got.items():
                assert out.dtype == storage and out.shape == sched.tensors[name].shape
                np.testing.assert_array_equal(out, sched.tensors[name].read(arena))
            assert [r.op for r in plan.last_report.records] == ["mamba2"]
            if previous is not None:  # the outputs are the caller's: the next call did not change them
                np.testing.assert_array_equal(previous[0], previous[1])
            if device.on_host:
                assert not np.shares_memory(got["dst"], plan._arena.handle)
            previous, state = (got["dst"], got["dst"].copy()), got["state"]


@pytest.mark.parametrize("make", [p for p in _devices() if p.id != "opencl"])
def test_an_unchanged_stamp_skips_the_write_and_a_new_one_writes(make):
    device = make()
    x, w = np.arange(N, dtype=np.float32), np.full(N, 2, np.float32)
    with CallPlan(_scale(), device) as plan:
        plan({"x": x, "w": w})  # the first call allocates the arena (an upload of its own)
        copies = _counting_writes(device, but=128) if not device.on_host else []
        np.testing.assert_array_equal(plan({"x": x, "w": w}, {"w": ("w", 1)})["y"], 2 * x)
        w[:] = 5  # the array behind an unchanged stamp changes: the plan keeps the value it has
        np.testing.assert_array_equal(plan({"x": x, "w": w}, {"w": ("w", 1)})["y"], 2 * x)
        np.testing.assert_array_equal(plan({"x": x}, {"w": ("w", 1)})["y"], 2 * x)  # left out: the stamp says unchanged
        np.testing.assert_array_equal(plan({"x": x, "w": w}, {"w": ("w", 2)})["y"], 5 * x)  # a new stamp: written
        if not device.on_host:  # x and w side by side: one copy when both go, x alone when w is skipped
            assert copies == [(0, 128), (0, 64), (0, 64), (0, 128)]
            assert plan.last_report.copies == 2  # the inputs in one copy, y out in another
        w[:] = 3
        np.testing.assert_array_equal(plan({"x": x, "w": w})["y"], 3 * x)  # no stamp: written, its stamp forgotten
        with pytest.raises(InputError, match=r"input 'w' is missing: an input is needed on every call until it has "
                                             r"been written with a stamp; the plan takes the inputs \['x', 'w'\]"):
            plan({"x": x}, {"w": ("w", 2)})
        plan({"x": x, "w": w}, {"w": 1})
        with pytest.raises(InputError, match=r"input 'w' is missing: its stamp 7 is not the one of its last write \(1\)"):
            plan({"x": x}, {"w": 7})
        with pytest.raises(InputError, match=r"input 'w' is missing: an input may be left out only with the stamp"):
            plan({"x": x})


@pytest.mark.parametrize("make", _devices())
def test_an_input_a_thunk_overwrites_is_written_on_every_call_whatever_its_stamp(make):
    device = make()
    acc = _binary("add", 0, 64, 0, {"acc": 0, "x": 64}, ["acc", "x"], ["acc"])  # acc += x, in place
    start, x = np.ones(N, np.float32), np.arange(N, dtype=np.float32)
    with CallPlan(acc, device) as plan:
        for _ in range(3):  # the same stamp each time, yet the caller's acc goes in again: 1 + x, not 1 + k x
            np.testing.assert_array_equal(plan({"acc": start, "x": x}, {"acc": 1, "x": 1})["acc"], start + x)
        with pytest.raises(InputError, match=r"input 'acc' is missing: a thunk of the schedule writes it"):
            plan({"x": x}, {"acc": 1, "x": 1})


def test_inputs_that_do_not_fit_are_refused_naming_them_before_anything_runs():
    device = rlx_gpu.get_device("host")
    with CallPlan(_scale(), device) as plan:
        with pytest.raises(InputError, match=r"input 'w' is missing: an input is needed on every call until it has "
                                             r"been written with a stamp"):
            plan({"x": np.zeros(N)}, {"w": 1})  # a stamp on the first call is no value
        assert device.thunks_run == 0
        with pytest.raises(InputError, match=r"input 'x' has shape \[4\], expected \[16\]"):
            plan({"x": np.zeros(4), "w": np.zeros(N)})
        with pytest.raises(InputError, match=r"the schedule has no input 'z', 'v'; its inputs are \['x', 'w'\]"):
            plan({"x": np.zeros(N), "w": np.zeros(N), "z": 1}, {"v": 1})
        assert device.thunks_run == 0
        x = np.arange(2 * N, dtype=np.float64)[::2]  # any strides, any float dtype
        np.testing.assert_array_equal(plan({"x": x, "w": np.ones(N)})["y"], x.astype(np.float32))


@pytest.mark.parametrize("make", _devices())
def test_integer_tensors_out_of_range_are_refused_through_a_plan(make):
    device = make()
    sched = named("mamba2", **MAMBA2)
    good, bad = mamba2_inputs(sched, 0), mamba2_inputs(sched, 0, cu_seqlens=(0, 3, 9))
    with CallPlan(sched, device) as plan:
        want = plan(good)
        with pytest.raises(RunError, match=r"thunk 0 \(mamba2\), field 'cu_seqlens'\[2\] = 9"):
            plan(bad)
        got = plan(good)
        for name in want:  # the good inputs again give the same outputs: the refused call ran nothing
            np.testing.assert_array_equal(got[name], want[name])


def test_an_early_check_reads_the_staged_inputs_not_the_device():
    device = Device(open_double(), Config(fallback="allow", overrides={"mamba2": "host"}))
    sched = named("mamba2", **MAMBA2)
    prims = device.session.prims
    reads: list[int] = []
    read = prims.read
    with CallPlan(sched, device) as plan:
        plan(mamba2_inputs(sched, 0))
        prims.read = lambda buffer, offset, out: (reads.append(out.size), read(buffer, offset, out))[1]
        with pytest.raises(RunError, match=r"field 'cu_seqlens'\[2\] = 9"):
            plan(mamba2_inputs(sched, 0, cu_seqlens=(0, 3, 9)))
        assert reads == []  # cu_seqlens was checked from the host buffer it was sent from
        plan(mamba2_inputs(sched, 1))
        # the inputs lie in a row (x ... cu_seqlens, state; dst after them): one copy in; state and dst
        # side by side: one copy out (the host fallback's own copies count as its copied bytes)
        assert plan.last_report.copies == 2


@pytest.mark.parametrize("make", _devices())
def test_calls_from_many_threads_take_turns(make):
    device = make()
    w = np.linspace(-1, 1, N).astype(np.float32)
    failures: list[str] = []
    with CallPlan(_scale(), device) as plan:
        plan({"x": np.zeros(N), "w": w}, {"w": 0})

        def worker(k: int) -> None:
            x = np.full(N, k, np.float32)
            for _ in range(20):
                y = plan({"x": x}, {"w": 0})["y"]
                if not np.array_equal(y, x * w):
                    failures.append(f"thread {k}: {y} != {x * w}")

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(1, 5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert failures == []


@pytest.mark.usefixtures("collect_only_new_objects")
def test_free_releases_the_arena_and_a_freed_plan_is_refused():
    device = Device(open_double(), Config(fallback="allow", overrides={"binary": "host"}))
    live = device.session.prims.live
    plan = CallPlan(_scale(), device)
    assert "not called yet" in repr(plan) and live == {}
    plan({"x": np.zeros(N), "w": np.zeros(N)})
    assert len(live) == 1
    plan.free()
    assert live == {} and "freed" in repr(plan)
    with pytest.raises(RlxError, match=r"this CallPlan was freed; make another"):
        plan({"x": np.zeros(N), "w": np.zeros(N)})
    plan.free()  # a second free does nothing
    with CallPlan(_scale(), device) as plan:
        plan({"x": np.zeros(N), "w": np.zeros(N)})
        assert len(live) == 1
    assert live == {}
    plan = CallPlan(_scale(), device)
    plan({"x": np.zeros(N), "w": np.zeros(N)})
    del plan
    gc.collect()
    assert live == {}  # garbage collection released it


def test_the_fallback_warning_comes_once_per_plan():
    device = Device(open_double(), Config(fallback="warn", overrides={"binary": "host"}))
    values = {"x": np.ones(N), "w": np.ones(N)}
    with CallPlan(_scale(), device) as plan:
        with pytest.warns(UserWarning, match=r"1 thunk\(s\) fall back to the host from numpy:0: 0 \(binary f32\)"):
            plan(values)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            np.testing.assert_array_equal(plan(values)["y"], np.ones(N))
        assert [r.backend for r in plan.last_report.records] == ["host"]


def test_inputs_close_together_go_as_one_copy_unless_a_thunk_writes_between():
    """x at 0, w at 256 (a gap of padding between): one copy from x to w, carrying the padding and a
    skipped w as the device holds them; with y (which the thunk writes) between them, two copies."""
    device = Device(open_double(), Config(fallback="allow", overrides={"binary": "host"}))
    x, w = np.arange(N, dtype=np.float32), np.full(N, 3, np.float32)
    apart = _binary("mul", 0, 256, 512, {"x": 0, "w": 256, "y": 512}, ["x", "w"], ["y"], arena_bytes=1024)
    between = _binary("mul", 0, 256, 128, {"x": 0, "w": 256, "y": 128}, ["x", "w"], ["y"], arena_bytes=1024)
    with CallPlan(apart, device) as plan, CallPlan(between, device) as split:
        plan({"x": x, "w": w})
        split({"x": x, "w": w})  # each first call uploads its arena
        copies = _counting_writes(device, but=512)
        np.testing.assert_array_equal(plan({"x": x, "w": w}, {"w": 1})["y"], 3 * x)
        np.testing.assert_array_equal(plan({"x": x + 1, "w": w * 0}, {"w": 1})["y"], 3 * (x + 1))  # w skipped
        assert copies == [(0, 256 + 64), (0, 64)]
        copies = _counting_writes(device, but=128)
        np.testing.assert_array_equal(split({"x": x, "w": w})["y"], 3 * x)
        assert sorted(copies) == [(0, 64), (256, 64)]
        assert split.last_report.copies == 3
