"""The kernel-session core through a second backend (the NumPy test double of ``numpy_device``):
caches, buffer lifetimes, device-memory limits, body thunks placed like top-level ones, run options."""
from __future__ import annotations

import re

import numpy as np
import pytest

import host_fallback
import rlx_gpu
from support.numpy_device import open_double
from rlx_gpu.runtime.config import Config
from rlx_gpu.runtime.executor import Device
from rlx_gpu.runtime.options import RunOptions

N = 4  # carry elements
LENGTH = 3


def _elementwise() -> dict:
    """fill y; unary tanh x -> y; copy y -> w (all kernels the double has)."""
    return {
        "abi": "rlx-thunks/1", "arena_bytes": 256,
        "tensors": {"x": {"offset": 0, "dtype": "f32", "shape": [8]}, "w": {"offset": 128, "dtype": "f32", "shape": [8]}},
        "inputs": ["x"], "outputs": ["w"],
        "thunks": [
            {"op": "fill", "dtype": "f32", "dst": 64, "n": 8, "value": 3.0},
            {"op": "unary", "dtype": "f32", "x": 0, "dst": 64, "n": 8, "fn": "tanh"},
            {"op": "copy", "dtype": "f32", "src": 64, "dst": 128, "nbytes": 32},
        ],
    }


def _scan() -> dict:
    """``h_{t+1} = tanh(h_t + x_t)`` over LENGTH steps, trajectory saved; the body is binary add + unary tanh."""
    body = {
        "arena_bytes": 64,
        "thunks": [
            {"op": "binary", "dtype": "f32", "a": 0, "b": 16, "dst": 32, "fn": "add", "shape": [N],
             "a_strides": [1], "b_strides": [1]},
            {"op": "unary", "dtype": "f32", "x": 32, "dst": 48, "n": N, "fn": "tanh"},
        ],
    }
    return {
        "abi": "rlx-thunks/1", "arena_bytes": 128,
        "tensors": {"h0": {"offset": 0, "dtype": "f32", "shape": [N]},
                    "xs": {"offset": 16, "dtype": "f32", "shape": [LENGTH, N]},
                    "traj": {"offset": 64, "dtype": "f32", "shape": [LENGTH, N]}},
        "inputs": ["h0", "xs"], "outputs": ["traj"],
        "thunks": [{"op": "scan", "dtype": "f32", "body": body, "body_input_off": 0, "body_output_off": 48,
                    "outer_init_off": 0, "outer_final_off": 64, "length": LENGTH, "carry_bytes": 4 * N,
                    "save_trajectory": True, "xs_inputs": [[16, 16, 4 * N]], "bcast_inputs": [],
                    "num_checkpoints": 0}],
    }


def _arena(sched: rlx_gpu.Schedule, rng: np.random.Generator) -> np.ndarray:
    arena = sched.pristine_arena()
    for name in sched.inputs:
        sched.tensors[name].write(arena, rng.uniform(-1, 1, sched.tensors[name].shape))
    return arena


def test_a_backend_of_primitives_only_runs_a_schedule_bit_identical_to_the_host():
    sched = rlx_gpu.load_schedule(_elementwise())
    arena = _arena(sched, np.random.default_rng(0))
    session = open_double(key="device A")
    device = Device(session, Config(fallback="forbid"))
    got = device.run(sched, arena)
    np.testing.assert_array_equal(got, rlx_gpu.get_device("host").run(sched, arena))
    x = sched.tensors["x"].read(arena).astype(np.float64)
    np.testing.assert_allclose(sched.tensors["w"].read(got), np.tanh(x), rtol=1e-6)
    assert session.prims.launched == ["fill", "unary", "copy_bytes"]
    assert len(session.prims.live) == 0  # the run's arena was released
    builds = len(session.prims.builds)
    assert builds == 1  # one body/f32 program serves all three kernels
    device.run(sched, arena)
    again = open_double(key="device A")  # a second session of the same device reuses the built program
    Device(again, Config()).run(sched, arena)
    assert len(session.prims.builds) == 1 and again.prims.builds == []
    other = open_double(key="device B")  # another device compiles its own
    Device(other, Config()).run(sched, arena)
    assert len(other.prims.builds) == 1


