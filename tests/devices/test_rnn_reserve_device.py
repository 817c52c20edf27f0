"""The recurrent ops' saved forward (ABI.md §9.1, docs/abi.md 6a.1) on OpenCL CPU implementations at both kernel
targets: the forward's kernels (persistent and per-step) write the reserve in the host's layout, and the device
backward reads it instead of running the forward again.

The gradients from a reserve equal (within f32 rounding) those the host computes recomputing its forward, for a
reserve written on the device and read by the host, written by the host and read on the device, and both on the
device; the bytes the host writes in a reserve are the bytes the device writes there; reruns give the same bytes;
a schedule with a reserve runs on the device, one with a short reserve is refused naming the minimum. PoCL's two devices and Intel's runtime each run it.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from host_fallback.abi import complete
from host_fallback.abi.rnn import reserve_slots
from rlx_gpu.runtime.registry import status
from support import background
from support.conformance_devices import opened
from support.device_reserve import (assert_close, gradients, reruns_give_the_same_bytes, run, run_forward,
                                    runs_a_reserve_and_refuses_a_short_one, with_reserve)
from support.opencl_cpu import needs_opencl_cpu
from support.rnn_backward_cases import backward_params, sample
from support.saved_forward import laid_with_reserve, without_reserve

CASES = [
    ("lstm", {}), ("gru", {}), ("rnn", {}),
    ("lstm", dict(seq_lens=[5, 2, 0], peepholes=True, clip=0.5, proj_size=2, w_hr=True,
                  activations=[["hard_sigmoid", 0.2, 0.5], ["elu", 1.0, 0.0], ["softsign", 0.0, 0.0]] * 2)),
    ("lstm", dict(input_forget=True, clip=0.7, num_layers=1)),
    ("gru", dict(linear_before_reset=False, clip=0.8, seq_lens=[3, 5, 1])),
    ("gru", dict(activations=[["leaky_relu", 0.1, 0.0], ["tanh", 0.0, 0.0], ["sigmoid", 0.0, 0.0],
                              ["softplus", 0.0, 0.0]])),
    ("rnn", dict(reverse=True, bidirectional=False, seq_lens=[4, 1, 5], relu=True)),
]
IDS = [f"{op}-{'.'.join(extra) or 'base'}" for op, extra in CASES]
TOL = {"f64": 1e-11, "f32": 2e-5, "bf16": 2e-2}  # of each gradient's largest magnitude
#: the other OpenCL CPU implementations: PoCL's second device and Intel's runtime
OTHER_DEVICES = [spec for spec in ("opencl:3:0", "opencl:2:0") if spec in {i.spec for i in status("opencl").devices}]


def _laid(op: str, dtype: str, extra: dict) -> tuple[dict, np.ndarray, dict]:
    """A backward thunk with a reserve of the minimum size, its arena, and the forward writing that reserve."""
    return laid_with_reserve(op, dtype, backward_params(op, **extra), sample)


def _every_way_matches_recomputing(session, op: str, extra: dict, dtype: str = "f32", **options) -> None:
    """The gradients read from a reserve the device wrote (backward on the host and on the device), and from one
    the host wrote (backward on the device), against the host's backward recomputing its forward."""
    thunk, arena, forward = _laid(op, dtype, extra)
    expected = gradients(thunk, run(None, without_reserve(thunk), arena))
    on_device, on_host = run_forward(session, forward, arena, **options), run_forward(None, forward, arena)
    for what, written, reader in (("device -> host", on_device, None), ("host -> device", on_host, session),
                                  ("device -> device", on_device, session)):
        got = gradients(thunk, run(reader, thunk, with_reserve(thunk, arena, written)))
        assert_close(got, expected, TOL[dtype], f"{what} at the {session.limits.target} target")


@needs_opencl_cpu
@pytest.mark.parametrize("op,extra", CASES, ids=IDS)
def test_gradients_from_a_reserve_match_recomputing_across_devices(cpu_session, op, extra):
    _every_way_matches_recomputing(cpu_session, op, extra)


@needs_opencl_cpu
@pytest.mark.parametrize("op", ["lstm", "gru", "rnn"])
@pytest.mark.parametrize("kernel", ["persistent", "step"])
def test_both_forward_kernels_write_the_reserve(cpu_session, op, kernel):
    _every_way_matches_recomputing(cpu_session, op, {}, rnn_kernel=kernel)


@needs_opencl_cpu
@pytest.mark.parametrize("dtype", ["f64", "bf16"])
def test_the_reserve_of_f64_and_16_bit_thunks(cpu_session, dtype):
    """f64 keeps an f64 reserve, a bf16 thunk an f32 one (the compute type)."""
    _every_way_matches_recomputing(cpu_session, "lstm", dict(seq_lens=[5, 2, 0], clip=0.5), dtype)


