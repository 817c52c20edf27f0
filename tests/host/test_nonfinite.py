"""Non-finite inputs stay causal: a NaN or ±inf at step t of one lane changes nothing before t.

A lane is one (batch item, channel/head) recurrence of ``selective_scan``, ``mamba2`` or
``gated_delta_net``. In the step recurrence of ABI.md §4 an input at step t reaches only the
outputs of steps >= t of its own lane (``selective_scan``'s ``b`` and ``c`` are shared by every
channel of a batch item, so they belong to all of that item's lanes). These tests run shapes long
enough for the host's chunked/blocked paths and for the OpenCL kernels (PoCL) and check, for every
lane, that each output strictly before the lane's first non-finite input is finite and matches the
float64 step recurrence (``rlx_gpu.conformance.reference_ssm``) run on the clean inputs, and that
every lane without a non-finite input is bit-identical to a run on the clean inputs.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import host_fallback
from host_fallback.arena import STORAGE
import rlx_gpu
from rlx_gpu import launches
from rlx_gpu.conformance import cases
from rlx_gpu.conformance.devices import find, open_device
from rlx_gpu.conformance.compare import nmse, non_finite_mismatch
from rlx_gpu.conformance.reference_ssm import gated_delta_net, lay_out, mamba2, read, selective_scan
from rlx_gpu.runtime.config import default_config_path, load_config
from rlx_gpu.runtime.executor import Device
from rlx_gpu.runtime.options import RunOptions

#: NMSE bounds of one thunk against the float64 reference: the ``tolerances`` table of configs/default.yaml.
BOUNDS = load_config(default_config_path())

#: Per-step inputs of each op and whose lanes they feed: ``lane`` fields are ``[B, S, H, ...]``
#: (one lane each), ``row`` fields ``[B, S, N]`` (every lane of their batch item).
STEP_FIELDS = {
    "selective_scan": {"x": "lane", "delta": "lane", "b": "row", "c": "row"},
    "mamba2": {"x": "lane", "dt": "lane", "b": "lane", "c": "lane"},
    "gated_delta_net": {f: "lane" for f in ("q", "k", "v", "g", "beta")},
}
#: Inputs read before the first step: ``a`` (per channel/head), the carried ``state`` ([B, H, ...]).
START_FIELDS = {"selective_scan": ("a",), "mamba2": ("a",), "gated_delta_net": ("state",)}

#: The gpu target's kernels of the chunked forms (their names end so)
CHUNKED = ("_chunked", "_chunk_state", "_state_pass", "_chunk_scan", "_chunk_prep", "_chunk_out")

#: The case kinds: op, and for gated_delta_net the gate kind and whether the state is carried.
KINDS = ["selective_scan", "mamba2", "gdn-head", "gdn-channel", "gdn-head-carry", "gdn-channel-carry"]


def op_of(kind: str) -> str:
    return "gated_delta_net" if kind.startswith("gdn") else kind

#: A value that rounds to ±inf in f16 storage (its largest finite value is 65504).
F16_OVERFLOW = 7e4


def make_case(kind: str, rng: np.random.Generator, batch: int = 2, gdn_seq: int = 75) -> tuple[str, dict, dict]:
    """``(op, params, tensors)``: float64 inputs in each op's usual range, at a sequence length that
    takes the host's chunked (blocked) path over several chunks, the last one partial (``gdn_seq``:
    another length for gated_delta_net)."""
    if kind == "selective_scan":
        b, s, h, n = batch, 70, 5, 4
        return kind, {"batch": b, "seq": s, "hidden": h, "state_size": n}, {
            "x": rng.standard_normal((b, s, h)), "delta": rng.uniform(0.01, 0.5, (b, s, h)),
            "a": -rng.uniform(0.05, 2.0, (h, n)), "b": rng.standard_normal((b, s, n)),
            "c": rng.standard_normal((b, s, n))}
    if kind == "mamba2":
        b, s, h, p, n = batch, 150, 3, 4, 8
        return kind, {"batch": b, "seq": s, "heads": h, "head_dim": p, "state_size": n}, {
            "x": rng.standard_normal((b, s, h, p)), "dt": rng.uniform(0.01, 0.5, (b, s, h)),
            "a": rng.uniform(-2.0, -0.05, (h,)), "b": rng.standard_normal((b, s, h, n)) / math.sqrt(n),
            "c": rng.standard_normal((b, s, h, n))}
    b, s, h, n = batch, gdn_seq, 3, 16
    per_channel, carry = "channel" in kind, kind.endswith("carry")
    k = rng.standard_normal((b, s, h, n))
    tensors = {"q": rng.standard_normal((b, s, h, n)), "k": k / np.linalg.norm(k, axis=-1, keepdims=True),
               "v": rng.standard_normal((b, s, h, n)),
               "g": rng.uniform(-1.0, 0.0, (b, s, h, n) if per_channel else (b, s, h)),
               "beta": rng.uniform(0.0, 1.0, (b, s, h))}
    if carry:
        tensors["state"] = rng.standard_normal((b, h, n, n))
    return op_of(kind), {"batch": b, "seq": s, "heads": h, "state_size": n,
                               "gate_per_channel": per_channel, "carry_state": carry}, tensors


def outputs_of(thunk: dict) -> tuple[str, ...]:
    return ("dst", "state") if thunk.get("carry_state") else ("dst",)


def reference(thunk: dict, arena: np.ndarray) -> dict[str, np.ndarray]:
    """The float64 step recurrence on the stored (rounded) inputs."""
    op = thunk["op"]
    if op == "gated_delta_net":
        state = read(thunk, arena, "state") if thunk["carry_state"] else None
        out, final = gated_delta_net(*(read(thunk, arena, f) for f in STEP_FIELDS[op]), state)
        return {"dst": out, "state": final} if thunk["carry_state"] else {"dst": out}
    ref = selective_scan if op == "selective_scan" else mamba2
    return {"dst": ref(*(read(thunk, arena, f) for f in ("x", "delta" if op == "selective_scan" else "dt", "a", "b", "c")))}


def first_nonfinite(thunk: dict, arena: np.ndarray) -> np.ndarray:
    """``[B, H]``: the first step whose inputs reach lane (b, h) with a non-finite value (``seq`` if none)."""
    op, b, s = thunk["op"], thunk["batch"], thunk["seq"]
    h = thunk["hidden"] if op == "selective_scan" else thunk["heads"]
    bad = np.zeros((b, s, h), bool)
    for field, kind in STEP_FIELDS[op].items():
        values = ~np.isfinite(read(thunk, arena, field))
        bad |= values.reshape(b, s, -1).any(-1)[..., None] if kind == "row" else values.reshape(b, s, h, -1).any(-1)
    for field in START_FIELDS[op]:
        if field == "state" and not thunk["carry_state"]:
            continue
        values = ~np.isfinite(read(thunk, arena, field))
        bad[:, 0] |= values.reshape(b, h, -1).any(-1) if field == "state" else values.reshape(h, -1).any(-1)
    return np.where(bad.any(1), bad.argmax(1), s)


def _expand(mask: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A ``[B, S, H]`` or ``[B, H]`` lane mask broadcast over an output's trailing axes."""
    return np.broadcast_to(mask.reshape(mask.shape + (1,) * (len(shape) - mask.ndim)), shape)