def test_scan_driver_on_the_double_matches_the_host_and_frees_its_body_arenas():
    sched = rlx_gpu.load_schedule(_scan())
    arena = _arena(sched, np.random.default_rng(1))
    session = open_double()
    device = Device(session, Config(fallback="allow", overrides={"binary": "host"}))
    got = device.run(sched, arena)
    np.testing.assert_array_equal(got, rlx_gpu.get_device("host").run(sched, arena))
    h, xs = sched.tensors["h0"].read(arena).astype(np.float64), sched.tensors["xs"].read(arena).astype(np.float64)
    for step in range(LENGTH):
        h = np.tanh(h + xs[step])
        np.testing.assert_allclose(sched.tensors["traj"].read(got)[step], h, rtol=1e-5)
    assert session.prims.live == {}  # body arenas and the run arena released (no plan needed scratch)
    assert "binary" not in session.prims.launched


def test_forbid_refuses_a_body_thunk_sent_to_the_host_before_any_launch():
    sched = rlx_gpu.load_schedule(_scan())
    session = open_double()
    device = Device(session, Config(fallback="forbid", overrides={"binary": "host"}))
    with pytest.raises(rlx_gpu.FallbackForbidden, match=r"thunk 0 › body thunk 0 \(binary, f32\): override binary:f32 -> "
                                                         r"host in <defaults>, but the fallback policy is 'forbid'"):
        device.run(sched, _arena(sched, np.random.default_rng(2)))
    assert device.thunks_run == 0 and session.prims.launched == [] and session.prims.live == {}


def test_plan_lists_body_thunks_and_the_report_counts_their_footprint_per_step():
    sched = rlx_gpu.load_schedule(_scan())
    device = Device(open_double(), Config(fallback="allow", overrides={"binary": "host"}))
    plan = device.place(sched)
    assert [(a.where, a.backend) for a in plan] == [
        ("thunk 0", "numpy"), ("thunk 0 › body thunk 0", "host"), ("thunk 0 › body thunk 1", "numpy")]
    assert "override binary:f32 -> host" in plan[1].reason
    footprint = 3 * 4 * N  # binary reads a and b, writes dst: N floats each
    assert plan[1].copied_bytes == footprint
    device.run(sched, _arena(sched, np.random.default_rng(3)))
    [record] = device.last_report.records
    assert record.backend == "numpy" and record.copied_bytes == footprint * LENGTH
    with pytest.warns(UserWarning, match=r"thunk 0 › body thunk 0 \(binary f32\)"):
        Device(open_double(), Config(fallback="warn", overrides={"binary": "host"})).run(sched)


def test_cli_plan_shows_the_body_assignment(tmp_path, capsys, monkeypatch):
    from rlx_gpu import cli

    path = tmp_path / "scan.json"
    rlx_gpu.save_schedule(rlx_gpu.load_schedule(_scan()), path)
    config = tmp_path / "c.yaml"
    config.write_text("fallback: allow\noverrides: {binary: host}\n")
    monkeypatch.setattr(cli, "get_device", lambda spec: Device(open_double(), rlx_gpu.load_config(config)))
    assert cli.main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "thunk 0 › body thunk 0  binary  f32    host" in out and "32 B in, 16 B out per body run" in out


def test_a_schedule_larger_than_the_device_allows_is_refused_before_anything_runs():
    raw = _elementwise()
    raw["arena_bytes"] = (1 << 20) + 1  # the double's largest allocation is 1 MiB
    session = open_double()
    device = Device(session, Config())
    with pytest.raises(rlx_gpu.DeviceError, match=r"the arena of this schedule \(arena_bytes\) needs 1048577 bytes "
                                                  r"\(1.0 MiB\), more than the largest allocation of NumPy test "
                                                  r"double \(numpy:0\): 1048576 bytes"):
        device.run(raw)
    with pytest.raises(rlx_gpu.DeviceError):
        device.arena(raw)
    assert device.thunks_run == 0 and session.prims.launched == [] and session.prims.live == {}
    small = open_double(max_alloc_bytes=1 << 20, global_mem_bytes=1000)
    with pytest.raises(rlx_gpu.DeviceError, match=r"more than the memory of NumPy test double \(numpy:0\): 1000 bytes"):
        Device(small, Config()).run(_elementwise() | {"arena_bytes": 1024})


