"""gated_delta_net_backward's chunked form (kernels/gdn_chunk_backward.cl, launches/gdn_backward.py) on OpenCL, at
both kernel targets.

With batch rows the plan runs the chunked launches, not the step walk: from a saved forward (ABI.md §9.1), or
without one recomputing it with the forward's kernels. Each case writes the reserve with the device's own forward,
runs the backward from it and compares every gradient field with the float64 reference of ABI.md §9
(rlx_gpu/conformance/reference_gdn_backward.py: a plain loop over steps, independent of the kernels), with the step
walk (``ssm_kernel="lanes"``) and with the chunked backward recomputing (the same thunk without a reserve) on the
same device; f32 at both targets with every field the chunked form takes (grouped value heads, K != V, K past the
chunk's 32 tokens, q/k L2-norm, scale, a carried state into slots, a partial chunk), f16 and bf16 (an f32 state) at
the gpu target; reruns give the same bytes; zeroing any of the reserve's arrays changes the gradients (each is read);
a gate of -inf gives the walk's finite gradients; per-channel gates (f32, both targets, every field above) run
chunked too, d_g per key channel; packed sequences keep the walk. One case on
Intel's OpenCL CPU runtime (the second compiler), one under Oclgrind at each target (per-channel gates at the gpu
target).
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("rlx_gpu.backends.opencl")
from host_fallback.abi import complete, regions  # noqa: E402
from host_fallback.abi.gdn import reserve_slots  # noqa: E402
from rlx_gpu import launches  # noqa: E402
from rlx_gpu.conformance import runner  # noqa: E402
from rlx_gpu.conformance.catalog import Case  # noqa: E402
from rlx_gpu.conformance.compare import nmse  # noqa: E402
from rlx_gpu.conformance.devices import find, open_device  # noqa: E402
from rlx_gpu.conformance.reference_gdn_backward import backward as float64_backward  # noqa: E402
from rlx_gpu.runtime.config import load_config  # noqa: E402
from rlx_gpu.runtime.registry import status  # noqa: E402
from support.conformance_devices import KERNEL_OPENCL  # noqa: E402
from support.device_reserve import (gradients, reruns_give_the_same_bytes, run, run_forward,  # noqa: E402
                                    under_oclgrind, with_reserve)
from support.gradient_check import read  # noqa: E402
from support.saved_forward import laid_case, without_reserve  # noqa: E402

OP = "gated_delta_net"
CHUNKED = {"gdn_chunk_back_pass", "gdn_chunk_back_grads", "gdn_backward_qk"}
#: over tests/support/saved_forward.py's base (B2 S70 H2 K4: chunks of 32, the last partial): grouped value heads,
#: K past a chunk's tokens and V apart from it, L2-norm, scale, a carried state into slots (one slot no row names)
EVERY = dict(value_heads=4, state_size=37, value_size=5, qk_l2norm=True, scale=0.7, carry_state=True,
             state_slots=[2, 0], num_slots=3)
#: per-channel gates (a log-decay per key channel, d_g per key channel) with the same fields
CHANNELS = dict(EVERY, gate_per_channel=True)
CASES = [("cpu", "f32", EVERY), ("gpu", "f32", EVERY), ("cpu", "f32", CHANNELS), ("gpu", "f32", CHANNELS),
         ("gpu", "bf16", dict(qk_l2norm=True, carry_state=True, state_dtype="f32")),
         ("gpu", "f16", dict(seq=64))]


@pytest.fixture(scope="module")
def sessions():
    return {target: open_device(find(KERNEL_OPENCL[0]), target) for target in ("cpu", "gpu")}


def _float64(thunk: dict, arena: np.ndarray) -> dict[str, np.ndarray]:
    """The float64 reference's gradients on the values in ``arena`` (as the thunk stores them)."""
    values, shapes = read(thunk, arena), {r.field: r.shape for r in regions(thunk)}
    want = float64_backward(complete(thunk), lambda field: values[field].reshape(shapes[field]))
    return {field: want[field] for field in gradients(thunk, arena)}


def _kernels(thunk: dict, session, **options) -> set[str]:
    return {launch.kernel for launch in launches.plan(thunk, session.limits, **options).launches}


def _check(session, dtype: str, case: dict, walk: bool = True) -> None:
    """The case's gradients from a reserve the device's forward wrote (``walk``; else the host's) against the
    float64 reference and (``walk``) the device's step walk."""
    thunk, arena, forward = laid_case(OP, dtype, case)
    assert CHUNKED <= _kernels(thunk, session) and "gated_delta_net_backward" not in _kernels(thunk, session)
    saved = with_reserve(thunk, arena, run_forward(session if walk else None, forward, arena))
    got = gradients(thunk, run(session, thunk, saved))
    want, bound = _float64(thunk, arena), load_config().tolerance(f"{OP}_backward", dtype)
    expected = [("the float64 reference", want)]
    if walk:
        recomputing = without_reserve(thunk)
        assert CHUNKED <= _kernels(recomputing, session) and "gated_delta_net_backward" in _kernels(
            recomputing, session, ssm_kernel="lanes")
        expected += [("the step walk", gradients(thunk, run(session, recomputing, arena, ssm_kernel="lanes"))),
                     ("recomputing its chunks", gradients(thunk, run(session, recomputing, arena)))]
    target = session.limits.target
    for field, value in got.items():
        for who, by_field in expected:
            expected_value = by_field[field]
            err = nmse(value.reshape(-1), np.asarray(expected_value, np.float64).reshape(-1))
            assert err < bound, f"{target} {dtype} {field}: nmse {err:.3g} against {who} (bound {bound:.3g})"


