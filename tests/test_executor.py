"""Executor and registry: fallback copies exactly the footprint, policies, overrides, device specs."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import rlx_gpu
from rlx_gpu.backends.base import DeviceInfo
from rlx_gpu.backends.host import HostSession
from rlx_gpu.runtime.config import Config, load_config
from rlx_gpu.runtime.executor import Device
from rlx_gpu.schedule.ops import footprint
from rlx_gpu.runtime.registry import resolve


class PartialSession(HostSession):
    """A stand-in device with its own arenas that runs only some ops, so the rest must fall back."""

    def __init__(self, ops: set[str]):
        super().__init__(DeviceInfo("fake", "fake:0", "partial test device", fp64=False))
        self.ops = ops
        self.reads = 0

    def unsupported(self, thunk):
        return None if thunk["op"] in self.ops else f"the fake device has no {thunk['op']} kernel"

    def read(self, arena, offset, nbytes):
        self.reads += nbytes
        return super().read(arena, offset, nbytes)


def _schedule() -> dict:
    """fill x; unary tanh x -> y (falls back); binary y + x -> z; copy z -> w."""
    n = 16
    return {
        "abi": "rlx-thunks/1", "arena_bytes": 4096,
        "tensors": {"x": {"offset": 0, "dtype": "f32", "shape": [n]}, "w": {"offset": 1024, "dtype": "f32", "shape": [n]}},
        "inputs": ["x"], "outputs": ["w"],
        "thunks": [
            {"op": "unary", "dtype": "f32", "x": 0, "dst": 256, "n": n, "fn": "tanh"},
            {"op": "binary", "dtype": "f32", "a": 256, "b": 0, "dst": 512, "fn": "add", "shape": [n],
             "a_strides": [1], "b_strides": [1]},
            {"op": "copy", "dtype": "f32", "src": 512, "dst": 1024, "nbytes": 4 * n},
        ],
    }


def _arena(sched: rlx_gpu.Schedule) -> np.ndarray:
    arena = sched.pristine_arena()
    sched.tensors["x"].write(arena, np.linspace(-2, 2, 16))
    return arena


def test_fallback_copies_exactly_the_footprint_and_matches_the_host():
    sched = rlx_gpu.load_schedule(_schedule())
    arena = _arena(sched)
    device = Device(PartialSession({"binary", "copy"}), Config(fallback="allow"))
    got = device.run(sched, arena)
    want = rlx_gpu.get_device("host").run(sched, arena)
    np.testing.assert_array_equal(got, want)
    x = np.linspace(-2, 2, 16).astype(np.float32)
    np.testing.assert_allclose(sched.tensors["w"].read(got), np.tanh(x) + x, rtol=1e-6)
    reads, writes = footprint(sched.thunks[0])
    assert device.last_report.fallback_bytes == sum(r.nbytes for r in reads + writes) == 128
    assert [r.backend for r in device.last_report.records] == ["host", "fake", "fake"]


def test_policies_warn_and_forbid():
    sched = rlx_gpu.load_schedule(_schedule())
    with pytest.warns(UserWarning, match=r"1 thunk\(s\) fall back to the host from fake:0: 0 \(unary f32\)"):
        Device(PartialSession({"binary", "copy"}), Config(fallback="warn")).run(sched, _arena(sched))
    device = Device(PartialSession({"binary", "copy"}), Config(fallback="forbid"))
    with pytest.raises(rlx_gpu.FallbackForbidden, match=r"thunk 0 \(unary, f32\) cannot run on fake:0: the fake device has no unary kernel"):
        device.run(sched, _arena(sched))
    assert device.thunks_run == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Device(PartialSession({"unary", "binary", "copy"}), Config(fallback="forbid")).run(sched, _arena(sched))


def test_override_pins_an_op_to_the_host_and_plan_explains_it():
    sched = rlx_gpu.load_schedule(_schedule())
    device = Device(PartialSession({"unary", "binary", "copy"}), Config(fallback="allow", overrides={"binary:f32": "host"}))
    plan = device.place(sched)
    assert [a.backend for a in plan] == ["fake", "host", "fake"]
    assert "override binary:f32 -> host" in plan[1].reason and plan[0].reason == "supported on fake:0"


def test_arena_of_the_wrong_size_is_refused():
    sched = rlx_gpu.load_schedule(_schedule())
    with pytest.raises(ValueError, match=r"numpy uint8 array of arena_bytes = 4096 \(4.0 KiB\)"):
        rlx_gpu.get_device("host").run(sched, np.zeros(100, np.uint8))


def test_init_bytes_are_applied_and_the_input_arena_is_not_modified():
    raw = _schedule()
    raw["init"] = [{"offset": 0, "b64": "AACAPwAAAEA="}]  # 1.0, 2.0
    sched = rlx_gpu.load_schedule(raw)
    arena = np.zeros(4096, np.uint8)
    out = rlx_gpu.get_device("host").run(sched, arena)
    assert not arena.any()
    np.testing.assert_allclose(sched.tensors["w"].read(out)[:3], [np.tanh(1) + 1, np.tanh(2) + 2, 0], rtol=1e-6)


def test_device_specs_and_environment(monkeypatch, tmp_path):
    cfg = load_config()
    assert resolve("host", cfg).spec == "host"
    monkeypatch.setenv("RLX_DEVICE", "host")
    assert rlx_gpu.get_device().spec == "host"
    with pytest.raises(rlx_gpu.DeviceError, match="device 'tpu' is not a device spec"):
        resolve("tpu", cfg)
    config = tmp_path / "c.yaml"
    config.write_text("device: host\nfallback: sometimes\n")
    with pytest.raises(rlx_gpu.RlxError, match=r"fallback: 'sometimes' is not a fallback policy; expected one of allow, warn, forbid"):
        load_config(config)
    config.write_text("device: host\nfallback: forbid\noverrides: {lstm: host}\n")
    monkeypatch.setenv("RLX_CONFIG", str(config))
    loaded = load_config()
    assert loaded.fallback == "forbid" and loaded.override_for("lstm", "f16") == "host"


def test_auto_picks_the_first_available_backend_in_priority_order():
    cfg = Config(priority=("cuda", "host", "opencl"))
    assert resolve("auto", cfg).backend == "host"


def test_host_fallback_refuses_a_thunk_past_its_arena():
    import host_fallback

    arena = np.zeros(64, np.uint8)
    with pytest.raises(ValueError, match=r"unary thunk, field 'dst': bytes \[32, 96\) fall outside the arena of 64"):
        host_fallback.execute({"op": "unary", "dtype": "f32", "x": 0, "dst": 32, "n": 16, "fn": "exp"}, arena)
    assert not arena.any()
