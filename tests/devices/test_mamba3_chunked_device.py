"""mamba3's chunked prefill (ABI.md §11's note on the chunked form; kernels/mamba3.cl ``mamba3_chunk_*`` and
``mamba3_state_pass``, launches/mamba3.py) on the OpenCL CPU implementations at both kernel targets.

The plan takes it from M3C_MIN_SEQ tokens on (the step recurrence keeps decode and short sequences, and f64 at the
gpu target); forced, it runs the shapes below against the float64 reference and the host, the same bytes twice:
several chunks with a partial last one, packed sequences of 70, 0, 1 and 79 tokens through slots, state rows past
one tile, every field, 16-bit storage with f32 step inputs and parameters, f64, state_size 256. Two chunked calls
chained through the four states equal one call; the chunked and step forms agree; a NaN at one token reaches
exactly the outputs the recurrence says, whichever input holds it, inside a chunk or on a chunk's first token, and
an adt of -inf forgets the state as the recurrence's alpha = 0 does (where the chunk's sums would give NaN).
"""
from __future__ import annotations

import numpy as np
import pytest

from host_fallback.abi import complete
from rlx_gpu import launches
from rlx_gpu.conformance import runner
from rlx_gpu.conformance.catalog import Case
from rlx_gpu.launches.limits import REFERENCE_GPU, DeviceLimits
from rlx_gpu.launches.mamba3 import CHUNKED_KERNELS as KERNELS
from rlx_gpu.runtime.config import default_config_path, load_config
from rlx_gpu.runtime.registry import status
from support.conformance_devices import opened
from support.opencl_cpu import needs_opencl_cpu, passes_and_runs_the_same_bytes_twice

CPU = DeviceLimits(1024, 1 << 20, True)
CARRIED = dict(carry_state=True, angle_state=True, state=True, k_state=True, v_state=True)
EVERY = dict(groups=2, q_bias=True, k_bias=True, d=True, z=True)
CHUNKED = {"ssm_kernel": "chunked"}

#: name -> (dtype, params): more tokens than a chunk at both targets (M3C_Q 32 cpu, 64 gpu)
SHAPES = {
    "every-field-varlen-empty-one-token-slots": ("f32", dict(
        batch=1, seq=150, heads=4, head_dim=20, state_size=16, num_angles=5, cu_seqlens=[0, 70, 70, 71, 150],
        num_seqs=4, state_slots=[2, 0, 4, 1], num_slots=5, **CARRIED, **EVERY)),
    "rows-past-one-tile-bf16": ("bf16", dict(batch=2, seq=100, heads=2, head_dim=70, state_size=32, num_angles=16,
                                             d=True, z=True)),
    "f16-f32-fields-carried": ("f16", dict(batch=2, seq=70, heads=4, head_dim=8, state_size=64, num_angles=7,
                                           dt_dtype="f32", param_dtype="f32", **CARRIED, **EVERY)),
    "f64-carried": ("f64", dict(batch=1, seq=90, heads=2, head_dim=6, state_size=12, num_angles=3, **CARRIED, d=True)),
    "state-256": ("f32", dict(batch=1, seq=66, heads=1, head_dim=4, state_size=256, num_angles=128, **CARRIED)),
}


def _thunk(dtype: str, params: dict) -> dict:
    return complete(runner.lay_out(Case("mamba3", dtype, params)).thunk)


def _kernels(thunk: dict, lim: DeviceLimits, **options: str) -> list[str]:
    return [launch.kernel for launch in launches.plan(thunk, lim, **options).launches]