@pytest.mark.parametrize("target, dtype, case", CASES,
                         ids=[f"{t}-{d}{'-channels' if c.get('gate_per_channel') else ''}" for t, d, c in CASES])
def test_gradients_match_the_float64_reference_and_the_step_walk(sessions, target, dtype, case):
    _check(sessions[target], dtype, case)


def test_each_array_of_the_reserve_is_read_and_reruns_give_the_same_bytes(sessions):
    session = sessions["gpu"]
    thunk, arena, forward = laid_case(OP, "f32", EVERY)
    saved = with_reserve(thunk, arena, run_forward(session, forward, arena))
    got = gradients(thunk, run(session, thunk, saved))
    for slot in reserve_slots(complete(thunk)):
        emptied = saved.copy()
        emptied[thunk["reserve"] + slot.offset:thunk["reserve"] + slot.end] = 0
        changed = gradients(thunk, run(session, thunk, emptied))
        assert any(not np.allclose(changed[f], got[f], rtol=1e-4, atol=1e-6) for f in got), slot.name
    reruns_give_the_same_bytes(session, thunk, arena, forward)


def test_a_gate_of_minus_infinity_gives_the_step_walks_finite_gradients(sessions):
    """A decay of exactly 0 (g = -inf at step 5) inside a chunk: the chunk's log-decays are floored, so no ratio
    of two infinite ones turns NaN."""
    session = sessions["gpu"]
    laid = runner.lay_out(Case(f"{OP}_backward", "f32", dict(batch=1, seq=40, heads=2, state_size=4,
                                                            gate_per_channel=False, carry_state=False),
                               poison="g", poison_step=5, poison_value=-np.inf))
    chunked = gradients(laid.thunk, run(session, laid.thunk, laid.arena))
    walked = gradients(laid.thunk, run(session, laid.thunk, laid.arena, ssm_kernel="lanes"))
    for field, value in chunked.items():
        assert np.isfinite(value).all() and np.isfinite(walked[field]).all(), field
        np.testing.assert_allclose(value, walked[field], rtol=0, atol=1e-5 * np.abs(walked[field]).max(), err_msg=field)


def test_packed_sequences_keep_the_step_walk(sessions):
    packed = runner.lay_out(Case(f"{OP}_backward", "f32", dict(batch=1, seq=20, heads=2, state_size=4,
                                                              gate_per_channel=False, carry_state=False,
                                                              cu_seqlens=[0, 7, 20], num_seqs=2))).thunk
    for session in sessions.values():
        assert not CHUNKED - {"gdn_backward_qk"} & _kernels(packed, session)


_SECOND = [spec for spec in ("opencl:2:0",) if spec in {i.spec for i in status("opencl").devices}]


@pytest.mark.skipif(not _SECOND, reason="no Intel OpenCL runtime")
def test_the_second_opencl_compiler_runs_it_too():
    """One f32 case at the cpu target on Intel's CPU runtime from the host's reserve (seconds a program build: the
    backward's program alone)."""
    _check(open_device(find(_SECOND[0]), "cpu"), "f32", dict(EVERY, state_size=6, seq=40, qk_l2norm=False), walk=False)


#: run under Oclgrind: at the cpu target the backward recomputing its saved forward (the state copied, the walk
#: recording it), at the gpu target, with per-channel gates (their decays shared by the lanes through scratch),
#: reading the one the host's forward wrote
_OCLGRIND_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from rlx_gpu.conformance.devices import find, open_device
from support.device_reserve import run, run_forward, with_reserve
from support.saved_forward import laid_case, without_reserve
thunk, arena, forward = laid_case("gated_delta_net", "f32", {params!r})
run(open_device(find({spec!r}), "cpu"), without_reserve(thunk), arena)
print("cpu ran", flush=True)
thunk, arena, forward = laid_case("gated_delta_net", "f32", dict({params!r}, gate_per_channel=True))
run(open_device(find({spec!r}), "gpu"), thunk, with_reserve(thunk, arena, run_forward(None, forward, arena)))
print("gpu ran", flush=True)
"""
_OCLGRIND_PARAMS = dict(batch=1, seq=36, heads=1, value_heads=2, state_size=3, value_size=2, carry_state=True)


@pytest.mark.skipif("opencl:0:0" not in {i.spec for i in status("opencl").devices}, reason="no Oclgrind platform")
def test_the_chunked_kernels_are_clean_under_oclgrind():
    from pathlib import Path
    script = _OCLGRIND_SCRIPT.format(tests=str(Path(__file__).resolve().parents[1]), spec="opencl:0:0",
                                     params=_OCLGRIND_PARAMS)
    code, diagnostics, output = under_oclgrind(script)
    assert code == 0, output[-3000:]
    assert output.count(" ran") == 2 and not diagnostics, "\n".join(diagnostics[:40])
