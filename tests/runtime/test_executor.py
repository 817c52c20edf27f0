"""Executor and registry: fallback copies exactly the footprint (consecutive host thunks share one copy
each way), policies, overrides, device specs, and a backend described in one place."""
from __future__ import annotations

import textwrap
import warnings

import numpy as np
import pytest

import rlx_gpu
from rlx_gpu import backends
from rlx_gpu.backends import programs
from rlx_gpu.backends.base import DeviceInfo
from rlx_gpu.backends.host import HostSession
from rlx_gpu.runtime.config import Config, check_spec, load_config
from rlx_gpu.runtime.executor import Device
from host_fallback.abi import footprint
from rlx_gpu.runtime.registry import resolve

from support.schedule_files import f32_chain


class PartialSession(HostSession):
    """A stand-in device with its own arenas that runs only some ops, so the rest must fall back."""

    def __init__(self, ops: set[str]):
        super().__init__(DeviceInfo("fake", "fake:0", "partial test device", fp64=False))
        self.ops = ops
        self.reads = 0
        self.copies = 0  # uploads, reads and writes: each is one transfer on a real device

    def unsupported(self, thunk):
        return None if thunk["op"] in self.ops else f"the fake device has no {thunk['op']} kernel"

    def read(self, arena, offset, nbytes):
        self.reads += nbytes
        self.copies += 1
        return super().read(arena, offset, nbytes)

    def write(self, arena, offset, data):
        self.copies += 1
        super().write(arena, offset, data)

    def upload(self, data, what="an arena", resident=False):
        self.copies += 1
        return super().upload(data, what, resident)


def _schedule() -> dict:
    """fill x; unary tanh x -> y (falls back); binary y + x -> z; copy z -> w."""
    n = 16
    return f32_chain(n, 4096, 1024, [
        {"op": "unary", "dtype": "f32", "x": 0, "dst": 256, "n": n, "fn": "tanh"},
        {"op": "binary", "dtype": "f32", "a": 256, "b": 0, "dst": 512, "fn": "add", "shape": [n],
         "a_strides": [1], "b_strides": [1]},
        {"op": "copy", "dtype": "f32", "src": 512, "dst": 1024, "nbytes": 4 * n},
    ])


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


def test_the_cuda_tf32_key_is_a_boolean_off_by_default(tmp_path):
    assert load_config().tf32 is False  # as torch's allow_tf32: f32 keeps FP32 FMA unless asked
    config = tmp_path / "c.yaml"
    config.write_text("cuda:\n  tf32: true\n")
    assert load_config(config).tf32 is True
    config.write_text("cuda:\n  tf32: '1'\n")
    with pytest.raises(rlx_gpu.ConfigError, match=r"cuda\.tf32: expected true or false, got str '1'"):
        load_config(config)
    config.write_text("cuda:\n  allow_tf32: true\n")
    with pytest.raises(rlx_gpu.ConfigError, match=r"cuda: 'allow_tf32' is not a cuda option.*expected one of tf32"):
        load_config(config)
    # the host has no TF32: the setting opens the same session there
    assert rlx_gpu.get_device("host", Config(tf32=True)).session is rlx_gpu.get_device("host").session


def test_auto_picks_the_first_available_backend_in_priority_order():
    cfg = Config(priority=("cuda", "host", "opencl"))
    assert resolve("auto", cfg).backend == "host"


def test_host_fallback_refuses_a_thunk_past_its_arena():
    import host_fallback

    arena = np.zeros(64, np.uint8)
    with pytest.raises(ValueError, match=r"unary thunk, field 'dst': bytes \[32, 96\) fall outside the arena of 64"):
        host_fallback.execute({"op": "unary", "dtype": "f32", "x": 0, "dst": 32, "n": 16, "fn": "exp"}, arena)
    assert not arena.any()


def _chain() -> dict:
    """unary tanh x -> y; binary y * x -> z; unary exp z -> z (in place); copy z -> w. The first three
    fall back on a device that runs only copy; each reads what the one before wrote."""
    n = 16
    return f32_chain(n, 1024, 768, [
        {"op": "unary", "dtype": "f32", "x": 0, "dst": 256, "n": n, "fn": "tanh"},
        {"op": "binary", "dtype": "f32", "a": 256, "b": 0, "dst": 512, "fn": "mul", "shape": [n],
         "a_strides": [1], "b_strides": [1]},
        {"op": "unary", "dtype": "f32", "x": 512, "dst": 512, "n": n, "fn": "exp"},
        {"op": "copy", "dtype": "f32", "src": 512, "dst": 768, "nbytes": 4 * n},
    ])


