"""Resident arenas: allocated pristine on the device, tensors written and read by name, schedules run
in place any number of times, freed; on the host, OpenCL and the NumPy double of the core."""
from __future__ import annotations

import numpy as np
import pytest

import rlx_gpu
from support.numpy_device import open_double
from rlx_gpu.runtime.config import Config
from rlx_gpu.runtime.executor import Device
from rlx_gpu.runtime.registry import status

N = 8


def _accumulate() -> dict:
    """``acc += x``, then ``y = tanh(acc + c)``: ``acc`` persists between runs, ``c`` is init's 0.5."""
    import base64

    half = np.full(N, 0.5, np.float32).tobytes()
    add = {"op": "binary", "dtype": "f32", "fn": "add", "shape": [N], "a_strides": [1], "b_strides": [1]}
    return {
        "abi": "rlx-thunks/1", "arena_bytes": 256,
        "tensors": {"x": {"offset": 0, "dtype": "f32", "shape": [N]}, "acc": {"offset": 64, "dtype": "f32", "shape": [N]},
                    "y": {"offset": 128, "dtype": "f32", "shape": [N]}, "c": {"offset": 192, "dtype": "f32", "shape": [N]}},
        "inputs": ["x"], "outputs": ["y"],
        "init": [{"offset": 192, "b64": base64.b64encode(half).decode()}],
        "thunks": [
            add | {"a": 64, "b": 0, "dst": 64},
            add | {"a": 64, "b": 192, "dst": 128},
            {"op": "unary", "dtype": "f32", "x": 128, "dst": 128, "n": N, "fn": "tanh"},
        ],
    }


def _devices() -> list:
    devices = [pytest.param(lambda: rlx_gpu.get_device("host"), id="host")]
    if status("opencl").available:
        devices.append(pytest.param(lambda: rlx_gpu.get_device("opencl", Config(fallback="forbid")), id="opencl"))
    # the double has no binary kernel: the override sends it to the host, copying its footprint each run
    devices.append(pytest.param(lambda: Device(open_double(), Config(fallback="allow", overrides={"binary": "host"})),
                                id="double"))
    return devices


@pytest.mark.parametrize("make", _devices())
def test_runs_in_place_keep_state_and_match_the_copying_path(make):
    device = make()
    sched = rlx_gpu.load_schedule(_accumulate())
    rng = np.random.default_rng(0)
    xs = rng.uniform(-1, 1, (3, N)).astype(np.float32)
    with device.arena(sched) as arena:
        np.testing.assert_array_equal(arena.read("c"), np.full(N, 0.5, np.float32))  # pristine: zeros plus init
        np.testing.assert_array_equal(arena.read("acc"), np.zeros(N, np.float32))
        host_arena = sched.pristine_arena()
        acc = np.zeros(N, np.float64)
        for x in xs:
            arena.write("x", x)
            assert device.run(sched, arena) is arena
            acc += x
            sched.tensors["x"].write(host_arena, x)
            host_arena = device.run(sched, host_arena)  # the copy-in/copy-out meaning, for comparison
            np.testing.assert_array_equal(arena.read("y"), sched.tensors["y"].read(host_arena))
            np.testing.assert_allclose(arena.read("y"), np.tanh(acc + 0.5), rtol=1e-5)
            np.testing.assert_array_equal(arena.read("acc"), sched.tensors["acc"].read(host_arena))
        assert arena.read("acc").dtype == np.float32 and arena.read("y").shape == (N,)
    with pytest.raises(rlx_gpu.RlxError, match="this arena was freed"):
        arena.read("y")
    with pytest.raises(rlx_gpu.RlxError, match="this arena was freed"):
        device.run(sched, arena)
    arena.free()  # a second free does nothing


def test_arena_memory_is_released_and_misuse_is_refused():
    session = open_double()
    device = Device(session, Config(fallback="allow", overrides={"binary": "host"}))
    sched = rlx_gpu.load_schedule(_accumulate())
    arena = device.arena(sched)
    assert len(session.prims.live) == 1
    with pytest.raises(rlx_gpu.RlxError, match=r"the schedule names no tensor 'z'; it has x, acc, y, c"):
        arena.write("z", np.zeros(N))
    with pytest.raises(rlx_gpu.RlxError, match=r"tensor 'x' has shape \[8\], got values of shape \[4\]"):
        arena.write("x", np.zeros(4))
    unnamed = {k: v for k, v in _accumulate().items() if k not in ("tensors", "inputs", "outputs")}
    with device.arena(rlx_gpu.load_schedule(unnamed)) as bare:
        with pytest.raises(rlx_gpu.RlxError, match=r"it has none \(give the schedule a 'tensors' table"):
            bare.read("x")
    other = Device(open_double(), Config(fallback="allow", overrides={"binary": "host"}))
    with pytest.raises(rlx_gpu.RlxError, match="this arena lives on"):
        other.run(sched, arena)
    bigger = rlx_gpu.load_schedule(_accumulate() | {"arena_bytes": 512})
    with pytest.raises(rlx_gpu.RlxError, match="the schedule needs arena_bytes = 512; this arena has 256"):
        device.run(bigger, arena)
    for _ in range(3):
        device.run(sched, arena)
    # the two binaries run on the host as one run: x, acc and c in, acc and y back; never the whole arena
    assert device.last_report.fallback_bytes == 5 * 4 * N
    arena.free()
    assert session.prims.live == {}