def check_close(got: np.ndarray, want: np.ndarray, op: str, dtype: str, where: str) -> None:
    """``got`` within the NMSE bound of ``op`` in ``dtype`` of the float64 ``want``."""
    err, bound = nmse(got, want), BOUNDS.tolerance(op, dtype)
    assert err <= bound, f"{where}: NMSE {err:.3g} > {bound:.3g} against the float64 recurrence"


def check_causal(got: dict, clean: dict, want: dict, first: np.ndarray, op: str, dtype: str, where: str) -> None:
    """Every output before its lane's first non-finite input finite and close to ``want``; every
    output of a lane without one (final states included) bit-identical to ``clean`` (a run without
    the non-finite values) and close to ``want``."""
    dst, ref = got["dst"], want["dst"]
    b, s, h = first.shape[0], dst.shape[1], first.shape[1]
    before = _expand(np.arange(s)[None, :, None] < first[:, None, :], dst.shape)
    broken = int(np.count_nonzero(~np.isfinite(dst[before])))
    assert broken == 0, f"{where}: {broken} of {np.count_nonzero(before)} outputs before the first non-finite input of their lane are not finite"
    if before.any():
        check_close(dst[before], ref[before], op, dtype, f"{where}: outputs before the first non-finite input")
    untouched = first == s
    for field, values in got.items():
        lanes = np.broadcast_to(untouched[:, None, :], (b, s, h)) if field == "dst" else untouched
        keep = _expand(lanes, values.shape)
        np.testing.assert_array_equal(values[keep], clean[field][keep],
                                      err_msg=f"{where}: {field} of lanes without a non-finite input changed")
        if keep.any():
            check_close(values[keep], want[field][keep], op, dtype, f"{where}: {field} of lanes without a non-finite input")


