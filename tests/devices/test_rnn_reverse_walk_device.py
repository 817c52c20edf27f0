"""The recurrent backward's persistent reverse walk (kernels/rnn_backward.cl's rnnb_reverse_walk) on an OpenCL CPU
implementation at both kernel targets.

A plan walks each layer's reverse in one launch (a work-group per block of batch rows and direction) where the
per-step form takes a projection, cell and product launch per step; the walk's gradients equal the per-step
walk's (``rnn_kernel="step"``) within f32 rounding, with every optional field at once, with and without a saved
forward; in f64 the walk passes the float64 reference at f64's tolerance; Oclgrind finds no race, no invalid or
uninitialized access in a small walk at either target.
"""
from __future__ import annotations

import numpy as np
import pytest

from rlx_gpu import launches
from rlx_gpu.conformance import runner
from rlx_gpu.conformance.catalog import Case
from rlx_gpu.launches.limits import REFERENCE_GPU, DeviceLimits
from rlx_gpu.runtime.config import default_config_path, load_config
from rlx_gpu.runtime.registry import status
from support.device_reserve import gradients, run, under_oclgrind
from support.opencl_cpu import needs_opencl_cpu
from support.rnn_backward_cases import sample
from support.rnn_fields import BACKWARD_FIELDS, RECURRENT
from support.saved_forward import laid_with_reserve, run_forward, without_reserve

CPU = DeviceLimits(1024, 1 << 20, True)
TARGET_SHAPE = dict(batch=32, seq=128, input_size=256, hidden=256, num_layers=2, bidirectional=True, carry=False)
STEP_KERNELS = {"rnnb_backward_cell", "rnnb_backward_proj"}


def _kernels(op: str, params: dict, lim: DeviceLimits, **options) -> list:
    plan = launches.plan(runner.lay_out(Case(f"{op}_backward", "f32", params)).thunk, lim, **options)
    return [launch for launch in plan.launches if launch.family == "rnn_backward"]


@pytest.mark.parametrize("lim", [REFERENCE_GPU, CPU], ids=["gpu", "cpu"])
@pytest.mark.parametrize("op", RECURRENT)
def test_a_layer_walks_its_reverse_in_one_launch(lim, op):
    """Every field at once (two bidirectional layers): one walk per layer over both directions, no per-step
    reverse launch; the per-step form on request launches its cells once per step and phase."""
    _, params = BACKWARD_FIELDS[op]
    walks = [x for x in _kernels(op, params, lim) if x.kernel == "rnnb_reverse_walk"]
    assert len(walks) == params["num_layers"] and all(x.global_size[2] == 2 for x in walks)
    assert not STEP_KERNELS & {x.kernel for x in _kernels(op, params, lim)}
    steps = [x for x in _kernels(op, params, lim, rnn_kernel="step") if x.kernel == "rnnb_backward_cell"]
    phases = 2 if op == "gru" and not params.get("linear_before_reset", True) else 1
    assert len(steps) == params["num_layers"] * params["seq"] * phases


