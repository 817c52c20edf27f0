"""gated_delta_net's saved forward (ABI.md §9.1, docs/abi.md 6a.1) on OpenCL CPU implementations at both kernel
targets: the device forward (the cpu target's walk, the gpu target's lanes and chunked forms) writes the reserve in
the host's layout, and the device backward reads its states as checkpoints instead of walking the forward.

The gradients from a reserve equal (within rounding) those the host computes recomputing its forward, for a reserve
written on the device and read by the host, written by the host and read on the device, and both on the device;
the values the device writes equal the host's (f32); a zeroed reserve changes what the device backward gives (it reads
it); reruns give the same bytes; a schedule with a reserve runs on the device, one with a short reserve is refused
naming the minimum. PoCL's device runs it at both targets, Intel's runtime one case at the cpu target; Oclgrind
checks one case per target.
"""
from __future__ import annotations

import numpy as np
import pytest

from host_fallback.abi import complete, regions
from host_fallback.abi.gdn import reserve_slots
from rlx_gpu import launches
from rlx_gpu.conformance.devices import find, open_device
from rlx_gpu.conformance.reference_gdn_backward import backward as float64_backward
from rlx_gpu.launches.cost import launch_cost
from rlx_gpu.runtime.registry import status
from support.device_reserve import (assert_close, gradients, run, run_forward, runs_a_reserve_and_refuses_a_short_one,
                                    under_oclgrind, with_reserve)
from support.gradient_check import read
from support.opencl_cpu import needs_opencl_cpu
from support.saved_forward import laid_case, without_reserve

OP = "gated_delta_net"
#: over tests/support/saved_forward.py's base (B2, S70: three chunks of 32, the last partial; at the gpu target the
#: chunked form): per-head gates; grouped value heads with K != V, q/k L2-norm and whole chunks; per-channel gates
#: and a carried state in slots; a decode step
CASES = {"per_head": {},
         "groups.width.l2.scale.whole_chunks": dict(value_heads=4, value_size=3, qk_l2norm=True, scale=0.7, seq=64),
         "carry.slots.per_channel": dict(carry_state=True, state_slots=[2, 0], num_slots=3, gate_per_channel=True),
         "decode": dict(seq=1, carry_state=True)}
TOL = {"f64": 1e-11, "f32": 2e-5, "bf16": 2e-2}  # of each gradient's largest magnitude
#: the other OpenCL CPU implementation: Intel's runtime
OTHER_DEVICES = [spec for spec in ("opencl:2:0",) if spec in {i.spec for i in status("opencl").devices}]


def _same_layout(session, forward: dict, host: np.ndarray, device: np.ndarray) -> None:
    """Every value of the reserve, the host's forward and the device's write as the same number (within f32
    rounding), slot by slot; the bytes past the last slot are nobody's."""
    start = forward["reserve"]
    for slot in reserve_slots(complete(forward)):
        want, got = (x[start + slot.offset:start + slot.end].view(np.float32) for x in (host, device))
        np.testing.assert_allclose(got, want, rtol=0, atol=4e-6 * (np.abs(want).max() + 1),
                                   err_msg=f"{slot.name} at the {session.limits.target} target")


def _every_way_matches_recomputing(session, case: dict, dtype: str = "f32") -> None:
    """The gradients read from a reserve the device wrote (backward on the host and on the device), and from one
    the host wrote (backward on the device), against the host's backward recomputing its forward; at f32 the
    reserve's values against the host's."""
    thunk, arena, forward = laid_case(OP, dtype, case)
    expected = gradients(thunk, run(None, without_reserve(thunk), arena))
    on_device, on_host = run_forward(session, forward, arena), run_forward(None, forward, arena)
    if dtype == "f32":
        _same_layout(session, forward, on_host, on_device)
    for what, written, reader in (("device -> host", on_device, None), ("host -> device", on_host, session),
                                  ("device -> device", on_device, session)):
        got = gradients(thunk, run(reader, thunk, with_reserve(thunk, arena, written)))
        assert_close(got, expected, TOL[dtype], f"{what} at the {session.limits.target} target")


@needs_opencl_cpu
@pytest.mark.parametrize("case", list(CASES))
def test_gradients_from_a_reserve_match_recomputing_across_devices(cpu_session, case):
    _every_way_matches_recomputing(cpu_session, CASES[case])


@needs_opencl_cpu
@pytest.mark.parametrize("dtype", ["f64", "bf16"])
def test_the_reserve_of_f64_and_16_bit_thunks(cpu_session, dtype):
    """f64 keeps an f64 reserve (the gpu target's lanes kernel), a bf16 thunk an f32 one (the compute type)."""
    _every_way_matches_recomputing(cpu_session, dict(CASES["carry.slots.per_channel"], qk_l2norm=True), dtype)


def _gates_past_the_split(thunk: dict, arena: np.ndarray) -> np.ndarray:
    """``arena`` with per-channel log-decays that the reserve's products cannot all factor through a chunk's middle
    token (kernels/gdn.cl gdn_reserve_grams): channel 1 strongly negative everywhere (-3 a step), channel 2 -inf
    at tokens 5 and 40, channel 17 (the second slice of 16 channels) saturated once (-200 at token 33), channel 3
    positive (+0.05); the others as drawn, so each slice has chunks that factor, chunks that do partly and
    (channels 16..) chunks that do wholly."""
    region = next(r for r in regions(thunk) if r.field == "g")
    g = arena[region.offset:region.offset + region.nbytes].view(np.float32).reshape(region.shape).copy()
    g[..., 1] = -3.0
    g[:, [5, 40], :, 2] = -np.inf
    g[:, 33, :, 17] = -200.0
    g[..., 3] = 0.05
    out = arena.copy()
    out[region.offset:region.offset + region.nbytes] = g.reshape(-1).view(np.uint8)
    return out


