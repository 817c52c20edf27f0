"""host_fallback selective_scan and mamba2 with ABI.md §8's fields, against the float64 references.

Every field present and absent and their combinations (varlen with state slots and a carried state,
a bf16 thunk with an f32 state), on the step path and on the fast one with chunks short enough that
sequences start inside them; packed sequences against each sequence run alone; the slots nobody
names left alone; a NaN or Inf in a new input reaching exactly the outputs the recurrence sends it to.
"""
from __future__ import annotations

import numpy as np
import pytest

import host_fallback
from host_fallback.abi import complete
from host_fallback.arena import STORAGE
from rlx_gpu.conformance.compare import non_finite_mismatch
from rlx_gpu.conformance.reference_ssm import lay_out, read
from rlx_gpu.conformance.references import REFERENCES
from support.ssm_v2_cases import (CU, MAMBA2_FIELDS, NUM_SLOTS, SCAN_FIELDS, SLOTS, TOL, check_close, make, outputs,
                                  run)

#: the fast path of each op
FAST = {"selective_scan": "blocked", "mamba2": "chunked"}

CASES = ([("selective_scan", f) for f in SCAN_FIELDS] + [("mamba2", f) for f in MAMBA2_FIELDS])


def _label(case):
    op, fields = case
    return f"{op}-" + ".".join(k if v is True else f"{k}={v}" for k, v in fields.items())


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("fast", [False, True], ids=["step", "fast"])
@pytest.mark.parametrize("case", CASES, ids=[_label(c) for c in CASES])
def test_fields_match_the_reference(case, fast, dtype):
    op, fields = case
    params, tensors = make(op, np.random.default_rng(len(fields) * 7 + 3), fields)
    path = FAST[op] if fast else "step"
    thunk, got, want = run(op, dtype, params, tensors, path=path, chunk=8)
    check_close(thunk, got, want, f"{op} {path} {dtype}")


@pytest.mark.parametrize("op", ["selective_scan", "mamba2"])
@pytest.mark.parametrize("dtype,state_dtype,param_dtype", [("bf16", "f32", "f32"), ("f16", "f32", "f16"),
                                                           ("f32", "f64", "f32"), ("f64", "f64", "f64")])
def test_wider_state_and_parameters(op, dtype, state_dtype, param_dtype):
    """A 16-bit thunk with an f32 state (and f32 a/d/bias, as mamba_ssm keeps them), an f32 thunk with
    an f64 state: the state and parameters are stored in their own type and the recurrence carried at
    that precision, so the final state is as close to the float64 one as its own type allows."""
    bias = "delta_bias" if op == "selective_scan" else "dt_bias"
    fields = {"varlen": True, "carry_state": True, "slots": True, "d": True, bias: True,
              "state_dtype": state_dtype, "param_dtype": param_dtype}
    params, tensors = make(op, np.random.default_rng(11), fields)
    for fast in (False, True):
        thunk, got, want = run(op, dtype, params, tensors, path=FAST[op] if fast else "step", chunk=8)
        check_close(thunk, got, want, f"{op} {dtype} state {state_dtype}")
        regions = {r.field: r.dtype for r in host_fallback.regions(thunk)}
        assert regions["state"] == state_dtype and regions["a"] == regions["d"] == regions[bias] == param_dtype