def test_a_repeated_run_reuses_the_bound_schedule():
    device = Device(open_double(), Config(fallback="allow", overrides={"binary": "host"}))
    sched = rlx_gpu.load_schedule(_accumulate())
    with device.arena(sched) as arena:
        device.run(sched, arena)
        bound = device.bind(sched)
        device.run(sched, arena)
        assert device.bind(sched) is bound
    builds = len(device.session.prims.builds)
    device.run(sched)
    assert len(device.session.prims.builds) == builds


def test_disjoint_writes_in_any_order_go_as_one_copy_and_neighbouring_reads_as_one():
    """A decode step writes its inputs in the schedule's order, which need not be the arena's, and reads
    outputs that lie side by side: one device copy each way, the values each tensor's own."""
    device = Device(open_double(), Config(fallback="allow", overrides={"binary": "host"}))
    sched = rlx_gpu.load_schedule(dict(_accumulate(), tensors={
        name: {"offset": 64 * i, "dtype": "f32", "shape": [16]} for i, name in enumerate(("x", "acc", "y", "c"))}))
    prims = device.session.prims
    writes: list[int] = []
    reads: list[tuple[int, int]] = []
    write, read = prims.write, prims.read
    prims.write = lambda buffer, offset, data: (writes.append(offset), write(buffer, offset, data))
    prims.read = lambda buffer, offset, out: (reads.append((offset, out.size)), read(buffer, offset, out))
    values = {name: np.full(16, k, np.float32) for k, name in enumerate(("y", "acc", "x"), start=1)}
    with device.arena(sched) as arena:
        writes.clear()
        for name, v in values.items():
            arena.write(name, v)
        got = arena.read_many(["acc", "x", "y"])
        assert writes == [0] and reads == [(0, 3 * 64)]
        for name, v in values.items():
            np.testing.assert_array_equal(got[name], v)


@pytest.mark.parametrize("make", [p for p in _devices() if p.id != "host"])
def test_staged_writes_reach_the_device_in_order_adjacent_ones_as_one_copy(make):
    """Every write is staged until a run or a read; then tensors that follow each other in the arena go
    as one copy, in the order written (a later write of the same bytes wins)."""
    device = make()
    sched = rlx_gpu.load_schedule(dict(_accumulate(), tensors={  # x, acc, y, c as 64-byte tensors in a row
        name: {"offset": 64 * i, "dtype": "f32", "shape": [16]} for i, name in enumerate(("x", "acc", "y", "c"))}))
    prims = device.session.prims
    copies: list[tuple[int, int]] = []
    write = prims.write

    def counted(buffer, offset, data):
        copies.append((offset, data.size))
        write(buffer, offset, data)

    rng = np.random.default_rng(5)
    with device.arena(sched) as arena:
        prims.write = counted
        values = {name: rng.uniform(-1, 1, 16).astype(np.float32) for name in ("x", "acc", "y")}
        kept = {name: v.copy() for name, v in values.items()}
        for name, v in values.items():
            arena.write(name, v)
            v[:] = 7  # the caller's array changes after the write: the staged copy must not
        assert copies == []  # nothing sent yet
        for name, v in kept.items():
            np.testing.assert_array_equal(arena.read(name), v)
        assert copies == [(0, 3 * 64)]  # one copy for the three adjacent tensors
        copies.clear()
        arena.write("c", np.ones(16, np.float32))
        arena.write("x", np.full(16, 2, np.float32))  # not right after c: a second copy
        arena.write("x", np.full(16, 3, np.float32))  # the same tensor again: sent after, so it wins
        np.testing.assert_array_equal(arena.read("x"), np.full(16, 3, np.float32))
        np.testing.assert_array_equal(arena.read("c"), np.ones(16, np.float32))
        assert [o for o, _ in copies] == [192, 0, 0]
        copies.clear()
        arena.write("x", np.full(16, 0.25, np.float32))
        device.run(sched, arena)  # the run sends it first: acc (its first 8 values) = old acc + 0.25
        assert copies[0] == (0, 64)
        np.testing.assert_allclose(arena.read("acc")[:N], kept["acc"][:N] + np.float32(0.25), rtol=1e-6)