@pytest.mark.parametrize("lim", [REFERENCE_GPU, CPU], ids=["gpu", "cpu"])
def test_the_plan_takes_the_chunked_form_from_m3c_min_seq_tokens_on(lim):
    for dtype, params in SHAPES.values():
        thunk = _thunk(dtype, params)
        assert launches.unsupported(thunk, lim) is None
        chunked = not (lim.target == "gpu" and dtype == "f64")  # f64 keeps the step kernels on GPUs
        assert (_kernels(thunk, lim, **CHUNKED) == list(KERNELS)) == chunked
    long = _thunk("f32", dict(batch=2, seq=lim.tune("M3C_MIN_SEQ"), heads=2, head_dim=8, state_size=16, num_angles=4))
    short = dict(long, seq=lim.tune("M3C_MIN_SEQ") - 1)
    assert _kernels(long, lim) == list(KERNELS)
    assert not set(_kernels(short, lim)) & set(KERNELS)
    assert not set(_kernels(long, lim, ssm_kernel="lanes")) & set(KERNELS)
    plan = launches.plan(long, lim)
    assert plan.scratch_bytes >= 2 * 2 * 2 * lim.tune("M3C_Q") * 16 * 4  # q~ and k~ of 2 heads x 2 chunk slots
    small = DeviceLimits(lim.tune("M3C_LANES") // 2, lim.local_mem_bytes, True, lim.target)  # groups too small
    tight = DeviceLimits(lim.max_work_group, 4096, True, lim.target)  # LOCAL memory too small for the scan's tiles
    assert all(not set(_kernels(long, device, **CHUNKED)) & set(KERNELS) for device in (small, tight))


@needs_opencl_cpu
@pytest.mark.parametrize("name", list(SHAPES))
def test_the_chunked_form_matches_the_float64_reference_and_runs_the_same_bytes_twice(cpu_session, host, name):
    dtype, params = SHAPES[name]
    passes_and_runs_the_same_bytes_twice(cpu_session, host, Case("mamba3", dtype, params, options=CHUNKED, seed=11))


#: the token-major fields of mamba3, which a call over a later stretch of tokens reads further along
TOKEN_FIELDS = ("q", "k", "v", "adt", "dt", "trap", "angles", "z", "dst")
STATE_FIELDS = ("angle_state", "state", "k_state", "v_state")


def _run(session, laid, thunk: dict, arena=None, **options) -> np.ndarray:
    arena = session.upload(laid.arena) if arena is None else arena
    session.launch(thunk, arena, **options)
    return arena


def _assert_same(laid, got: np.ndarray, want: np.ndarray, fields: tuple[str, ...], rtol: float, atol: float) -> None:
    for field in fields:
        mine, ref = laid.view(got, field), laid.view(want, field)
        if field == "angle_state":  # compared modulo 2pi
            mine, ref = np.cos(mine), np.cos(ref)
        np.testing.assert_allclose(mine, ref, rtol=rtol, atol=atol, err_msg=field)


@needs_opencl_cpu
def test_two_chunked_calls_chained_through_the_states_equal_one_call(cpu_session):
    """Tokens 0..69 then 70..199 of one batch row (neither a whole number of chunks), the second call reading what
    the first wrote into the four states (the boundary term from the carried value and key), equal one call."""
    seq, split = 200, 70
    params = dict(batch=1, seq=seq, heads=2, head_dim=20, state_size=32, num_angles=13, **CARRIED, **EVERY)
    laid = runner.lay_out(Case("mamba3", "f32", params, seed=3))
    whole = cpu_session.read(_run(cpu_session, laid, laid.thunk, **CHUNKED), 0, laid.arena.size)
    arena = cpu_session.upload(laid.arena)
    per_token = {r.field: r.nbytes // seq for r in laid.regions if r.field in TOKEN_FIELDS}
    for first, end in ((0, split), (split, seq)):
        part = dict(laid.thunk, seq=end - first, **{f: laid.thunk[f] + first * n for f, n in per_token.items()})
        _run(cpu_session, laid, part, arena, **CHUNKED)
    _assert_same(laid, cpu_session.read(arena, 0, laid.arena.size), whole, ("dst",) + STATE_FIELDS, 1e-4, 1e-5)


@needs_opencl_cpu
def test_the_chunked_and_step_forms_agree(cpu_session):
    params = dict(batch=1, seq=300, heads=2, head_dim=12, state_size=24, num_angles=12, cu_seqlens=[0, 130, 300],
                  num_seqs=2, **CARRIED, **EVERY)
    laid = runner.lay_out(Case("mamba3", "f32", params, seed=5))
    forms = [cpu_session.read(_run(cpu_session, laid, laid.thunk, ssm_kernel=form), 0, laid.arena.size)
             for form in ("chunked", "lanes")]
    _assert_same(laid, *forms, ("dst",) + STATE_FIELDS, 1e-4, 1e-5)


NAN, FORGET = float("nan"), -float("inf")
#: (field, token, value): a NaN there, inside the second chunk of the first packed sequence at both targets (cpu
#: chunks of 32, gpu of 64), or on a chunk's first token (its dt and trap enter the previous token's weight); an adt
#: of -inf (alpha = 0: the state forgets everything before), inside a chunk or on its first token
POISONED = [("v", 75, NAN), ("adt", 80, NAN), ("dt", 64, NAN), ("trap", 96, NAN), ("q", 70, NAN), ("k", 100, NAN),
            ("angles", 66, NAN), ("adt", 40, FORGET), ("adt", 64, FORGET)]


@needs_opencl_cpu
@pytest.mark.parametrize("field,token,value", POISONED)
def test_a_nan_or_a_reset_reaches_exactly_the_outputs_the_recurrence_says(cpu_session, host, field, token, value):
    params = dict(batch=1, seq=150, heads=2, head_dim=5, state_size=8, num_angles=2, cu_seqlens=[0, 110, 150],
                  num_seqs=2, **CARRIED)
    case = Case("mamba3", "f32", params, options=CHUNKED, poison=field, poison_step=token, poison_value=value, seed=2)
    outcome = runner.check(cpu_session, case, load_config(default_config_path()), host)
    assert outcome.status == "pass", outcome.message


#: every OpenCL CPU implementation here (PoCL 3.1 and the wheel's 3.0, Intel's CPU runtime)
REAL_CPUS = [info.spec for info in status("opencl").devices if not info.details["simulator"]]


@pytest.mark.skipif(len(REAL_CPUS) < 2, reason=f"fewer than two OpenCL CPU implementations: {REAL_CPUS}")
@pytest.mark.parametrize("target", ["cpu", "gpu"])
@pytest.mark.parametrize("spec", REAL_CPUS)
def test_every_opencl_cpu_implementation_runs_the_every_field_case(host, spec, target):
    session = opened(spec, target)
    dtype, params = SHAPES["every-field-varlen-empty-one-token-slots"]
    passes_and_runs_the_same_bytes_twice(session, host, Case("mamba3", dtype, params, options=CHUNKED, seed=13))
