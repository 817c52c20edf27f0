"""Kernel arguments by name: every KERNEL signature read from its text, and planners that bind by name.

A planner names every argument of a launch by its kernel's parameter names; ``launches.signatures`` puts them
in the order the kernel text declares, so a missing, unknown or mistyped argument fails at plan time, and
arguments cannot trade places unseen. These tests read every kernel text at both targets, show that swapped,
missing and mistyped arguments are caught, and bind the launches every planner makes for a sample of the
conformance catalog at both targets.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

import rlx_gpu
from rlx_gpu import launches
from rlx_gpu.backends.programs import FAMILIES
from rlx_gpu.conformance import cases, catalog, runner
from rlx_gpu.conformance.catalog import Case
from rlx_gpu.launches import ARENA, SCRATCH, body
from rlx_gpu.launches.limits import REFERENCE_GPU, TARGETS, DeviceLimits
from rlx_gpu.launches.arguments import bind, bind_some, kernel_launch, named
from rlx_gpu.launches.signatures import KernelArgumentError, KernelTextError, parse, signature, signatures, texts
from rlx_gpu.paths import data_dir

LIMITS = {"cpu": DeviceLimits(1024, 1 << 20, True), "gpu": REFERENCE_GPU}
#: a cpu-target lstm whose layer runs as one rnn_persist launch (the input projected in the recurrence)
PERSISTENT_LSTM = cases.lay_out("lstm", "f32", {"batch": 1, "seq": 3, "input_size": 4, "hidden": 5, "num_layers": 1,
                                                "bidirectional": False, "carry": True})[0]


def _kernel_names(family: str) -> set[str]:
    text = "".join((data_dir("kernels") / name).read_text() for name in texts(family))
    return set(re.findall(r"^KERNEL(?:_BOUNDED\([^)]*\))?\s+(\w+)\s*\(", text, re.M))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_kernel_text_is_read_at_the_targets_that_compile_it(family):
    read = {target: signatures(family, target) for target in TARGETS}
    assert set().union(*read.values()) == _kernel_names(family)
    for target, found in read.items():
        for sig in found.values():
            assert sig.target == target and sig.where.split(":")[0] in {f"kernels/{name}" for name in texts(family)}
            assert len({p.name for p in sig.params}) == len(sig.params), sig


def test_a_kernel_with_a_text_per_target_has_a_signature_per_target():
    cpu, gpu = signature("rnn", "rnn_persist", "cpu"), signature("rnn", "rnn_persist", "gpu")
    assert {"I", "xb", "wib", "hb0"} <= {p.name for p in cpu.params}
    assert "whb" in {p.name for p in gpu.params} and "I" not in {p.name for p in gpu.params}
    assert [p.kind for p in cpu.params[:7]] == ["i64", "i64", "i64", "i64", "int", "int", "tensor"]
    assert cpu.params[6].offset == "xwo"
    assert "selective_scan" in signatures("ssm", "cpu") and "selective_scan" not in signatures("ssm", "gpu")


def _persist_args(monkeypatch) -> dict:
    """The named arguments the planner gives rnn_persist for PERSISTENT_LSTM at the cpu target."""
    seen = {}
    real_launch = launches.rnn.kernel_launch

    def spy(family, kernel, dtype, global_size, local_size, args, **kw):
        if kernel == "rnn_persist":
            seen.update(args)
        return real_launch(family, kernel, dtype, global_size, local_size, args, **kw)

    monkeypatch.setattr(launches.rnn, "kernel_launch", spy)
    launches.plan(PERSISTENT_LSTM, LIMITS["cpu"], rnn_kernel="persistent")
    assert seen, "the plan has no rnn_persist launch"
    return seen


def test_two_swapped_arguments_of_rnn_persist_are_caught(monkeypatch):
    """h0's offset and o_rs were two adjacent-looking np.int64 of one positional tuple; by name the offset
    belongs to its tensor, so giving each the other's value fails at plan time, naming kernel and parameter."""
    args = _persist_args(monkeypatch)
    sig = signature("rnn", "rnn_persist", "cpu")
    bind(sig, "f32", args)  # as planned: binds
    swapped = {**args, "h0b": args["o_rs"], "o_rs": args["h0b"]}
    with pytest.raises(KernelArgumentError, match=r"kernel rnn_persist \(kernels/rnn\.cl:\d+, cpu target\): "
                                                  r"parameter tensor h0b, h0o takes a \(Buf, byte offset\) pair; got 5"):
        bind(sig, "f32", swapped)