def test_a_launch_scratch_larger_than_the_device_allows_is_refused_before_anything_runs():
    batch, k, n = 8, 200, 200  # B broadcast over the batch and transposed: staged as 8*200*200 f32 of scratch
    raw = {"abi": "rlx-thunks/1", "arena_bytes": 4 * (batch * k + k * n + batch * n),
           "thunks": [{"op": "fill", "dtype": "f32", "dst": 0, "n": 4, "value": 1.0},
                      {"op": "matmul", "dtype": "f32", "a": 0, "b": 4 * batch * k, "dst": 4 * (batch * k + k * n),
                       "batch": batch, "m": 1, "k": k, "n": n, "trans_a": False, "trans_b": True,
                       "a_batch_stride": k, "b_batch_stride": 0}]}
    session = open_double()
    device = Device(session, Config())
    with pytest.raises(rlx_gpu.DeviceError, match=r"the launch scratch of thunk 1 \(matmul\) needs 1280000 bytes "
                                                  r"\(1.2 MiB\), more than the largest allocation of NumPy test double"):
        device.run(raw)
    assert device.thunks_run == 0 and session.prims.launched == [] and session.prims.live == {}


def test_run_options_are_typed_and_misspellings_are_errors():
    assert RunOptions.build(Config(recompute="treeverse")).recompute == "treeverse"
    assert RunOptions.build(Config(recompute="treeverse"), recompute="segment").recompute == "segment"
    with pytest.raises(rlx_gpu.RlxError, match=r"unknown run option\(s\) 'recompte'; known: recompute, rnn_kernel"):
        rlx_gpu.get_device("host", recompte="treeverse")
    with pytest.raises(rlx_gpu.RlxError, match=r"rnn_kernel='fast' is not one of auto, persistent, step"):
        RunOptions(rnn_kernel="fast")
    with pytest.raises(rlx_gpu.RlxError, match=r"workers=0: expected a positive integer"):
        RunOptions(workers=0)
    assert RunOptions(host_path="step", workers=2).host_keywords == {"recompute": "segment", "workers": 2, "path": "step"}
    thunk = {"op": "unary", "dtype": "f32", "x": 0, "dst": 0, "n": 4, "fn": "exp"}
    with pytest.raises(TypeError, match=r"unknown host option\(s\) \['chunck'\]; the host kernels take \['chunk', "):
        host_fallback.execute(thunk, np.zeros(16, np.uint8), chunck=8)
    assert host_fallback.keywords_for("gated_delta_net", {"chunk": 8, "recompute": "segment"}) == {"chunk": 8}
    assert host_fallback.keywords_for("scan", {"chunk": 8, "recompute": "segment"}) == {"chunk": 8, "recompute": "segment"}


def test_host_options_reach_body_thunks_of_a_host_scan():
    """A misspelled option is refused even when only a scan's body would have used it."""
    sched = rlx_gpu.load_schedule(_scan())
    arena = _arena(sched, np.random.default_rng(4))
    with pytest.raises(TypeError, match="unknown host option"):
        host_fallback.execute(sched.thunks[0], arena.copy(), parallel_direction=True)
    host_fallback.execute(sched.thunks[0], arena.copy(), parallel_directions=True, workers=1, recompute="treeverse")


def test_an_arena_over_the_opencl_devices_largest_allocation_names_size_limit_and_device():
    from rlx_gpu.runtime.registry import status

    if not status("opencl").available:
        pytest.skip(status("opencl").reason)
    device = rlx_gpu.get_device("opencl")
    limit = device.session.info.details["max_alloc_bytes"]  # probed: CL_DEVICE_MAX_MEM_ALLOC_SIZE
    raw = _elementwise() | {"arena_bytes": limit + (1 << 20)}
    message = (rf"the arena of this schedule \(arena_bytes\) needs {limit + (1 << 20)} bytes .*more than the largest "
               rf"allocation of {re.escape(device.session.info.name)} \({device.spec}\): {limit} bytes")
    for attempt in (lambda: device.run(raw), lambda: device.arena(raw)):
        with pytest.raises(rlx_gpu.DeviceError, match=message):
            attempt()
    assert device.thunks_run == 0


