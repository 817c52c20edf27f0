"""mamba3's compiled step (``jit_mamba3.mamba3_step``, bound by ``host_fallback.mamba3.prepare``): a thunk's whole
step path in one Numba call, beside NumPy's step path (``RLX_HOST_JIT=0``).

Both against the float64 reference (rlx_gpu/conformance/reference_mamba3.py) at decode (S=1) and a few tokens,
over every field the step path takes (q/k groups, biases, d, z, carried state with slots, packed sequences, an
empty one, no carried state); their NaN and ±inf positions against each other; the compiled step exactly where
it applies (f32 storage, the step path) and not elsewhere; a prepared thunk rebinding each arena it is given.
"""
from __future__ import annotations

import numpy as np
import pytest

import host_fallback
from host_fallback import jit
from rlx_gpu.conformance import reference_mamba3 as ref
from rlx_gpu.conformance.reference_ssm import lay_out, read
from support.host_jit import compiled, count_calls  # noqa: F401  (compiled: a fixture)
from tests.support.mamba3_cases import OPTIONAL, STATES, draw

numba = pytest.importorskip("numba", reason="the jit extra (Numba) is not installed")
from host_fallback import jit_mamba3  # noqa: E402  (needs Numba)

#: Error allowed relative to the largest reference value (f32 arithmetic).
TOL = 5e-5


@pytest.fixture
def calls(monkeypatch):
    """Counts the compiled step's calls (it still runs)."""
    return count_calls(monkeypatch, jit_mamba3, ["mamba3_step"])


def _case(seq: int, *, groups: int = 2, optional=OPTIONAL, carry: bool = True, slots=None, cu=None, seed: int = 0,
          dtype: str = "f32", heads: int = 4):
    """``(thunk, arena, reference y, reference pools, the entries its rows write)``: a mamba3 thunk of ``heads``
    heads (P=3, N=8, A=3)."""
    batch = 1 if cu is not None else 2
    rows = len(cu) - 1 if cu is not None else batch
    entries = (max(slots) + 1 if slots is not None else rows) if carry else None
    args = draw(batch, seq, heads, 3, 8, 3, groups=groups, optional=optional, entries=entries, seed=seed)
    params = dict(batch=batch, seq=seq, heads=heads, head_dim=3, state_size=8, num_angles=3, groups=groups,
                  carry_state=carry, **{f: True for f in optional})
    tensors = {f: a for f, a in args.items() if f != "states"}
    if carry:
        tensors.update(zip(STATES, args["states"]))
    if slots is not None:
        params.update(state_slots=list(slots), num_slots=entries)
    if cu is not None:
        params.update(cu_seqlens=list(cu), num_seqs=rows)
    thunk, arena = lay_out("mamba3", dtype, params, tensors)
    stored = {f: read(thunk, arena, f) for f in tensors}  # the rounded values the kernel reads
    states = [stored[f] for f in STATES] if carry else None
    out = ref.mamba3(*(stored[f] for f in ("q", "k", "v", "adt", "dt", "trap", "angles")),
                     **{f: stored[f] for f in optional}, states=states, cu_seqlens=cu, state_slots=slots)
    y, pools = out if carry else (out, None)
    taking = [r for r in range(rows) if cu is None or cu[r + 1] > cu[r]]  # the rows with a token
    return thunk, arena, y, pools, [r if slots is None else slots[r] for r in taking]


def _check(thunk, arena, y, pools, written):
    scale = max(1.0, float(np.max(np.abs(y))))
    np.testing.assert_allclose(read(thunk, arena, "dst"), y, rtol=0, atol=TOL * scale)
    for f, want in zip(STATES, pools or ()):
        got = read(thunk, arena, f)
        if f == "angle_state":  # written reduced into [0, 2π], compared modulo 2π (ABI.md §11)
            assert np.all((got[written] >= 0) & (got[written] <= np.float32(2 * np.pi))), got
            got, want = np.cos(got), np.cos(want)
        np.testing.assert_allclose(got, want, rtol=0, atol=TOL * max(1.0, float(np.max(np.abs(want)))), err_msg=f)


CASES = {
    "everything": {},
    "one group": {"groups": 1},
    "no optional": {"optional": ()},
    "biases only": {"optional": ("q_bias", "k_bias")},
    "slots": {"slots": [2, 0]},
    "no carried state": {"carry": False},
    "packed, an empty one": {"cu": [0, 1, 1, 2], "slots": [1, 3, 0]},
}


