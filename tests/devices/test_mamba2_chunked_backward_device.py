"""mamba2_backward's chunked form at the gpu target (kernels/mamba2_backward.cl, launches/mamba2_backward.py) on
OpenCL.

Each case runs a sequence of at least M2_MIN_SEQ steps (whole chunks of M2_Q and a partial one) at the gpu target
on PoCL, where the plan takes the chunked launches, and its gradients are compared with the conformance catalog's
float64 reference of ABI.md §9 (rlx_gpu/conformance/reference_mamba2_backward.py: a loop over steps, independent
of the kernels) and with the step walk (kernels/ssm_backward.cl) on the same arena; every field the kernels take
(groups, dt bias and its gradient, softplus, the clamp, d, z, a carried state into slots, f32 state and
parameters beside bf16), every dtype they run (f32, f16, bf16); the same bytes on a second run; a NaN in d_dst
reaching only the steps that depend on it; and one case on Intel's OpenCL CPU runtime, the second compiler.
Given a saved forward (ABI.md §9.1) written by the host's forward or the device's, the plan runs no
mamba2_chunk_state and the gradients equal the recomputing chunked backward's and the float64 reference's on the same
values; zeroing any of the reserve's arrays (states, y, scores) changes them (each is read), and reruns give the
same bytes.
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("rlx_gpu.backends.opencl")
from host_fallback.abi import complete, regions  # noqa: E402
from host_fallback.abi.ssm import mamba2_reserve_slots  # noqa: E402
from rlx_gpu import launches  # noqa: E402
from rlx_gpu.conformance import runner  # noqa: E402
from rlx_gpu.conformance.catalog import Case  # noqa: E402
from rlx_gpu.conformance.compare import nmse  # noqa: E402
from rlx_gpu.conformance.reference_mamba2_backward import backward as float64_backward  # noqa: E402
from rlx_gpu.conformance.devices import find, open_device  # noqa: E402
from rlx_gpu.runtime.config import load_config  # noqa: E402
from support.conformance_devices import KERNEL_OPENCL, SPECS  # noqa: E402
from support.device_reserve import (assert_close, gradients, reruns_give_the_same_bytes, run,  # noqa: E402
                                    run_forward, with_reserve)
from support.saved_forward import laid_case, without_reserve  # noqa: E402

CHUNKED = {"mamba2_chunk_state", "mamba2_backward_dstate", "mamba2_backward_pass", "mamba2_backward_chunk"}
_CARRIED = dict(carry_state=True, state=True, d_state=True)
_EVERY = dict(groups=2, dt_bias=True, d_dt_bias=True, dt_softplus=True, dt_limit=[0.05, 1.5], d=True, d_d=True, z=True,
              d_z=True)
CASES = [
    # every field, two batch rows into slots (one pool entry no row names), two whole chunks and a partial one
    Case("mamba2_backward", "f32", dict(batch=2, seq=130, heads=4, head_dim=5, state_size=6, state_slots=[2, 0],
                                        num_slots=3, **_EVERY, **_CARRIED)),
    # a 16-bit thunk with f32 state and parameters, an open clamp
    Case("mamba2_backward", "bf16", dict(batch=1, seq=100, heads=2, head_dim=4, state_size=3, groups=1, dt_bias=True,
                                         d_dt_bias=True, dt_softplus=True, dt_limit=[0.0, None], d=True, d_d=True,
                                         z=True, d_z=True, state_dtype="f32", param_dtype="f32", **_CARRIED)),
    # version 1 in f16: one whole chunk per row
    Case("mamba2_backward", "f16", dict(batch=2, seq=64, heads=2, head_dim=3, state_size=4, groups=1)),
]


@pytest.fixture(scope="module")
def session():
    return open_device(find(KERNEL_OPENCL[0]), "gpu")


def _run(session, laid, **options) -> np.ndarray:
    arena = session.upload(laid.arena)
    with np.errstate(all="ignore"):
        session.launch(laid.thunk, arena, **options)
    session.finish()
    return session.read(arena, 0, laid.arena.size)


def _gradients(laid, arena: np.ndarray) -> dict[str, np.ndarray]:
    return {r.field: laid.view(arena, r.field) for r in laid.regions if r.field.startswith("d_") and r.field != "d_dst"}


def _check(session, case: Case) -> None:
    laid = runner.lay_out(case)
    assert session.unsupported(laid.thunk) is None, session.unsupported(laid.thunk)
    kernels = {launch.kernel for launch in launches.plan(laid.thunk, session.limits).launches}
    assert CHUNKED <= kernels and "mamba2_backward" not in kernels, kernels
    got = _run(session, laid)
    walked = _gradients(laid, _run(session, laid, ssm_kernel="lanes"))
    bound = load_config().tolerance(case.op, case.dtype)
    want = laid.reference()
    for field, value in _gradients(laid, got).items():
        err = nmse(value, want[field].reshape(-1))
        assert err < bound, f"{case.dtype} {field}: nmse {err:.3g} against the float64 reference (bound {bound:.3g})"
        err = nmse(value, walked[field])
        assert err < bound, f"{case.dtype} {field}: nmse {err:.3g} against the step walk (bound {bound:.3g})"
    assert np.array_equal(_run(session, laid), got), "a second run gave other bytes"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.dtype)
def test_gradients_match_the_float64_reference_and_the_step_walk(session, case):
    _check(session, case)


def test_a_nan_in_d_dst_reaches_only_the_steps_it_depends_on(session):
    # the f32 case above poisoned at step 100 of row 0 (its programs)
    case = Case("mamba2_backward", "f32", CASES[0].params, poison="d_dst", poison_step=100, poison_value=np.nan)
    laid = runner.lay_out(case)
    got = _run(session, laid)
    dx, dz, d_b, d_c, d_dt = (laid.view(got, f).reshape(2, 130, -1) for f in ("d_x", "d_z", "d_b", "d_c", "d_dt"))
    assert np.isnan(dx[0, :101]).any() and np.isfinite(dx[0, 101:]).all() and np.isfinite(dx[1]).all()
    assert np.isnan(dz[0, 100, 0]) and np.isfinite(dz[0, 101:]).all() and np.isfinite(dz[1]).all()
    assert np.isnan(d_b[0, :101]).any() and np.isfinite(d_b[0, 101:]).all() and np.isfinite(d_b[1]).all()
    assert np.isfinite(d_c[0, 101:]).all() and np.isfinite(d_dt[0, 101:]).all() and np.isfinite(d_dt[1]).all()
    state = laid.view(got, "d_state").reshape(3, -1)  # row 0's entry is slot 2, row 1's slot 0
    assert np.isnan(state[2]).any() and np.isfinite(state[0]).all()


#: support.saved_forward's mamba2 base (two rows of 150 steps: two whole chunks and a partial one) with every field
#: that moves the states: groups, d, z, the dt transform, a carried state into slots
_SAVED = dict(heads=4, groups=2, d=True, z=True, dt_bias=True, dt_softplus=True, carry_state=True, state=True,
              state_slots=[2, 0], num_slots=3)
#: of each gradient's largest magnitude (test_ssm_reserve_device's f32 bound: d_a and the dt bias's gradient sum
#: every token's share with cancellation)
_SAVED_TOL = 1e-4


def _kernels(thunk: dict, session) -> list[str]:
    return [launch.kernel for launch in launches.plan(thunk, session.limits).launches]


def _flat(grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {field: np.asarray(value, np.float64).reshape(-1) for field, value in grads.items()}


def _float64(thunk: dict, arena: np.ndarray) -> dict[str, np.ndarray]:
    """The float64 reference's gradients of the f32 ``thunk`` on the values in ``arena``."""
    by_field = {r.field: r for r in regions(thunk)}

    def load(field: str) -> np.ndarray:
        r = by_field[field]
        stored = np.int32 if r.dtype == "i32" else np.float32  # state_slots, or an f32 tensor
        return arena[r.offset:r.offset + r.nbytes].view(stored).astype(np.float64).reshape(r.shape)
    want = float64_backward(complete(thunk), load)
    return _flat({field: want[field] for field in gradients(thunk, arena)})