@needs_opencl_cpu
def test_the_reserve_of_gates_its_products_cannot_factor_matches_the_host(cpu_session):
    """The decayed products where a channel's decay is split at the chunk's middle token and where it is summed
    pair by pair, against the host's reserve; the gradients read from the device's reserve (device and host
    backward) against the float64 reference and the host recomputing, all finite."""
    thunk, arena, forward = laid_case(OP, "f32", dict(gate_per_channel=True, state_size=20, value_size=5,
                                                      value_heads=4, qk_l2norm=True))
    arena = _gates_past_the_split(thunk, arena)
    on_device, on_host = run_forward(cpu_session, forward, arena), run_forward(None, forward, arena)
    _same_layout(cpu_session, forward, on_host, on_device)
    values, shapes = read(thunk, arena), {r.field: r.shape for r in regions(thunk)}
    reference = float64_backward(complete(thunk), lambda field: values[field].reshape(shapes[field]))
    expected = gradients(thunk, run(None, without_reserve(thunk), arena))
    for reader in (None, cpu_session):
        got = gradients(thunk, run(reader, thunk, with_reserve(thunk, arena, on_device)))
        assert all(np.isfinite(x).all() for x in got.values())
        assert_close(got, expected, TOL["f32"], f"{cpu_session.limits.target} reserve read on {reader or 'the host'}")
        assert_close(got, {f: reference[f] for f in got}, TOL["f32"], "against the float64 reference")


@needs_opencl_cpu
def test_the_device_backward_reads_the_reserve_and_reruns_give_the_same_bytes(cpu_session):
    thunk, arena, forward = laid_case(OP, "f32", dict(CASES["carry.slots.per_channel"], qk_l2norm=True))
    first, second = run_forward(cpu_session, forward, arena), run_forward(cpu_session, forward, arena)
    assert np.array_equal(first, second)
    saved = with_reserve(thunk, arena, first)
    after = run(cpu_session, thunk, saved)
    assert np.array_equal(after, run(cpu_session, thunk, saved))
    zeroed = with_reserve(thunk, arena, np.zeros_like(first))
    assert not np.allclose(gradients(thunk, run(cpu_session, thunk, zeroed))["d_q"],
                           gradients(thunk, after)["d_q"]), "the device backward ignored its reserve"


@needs_opencl_cpu
@pytest.mark.parametrize("op", [OP, f"{OP}_backward"])
def test_the_device_runs_a_reserve_and_refuses_a_short_one_naming_the_minimum(op):
    runs_a_reserve_and_refuses_a_short_one(op)


@needs_opencl_cpu
def test_every_kernel_of_a_forward_writing_a_reserve_and_its_backward_declares_its_cost(cpu_session):
    for case in ("carry.slots.per_channel", "groups.width.l2.scale.whole_chunks"):
        backward, _, forward = laid_case(OP, "f32", CASES[case])
        plans = [launches.plan(complete(t), cpu_session.limits) for t in (forward, backward)]
        assert {launch.kernel for launch in plans[0].launches} >= {"gdn_reserve_grams", "gdn_reserve_inverse"}
        assert all(launch_cost(launch) is not None for plan in plans for launch in plan.launches), case


@pytest.mark.skipif(not OTHER_DEVICES, reason="no Intel OpenCL runtime")
@pytest.mark.parametrize("spec", OTHER_DEVICES)
def test_other_opencl_implementations(spec):
    session = open_device(find(spec), "cpu")
    _every_way_matches_recomputing(session, dict(CASES["carry.slots.per_channel"], qk_l2norm=True))


#: run under Oclgrind: per target, a forward writing the reserve, then the backward reading it
_OCLGRIND_SCRIPT = """
import numpy as np
import rlx_gpu
from host_fallback.abi import regions
from rlx_gpu.conformance import runner
from rlx_gpu.conformance.catalog import Case
from rlx_gpu.conformance.devices import find, open_device
params = {params!r}
for target in ("cpu", "gpu"):
    session = open_device(find({spec!r}), target)
    need = rlx_gpu.reserve_bytes(dict(params, op="gated_delta_net", dtype="f32"))
    laid = runner.lay_out(Case("gated_delta_net_backward", "f32", dict(params, reserve=True, reserve_bytes=need)))
    forward = {{k: v for k, v in laid.thunk.items() if not k.startswith("d_")}}
    forward.update(op="gated_delta_net", dst=-(-laid.arena.size // 256) * 256)
    dst = next(r for r in regions(forward) if r.field == "dst")
    arena = np.zeros(dst.offset + dst.nbytes, np.uint8)
    arena[:laid.arena.size] = laid.arena
    on_device = session.upload(arena)
    session.launch(forward, on_device, ssm_kernel="chunked" if target == "gpu" else "auto")
    session.launch(laid.thunk, on_device)
    session.finish()
    print(target, "ran", flush=True)
"""
_OCLGRIND_PARAMS = dict(batch=2, seq=40, heads=1, value_heads=2, state_size=4, value_size=3, gate_per_channel=True,
                        qk_l2norm=True, carry_state=True, state=True, d_state=True)


@pytest.mark.skipif("opencl:0:0" not in {i.spec for i in status("opencl").devices}, reason="no Oclgrind platform")
def test_the_reserve_kernels_are_clean_under_oclgrind():
    code, diagnostics, output = under_oclgrind(_OCLGRIND_SCRIPT.format(spec="opencl:0:0", params=_OCLGRIND_PARAMS))
    assert code == 0, output[-3000:]
    assert output.count(" ran") == 2 and not diagnostics, "\n".join(diagnostics[:40])