def test_run_options_reach_the_kernels_through_the_device():
    from rlx_gpu.conformance.cases import lay_out, schedule_of

    thunk, nbytes = lay_out("mamba2", "f32")
    sched = rlx_gpu.load_schedule(schedule_of(thunk, nbytes))
    rlx_gpu.get_device("host", host_path="step").run(sched)
    with pytest.raises(ValueError, match=r"mamba2: unknown path 'blocked'; expected 'step' or 'chunked'"):
        rlx_gpu.get_device("host", host_path="blocked").run(sched)  # selective_scan's path: refused by mamba2
    session = open_double()
    with pytest.raises(rlx_gpu.RlxError, match=r"unknown run option\(s\) 'rnn_kernal'"):
        session.launch(sched.thunks[0], session.alloc(nbytes), rnn_kernal="step")
    with pytest.raises(rlx_gpu.RlxError, match=r"ssm_kernel='fast' is not one of auto, lanes, chunked"):
        rlx_gpu.get_device("host", ssm_kernel="fast")


@pytest.mark.parametrize("per_channel", [False, True])
def test_ssm_kernel_forces_the_chunked_gated_delta_net_at_any_length(per_channel):
    """At the gpu target (forced on PoCL), ``ssm_kernel="chunked"`` runs the WY form on a 5-step sequence
    (one partial chunk) and ``"lanes"`` the step kernel on a 70-step one; both match the float64 recurrence."""
    from rlx_gpu import launches
    from rlx_gpu.conformance.cases import schedule_of
    from rlx_gpu.conformance.compare import nmse
    from rlx_gpu.conformance.devices import find, open_device
    from rlx_gpu.conformance.reference_ssm import gated_delta_net, lay_out, read
    from rlx_gpu.runtime.registry import status

    if not status("opencl").available:
        pytest.skip(status("opencl").reason)
    session = open_device(find("opencl"), "gpu")
    rng = np.random.default_rng(11)
    for seq, choice, first in ((5, "chunked", "gated_delta_net_chunk_prep"), (70, "lanes", "gated_delta_net_lanes")):
        b, h, n = 2, 2, 12
        k = rng.standard_normal((b, seq, h, n))
        tensors = {"q": rng.standard_normal((b, seq, h, n)), "k": k / np.linalg.norm(k, axis=-1, keepdims=True),
                   "v": rng.standard_normal((b, seq, h, n)),
                   "g": rng.uniform(-1, 0, (b, seq, h, n) if per_channel else (b, seq, h)),
                   "beta": rng.uniform(0, 1, (b, seq, h)), "state": rng.standard_normal((b, h, n, n))}
        thunk, arena = lay_out("gated_delta_net", "f32", dict(batch=b, seq=seq, heads=h, state_size=n,
                                                              gate_per_channel=per_channel, carry_state=True), tensors)
        options = RunOptions(ssm_kernel=choice)
        assert launches.plan(thunk, session.limits, **options.planner_keywords).launches[0].kernel == first
        got = Device(session, Config(fallback="forbid"), options).run(schedule_of(thunk, arena.size), arena)
        want, state = gated_delta_net(*(read(thunk, arena, f) for f in ("q", "k", "v", "g", "beta", "state")))
        assert nmse(read(thunk, got, "dst"), want) < 1e-10 and nmse(read(thunk, got, "state"), state) < 1e-10