def _host_written(thunk: dict, arena: np.ndarray, forward: dict) -> np.ndarray:
    """Which bytes of the reserve the host's forward writes: the same after a run over zeros and over 0xFF."""
    start, end = thunk["reserve"], thunk["reserve"] + thunk["reserve_bytes"]
    runs = []
    for fill in (0, 255):
        prefilled = arena.copy()
        prefilled[start:end] = fill
        runs.append(run_forward(None, forward, prefilled)[start:end])
    return runs[0] == runs[1]


def _read(t: dict, name: str) -> bool:
    """Whether a reader may read array ``name`` of the completed forward ``t``'s reserve (docs/abi.md 6a.1): ``u``
    with a clip or a slot f/g activation other than sigmoid and tanh, the masks with a clip, lstm's ``c_new`` with
    peepholes or an h activation other than tanh; every other array always."""
    slots = {"lstm": 3, "gru": 2, "rnn": 1}[t["op"]]
    names = [a[0] for a in t["activations"]]
    if name == "u":
        return bool(t["clip"]) or any(n not in ("sigmoid", "tanh") for k, n in enumerate(names) if k % slots < 2)
    if name == "mask":
        return bool(t["clip"])
    if name == "c_new":
        return t["peepholes"] is not None or any(n != "tanh" for k, n in enumerate(names) if k % slots == 2)
    return True


def _same_layout(session, op: str, extra: dict, **options) -> None:
    """Every value of the reserve a reader may read, the host's forward and the device's write as the same number
    (within f32 rounding; the clip's masks exactly)."""
    thunk, arena, forward = _laid(op, "f32", extra)
    start = thunk["reserve"]
    host, device = run_forward(None, forward, arena)[start:], run_forward(session, forward, arena, **options)[start:]
    written = _host_written(thunk, arena, forward)
    t = complete(forward)
    for slot in reserve_slots(t):
        lo, hi = slot.offset, slot.end
        mask = written[lo:hi]
        if not _read(t, slot.name):
            continue
        assert mask.any(), slot
        if slot.dtype == "u8":
            assert np.array_equal(device[lo:hi][mask], host[lo:hi][mask]), (slot.name, slot.index)
            continue
        mask = mask.reshape(-1, 4).all(axis=1)  # f32 values the host wrote whole
        got, want = device[lo:hi].view(np.float32)[mask], host[lo:hi].view(np.float32)[mask]
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * (np.abs(want).max() + 1), err_msg=str(slot))


@needs_opencl_cpu
@pytest.mark.parametrize("op,extra", [c for c in CASES if "seq_lens" not in c[1]],
                         ids=[i for c, i in zip(CASES, IDS) if "seq_lens" not in c[1]])
def test_the_device_writes_the_host_layout(cpu_session, op, extra):
    _same_layout(cpu_session, op, extra)


@needs_opencl_cpu
@pytest.mark.parametrize("op", ["lstm", "gru"])
def test_reruns_give_the_same_bytes(cpu_session, op):
    reruns_give_the_same_bytes(cpu_session, *_laid(op, "f32", dict(clip=0.5, seq_lens=[5, 2, 0])))


@needs_opencl_cpu
@pytest.mark.parametrize("op", ["lstm", "gru_backward"])
def test_the_device_runs_a_reserve_and_refuses_a_short_one_naming_the_minimum(op):
    runs_a_reserve_and_refuses_a_short_one(op)


@pytest.mark.skipif(not OTHER_DEVICES, reason="no second PoCL device nor Intel's OpenCL runtime")
@pytest.mark.parametrize("spec", OTHER_DEVICES)
@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_other_opencl_implementations(spec, target):
    session = opened(spec, target)
    for op, extra in (CASES[3], CASES[5]):
        _every_way_matches_recomputing(session, op, extra)
    _same_layout(session, "gru", dict(clip=0.5))


@pytest.mark.skipif("opencl:0:0" not in {i.spec for i in status("opencl").devices}, reason="no Oclgrind platform")
def test_the_reserve_kernels_are_clean_under_oclgrind():
    """support/reserve_oclgrind's forward and backward per target and op, run under Oclgrind beside the suite."""
    done = background.result("oclgrind-rnn-reserve")
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout)
    assert found["code"] == 0, found["output"][-3000:]
    assert found["output"].count(" ran") == 4 and not found["diagnostics"], "\n".join(found["diagnostics"][:40])