@pytest.mark.parametrize("seq", [1, 3])
@pytest.mark.parametrize("case", CASES)
def test_the_step_matches_the_reference(case, seq, compiled, calls):
    """One compiled call a thunk where Numba runs (none with ``RLX_HOST_JIT=0``), both within f32 of float64."""
    fields = dict(CASES[case])
    if "cu" in fields and seq > 1:
        fields["cu"] = [0, seq, seq, 2 * seq + 1]
    thunk, arena, *want = _case(seq if "cu" not in fields else fields["cu"][-1], **fields)
    host_fallback.bound_kernel(thunk, {})(arena)
    _check(thunk, arena, *want)
    assert calls["mamba3_step"] == (1 if compiled else 0)


def test_an_empty_sequence_leaves_its_entry_untouched(calls):
    """An entry whose sequence has no token keeps its bytes: its angle is not reduced again (2π stays 2π)."""
    thunk, arena, *_ = _case(2, cu=[0, 0, 2], slots=[0, 1])
    pool = next(r for r in host_fallback.abi.regions(thunk) if r.field == "angle_state")
    view = host_fallback.arena.view(arena, pool.offset, pool.dtype, pool.shape)
    view[0] = np.float32(2 * np.pi)
    before = arena.copy()
    host_fallback.bound_kernel(thunk, {})(arena)
    assert view[0].tobytes() == host_fallback.arena.view(before, pool.offset, pool.dtype, pool.shape)[0].tobytes()
    assert calls["mamba3_step"] == 1


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("field", ["v", "adt", "angles", "q", "z"])
def test_nan_and_inf_land_where_numpy_puts_them(field, value, monkeypatch, calls):
    thunk, arena, *_ = _case(3, seed=4)
    region = next(r for r in host_fallback.abi.regions(thunk) if r.field == field)
    host_fallback.arena.view(arena, region.offset, region.dtype, region.shape)[1, 1, 0] = value
    numpy_arena = arena.copy()
    host_fallback.bound_kernel(thunk, {})(arena)
    with monkeypatch.context() as patch:
        patch.setenv(jit.ENV, "0")
        host_fallback.bound_kernel(thunk, {})(numpy_arena)
    for f in ("dst", *STATES):
        got, want = read(thunk, arena, f), read(thunk, numpy_arena, f)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f)
        np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want), err_msg=f)
        np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg=f)
    assert calls["mamba3_step"] == 1


@pytest.mark.parametrize("label,fields,options", [
    ("f64 storage", {"dtype": "f64"}, {}),
    ("the chunked path", {}, {"path": "chunked"}),
    ("past the step path's length", {"seq_override": 9}, {}),
    ("two workers forced", {}, {"workers": 2}),
])
def test_numpy_runs_where_the_compiled_step_does_not_apply(label, fields, options, calls):
    seq = fields.pop("seq_override", 2)
    thunk, arena, *want = _case(seq, **fields)
    host_fallback.bound_kernel(thunk, options)(arena)
    _check(thunk, arena, *want)
    assert calls["mamba3_step"] == 0


def test_a_prepared_step_binds_each_arena_it_is_given(calls):
    """``PREPARE["mamba3"]`` on arena A, B, then A again with new inputs written in place: each run the float64
    reference of what that arena held, each through the compiled step."""
    cases = [_case(1, slots=[1, 0], seed=seed) for seed in (1, 2, 3)]
    run = host_fallback.PREPARE["mamba3"](cases[0][0])
    for thunk, arena, *want in (cases[0], cases[1], cases[0]):
        if arena is cases[0][1] and calls["mamba3_step"]:
            arena[:] = cases[2][1]  # the same array object, new contents
            want = cases[2][2:]
        run(arena)
        _check(thunk, arena, *want)
    assert calls["mamba3_step"] == 3


def test_a_bad_worker_count_is_refused_before_anything_runs(calls):
    thunk, arena, *_ = _case(1)
    before = arena.copy()
    with pytest.raises(ValueError, match=r"^mamba3: workers must be a positive int, got 0$"):
        host_fallback.bound_kernel(thunk, {"workers": 0})(arena)
    assert np.array_equal(arena, before) and calls["mamba3_step"] == 0