@pytest.mark.parametrize("recompute", ["segment", "treeverse"])
@pytest.mark.parametrize("length,checkpoints", [(6, 0), (6, 2), (13, 3), (17, 1)])
def test_working_bytes_is_the_peak_the_host_driver_allocates(recompute, length, checkpoints):
    from host_fallback import scan
    from rlx_gpu.conformance.cases import lay_out, scan_case

    fields = dict(scan_case("scan_backward_xs", "f32", length=length), num_checkpoints=checkpoints)
    thunk, arena_bytes = lay_out("scan_backward_xs", "f32", fields)
    arena = np.random.default_rng(length).standard_normal(arena_bytes // 4).astype(np.float32).view(np.uint8)
    memory = scan.HostMemory(recompute=recompute)
    scan.run_scan_backward(memory, thunk, arena, recompute)
    assert scan.working_bytes(thunk, recompute) == memory.peak


def test_a_body_arena_larger_than_host_memory_is_a_device_error_before_anything_runs():
    from rlx_gpu.conformance.cases import lay_out, scan_case, schedule_of

    fields = scan_case("scan_backward", "f32")
    fields["body_vjp"] = dict(fields["body_vjp"], arena_bytes=1 << 46)  # valid (under 2^48), larger than any RAM
    device = rlx_gpu.get_device("host")
    with pytest.raises(rlx_gpu.DeviceError, match=r"thunk 0 \(scan_backward\)'s body arenas and recompute cache "
                                                  r"needs \d+ bytes \(64.0 TiB\), more than the .* of memory of this"):
        device.run(schedule_of(*lay_out("scan_backward", "f32", fields)))
    assert device.thunks_run == 0


def test_consecutive_body_thunks_on_the_host_share_one_copy_each_way_per_step():
    sched = rlx_gpu.load_schedule(_scan())
    arena = _arena(sched, np.random.default_rng(5))
    device = Device(open_double(), Config(fallback="allow", overrides={"binary": "host", "unary": "host"}))
    got = device.run(sched, arena)
    np.testing.assert_array_equal(got, rlx_gpu.get_device("host").run(sched, arena))
    # binary reads a and b and writes dst; unary reads that dst and writes its own: as one run, a and b
    # come in and the two outputs go back (4 tensors a step), where each alone would move 3 + 2
    [record] = device.last_report.records
    assert record.copied_bytes == 4 * 4 * N * LENGTH
    assert sum(a.copied_bytes for a in device.place(sched) if a.nested) == 5 * 4 * N  # each thunk's own footprint


def test_placement_is_decided_once_and_a_run_follows_it():
    """The first run binds the schedule, placing every thunk; later runs ask the device nothing more
    about what it supports (body thunks included)."""
    sched = rlx_gpu.load_schedule(_scan())
    arena = _arena(sched, np.random.default_rng(6))
    session = open_double()
    device = Device(session, Config(fallback="allow", overrides={"binary": "host"}))
    device.run(sched, arena)

    def asked(thunk):
        raise AssertionError(f"placement asked again about {thunk['op']} during a run")
    session.unsupported = asked
    np.testing.assert_array_equal(device.run(sched, arena), rlx_gpu.get_device("host").run(sched, arena))


def _transfers(monkeypatch: pytest.MonkeyPatch, prims) -> list[tuple[str, int, int]]:
    """Spy on a backend's ``write`` and ``zero`` primitives: (primitive, offset, bytes) per call."""
    calls: list[tuple[str, int, int]] = []
    for name in ("write", "zero"):
        def spy(buffer, offset, what, _real=getattr(prims, name), _name=name):
            calls.append((_name, offset, what if isinstance(what, int) else what.size))
            _real(buffer, offset, what)
        monkeypatch.setattr(prims, name, spy)
    return calls


def test_a_run_on_a_device_arena_uploads_it_once_without_zeroing_it_first(monkeypatch):
    from rlx_gpu.runtime.registry import status

    sched = rlx_gpu.load_schedule(_elementwise())
    arena = _arena(sched, np.random.default_rng(7))
    sessions = [open_double()]
    if status("opencl").available:
        sessions.append(rlx_gpu.get_device("opencl").session)
    for session in sessions:
        calls = _transfers(monkeypatch, session.prims)
        got = Device(session, Config(fallback="forbid")).run(sched, arena)
        want = rlx_gpu.get_device("host").run(sched, arena)
        np.testing.assert_allclose(sched.tensors["w"].read(got), sched.tensors["w"].read(want), rtol=1e-6)
        assert calls == [("write", 0, sched.arena_bytes)], session
        calls.clear()
        with Device(session, Config(fallback="forbid")).arena(sched):  # a resident arena: the pristine bytes, once
            assert calls == [("write", 0, sched.arena_bytes)], session