def test_the_positional_order_follows_the_kernel_text(monkeypatch):
    """Two parameters that trade places in the text take their values by name, with no change to the planner;
    a parameter renamed in the text is reported as missing, the planner's old name as unknown."""
    args = _persist_args(monkeypatch)
    text = (data_dir("kernels") / "rnn.cl").read_text()
    declared = "GLOBAL uchar* h0b, i64 h0o, GLOBAL uchar* c0b, i64 c0o,"
    assert declared in text
    planned = signature("rnn", "rnn_persist", "cpu")
    swapped = parse(text.replace(declared, "GLOBAL uchar* c0b, i64 c0o, GLOBAL uchar* h0b, i64 h0o,"),
                    "rnn.cl", "rnn", "cpu")["rnn_persist"]
    at = [p.name for p in planned.params].index("h0b")
    width = sum(2 if p.kind == "tensor" else 1 for p in planned.params[:at])
    before, after = bind(planned, "f32", args), bind(swapped, "f32", args)
    assert after[width:width + 4] == before[width + 2:width + 4] + before[width:width + 2]
    renamed = parse(text.replace(declared, declared.replace("h0b", "h_init_b")), "rnn.cl", "rnn", "cpu")["rnn_persist"]
    with pytest.raises(KernelArgumentError, match=r"no parameter named 'h0b'; missing tensor h_init_b, h0o"):
        bind(renamed, "f32", args)


@pytest.mark.parametrize("change, message", [
    ({"carry": None}, r"missing int carry"),
    ({"bogus": 1}, r"no parameter named 'bogus'"),
    ({"carry": 0.5}, r"parameter int carry takes an integer of 32 bits; got 0\.5"),
    ({"S": ARENA}, r"parameter i64 S takes an integer; got Buf\(name='arena'\)"),
    ({"xwb": 12}, r"parameter tensor xwb, xwo takes a \(Buf, byte offset\) pair; got 12"),
    ({"xwb": (SCRATCH, 1.5)}, r"parameter tensor xwb, xwo takes a \(Buf, byte offset\) pair; got \(Buf"),
    ({"clip": SCRATCH}, r"parameter real clip takes a number; got Buf\(name='scratch'\)"),
    ({"reverse": 1 << 31}, r"parameter int reverse takes an integer of 32 bits; got 2147483648"),
])
def test_missing_unknown_and_mistyped_arguments_fail_at_plan_time(monkeypatch, change, message):
    args = {**_persist_args(monkeypatch), **change}
    args = {name: value for name, value in args.items() if value is not None}
    with pytest.raises(KernelArgumentError, match=r"kernel rnn_persist \(kernels/rnn\.cl:\d+, cpu target\): " + message):
        bind(signature("rnn", "rnn_persist", "cpu"), "f32", args)


def test_arguments_bound_ahead_are_checked_as_the_rest(monkeypatch):
    """A loop's shared arguments bound once and each launch's own later give the same tuple as one binding,
    with the same checks."""
    args = _persist_args(monkeypatch)
    sig = signature("rnn", "rnn_persist", "cpu")
    shared = bind_some(sig, "f32", {name: value for name, value in args.items() if name not in ("S", "h0b")})
    whole, parts = bind(sig, "f32", args), shared.bind({"S": args["S"], "h0b": args["h0b"]})
    assert parts == whole and [type(a) for a in parts] == [type(a) for a in whole]
    with pytest.raises(KernelArgumentError, match=r"'B' bound ahead already; missing i64 S"):
        shared.bind({"B": 1, "h0b": args["h0b"]})
    with pytest.raises(KernelArgumentError, match=r"parameter tensor h0b, h0o takes a \(Buf, byte offset\) pair; got 7"):
        shared.bind({"S": 3, "h0b": 7})
    with pytest.raises(KernelArgumentError, match=r"no parameter named 'bogus'"):
        bind_some(sig, "f32", {"bogus": 1})
    with pytest.raises(KernelArgumentError, match=r"arguments bound ahead for kernel rnn_persist \(.*\) at f32 given "
                                                  r"to a f32 launch of kernel rnn_step"):
        kernel_launch("rnn", "rnn_step", "f32", (1,), (1,), {}, target="cpu", shared=shared)


def test_an_unknown_kernel_is_named_with_the_ones_the_text_declares():
    with pytest.raises(KernelArgumentError, match=r"kernels/ssm\.cl declares no kernel 'mamba2' at the gpu target; "
                                                  r"it declares mamba2_chunk_scan, "):
        signature("ssm", "mamba2", "gpu")


def _check_bound(launch) -> None:
    """The launch's positional arguments are its kernel's, each of its parameter's type: read back by name and
    bound again, they give the same values of the same NumPy types."""
    sig = signature(launch.family, launch.kernel, launch.target)
    again = bind(sig, launch.dtype, named(sig, launch.args))
    assert [type(a) for a in again] == [type(a) for a in launch.args], launch.kernel
    assert again == launch.args, launch.kernel