def test_a_saved_forward_replaces_the_recomputed_states(session):
    thunk, arena, forward = laid_case("mamba2", "f32", _SAVED)
    recomputing = without_reserve(thunk)
    kernels, recomputed = _kernels(thunk, session), _kernels(recomputing, session)
    assert "mamba2_chunk_state" in recomputed and "mamba2_chunk_state" not in kernels, kernels
    assert CHUNKED - {"mamba2_chunk_state"} <= set(kernels) and len(kernels) == len(recomputed) - 1, kernels
    chunked, float64 = _flat(gradients(thunk, run(session, recomputing, arena))), _float64(thunk, arena)
    by_host = with_reserve(thunk, arena, run_forward(None, forward, arena))
    for who, saved in (("host", by_host), ("device", with_reserve(thunk, arena, run_forward(session, forward, arena)))):
        got = _flat(gradients(thunk, run(session, thunk, saved)))
        assert_close(got, chunked, _SAVED_TOL, f"a reserve the {who} wrote, against the recomputing chunked backward")
        assert_close(got, float64, _SAVED_TOL, f"a reserve the {who} wrote, against the float64 reference")
    for slot in mamba2_reserve_slots(complete(thunk)):
        emptied = by_host.copy()
        emptied[thunk["reserve"] + slot.offset:thunk["reserve"] + slot.end] = 0
        got = _flat(gradients(thunk, run(session, thunk, emptied)))
        assert any(not np.allclose(value, chunked[field], rtol=0, atol=_SAVED_TOL * np.abs(chunked[field]).max())
                   for field, value in got.items()), f"the reserve's {slot.name} zeroed left the gradients as they were"
    reruns_give_the_same_bytes(session, thunk, arena, forward)


_SECOND = [s for s in SPECS if s.startswith("opencl") and s not in KERNEL_OPENCL]


@pytest.mark.skipif(not _SECOND, reason="no second OpenCL implementation among the test devices")
def test_the_second_opencl_compiler_runs_it_too():
    """One small f32 case with every field on the other OpenCL implementation (Intel's CPU runtime: seconds a
    program build, so one program)."""
    session = open_device(find(_SECOND[0]), "gpu")
    _check(session, Case("mamba2_backward", "f32", dict(batch=1, seq=70, heads=2, head_dim=3, state_size=4,
                                                        **_EVERY, **_CARRIED)))
