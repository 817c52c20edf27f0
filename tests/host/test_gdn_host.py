"""host_fallback gated_delta_net against the float64 step recurrence of ABI.md §4."""
from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import host_fallback
from host_fallback import gdn
from rlx_gpu.conformance.reference_ssm import gated_delta_net, lay_out, read
from support.gdn_v2_cases import V2_CASES, v2_case, v2_run

settings.register_profile("ci", derandomize=True, max_examples=8, deadline=None)
PROPERTY = settings.get_profile("ci") if os.environ.get("CI") else settings(max_examples=30, deadline=None)

#: Error allowed relative to the largest reference value: f32/f64 math, one rounding on store.
TOL = {"f64": 1e-10, "f32": 5e-5, "f16": 4e-3, "bf16": 3e-2}


def _close(got, want, dtype, what="dst"):
    assert np.all(np.isfinite(got)), what
    err = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30)
    assert err <= TOL[dtype], f"{what}: relative error {err:.3g} > {TOL[dtype]} ({dtype})"


def _inputs(rng, b, s, h, n, per_channel, g_range=(-3.0, 0.0), carry=True):
    """L2-normalized keys, as the models feed them: the delta rule then never amplifies the state."""
    k = rng.standard_normal((b, s, h, n))
    tensors = {
        "q": rng.standard_normal((b, s, h, n)),
        "k": k / np.linalg.norm(k, axis=-1, keepdims=True),
        "v": rng.standard_normal((b, s, h, n)),
        "g": rng.uniform(*g_range, (b, s, h, n) if per_channel else (b, s, h)),
        "beta": rng.uniform(0.0, 1.0, (b, s, h)),
    }
    if carry:
        tensors["state"] = rng.standard_normal((b, h, n, n))
    return tensors


def _lay(dtype, tensors):
    b, s, h, n = tensors["q"].shape
    params = {"batch": b, "seq": s, "heads": h, "state_size": n, "gate_per_channel": tensors["g"].ndim == 4,
              "carry_state": "state" in tensors}
    return lay_out("gated_delta_net", dtype, params, tensors)


def _run(dtype, tensors, **options):
    """Run the kernel; return ``(out, final state or None)`` and the reference's."""
    thunk, arena = _lay(dtype, tensors)
    inputs = [read(thunk, arena, f) for f in ("q", "k", "v", "g", "beta")]
    state = read(thunk, arena, "state") if thunk["carry_state"] else None
    host_fallback.execute(thunk, arena, **options)
    got_state = read(thunk, arena, "state") if thunk["carry_state"] else None
    want, want_state = gated_delta_net(*inputs, state)
    return read(thunk, arena, "dst"), got_state, want, want_state


def _check(dtype, tensors, **options):
    got, got_state, want, want_state = _run(dtype, tensors, **options)
    _close(got, want, dtype)
    if got_state is not None:
        _close(got_state, want_state, dtype, "state")


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "f64"])
@pytest.mark.parametrize("path", ["step", "chunked"])
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("seq,heads,n,carry", [(1, 3, 16, True), (37, 1, 1, True), (37, 3, 16, False),
                                               (21, 2, 64, True), (19, 1, 128, True), (9, 2, 256, True)])
def test_matches_recurrence(dtype, path, per_channel, seq, heads, n, carry):
    rng = np.random.default_rng(seq * 1000 + n + heads)
    _check(dtype, _inputs(rng, 2, seq, heads, n, per_channel, carry=carry), path=path, chunk=8)


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("chunk", [2, 4, 16, 64])
def test_chunk_lengths(per_channel, chunk):
    _check("f32", _inputs(np.random.default_rng(chunk), 2, 70, 2, 8, per_channel), path="chunked", chunk=chunk)


