"""selective_scan's and mamba2's saved forward (ABI.md §9.1, docs/abi.md 6a.1) on OpenCL CPU implementations at both
kernel targets: the forward's kernels (step and lanes forms) write the reserve in the host's layout (mamba2's scores
by a launch of their own), and the device backward takes its checkpoints from the reserve's states.

Per case: the values the device writes in every array of the reserve equal those the host writes (within f32
rounding), and the gradients read from a reserve the device wrote (backward on the host and on the device) and from
one the host wrote (backward on the device) equal the host's backward recomputing its forward, and the device's
own without a reserve. Reruns give the same bytes; a schedule with a reserve runs on the device, one with a short
reserve is refused naming the minimum; Intel's runtime and Oclgrind run a small sample.
"""
from __future__ import annotations

import numpy as np
import pytest

import host_fallback
import rlx_gpu
from host_fallback.abi import complete, regions
from host_fallback.abi.ssm import RESERVE_SLOTS
from rlx_gpu import launches
from rlx_gpu.conformance.cases import SMALL, lay_out, schedule_of
from rlx_gpu.conformance.devices import find, open_device
from rlx_gpu.runtime.registry import status
from support.gradient_check import read
from support.opencl_cpu import OPENCL_CPU, needs_opencl_cpu
from support.saved_forward import laid_case, without_reserve

#: (op, a case of support.saved_forward.OPS): several chunks with the last partial, exact chunks, one partial
#: chunk, groups with d and z, the delta transform's fields, a carried state through slots
CASES = [("selective_scan", "base"), ("selective_scan", "groups.d.z"), ("selective_scan", "knobs.carry.slots"),
         ("mamba2", "base"), ("mamba2", "exact_chunks"), ("mamba2", "one_chunk"), ("mamba2", "groups.d.z"),
         ("mamba2", "dt_knobs"), ("mamba2", "carry.slots")]
#: of each gradient's largest magnitude: a backward reading values another device wrote. mamba2's d_a and dt bias
#: gradient sum every token's and state's share with cancellation: the host's own reserve moves them by 1e-5
TOL = {"f64": 1e-11, "f32": 1e-4, "bf16": 2e-2}
#: of each reserve array's largest magnitude: the values the device and the host write (mamba2's scores from a
#: dot product summed in another order, its states from the chunked form on the host)
LAYOUT_TOL = {"f64": 1e-13, "f32": 1e-5, "bf16": 1e-5}
INTEL = [spec for spec in ("opencl:2:0",) if spec in {i.spec for i in status("opencl").devices}]


def _run(session, thunk: dict, arena: np.ndarray) -> np.ndarray:
    """``arena`` after ``thunk``: on the device ``session`` (which must have kernels for it), or on the host."""
    if session is None:
        out = arena.copy()
        host_fallback.execute(thunk, out)
        return out
    assert launches.unsupported(complete(thunk), session.limits) is None
    on_device = session.upload(arena)
    session.launch(thunk, on_device)
    return session.read(on_device, 0, arena.size)


def _forward(session, forward: dict, arena: np.ndarray) -> np.ndarray:
    """The arena, lengthened to hold ``forward``'s dst, after ``forward``."""
    dst = next(r for r in regions(forward) if r.field == "dst")
    longer = np.zeros(dst.offset + dst.nbytes, np.uint8)
    longer[:arena.size] = arena
    return _run(session, forward, longer)


def _gradients(thunk: dict, arena: np.ndarray) -> dict[str, np.ndarray]:
    return {f: v for f, v in read(thunk, arena).items() if f.startswith("d_") and f != "d_dst"}


def _with_reserve(thunk: dict, arena: np.ndarray, written: np.ndarray) -> np.ndarray:
    start, end = thunk["reserve"], thunk["reserve"] + thunk["reserve_bytes"]
    out = arena.copy()
    out[start:end] = written[start:end]
    return out


def _assert_close(got: dict, expected: dict, tol: float, what: str) -> None:
    assert set(got) == set(expected)
    for name in expected:
        scale = np.abs(expected[name]).max() + 1e-30
        np.testing.assert_allclose(got[name], expected[name], rtol=0, atol=tol * scale, err_msg=f"{what}: {name}")


def _same_layout(thunk: dict, forward: dict, host: np.ndarray, device: np.ndarray, tol: float) -> None:
    """Every array of the reserve holds the same values in the host's and the device's forward."""
    start = thunk["reserve"]
    for slot in RESERVE_SLOTS[forward["op"]](complete(forward)):
        kind = {"f32": np.float32, "f64": np.float64}[slot.dtype]
        want, got = (run[start + slot.offset:start + slot.end].view(kind) for run in (host, device))
        np.testing.assert_allclose(got, want, rtol=0, atol=tol * (np.abs(want).max() + 1e-30), err_msg=slot.name)


def _every_way_matches_recomputing(session, op: str, case: str | dict, dtype: str = "f32",
                                   device_recomputes: bool = False) -> None:
    """The reserve the device writes against the host's, and the gradients read from a reserve the device wrote
    (backward on the host and on the device) and from one the host wrote (backward on the device) against the
    host's backward recomputing the forward (and the device's, with ``device_recomputes``: a program more to
    build, the plain backward's)."""
    thunk, arena, forward = laid_case(op, dtype, case)
    expected = _gradients(thunk, _run(None, without_reserve(thunk), arena))
    where = f"{op} {case} {dtype} at the {session.limits.target} target"
    if device_recomputes:
        _assert_close(_gradients(thunk, _run(session, without_reserve(thunk), arena)), expected, TOL[dtype],
                      f"{where}: the device recomputing")
    on_device, on_host = _forward(session, forward, arena), _forward(None, forward, arena)
    _same_layout(thunk, forward, on_host, on_device, LAYOUT_TOL[dtype])
    for what, written, reader in (("device -> host", on_device, None), ("host -> device", on_host, session),
                                  ("device -> device", on_device, session)):
        got = _gradients(thunk, _run(reader, thunk, _with_reserve(thunk, arena, written)))
        _assert_close(got, expected, TOL[dtype], f"{where}: {what}")