@pytest.mark.parametrize("op", ["selective_scan", "mamba2"])
@pytest.mark.parametrize("fast", [False, True], ids=["step", "fast"])
def test_packed_sequences_equal_each_sequence_alone(op, fast):
    """One varlen thunk through state slots gives each sequence the outputs and final state of a thunk
    of that sequence alone (batch 1) started from the same pool entry."""
    bias = "delta_bias" if op == "selective_scan" else "dt_bias"
    fields = {"varlen": True, "carry_state": True, "slots": True, "d": True, "z": True, bias: True}
    params, tensors = make(op, np.random.default_rng(5), fields)
    path = FAST[op] if fast else "step"
    thunk, got, _ = run(op, "f32", params, tensors, path=path, chunk=8)
    for r, (lo, hi) in enumerate(zip(CU, CU[1:])):
        entry = SLOTS[r]
        if hi == lo:  # an empty sequence keeps its entry
            np.testing.assert_array_equal(got["state"][entry], read(thunk, lay_out(op, "f32", params, tensors)[1],
                                                                    "state")[entry])
            continue
        alone = {k: v for k, v in params.items() if k not in ("cu_seqlens", "num_seqs", "state_slots", "num_slots")}
        alone["seq"] = hi - lo
        one = {f: (v[:, lo:hi] if f not in ("a", "d", bias, "state") else v) for f, v in tensors.items()}
        one["state"] = tensors["state"][entry : entry + 1]
        _, single, _ = run(op, "f32", alone, one, path=path, chunk=8)
        np.testing.assert_allclose(got["dst"][:, lo:hi], single["dst"], rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(got["state"][entry], single["state"][0], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("op", ["selective_scan", "mamba2"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_slots_leave_the_other_entries_untouched(op, dtype):
    params, tensors = make(op, np.random.default_rng(2), {"carry_state": True, "slots": True})
    thunk, arena = lay_out(op, dtype, params, tensors)
    before = arena.copy()
    host_fallback.execute(thunk, arena)
    state = next(r for r in host_fallback.regions(thunk) if r.field == "state")
    entry = state.nbytes // NUM_SLOTS
    named = set(SLOTS[: params["batch"]])
    for e in range(NUM_SLOTS):
        span = slice(state.offset + e * entry, state.offset + (e + 1) * entry)
        same = np.array_equal(arena[span], before[span])
        assert same == (e not in named), f"entry {e}: {'unchanged' if same else 'changed'}"


def _poisoned(op, fields, field, index, value, seed=4):
    params, tensors = make(op, np.random.default_rng(seed), fields)
    tensors = dict(tensors, **{field: tensors[field].copy()})
    tensors[field][index] = value
    return params, tensors


#: (op, §8 fields, input, index, value): one NaN or Inf in an input of version 2. In ``varlen`` cases
#: it sits in sequence 2 (tokens 5..17), which shares chunk 2 (tokens 16..23) with sequences 3 and 4.
NONFINITE = [
    ("selective_scan", {"z": True}, "z", (1, 20, 2), np.nan),
    ("selective_scan", {"d": True}, "d", (1,), np.inf),
    ("selective_scan", {"delta_bias": True, "delta_softplus": True}, "delta_bias", (3,), np.inf),
    ("selective_scan", {"carry_state": True}, "state", (1, 2, 0), np.nan),
    ("selective_scan", {"varlen": True, "carry_state": True, "slots": True}, "x", (0, 12, 1), np.inf),
    ("selective_scan", {"varlen": True, "carry_state": True}, "delta", (0, 16, 0), np.nan),
    ("mamba2", {"z": True}, "z", (1, 20, 2, 1), -np.inf),
    ("mamba2", {"d": True}, "d", (2,), np.nan),
    ("mamba2", {"dt_bias": True, "dt_softplus": True, "dt_limit": [0.0, None]}, "dt_bias", (1,), np.inf),
    ("mamba2", {"carry_state": True}, "state", (1, 2, 0, 3), np.inf),
    ("mamba2", {"varlen": True, "carry_state": True, "slots": True}, "x", (0, 12, 1, 2), np.nan),
    ("mamba2", {"varlen": True, "carry_state": True}, "dt", (0, 17, 3), np.inf),
    ("mamba2", {"varlen": True}, "b", (0, 16, 0, 1), -np.inf),
]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("fast", [False, True], ids=["step", "fast"])
@pytest.mark.parametrize("case", NONFINITE, ids=[f"{c[0]}-{c[2]}" for c in NONFINITE])
def test_nonfinite_inputs_reach_what_the_recurrence_reaches(case, fast):
    """Every output (final states included) non-finite exactly where the float64 recurrence's is, with
    its class (NaN, +Inf, -Inf), and close to it elsewhere: a packed sequence restarts clean after a
    NaN in the one before it, inside the chunk they share too."""
    op, fields, field, index, value = case
    params, tensors = _poisoned(op, fields, field, index, value)
    path = FAST[op] if fast else "step"
    thunk, got, want = run(op, "f32", params, tensors, path=path, chunk=8)
    for name, values in got.items():
        finite = np.isfinite(want[name])
        assert not finite.all() or name == "state", f"{name}: the case reaches no output"
        wrong = int(np.count_nonzero(np.isfinite(values) != finite))
        assert wrong == 0, f"{path} {name}: {wrong} outputs finite where the recurrence's are not or the other way"
        mismatch = non_finite_mismatch(values, want[name].astype(STORAGE["f32"]))
        assert mismatch is None, f"{path} {name}: {mismatch[0]} positions differ at {mismatch[1][:8].tolist()}"
        err = np.max(np.abs(values[finite] - want[name][finite]), initial=0) / np.max(np.abs(want[name][finite]))
        assert err <= TOL["f32"], f"{path} {name}: relative error {err:.3g} where finite"
    if fields.get("varlen"):
        later = slice(CU[3], None)  # sequences 3 and 4 start after the poisoned sequence 2 has ended
        assert np.isfinite(got["dst"][:, later]).all()


# ----------------------------------------------------------------------------- the Graph builder
@pytest.mark.parametrize("op", ["selective_scan", "mamba2"])
def test_builder_takes_mamba_ssm_arguments(op):
    """``Graph.selective_scan`` / ``mamba2`` with D, z, the bias/softplus/limit, grouped b/c, a packed batch
    (cu_seqlens baked in) through state slots (an i32 input), a bf16 thunk with f32 state and parameters:
    the schedule is version 2 and the outputs match the float64 reference on the stored values."""
    from rlx_gpu.conformance import reference_ssm
    from rlx_gpu.graph.builder import Graph

    _, tensors = make(op, np.random.default_rng(9), {"varlen": True, "carry_state": True, "slots": True, "groups": 2})
    if op == "selective_scan":
        names, knobs, limit = ("x", "delta", "a", "b", "c"), dict(delta_softplus=True), {}
        bias = {"delta_bias": tensors["delta_bias"]}
    else:
        names, knobs, limit = ("x", "dt", "a", "b", "c"), dict(dt_softplus=True), {"dt_limit": (0.0, float("inf"))}
        bias = {"dt_bias": tensors["dt_bias"]}
    g = Graph("bf16")
    ins = {f: g.input(f, tensors[f].shape) for f in (*names, "z") if f != "a"}
    state = g.input("state", tensors["state"].shape, "f32")
    y, _ = getattr(g, op)(ins[names[0]], ins[names[1]], tensors["a"], ins["b"], ins["c"], D=tensors["d"], z=ins["z"],
                          initial_state=state, cu_seqlens=CU, state_slots=g.input("slots", (len(SLOTS),), "i32"),
                          param_dtype="f32", name="ssm", **knobs, **limit, **bias)
    g.output("y", y)
    exe = g.compile("host")
    thunk = next(t for t in exe.schedule.thunks if t.op == op)
    assert exe.schedule.abi == "rlx-thunks/2"
    assert thunk.fields["state_dtype"] == thunk.fields["param_dtype"] == "f32" and thunk.fields["groups"] == 2
    got = exe.run(**{f: tensors[f] for f in ins}, state=tensors["state"], slots=np.array(SLOTS, np.int32))
    stored = {f: v.astype(STORAGE["bf16" if f in ins else "f32"]).astype(np.float64) for f, v in tensors.items()}
    params = {f: stored[f] for f in ("d", *bias)}
    want, want_state = getattr(reference_ssm, op)(*(stored[f] for f in names), z=stored["z"], state=stored["state"],
                                                  cu_seqlens=CU, state_slots=SLOTS, **knobs, **params,
                                                  **({"dt_limit": (0.0, None)} if limit else {}))
    for label, values, ref, tol in (("y", got["y"], want, TOL["bf16"]), ("state", got["ssm.state"], want_state, 1e-4)):
        err = np.max(np.abs(values - ref)) / np.max(np.abs(ref))
        assert err <= tol, f"{label}: relative error {err:.3g}"


@pytest.mark.parametrize("op", ["selective_scan", "mamba2"])
def test_builder_without_version_2_arguments_stays_version_1(op):
    from host_fallback.abi import OPS
    from rlx_gpu.graph.builder import Graph

    _, tensors = make(op, np.random.default_rng(1), {})
    names = ("x", "delta" if op == "selective_scan" else "dt", "a", "b", "c")
    g = Graph("f32")
    g.output("y", getattr(g, op)(*(g.input(f, tensors[f].shape) for f in names)))
    exe = g.compile("host")
    assert exe.schedule.abi == "rlx-thunks/1"
    assert not set(exe.schedule.to_dict()["thunks"][0]) & set(OPS[op].defaults)


@pytest.mark.parametrize("op", ["selective_scan", "mamba2"])
@pytest.mark.parametrize("fast", [False, True], ids=["step", "fast"])
@pytest.mark.parametrize("shape", [dict(batch=2, seq=37), dict(batch=1, seq=8, h=1)], ids=["B2S37", "B1S8H1"])
def test_inputs_are_read_where_they_lie_and_left_as_they_were(op, fast, shape):
    """The kernels read f32 inputs straight from the arena: every byte outside the outputs is unchanged
    afterwards (one chunk of one head per thread included, where a chunked view is the input itself)."""
    bias = "delta_bias" if op == "selective_scan" else "dt_bias"
    fields = {"d": True, "z": True, bias: True, "delta_softplus" if op == "selective_scan" else "dt_softplus": True}
    params, tensors = make(op, np.random.default_rng(3), fields, **shape)
    if op == "mamba2":  # steep decays: the chunk is not factored and takes the form that scales c in place
        tensors["a"] = tensors["a"] * 60
    thunk, arena = lay_out(op, "f32", params, tensors)
    before = arena.copy()
    host_fallback.execute(thunk, arena, path=FAST[op] if fast else "step", chunk=8, workers=4)
    dst = next(r for r in host_fallback.regions(thunk) if r.field == "dst")
    kept = np.ones(arena.size, bool)
    kept[dst.offset : dst.offset + dst.nbytes] = False
    np.testing.assert_array_equal(arena[kept], before[kept])
    assert not np.array_equal(arena[~kept], before[~kept])


@pytest.mark.parametrize("op", ["selective_scan", "mamba2"])
def test_through_load_schedule_on_the_host_device(op):
    """A version-2 schedule read by ``load_schedule`` and run by the host device: the packed batch
    through slots with every knob matches the reference, and a slot used twice is refused with a
    RunError naming the field, the caller's arena unchanged."""
    import rlx_gpu
    from rlx_gpu.conformance.cases import schedule_of

    bias = "delta_bias" if op == "selective_scan" else "dt_bias"
    fields = {"varlen": True, "carry_state": True, "slots": True, "groups": 2, "d": True, "z": True, bias: True}
    params, tensors = make(op, np.random.default_rng(21), fields)
    thunk, arena = lay_out(op, "f32", params, tensors)
    want = REFERENCES[op](complete(thunk), lambda f: read(thunk, arena, f))
    schedule = rlx_gpu.load_schedule(schedule_of(thunk, arena.size))
    assert schedule.abi == "rlx-thunks/2"
    out = rlx_gpu.get_device("host").run(schedule, arena)
    check_close(thunk, {f: read(thunk, out, f) for f in outputs(thunk)}, want)
    bad, bad_arena = lay_out(op, "f32", dict(params, state_slots=[6, 0, 6, 5, 1]), tensors)
    given = bad_arena.copy()
    with pytest.raises(rlx_gpu.RunError, match="state_slots"):
        rlx_gpu.get_device("host").run(rlx_gpu.load_schedule(schedule_of(bad, bad_arena.size)), given)
    np.testing.assert_array_equal(given, bad_arena)


@pytest.mark.parametrize("op", ["selective_scan", "mamba2"])
@pytest.mark.parametrize("fast", [False, True], ids=["step", "fast"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_blocks_on_threads_share_the_pool(op, fast, dtype):
    """Packed sequences through slots split across threads by groups (selective_scan) or heads (mamba2):
    each block gathers and scatters its own part of the pool rows, and the whole matches the reference."""
    fields = {"varlen": True, "carry_state": True, "slots": True, "groups": 2}
    params, tensors = make(op, np.random.default_rng(13), fields)
    thunk, got, want = run(op, dtype, params, tensors, path=FAST[op] if fast else "step", chunk=8, workers=3)
    check_close(thunk, got, want, f"{op} {dtype} on threads")
    fields["varlen"] = False
    params, tensors = make(op, np.random.default_rng(14), fields)
    thunk, got, want = run(op, dtype, params, tensors, path=FAST[op] if fast else "step", chunk=8, workers=3)
    check_close(thunk, got, want, f"{op} {dtype} batch on threads")