def test_state_size_beyond_256_is_served():
    for path in ("step", "chunked"):
        _check("f32", _inputs(np.random.default_rng(1), 1, 5, 1, 300, True), path=path, chunk=4)


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("g_range", [(0.0, 0.4), (-200.0, -20.0)])
def test_growing_and_steep_gates_stay_finite(per_channel, g_range):
    """Positive gates grow the state (finite here); gates of -20 and below underflow it."""
    tensors = _inputs(np.random.default_rng(2), 2, 40, 2, 8, per_channel, g_range)
    got, got_state, want, want_state = _run("f32", tensors, path="chunked", chunk=32)
    assert np.all(np.isfinite(want)) and np.all(np.isfinite(want_state))
    _close(got, want, "f32")
    _close(got_state, want_state, "f32", "state")


@pytest.mark.parametrize("per_channel", [False, True])
def test_decode_steps_and_split_runs_reproduce_one_run(per_channel):
    tensors = _inputs(np.random.default_rng(4), 2, 30, 2, 16, per_channel)
    thunk, arena = _lay("f32", tensors)
    host_fallback.execute(thunk, arena, path="chunked", chunk=8)
    whole, whole_state = read(thunk, arena, "dst"), read(thunk, arena, "state")
    for cuts in ([0, 30], [0, 13, 30], list(range(31))):  # one run, a split, one step at a time
        state, outs = tensors["state"], []
        for lo, hi in zip(cuts, cuts[1:]):
            part = {f: (t[:, lo:hi] if f != "state" else state) for f, t in tensors.items()}
            part_thunk, part_arena = _lay("f32", part)
            host_fallback.execute(part_thunk, part_arena)
            outs.append(read(part_thunk, part_arena, "dst"))
            state = read(part_thunk, part_arena, "state")
        np.testing.assert_allclose(np.concatenate(outs, axis=1), whole, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(state, whole_state, rtol=1e-4, atol=1e-5)


def test_batch_items_are_independent():
    tensors = _inputs(np.random.default_rng(6), 3, 25, 2, 8, True)
    thunk, arena = _lay("f32", tensors)
    host_fallback.execute(thunk, arena, chunk=8)
    out, state = read(thunk, arena, "dst"), read(thunk, arena, "state")
    for i in range(3):
        one_thunk, one_arena = _lay("f32", {f: t[i : i + 1] for f, t in tensors.items()})
        host_fallback.execute(one_thunk, one_arena, chunk=8)
        np.testing.assert_allclose(read(one_thunk, one_arena, "dst")[0], out[i], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(read(one_thunk, one_arena, "state")[0], state[i], rtol=1e-5, atol=1e-6)


def test_path_choice_and_bad_options():
    shape = {"op": "gated_delta_net", "batch": 1, "heads": 1, "state_size": 16}
    long, short = {**shape, "seq": 4096}, {**shape, "seq": 1}
    assert gdn.path_for(long, workers=1) == f"chunked L={gdn.CHUNK}"
    assert gdn.path_for(short) == "step"
    assert gdn.path_for(short, path="chunked", chunk=8) == "chunked L=8"
    with pytest.raises(ValueError, match="power of two"):
        gdn.path_for(long, chunk=24)
    with pytest.raises(ValueError, match="unknown path 'fast'"):
        gdn.path_for(long, path="fast")
    with pytest.raises(ValueError, match="workers must be a positive int, got 0"):
        gdn.path_for(long, workers=0)


def test_split_across_cores_is_named_and_capped():
    big = {"op": "gated_delta_net", "batch": 2, "heads": 8, "state_size": 64, "seq": 1024}
    assert gdn.path_for(big, workers=2) == f"chunked L={gdn.CHUNK}, 2 threads"
    assert gdn.path_for({**big, "batch": 1, "heads": 1}, workers=4) == f"chunked L={gdn.CHUNK}"
    assert gdn.path_for({**big, "seq": 1}) == "step"  # decode stays on one thread
    assert gdn.path_for({**big, "seq": 16, "state_size": 4}) == "chunked L=32"  # too small to split


@pytest.mark.parametrize("path", ["step", "chunked"])
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("b,h,workers", [(3, 2, 2), (1, 5, 3), (2, 3, 7)])
def test_split_across_threads_matches_recurrence(path, per_channel, b, h, workers):
    """Blocks of batch items or heads on several threads, each updating its own slice of the
    carried state: every block is checked, and against the one-thread run."""
    tensors = _inputs(np.random.default_rng(b * 10 + h), b, 21, h, 8, per_channel)
    got, got_state, want, want_state = _run("f32", tensors, path=path, chunk=8, workers=workers)
    _close(got, want, "f32")
    _close(got_state, want_state, "f32", "state")
    one, one_state, _, _ = _run("f32", tensors, path=path, chunk=8, workers=1)
    np.testing.assert_allclose(got, one, rtol=0, atol=1e-6 * np.max(np.abs(one)))
    np.testing.assert_allclose(got_state, one_state, rtol=0, atol=1e-6 * np.max(np.abs(one_state)))


def test_a_failing_thread_raises_and_restores_blas(monkeypatch):
    from host_fallback import threads

    before = threads.blas_threads()
    real = gdn._chunked
    calls = []

    def failing(q, *rest):
        calls.append(q.shape)
        if len(calls) == 2:
            raise RuntimeError("block failed")
        real(q, *rest)

    monkeypatch.setattr(gdn, "_chunked", failing)
    with pytest.raises(RuntimeError, match="block failed"):
        _run("f32", _inputs(np.random.default_rng(0), 2, 20, 2, 8, False), path="chunked", chunk=8, workers=2)
    assert len(calls) == 2
    assert threads.blas_threads() == before


@PROPERTY
@given(
    b=st.integers(1, 2), s=st.integers(1, 40), h=st.integers(1, 3), n=st.sampled_from([1, 2, 5, 16]),
    per_channel=st.booleans(), carry=st.booleans(), chunk=st.sampled_from([2, 4, 8, 32]),
    g_low=st.floats(-20.0, 0.0), seed=st.integers(0, 2**16),
)
def test_property(b, s, h, n, per_channel, carry, chunk, g_low, seed):
    tensors = _inputs(np.random.default_rng(seed), b, s, h, n, per_channel, (g_low, 0.0), carry)
    _check("f32", tensors, path="chunked", chunk=chunk)


@pytest.mark.parametrize("workers", [1, 2])
def test_output_overlapping_another_blocks_inputs_reads_them_as_they_were(workers):
    """``dst`` placed one batch item into ``q`` (so over ``q[1]`` and the start of ``k``): the blocks
    of a split run must all load before any stores."""
    tensors = _inputs(np.random.default_rng(5), 2, 21, 2, 8, False, carry=False)
    thunk, arena = _lay("f32", tensors)
    want, _ = gated_delta_net(*(read(thunk, arena, f) for f in ("q", "k", "v", "g", "beta")))
    thunk = {**thunk, "dst": thunk["q"] + 21 * 2 * 8 * 4}
    host_fallback.execute(thunk, arena, path="chunked", chunk=8, workers=workers)
    _close(read(thunk, arena, "dst"), want, "f32")


# --- version 2 (ABI.md §8): grouped value heads, K != V, scale, q/k L2-norm, packed sequences, slots ---
# (the cases: support.gdn_v2_cases)

@pytest.mark.parametrize("path", ["step", "chunked"])
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("case", list(V2_CASES))
def test_v2_fields_match_reference(case, per_channel, path):
    params, tensors = v2_case(np.random.default_rng(len(case)), per_channel=per_channel, **V2_CASES[case])
    got, got_state, want, want_state = v2_run("f32", params, tensors, path=path, chunk=4)
    _close(got, want, "f32")
    if got_state is not None:
        _close(got_state, want_state, "f32", "state")


@pytest.mark.parametrize("dtype,state_dtype", [("bf16", "f32"), ("f16", "f32"), ("f32", "f64"), ("bf16", "bf16")])
@pytest.mark.parametrize("path", ["step", "chunked"])
def test_state_dtype_carries_the_state_at_its_precision(dtype, state_dtype, path):
    """Everything at once in 16-bit storage with an f32 state: the state round trip keeps f32 digits."""
    fields = dict(V2_CASES["all"], state_dtype=state_dtype)
    params, tensors = v2_case(np.random.default_rng(3), per_channel=True, **fields)
    got, got_state, want, want_state = v2_run(dtype, params, tensors, path=path, chunk=4)
    _close(got, want, dtype)
    _close(got_state, want_state, "f32" if state_dtype != dtype else dtype, "state")


@pytest.mark.parametrize("path", ["step", "chunked"])
@pytest.mark.parametrize("per_channel", [False, True])
def test_packed_sequences_match_each_sequence_run_alone(per_channel, path):
    cu = [0, 5, 5, 6, 17, 19]
    params, tensors = v2_case(np.random.default_rng(8), per_channel=per_channel, cu=cu, value_heads=4)
    thunk, arena = lay_out("gated_delta_net", "f32", params, tensors)
    host_fallback.execute(thunk, arena, path=path, chunk=4)
    packed_out, packed_state = read(thunk, arena, "dst"), read(thunk, arena, "state")
    for i, (lo, hi) in enumerate(zip(cu, cu[1:])):
        alone = {f: tensors[f][:, lo:hi] for f in ("q", "k", "v", "g", "beta")}
        alone["state"] = tensors["state"][i:i + 1]
        if hi == lo:  # an empty sequence: its state comes back as it was
            np.testing.assert_array_equal(packed_state[i], read(thunk, arena, "state")[i])
            np.testing.assert_allclose(packed_state[i], tensors["state"][i].astype(np.float32), rtol=0, atol=0)
            continue
        one_params = {**params, "batch": 1, "seq": hi - lo}
        del one_params["cu_seqlens"]
        one_thunk, one_arena = lay_out("gated_delta_net", "f32", one_params, alone)
        host_fallback.execute(one_thunk, one_arena, path=path, chunk=4)
        np.testing.assert_allclose(packed_out[0, lo:hi], read(one_thunk, one_arena, "dst")[0], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(packed_state[i], read(one_thunk, one_arena, "state")[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cu", [None, [0, 2, 9]])
@pytest.mark.parametrize("path", ["step", "chunked"])
def test_slots_leave_every_other_pool_entry_untouched(path, cu):
    params, tensors = v2_case(np.random.default_rng(11), slots=[3, 1], num_slots=5, cu=cu, value_heads=4)
    thunk, arena = lay_out("gated_delta_net", "bf16", {**params, "state_dtype": "f32"}, tensors)
    region = next(r for r in host_fallback.regions(thunk) if r.field == "state")
    before = arena[region.offset:region.offset + region.nbytes].copy().reshape(5, -1)
    host_fallback.execute(thunk, arena, path=path, chunk=4)
    after = arena[region.offset:region.offset + region.nbytes].reshape(5, -1)
    for entry in (0, 2, 4):
        np.testing.assert_array_equal(after[entry], before[entry])
    assert all((after[e] != before[e]).any() for e in (1, 3))


@pytest.mark.parametrize("path", ["step", "chunked"])
@pytest.mark.parametrize("per_channel", [False, True])
def test_packed_split_across_threads_matches_one_thread(per_channel, path):
    params, tensors = v2_case(np.random.default_rng(13), per_channel=per_channel, cu=[0, 3, 11, 12], heads=3,
                               value_heads=6)
    one, one_state, want, want_state = v2_run("f32", params, tensors, path=path, chunk=4, workers=1)
    got, got_state, _, _ = v2_run("f32", params, tensors, path=path, chunk=4, workers=3)
    _close(got, want, "f32")
    _close(got_state, want_state, "f32", "state")
    np.testing.assert_allclose(got, one, rtol=0, atol=1e-6 * np.max(np.abs(one)))
    np.testing.assert_allclose(got_state, one_state, rtol=0, atol=1e-6 * np.max(np.abs(one_state)))


@pytest.mark.parametrize("path", ["step", "chunked"])
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_packed_nonfinite_stays_in_its_sequence(value, per_channel, path):
    """A NaN/Inf in one sequence's carried state and in another's value at a mid-chunk token reach
    exactly the outputs and states the float64 recurrence gives them, and no other sequence."""
    cu = [0, 5, 6, 13, 17]
    params, tensors = v2_case(np.random.default_rng(21), per_channel=per_channel, cu=cu, value_heads=4, v=6)
    tensors["state"][1, 2, 0, 3] = value
    tensors["v"][0, 9, 1, 2] = value
    with np.errstate(invalid="ignore", over="ignore"):
        got, got_state, want, want_state = v2_run("f32", params, tensors, path=path, chunk=4)
    for name, a, b in (("dst", got, want), ("state", got_state, want_state)):
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=name)
        np.testing.assert_array_equal(np.isposinf(a), np.isposinf(b), err_msg=name)
        finite = np.isfinite(b)
        np.testing.assert_allclose(a[finite], b[finite], rtol=1e-4, atol=1e-4, err_msg=name)
    assert np.isfinite(got[0, :5]).all() and np.isfinite(got[0, 13:]).all()  # sequences 0 and 3 untouched
    assert not np.isfinite(got[0, 5]).all() and not np.isfinite(got[0, 9:13]).all()


def _graph_gdn(dtype, state_dtype, shapes, **kwargs):
    """A graph of one gated_delta_net over inputs of ``shapes``; returns (executable, its schedule's label)."""
    from rlx_gpu.graph.builder import Graph
    from rlx_gpu.graph.lowering import lower

    g = Graph(dtype)
    ins = {f: g.input(f, shape, {"cu_seqlens": "i32", "state_slots": "i32", "state": state_dtype}.get(f))
           for f, shape in shapes.items()}
    extra = {f: ins[f] for f in ("cu_seqlens", "state_slots") if f in ins}
    out = g.gated_delta_net(*(ins[f] for f in ("q", "k", "v", "g", "beta")), initial_state=ins.get("state"),
                            name="gdn", **extra, **kwargs)
    g.output("y", out[0] if isinstance(out, tuple) else out)
    return g.compile("host"), lower(g)[0]["abi"]


def test_builder_takes_fla_arguments_and_emits_version_2_only_when_used():
    cu, slots = [0, 3, 3, 9], [2, 0, 3]
    params, tensors = v2_case(np.random.default_rng(31), heads=2, value_heads=4, k=8, v=6, cu=cu, slots=slots,
                               num_slots=4, per_channel=True, state_dtype="f32")
    shapes = {f: np.shape(a) for f, a in tensors.items()}
    exe, abi = _graph_gdn("bf16", "f32", shapes, gate_per_channel=True, scale=0.25, use_qk_l2norm=True)
    assert abi == "rlx-thunks/2"
    thunk = exe.schedule.thunks[0].to_dict()
    assert {f: thunk[f] for f in ("value_heads", "value_size", "scale", "qk_l2norm", "num_seqs", "num_slots",
                                  "state_dtype")} == dict(value_heads=4, value_size=6, scale=0.25, qk_l2norm=True,
                                                          num_seqs=3, num_slots=4, state_dtype="f32")
    got = exe.run(**{f: np.asarray(a) for f, a in tensors.items()})
    rounded = {f: np.asarray(a, np.float64) if f in ("cu_seqlens", "state_slots", "state")
               else np.asarray(a).astype(ml_dtypes.bfloat16).astype(np.float64) for f, a in tensors.items()}
    want, want_state = gated_delta_net(*(rounded[f] for f in ("q", "k", "v", "g", "beta")),
                                       rounded["state"].astype(np.float32), scale=0.25, qk_l2norm=True,
                                       cu_seqlens=cu, state_slots=slots)
    _close(got["y"], want, "bf16")
    _close(got["gdn.state"], want_state, "f32", "state")
    v1_shapes = {"q": (1, 9, 2, 8), "k": (1, 9, 2, 8), "v": (1, 9, 2, 8), "g": (1, 9, 2), "beta": (1, 9, 2),
                 "state": (1, 2, 8, 8)}
    _, abi = _graph_gdn("f32", None, v1_shapes, scale=8 ** -0.5)  # the default scale, given: still version 1
    assert abi == "rlx-thunks/1"