@pytest.fixture(scope="module", params=["host", "opencl", "opencl-gpu"])
def backend(request):
    """``(name, run)``: ``run(thunk, arena) -> {output: float64 array}`` on the host (asserting the
    chunked or blocked path) or on OpenCL (no host fallback allowed) at the device's own kernel target
    and with the gpu target forced (every case is long enough for the chunked gpu forms)."""
    if request.param == "host":
        def run(thunk, arena):
            path = host_fallback.path_for(thunk)
            long_enough = path.startswith(("chunked", "blocked")) or thunk["seq"] == 1  # or a decode step
            assert long_enough, f"{thunk['op']} seq {thunk['seq']} takes the {path} path"
            arena = arena.copy()
            host_fallback.execute(thunk, arena)
            return {f: read(thunk, arena, f) for f in outputs_of(thunk)}
        return "host", run
    config = rlx_gpu.Config(fallback="forbid")
    try:
        session = open_device(find("opencl"), "gpu" if request.param == "opencl-gpu" else None)
    except rlx_gpu.RlxError as err:
        pytest.skip(f"no OpenCL device: {err}")
    device = Device(session, config, RunOptions.build(config))
    if request.param == "opencl-gpu":
        for kind in KINDS:
            op, params, _ = make_case(kind, np.random.default_rng(0))
            thunk, _ = cases.lay_out(op, "f32", params)
            assert all(launch.kernel.endswith(CHUNKED) for launch in launches.plan(thunk, session.limits).launches), kind

    def run(thunk, arena):
        out = device.run(cases.schedule_of(thunk, arena.size), arena)
        return {f: read(thunk, out, f) for f in outputs_of(thunk)}
    return request.param, run


_CLEAN: dict[tuple, tuple] = {}


def clean_case(kind: str, dtype: str, seed: int, backend) -> tuple:
    """``(op, params, tensors, want, clean)`` of one seeded case: the reference and the backend's
    own run on the clean inputs (checked against the reference), computed once."""
    name, run = backend
    key = (kind, dtype, seed, name)
    if key not in _CLEAN:
        op, params, tensors = make_case(kind, np.random.default_rng(seed))
        thunk, arena = lay_out(op, dtype, params, tensors)
        want = reference(thunk, arena)
        clean = run(thunk, arena)
        check_causal(clean, clean, want, first_nonfinite(thunk, arena), op, dtype, f"{name} {kind} {dtype} clean")
        _CLEAN[key] = (op, params, tensors, want, clean)
    return _CLEAN[key]


SEEDS = (1, 2, 3)
VALUES = {"nan": np.nan, "+inf": np.inf, "-inf": -np.inf}
POISONED = [(kind, field) for kind in KINDS for field in STEP_FIELDS[op_of(kind)]]


def _steps(tensors: dict) -> dict:
    """The per-step fields of ``tensors`` (those with a batch and a step axis), as copies."""
    return {f: v.copy() for f, v in tensors.items() if f not in ("a", "state")}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("kind,field", POISONED)
def test_one_nonfinite_input_stays_causal(backend, kind, field, value, dtype):
    """One element of ``field`` at a random step (not the first) of a random lane set to NaN/±inf."""
    for seed in SEEDS:
        op, params, tensors, want, clean = clean_case(kind, dtype, seed, backend)
        rng = np.random.default_rng([seed, KINDS.index(kind), list(STEP_FIELDS[op]).index(field)])
        poisoned = dict(tensors, **{field: tensors[field].copy()})
        index = tuple(int(rng.integers(1 if axis == 1 else 0, size)) for axis, size in enumerate(poisoned[field].shape))
        poisoned[field][index] = VALUES[value]
        thunk, arena = lay_out(op, dtype, params, poisoned)
        first = first_nonfinite(thunk, arena)
        assert np.count_nonzero(first < params["seq"]) == (first.shape[1] if STEP_FIELDS[op][field] == "row" else 1)
        check_causal(backend[1](thunk, arena), clean, want, first, op, dtype,
                     f"{backend[0]} {kind} {dtype} seed {seed}: {field}{list(index)} = {value}")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("kind", ["gdn-head", "gdn-channel", "gdn-head-carry", "gdn-channel-carry"])