@pytest.mark.parametrize("lim", [REFERENCE_GPU, CPU], ids=["gpu", "cpu"])
def test_the_target_shape_gives_both_cores_work_groups(lim):
    """B32 S128 I=H=256, two bidirectional layers: at least two work-groups per walk (PoCL runs one per core)."""
    for op in RECURRENT:
        (walk, _) = [x for x in _kernels(op, dict(TARGET_SHAPE), lim) if x.kernel == "rnnb_reverse_walk"]
        groups = np.prod([g // loc for g, loc in zip(walk.global_size, walk.local_size)])
        assert groups >= 2 * 2, (op, walk.global_size, walk.local_size)


def _walk_equals_steps(session, thunk: dict, arena: np.ndarray) -> dict[str, np.ndarray]:
    """The walk's gradients, asserted equal to the per-step reverse's within f32 rounding."""
    walk, steps = (gradients(thunk, run(session, thunk, arena, rnn_kernel=kind)) for kind in ("auto", "step"))
    assert set(walk) == set(steps)
    for field, expected in steps.items():
        scale = np.abs(expected).max() + 1e-30
        np.testing.assert_allclose(walk[field], expected, rtol=0, atol=2e-6 * scale, err_msg=field)
    return walk


@needs_opencl_cpu
@pytest.mark.parametrize("reserve", [False, True], ids=["recompute", "reserve"])
@pytest.mark.parametrize("op", RECURRENT)
def test_the_walk_equals_the_per_step_reverse(cpu_session, op, reserve):
    """Every field at once; with a reserve, the host's forward writes it."""
    _, params = BACKWARD_FIELDS[op]
    thunk, arena, forward = laid_with_reserve(op, "f32", {k: v for k, v in params.items() if not k.startswith("d_")},
                                              sample)
    if reserve:
        start, end = thunk["reserve"], thunk["reserve"] + thunk["reserve_bytes"]
        arena[start:end] = run_forward(forward, arena)[start:end]
    else:
        thunk = without_reserve(thunk)
    assert {"d_w_hh", "d_h0"} <= set(_walk_equals_steps(cpu_session, thunk, arena))


#: wider than a work-group of the gpu target (H 300, K 270 > 256 items) and than the register blocks (K not a
#: multiple of 16, a batch of 9 leaving a block of one row)
WIDE = {"lstm": dict(batch=9, seq=3, input_size=5, hidden=300, proj_size=270, w_hr=True, num_layers=1,
                     bidirectional=True, carry=True, seq_lens=[3, 1, 0, 2, 3, 3, 1, 2, 3]),
        "gru": dict(batch=9, seq=3, input_size=5, hidden=300, num_layers=1, bidirectional=False, carry=True,
                    linear_before_reset=False)}


@needs_opencl_cpu
@pytest.mark.parametrize("op", sorted(WIDE))
def test_a_walk_wider_than_its_blocks_equals_the_per_step_reverse(cpu_session, op):
    thunk, arena, _ = laid_with_reserve(op, "f32", WIDE[op], sample)
    assert {"d_w_hh", "d_h0"} <= set(_walk_equals_steps(cpu_session, without_reserve(thunk), arena))


@needs_opencl_cpu
@pytest.mark.parametrize("op", RECURRENT)
def test_the_f64_walk_passes_the_float64_reference(cpu_session, host, op):
    name, params = BACKWARD_FIELDS[op]
    outcome = runner.check(cpu_session, Case(name, "f64", params, seed=8), load_config(default_config_path()), host)
    assert outcome.status == "pass", outcome.message


#: run under Oclgrind (its race and uninitialized-value checks on): per target the walk of a small lstm with its
#: projection, peepholes, clip and lengths (a row of none), and of a gru of two phases a step
_OCLGRIND_SCRIPT = """
from rlx_gpu.conformance import runner
from rlx_gpu.conformance.catalog import Case
from rlx_gpu.conformance.devices import find, open_device
for target in ("cpu", "gpu"):
    session = open_device(find({spec!r}), target)
    for op, params in {cases!r}:
        laid = runner.lay_out(Case(op + "_backward", "f32", params))
        arena = session.upload(laid.arena)
        session.launch(laid.thunk, arena)
        session.finish()
        print(target, op, "ran", flush=True)
"""
_OCLGRIND_CASES = [
    ("lstm", dict(batch=3, seq=3, input_size=3, hidden=4, num_layers=1, bidirectional=True, carry=True,
                  seq_lens=[3, 1, 0], clip=0.5, peepholes=True, proj_size=2, w_hr=True, d_peepholes=True,
                  d_w_hr=True, d_h0=True, d_c0=True)),
    ("gru", dict(batch=2, seq=3, input_size=3, hidden=4, num_layers=1, bidirectional=False, carry=False,
                 linear_before_reset=False)),
]


@pytest.mark.skipif("opencl:0:0" not in {i.spec for i in status("opencl").devices}, reason="no Oclgrind platform")
def test_the_walk_is_clean_under_oclgrind():
    code, diagnostics, output = under_oclgrind(_OCLGRIND_SCRIPT.format(spec="opencl:0:0", cases=_OCLGRIND_CASES))
    assert code == 0, output[-3000:]
    assert output.count(" ran") == 4 and not diagnostics, "\n".join(diagnostics[:40])