@pytest.mark.parametrize("target", TARGETS)
def test_every_planners_launches_bind_to_their_kernel_signatures(target):
    lim, planned, kernels = LIMITS[target], 0, set()
    sample = [case for case in catalog.cases() if case.op in launches.PLANNERS][::2]
    for case in sample:
        thunk = runner.lay_out(case).thunk
        if launches.unsupported(thunk, lim):
            continue
        for options in ({}, {"rnn_kernel": "persistent", "ssm_kernel": "chunked"},
                        {"rnn_kernel": "step", "ssm_kernel": "lanes"}):
            for launch in launches.plan(thunk, lim, **{**case.options, **options}).launches:
                _check_bound(launch)
                kernels.add((launch.family, launch.kernel))
                planned += 1
    # mamba3's prefill split over groups and its final launch (no catalog case has that many state rows)
    carried = dict(carry_state=True, angle_state=True, state=True, k_state=True, v_state=True)
    split = runner.lay_out(Case("mamba3", "f32", dict(batch=1, seq=64, heads=2, head_dim=8, state_size=6,
                                                      num_angles=2, **carried))).thunk
    # a saved forward with lengths: its zeros past them (no catalog case has both)
    saved = runner.lay_out(Case("lstm", "f32", dict(batch=2, seq=5, input_size=3, hidden=4, num_layers=1,
                                                    bidirectional=True, carry=False, seq_lens=[5, 2], reserve=True,
                                                    reserve_bytes=1 << 15))).thunk
    # gated_delta_net's saved forward (every other catalog case is sampled: its reserve case may not be)
    gdn = dict(cases.SMALL["gated_delta_net"], op="gated_delta_net", dtype="f32")
    gdn_saved = runner.lay_out(Case("gated_delta_net", "f32", dict(cases.SMALL["gated_delta_net"], reserve=True,
                                                                   reserve_bytes=rlx_gpu.reserve_bytes(gdn)))).thunk
    # and its backward with per-channel gates: chunked, and by the step walk (ssm_kernel="lanes": at the cpu target
    # gdn_backward_saved, which batch rows reach no more by default)
    channel = dict(cases.SMALL["gated_delta_net"], gate_per_channel=True)
    gdn_channel = runner.lay_out(Case("gated_delta_net_backward", "f32", dict(
        channel, reserve=True, reserve_bytes=rlx_gpu.reserve_bytes(dict(gdn, **channel))))).thunk
    for launch in (launches.plan(split, lim, ssm_kernel="lanes").launches + launches.plan(saved, lim).launches
                   + launches.plan(gdn_saved, lim).launches + launches.plan(gdn_channel, lim).launches
                   + launches.plan(gdn_channel, lim, ssm_kernel="lanes").launches):
        _check_bound(launch)
        kernels.add((launch.family, launch.kernel))
    for dtype in ("f32", "f64"):  # the scan driver's own launches
        _check_bound(body.copy_launch(lim, 100, (ARENA, 8), (SCRATCH, 0), dtype))
        _check_bound(body.accumulate(lim, dtype, 10, (ARENA, 8), (SCRATCH, 0)))
    assert planned > 1000
    assert {(f, k) for f in FAMILIES for k in signatures(f, target)} - kernels <= {("cast", "cast")} | (
        {("rnn", "rnn_persist")} if target == "gpu" else set()), "a kernel no sampled plan launches"


def test_target_conditions_decide_which_text_is_read():
    text = """
KERNEL both(i64 n, GLOBAL uchar* xb, i64 xo)
#ifdef RLX_TARGET_GPU
KERNEL one(int a)
#elif defined(RLX_TARGET_CPU) && OTHER
KERNEL one(real a)
#else
KERNEL never(int a)
#endif
#if !defined(RLX_TARGET_GPU) /* cpu */
KERNEL cpu_only(int a)
#endif
#if SOME_FLAG
KERNEL flagged(int a,
               i64 b)
#endif
"""
    gpu, cpu = parse(text, "t.cl", "t", "gpu"), parse(text, "t.cl", "t", "cpu")
    assert set(gpu) == {"both", "one", "flagged"} and set(cpu) == {"both", "one", "cpu_only", "never", "flagged"}
    assert [p.kind for p in gpu["one"].params] == ["int"] and [p.kind for p in cpu["one"].params] == ["real"]
    assert cpu["flagged"].where == "t.cl:14" and [p.name for p in cpu["flagged"].params] == ["a", "b"]


@pytest.mark.parametrize("text, message", [
    ("KERNEL k(GLOBAL uchar* xb, int n)", r"t\.cl:1: buffer xb is not followed by its i64 byte offset"),
    ("KERNEL k(GLOBAL float* xb, i64 xo)", r"t\.cl:1: parameter 'GLOBAL float\* xb' is none of"),
    ("KERNEL k(int a)\nKERNEL k(i64 a)", r"t\.cl:2: kernel k is declared again at the cpu target with other "
                                         r"parameters than at t\.cl:1"),
    ("#if defined(RLX_TARGET_GPU) || X\n#endif", r"t\.cl:1: a target condition joins terms with \|\|"),
])
def test_a_kernel_text_the_reader_cannot_read_is_named(text, message):
    with pytest.raises(KernelTextError, match=message):
        parse(text, "t.cl", "t", "cpu")


def test_bound_scalars_take_their_parameters_types():
    sig = signature("body", "fill", "cpu")
    for dtype, real in (("f16", np.float32), ("f64", np.float64)):
        bound = bind(sig, dtype, {"db": (ARENA, 16), "n": 3, "value": 1})
        assert [type(a) for a in bound] == [type(ARENA), np.int64, np.int64, real]