def test_f16_gated_delta_net_with_inf_inputs(backend, kind):
    """Eight ±inf scattered over q, k, v, g and beta of an f16 gated_delta_net: the lanes they hit
    keep every output before the first one, the others are untouched."""
    for seed in SEEDS:
        op, params, tensors, want, clean = clean_case(kind, "f16", seed, backend)
        rng = np.random.default_rng([seed, 99])
        poisoned = dict(tensors, **_steps(tensors))
        fields = list(STEP_FIELDS[op])
        for _ in range(8):
            arr = poisoned[fields[rng.integers(len(fields))]]
            arr[tuple(int(rng.integers(size)) for size in arr.shape)] = rng.choice([-np.inf, np.inf])
        thunk, arena = lay_out(op, "f16", params, poisoned)
        check_causal(backend[1](thunk, arena), clean, want, first_nonfinite(thunk, arena), op, "f16",
                     f"{backend[0]} {kind} seed {seed}")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("kind", KINDS)
def test_outputs_are_nonfinite_exactly_where_the_recurrence_has_them(backend, kind, dtype):
    """One to five NaN/±inf anywhere in the per-step inputs (half of those in ``g`` a reset,
    ``-inf``): every output, final states included, is non-finite exactly where the float64
    recurrence's is and matches it elsewhere, after the first non-finite input of a lane too (a
    NaN in one channel of ``x`` or ``v`` spoils only the state entries it reaches; a ``-inf`` gate
    empties the state, and the outputs after it are finite again)."""
    for seed in range(5):
        rng = np.random.default_rng([seed, 17, KINDS.index(kind)])
        op, params, tensors = make_case(kind, rng)
        fields = list(STEP_FIELDS[op])
        for _ in range(int(rng.integers(1, 6))):
            field = fields[rng.integers(len(fields))]
            value = -np.inf if field == "g" and rng.random() < 0.5 else rng.choice([np.nan, np.inf, -np.inf])
            tensors[field][tuple(int(rng.integers(size)) for size in tensors[field].shape)] = value
        check_nonfinite_where_the_recurrence_is(backend, kind, dtype, seed, op, params, tensors)


def check_nonfinite_where_the_recurrence_is(backend, kind: str, dtype: str, seed: int, op: str, params: dict,
                                            tensors: dict) -> None:
    """Every output (final state included) of ``backend`` non-finite exactly where the float64
    recurrence's is, and within the op's NMSE bound of it where finite. The step forms (the host, whose
    chunked path redoes a non-finite chunk step by step, and the cpu target) also give the recurrence's
    class at each of those positions: NaN, +Inf or -Inf; the gpu target's chunked forms may differ there."""
    thunk, arena = lay_out(op, dtype, params, tensors)
    want, got = reference(thunk, arena), backend[1](thunk, arena)
    for field, values in got.items():
        finite = np.isfinite(want[field])
        where = f"{backend[0]} {kind} {dtype} seed {seed}, {field}"
        wrong = int(np.count_nonzero(np.isfinite(values) != finite))
        assert wrong == 0, f"{where}: {wrong} outputs finite where the recurrence's are not or the other way"
        if backend[0] != "opencl-gpu":
            mismatch = non_finite_mismatch(values, want[field].astype(STORAGE[dtype]))
            assert mismatch is None, f"{where}: {mismatch[0]} positions differ at {mismatch[1][:8].tolist()}"
        check_close(values, want[field], op, dtype, f"{where}, where finite")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("kind", [kind for kind in KINDS if kind.startswith("gdn")])
def test_a_decode_step_is_nonfinite_exactly_where_the_recurrence_is(backend, kind, dtype):
    """One step (seq 1: the cpu target's gated_delta_net_step, the host's decode path) with one to
    three NaN/±inf in q, k, v, g, beta or the carried state: non-finite exactly where the float64
    recurrence is (a NaN in one channel of v spoils only that column of the state and output)."""
    for seed in range(8):
        rng = np.random.default_rng([seed, 23, KINDS.index(kind)])
        op, params, tensors = make_case(kind, rng, gdn_seq=1)
        fields = [*STEP_FIELDS[op], *(("state",) if params["carry_state"] else ())]
        for _ in range(int(rng.integers(1, 4))):
            field = fields[rng.integers(len(fields))]
            value = -np.inf if field == "g" and rng.random() < 0.5 else rng.choice([np.nan, np.inf, -np.inf])
            tensors[field][tuple(int(rng.integers(size)) for size in tensors[field].shape)] = value
        check_nonfinite_where_the_recurrence_is(backend, kind, dtype, seed, op, params, tensors)