@needs_opencl_cpu
@pytest.mark.parametrize("op,case", CASES, ids=[f"{op}-{case}" for op, case in CASES])
def test_the_device_writes_the_host_layout_and_reads_either(cpu_session, op, case):
    _every_way_matches_recomputing(cpu_session, op, case, device_recomputes=case == "base")


@needs_opencl_cpu
@pytest.mark.parametrize("op", ["selective_scan", "mamba2"])
@pytest.mark.parametrize("dtype", ["f64", "bf16"])
def test_the_reserve_of_f64_and_16_bit_thunks(cpu_session, op, dtype):
    """f64 keeps an f64 reserve, a bf16 thunk an f32 one (the compute type)."""
    _every_way_matches_recomputing(cpu_session, op, "base", dtype)


@needs_opencl_cpu
def test_a_decode_step_writes_its_final_state(cpu_session):
    """seq 1: the kernels' decode forms give way to the walk that writes the reserve."""
    for op in ("selective_scan", "mamba2"):
        _every_way_matches_recomputing(cpu_session, op, dict(seq=1))


@needs_opencl_cpu
@pytest.mark.parametrize("op", ["selective_scan", "mamba2"])
def test_reruns_give_the_same_bytes(cpu_session, op):
    thunk, arena, forward = laid_case(op, "f32", "groups.d.z")
    first, second = _forward(cpu_session, forward, arena), _forward(cpu_session, forward, arena)
    assert np.array_equal(first, second)
    saved = _with_reserve(thunk, arena, first)
    assert np.array_equal(_run(cpu_session, thunk, saved), _run(cpu_session, thunk, saved))


def _schedule(op: str, short: int = 0) -> dict:
    """A schedule of ``op`` (the catalog's small shape) with a reserve ``short`` bytes below the minimum."""
    need = rlx_gpu.reserve_bytes({"op": op, "dtype": "f32", **SMALL[op]})
    thunk, nbytes = lay_out(op, "f32", {"reserve": True, "reserve_bytes": need - short, **SMALL[op]})
    return schedule_of(thunk, nbytes)


@needs_opencl_cpu
@pytest.mark.parametrize("op", ["selective_scan", "mamba2_backward"])
def test_the_device_runs_a_reserve_and_refuses_a_short_one_naming_the_minimum(op):
    device = rlx_gpu.get_device(OPENCL_CPU[0])
    assert {a.backend for a in device.place(_schedule(op))} == {"opencl"}
    need = rlx_gpu.reserve_bytes({"op": op, "dtype": "f32", **SMALL[op]})
    with pytest.raises(rlx_gpu.ScheduleError, match=rf"field 'reserve_bytes': expected at least {need} bytes"):
        device.run(_schedule(op, short=16))


@pytest.mark.skipif(not INTEL, reason="no Intel OpenCL runtime")
def test_intels_runtime():
    """mamba2 with its dt knobs at the cpu target: a forward and a backward program (each build costs Intel's
    runtime seconds)."""
    _every_way_matches_recomputing(open_device(find(INTEL[0]), "cpu"), "mamba2", "dt_knobs")


#: run under Oclgrind: per target and op, a forward writing the reserve (two of its chunks), then the backward
#: reading it
_OCLGRIND_SCRIPT = """
import sys
import numpy as np
sys.path.insert(0, {tests!r})
from host_fallback.abi import regions
from rlx_gpu.conformance.devices import find, open_device
from support.saved_forward import laid_case
for target in ("cpu", "gpu"):
    session = open_device(find({spec!r}), target)
    for op, case in {cases!r}:
        thunk, laid, forward = laid_case(op, "f32", case)
        dst = next(r for r in regions(forward) if r.field == "dst")
        arena = np.zeros(dst.offset + dst.nbytes, np.uint8)
        arena[:laid.size] = laid
        on_device = session.upload(arena)
        session.launch(forward, on_device)
        session.launch(thunk, on_device)
        session.finish()
        print(target, op, "ran", flush=True)
"""
_OCLGRIND_CASES = [("selective_scan", dict(batch=1, seq=34, hidden=2, delta_bias=True, d=True)),
                   ("mamba2", dict(batch=1, seq=66, heads=1, head_dim=2, z=True, carry_state=True, state=True))]


@pytest.mark.skipif("opencl:0:0" not in {i.spec for i in status("opencl").devices}, reason="no Oclgrind platform")
def test_the_reserve_kernels_are_clean_under_oclgrind():
    import importlib.util
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("oclgrind_check", root / "tools" / "oclgrind_check.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    script = _OCLGRIND_SCRIPT.format(tests=str(root / "tests"), spec="opencl:0:0", cases=_OCLGRIND_CASES)
    code, diagnostics, output = tool.run_under_oclgrind([sys.executable, "-c", script], {})
    assert code == 0, output[-3000:]
    assert output.count(" ran") == 4 and not diagnostics, "\n".join(diagnostics[:40])