def test_consecutive_host_thunks_share_one_copy_of_their_joint_footprint_each_way():
    sched = rlx_gpu.load_schedule(_chain())
    arena = _arena(sched)
    session = PartialSession({"copy"})
    device = Device(session, Config(fallback="allow"))
    got = device.run(sched, arena)
    np.testing.assert_array_equal(got, rlx_gpu.get_device("host").run(sched, arena))
    x = np.linspace(-2, 2, 16)
    np.testing.assert_allclose(sched.tensors["w"].read(got), np.exp(np.tanh(x) * x), rtol=1e-6)
    tensor = 4 * 16
    # one run of three host thunks: x comes in (y and z are written before they are read), y and z go back
    each_own = sum(r.nbytes for t in sched.thunks[:3] for part in footprint(t) for r in part)
    assert each_own == 7 * tensor
    assert device.last_report.fallback_bytes == 3 * tensor
    assert [r.copied_bytes for r in device.last_report.records] == [tensor, 0, 2 * tensor, 0]
    assert session.reads == tensor + sched.arena_bytes  # x in, then the result arena out
    assert session.copies == 3 + 1 + 1  # x in, y and z back; the arena in and out


def test_host_runs_on_opencl_copy_their_joint_footprint_and_match_the_host():
    from rlx_gpu.runtime.registry import status

    if not status("opencl").available:
        pytest.skip(status("opencl").reason)
    sched = rlx_gpu.load_schedule(_chain())
    arena = _arena(sched)
    device = Device(rlx_gpu.get_device("opencl").session,
                    Config(fallback="allow", overrides={"unary": "host", "binary": "host"}))
    got = device.run(sched, arena)
    np.testing.assert_array_equal(got, rlx_gpu.get_device("host").run(sched, arena))
    assert [r.backend for r in device.last_report.records] == ["host", "host", "host", "opencl"]
    assert device.last_report.fallback_bytes == 3 * 4 * 16


def test_joint_footprints_are_merged_ranges_less_what_the_run_wrote_first():
    from rlx_gpu.runtime.fallback import merged, without

    assert merged([(8, 4), (0, 4), (4, 2), (20, 0), (10, 6)]) == ((0, 6), (8, 8))
    assert without(((0, 16), (32, 8)), ((4, 4), (12, 24))) == ((0, 4), (8, 4), (36, 4))
    assert without(((0, 8),), ()) == ((0, 8),) and without(((0, 8),), ((0, 8),)) == ()


def test_a_device_thunk_between_host_thunks_splits_their_runs():
    sched = rlx_gpu.load_schedule(_chain())
    arena = _arena(sched)
    device = Device(PartialSession({"binary", "copy"}), Config(fallback="allow"))
    got = device.run(sched, arena)
    np.testing.assert_array_equal(got, rlx_gpu.get_device("host").run(sched, arena))
    tensor = 4 * 16
    assert [r.copied_bytes for r in device.last_report.records] == [2 * tensor, 0, 2 * tensor, 0]


TOY_BACKEND = '''
"""A toy backend: the host's kernels under another name, with a spec index and a device variable."""
from rlx_gpu.backends.base import DeviceInfo
from rlx_gpu.backends.host import HostSession

NAME = "toy"
SPEC_INDICES = ("slot",)
PRELUDE = ("kernels_opencl", "prelude.cl")
DEVICE_ENV = "RLX_TOY_SLOT"


def device_from_env(value, devices):
    return f"toy:{value}"


def probe():
    return [DeviceInfo(NAME, "toy:0", "toy device", fp64=True)]


def open(info):
    return HostSession(info)
'''


def test_a_backend_module_registered_in_one_place_is_discovered_everywhere(tmp_path, monkeypatch, capsys):
    from rlx_gpu import cli

    (tmp_path / "rlx_toy_backend.py").write_text(textwrap.dedent(TOY_BACKEND))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(backends.MODULES, "toy", "rlx_toy_backend")  # the one place
    for name in ("RLX_DEVICE", "PYOPENCL_CTX", "RLX_CONFIG"):
        monkeypatch.delenv(name, raising=False)

    assert check_spec("toy:3") == "toy:3"
    forms = r"expected host \| opencl\[:platform\[:device\]\] \| cuda\[:n\] \| toy\[:slot\] \| auto"
    with pytest.raises(rlx_gpu.DeviceError, match=forms):
        check_spec("toy:1:2")
    config = tmp_path / "toy.yaml"
    config.write_text("device: toy:0\npriority: [toy, host]\noverrides: {lstm: toy}\n")
    loaded = load_config(config)
    assert loaded.priority == ("toy", "host") and loaded.override_for("lstm", "f32") == "toy"
    assert resolve("auto", loaded).spec == "toy:0"
    monkeypatch.setenv("RLX_TOY_SLOT", "0")  # its device variable picks it when nothing else does
    assert resolve(None, Config(device="host")).spec == "toy:0"
    assert programs.prelude_path("toy") == programs.prelude_path("opencl")
    assert cli.main(["devices"]) == 0
    out = capsys.readouterr().out
    assert "toy: available" in out and "toy:0" in out and "support on toy:0" in out
    sched = rlx_gpu.load_schedule(_schedule())
    arena = _arena(sched)
    toy = rlx_gpu.get_device("toy")
    np.testing.assert_array_equal(toy.run(sched, arena), rlx_gpu.get_device("host").run(sched, arena))