def _overflowing(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Values past f16's range, of either sign: ±inf once stored in f16."""
    return rng.choice([-1.0, 1.0], shape) * rng.uniform(F16_OVERFLOW, 2 * F16_OVERFLOW, shape)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("kind", KINDS)
def test_padding_row_that_overflows_f16_leaves_the_real_rows_alone(backend, kind):
    """A third batch row of padding whose every value overflows f16: the two real rows come out
    bit-identical to a run without it."""
    op, params, tensors, want, clean = clean_case(kind, "f16", SEEDS[0], backend)
    rng = np.random.default_rng(7)
    padded = {f: v if f == "a" else np.concatenate([v, _overflowing(rng, (1, *v.shape[1:]))]) for f, v in tensors.items()}
    thunk, arena = lay_out(op, "f16", {**params, "batch": 3}, padded)
    first = first_nonfinite(thunk, arena)
    assert np.all(first[2] == 0) and np.all(first[:2] == params["seq"])
    got = {f: v[:2] for f, v in backend[1](thunk, arena).items()}
    check_causal(got, clean, want, first[:2], op, "f16", f"{backend[0]} {kind} padded batch")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("kind", KINDS)
def test_right_padding_that_overflows_f16_leaves_the_real_tokens_alone(backend, kind):
    """Batch item 1 is a shorter sequence right-padded with values that overflow f16: its real
    tokens (the steps before the padding) and batch item 0 come out as without the padding."""
    for seed in SEEDS:
        op, params, tensors, want, clean = clean_case(kind, "f16", seed, backend)
        rng = np.random.default_rng([seed, 5])
        padded = dict(tensors, **_steps(tensors))
        start = int(rng.integers(params["seq"] // 3, params["seq"]))
        for field in STEP_FIELDS[op]:
            padded[field][1, start:] = _overflowing(rng, padded[field][1, start:].shape)
        thunk, arena = lay_out(op, "f16", params, padded)
        first = first_nonfinite(thunk, arena)
        assert np.all(first[1] == start) and np.all(first[0] == params["seq"])
        check_causal(backend[1](thunk, arena), clean, want, first, op, "f16", f"{backend[0]} {kind} seed {seed}, padding from step {start}")


#: Every op with a host kernel whose arithmetic can overflow or meet a NaN (the ABI's numeric ops).
QUIET_OPS = ["lstm", "gru", "rnn", "selective_scan", "mamba2", "gated_delta_net", "lstm_backward", "gru_backward",
             "rnn_backward", "selective_scan_backward", "mamba2_backward", "gated_delta_net_backward"]


def _saturated(n: int, seed: int) -> np.ndarray:
    """Arena bytes of f32 values up to 3e38 in size, a few of them NaN or ±inf."""
    rng = np.random.default_rng(seed)
    values = np.clip(rng.standard_normal(n // 4) * 10.0 ** rng.integers(0, 39, n // 4), -3e38, 3e38)
    values[rng.integers(0, values.size, 6)] = [np.nan, np.inf, -np.inf, np.nan, -np.inf, np.inf]
    return values.astype(np.float32).view(np.uint8)


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("op", QUIET_OPS)
def test_host_kernels_raise_no_runtime_warning_on_non_finite_or_saturated_input(op):
    """NaN/inf propagate silently (the host kernels run under errstate), through the host device, the
    fallback's entry point and its worker threads alike; the caller's NumPy error state is left as it was."""
    params = dict(cases.SMALL[op])
    if "seq" in params:
        params["seq"] = 80  # long enough for the chunked paths
    thunk, nbytes = cases.lay_out(op, "f32", params)
    sched = cases.schedule_of(thunk, nbytes)
    before = np.geterr()
    for seed in range(3):
        arena = _saturated(nbytes, seed)
        rlx_gpu.get_device("host").run(sched, arena)
        workers = {"workers": 2} if "workers" in host_fallback.ACCEPTS[op] else {}
        host_fallback.execute(thunk, arena.copy(), **workers)
    assert np.geterr() == before
