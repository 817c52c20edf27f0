"""mamba3_backward's chunked form at the gpu target (kernels/mamba3_chunk_backward.cl, launches/mamba3_chunk_backward.py)
on OpenCL.

Each case runs rows of at least M3C_MIN_SEQ tokens (whole chunks of M3C_Q and a partial one) at the gpu target on
PoCL, where the plan takes the chunked launches, and every gradient field is compared with the conformance catalog's
float64 reference of ABI.md §11 (rlx_gpu/conformance/reference_mamba3.py: §11's six steps reversed token by token,
independent of the kernels) and with the step walk (kernels/mamba3_backward.cl) on the same arena: every field the
chunked kernels take (groups, both biases, d, z, the four carried states into slots, f32 step inputs, parameters and
states beside a 16-bit thunk), each dtype they run (f32, f16, bf16); the same bytes on a second run. One case on
Intel's OpenCL CPU runtime (the second compiler) and one under Oclgrind's checkers.
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("rlx_gpu.backends.opencl")
from rlx_gpu import launches  # noqa: E402
from rlx_gpu.conformance import runner  # noqa: E402
from rlx_gpu.conformance.catalog import Case  # noqa: E402
from rlx_gpu.conformance.compare import nmse  # noqa: E402
from rlx_gpu.conformance.devices import find, open_device  # noqa: E402
from rlx_gpu.runtime.config import load_config  # noqa: E402
from rlx_gpu.runtime.registry import status  # noqa: E402
from support.conformance_devices import KERNEL_OPENCL, SPECS  # noqa: E402
from support.device_reserve import gradients, run, under_oclgrind  # noqa: E402

CHUNKED = {"mamba3_cb_states", "mamba3_cb_pass", "mamba3_cb_chunk"}
_CARRIED = dict(carry_state=True, angle_state=True, state=True, k_state=True, v_state=True, d_angle_state=True,
                d_state=True, d_k_state=True, d_v_state=True)
_EVERY = dict(groups=2, q_bias=True, k_bias=True, d=True, z=True, d_q_bias=True, d_k_bias=True, d_d=True, d_z=True)
CASES = [
    # every field, two batch rows into slots (one pool entry no row names), two whole chunks and a partial one
    Case("mamba3_backward", "f32", dict(batch=2, seq=150, heads=4, head_dim=5, state_size=8, num_angles=3,
                                        state_slots=[2, 0], num_slots=3, **_EVERY, **_CARRIED)),
    # a 16-bit thunk with f32 step inputs, parameters and states
    Case("mamba3_backward", "bf16", dict(batch=1, seq=100, heads=2, head_dim=4, state_size=6, num_angles=2, d=True,
                                         z=True, d_d=True, d_z=True, dt_dtype="f32", param_dtype="f32",
                                         state_dtype="f32", **_CARRIED)),
    # version 1 in f16: one whole chunk per row
    Case("mamba3_backward", "f16", dict(batch=2, seq=64, heads=2, head_dim=3, state_size=4, num_angles=1)),
]


@pytest.fixture(scope="module")
def session():
    return open_device(find(KERNEL_OPENCL[0]), "gpu")


def _check(session, case: Case) -> None:
    """``case`` planned chunked on ``session``: each gradient within the dtype's NMSE bound of the float64 reference
    and of the step walk, the same bytes a second time."""
    laid = runner.lay_out(case)
    kernels = {launch.kernel for launch in launches.plan(laid.thunk, session.limits).launches}
    assert CHUNKED <= kernels and "mamba3_backward_walk" not in kernels, kernels
    arena = run(session, laid.thunk, laid.arena)
    got, want = gradients(laid.thunk, arena), laid.reference()
    walked = gradients(laid.thunk, run(session, laid.thunk, laid.arena, ssm_kernel="lanes"))
    assert set(got) == {f for f in case.params if f.startswith("d_")} | {
        "d_q", "d_k", "d_v", "d_adt", "d_dt", "d_trap", "d_angles"}, sorted(got)
    bound = load_config().tolerance(case.op, case.dtype)
    for field, value in got.items():
        for name, other in (("the float64 reference", want[field]), ("the step walk", walked[field])):
            err = nmse(np.reshape(value, -1), np.reshape(other, -1))
            assert err < bound, f"{case.dtype} {field}: nmse {err:.3g} against {name} (bound {bound:.3g})"
    assert np.array_equal(run(session, laid.thunk, laid.arena), arena), "a second run gave other bytes"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.dtype)
def test_gradients_match_the_float64_reference_and_the_step_walk(session, case):
    _check(session, case)


def test_packed_sequences_and_f64_keep_the_step_walk(session):
    packed = runner.lay_out(Case("mamba3_backward", "f32", dict(batch=1, seq=100, heads=1, head_dim=3, state_size=4,
                                                                 num_angles=1, cu_seqlens=[0, 60, 100], num_seqs=2)))
    wide = runner.lay_out(Case("mamba3_backward", "f64", dict(CASES[2].params)))
    for laid in (packed, wide):
        kernels = {launch.kernel for launch in launches.plan(laid.thunk, session.limits).launches}
        assert "mamba3_backward_walk" in kernels and not CHUNKED & kernels, kernels


_SECOND = [s for s in SPECS if s.startswith("opencl") and s not in KERNEL_OPENCL]


@pytest.mark.skipif(not _SECOND, reason="no second OpenCL implementation among the test devices")
def test_the_second_opencl_compiler_runs_it_too():
    """One small f32 case with every field on the other OpenCL implementation (Intel's CPU runtime: seconds a
    program build, so one program)."""
    _check(open_device(find(_SECOND[0]), "gpu"), Case("mamba3_backward", "f32", dict(
        batch=1, seq=70, heads=2, head_dim=3, state_size=4, num_angles=2, **_EVERY, **_CARRIED)))


_OCLGRIND_SCRIPT = """
import numpy as np
from rlx_gpu.conformance import runner
from rlx_gpu.conformance.catalog import Case
from rlx_gpu.conformance.devices import find, open_device
session = open_device(find({spec!r}), "gpu")
laid = runner.lay_out(Case("mamba3_backward", "f32", {params!r}))
arena = session.upload(laid.arena)
session.launch(laid.thunk, arena, ssm_kernel="chunked")
session.finish()
print("ran", flush=True)
"""
#: two chunks (the second partial) of one row with the four carried states, at the smallest sizes
_OCLGRIND_PARAMS = dict(batch=1, seq=70, heads=1, head_dim=2, state_size=4, num_angles=1, d=True, z=True, d_d=True,
                        d_z=True, **_CARRIED)


@pytest.mark.skipif("opencl:0:0" not in {i.spec for i in status("opencl").devices}, reason="no Oclgrind platform")
def test_the_chunked_kernels_are_clean_under_oclgrind():
    code, diagnostics, output = under_oclgrind(_OCLGRIND_SCRIPT.format(spec="opencl:0:0", params=_OCLGRIND_PARAMS))
    assert code == 0, output[-3000:]
    assert output.count("ran") == 1 and not diagnostics, "\n".join(diagnostics[:40])
