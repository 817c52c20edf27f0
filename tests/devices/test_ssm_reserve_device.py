"""selective_scan's and mamba2's saved forward (ABI.md §9.1, docs/abi.md 6a.1) on OpenCL CPU implementations at both
kernel targets: the forward's kernels (step, lanes and chunked forms) write the reserve in the host's layout (mamba2's
scores by a launch of their own), and the device backward takes its checkpoints from the reserve's states.

Per case: the values the device writes in every array of the reserve equal those the host writes (within f32
rounding), and the gradients read from a reserve the device wrote (backward on the host and on the device) and from
one the host wrote (backward on the device) equal the host's backward recomputing its forward, and the device's
own without a reserve. Reruns give the same bytes; a schedule with a reserve runs on the device, one with a short
reserve is refused naming the minimum; Intel's runtime and Oclgrind run a small sample.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from host_fallback.abi import complete
from host_fallback.abi.ssm import RESERVE_SLOTS
from rlx_gpu.conformance.devices import find, open_device
from rlx_gpu.runtime.registry import status
from support.device_reserve import (assert_close, gradients, reruns_give_the_same_bytes, run, run_forward,
                                    runs_a_reserve_and_refuses_a_short_one, under_oclgrind, with_reserve)
from support.opencl_cpu import needs_opencl_cpu
from support.saved_forward import laid_case, without_reserve

#: (op, a case of support.saved_forward.OPS): several chunks with the last partial, exact chunks, one partial
#: chunk, groups with d and z, the delta transform's fields, a carried state through slots. At the gpu target the
#: sequences of 64 tokens and more take the chunked forms, the shorter the lanes kernels.
CASES = [("selective_scan", "base"), ("selective_scan", "one_chunk"), ("selective_scan", "groups.d.z"),
         ("selective_scan", "knobs.carry.slots"),
         ("mamba2", "base"), ("mamba2", "exact_chunks"), ("mamba2", "one_chunk"), ("mamba2", "groups.d.z"),
         ("mamba2", "dt_knobs"), ("mamba2", "carry.slots")]
#: of each gradient's largest magnitude: a backward reading values another device wrote. mamba2's d_a and dt bias
#: gradient sum every token's and state's share with cancellation: the host's own reserve moves them by 1e-5
TOL = {"f64": 1e-11, "f32": 1e-4, "bf16": 2e-2}
#: of each reserve array's largest magnitude: the values the device and the host write (mamba2's scores from a
#: dot product summed in another order, its states from the chunked form on the host)
LAYOUT_TOL = {"f64": 1e-13, "f32": 1e-5, "bf16": 1e-5}
INTEL = [spec for spec in ("opencl:2:0",) if spec in {i.spec for i in status("opencl").devices}]


def _same_layout(thunk: dict, forward: dict, host: np.ndarray, device: np.ndarray, tol: float) -> None:
    """Every array of the reserve holds the same values in the host's and the device's forward."""
    start = thunk["reserve"]
    for slot in RESERVE_SLOTS[forward["op"]](complete(forward)):
        kind = {"f32": np.float32, "f64": np.float64}[slot.dtype]
        want, got = (arena[start + slot.offset:start + slot.end].view(kind) for arena in (host, device))
        np.testing.assert_allclose(got, want, rtol=0, atol=tol * (np.abs(want).max() + 1e-30), err_msg=slot.name)


def _every_way_matches_recomputing(session, op: str, case: str | dict, dtype: str = "f32",
                                   device_recomputes: bool = False) -> None:
    """The reserve the device writes against the host's, and the gradients read from a reserve the device wrote
    (backward on the host and on the device) and from one the host wrote (backward on the device) against the
    host's backward recomputing the forward (and the device's, with ``device_recomputes``: a program more to
    build, the plain backward's)."""
    thunk, arena, forward = laid_case(op, dtype, case)
    expected = gradients(thunk, run(None, without_reserve(thunk), arena))
    where = f"{op} {case} {dtype} at the {session.limits.target} target"
    if device_recomputes:
        assert_close(gradients(thunk, run(session, without_reserve(thunk), arena)), expected, TOL[dtype],
                     f"{where}: the device recomputing")
    on_device, on_host = run_forward(session, forward, arena), run_forward(None, forward, arena)
    _same_layout(thunk, forward, on_host, on_device, LAYOUT_TOL[dtype])
    for what, written, reader in (("device -> host", on_device, None), ("host -> device", on_host, session),
                                  ("device -> device", on_device, session)):
        got = gradients(thunk, run(reader, thunk, with_reserve(thunk, arena, written)))
        assert_close(got, expected, TOL[dtype], f"{where}: {what}")


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
    reruns_give_the_same_bytes(cpu_session, *laid_case(op, "f32", "groups.d.z"))


@needs_opencl_cpu
@pytest.mark.parametrize("op", ["selective_scan", "mamba2_backward"])
def test_the_device_runs_a_reserve_and_refuses_a_short_one_naming_the_minimum(op):
    runs_a_reserve_and_refuses_a_short_one(op)


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
    tests = str(Path(__file__).resolve().parents[1])
    code, diagnostics, output = under_oclgrind(_OCLGRIND_SCRIPT.format(tests=tests, spec="opencl:0:0",
                                                                       cases=_OCLGRIND_CASES))
    assert code == 0, output[-3000:]
    assert output.count(" ran") == 4 and not diagnostics, "\n".join(diagnostics[:40])
