"""host_fallback's compiled state-space steps (``jit``, ``compiled_step``): the step paths of selective_scan,
mamba2 and gated_delta_net in one Numba call each, beside their NumPy twin (``RLX_HOST_JIT=0``).

Both against the float64 references (rlx_gpu/conformance/reference_ssm.py, through test_ssm_v2's and
test_gdn_host's cases) over every version-2 field the step path takes, at decode (S=1) and a few tokens;
their NaN and ±inf positions against each other; the compiled step exactly where it applies (f32
storage, outputs apart from inputs, one thread); a prepared thunk rebinding each arena it is given; the
kernels' exp, log and softplus against float64's.
"""
from __future__ import annotations

import numpy as np
import pytest

import host_fallback
from host_fallback import jit
from rlx_gpu.conformance.reference_ssm import lay_out, read
from support.gdn_v2_cases import V2_CASES, v2_case, v2_run
from support.ssm_v2_cases import MAMBA2_FIELDS, SCAN_FIELDS, check_close, make, outputs, run

numba = pytest.importorskip("numba", reason="the jit extra (Numba) is not installed")
from host_fallback import jit_math, jit_ssm_steps  # noqa: E402  (needs Numba)

STEPS = {"selective_scan": "selective_scan_step", "mamba2": "mamba2_step", "gated_delta_net": "gated_delta_net_step"}
#: Error allowed relative to the largest reference value (f32 arithmetic, as test_gdn_host's).
GDN_TOL = 5e-5


@pytest.fixture
def calls(monkeypatch):
    """Counts each compiled step's calls (they still run), by op."""
    counted = dict.fromkeys(STEPS, 0)
    for op, name in STEPS.items():
        def spy(*args, op=op, real=getattr(jit_ssm_steps, name)):
            counted[op] += 1
            real(*args)
        monkeypatch.setattr(jit_ssm_steps, name, spy)
    return counted


@pytest.fixture(params=[True, False], ids=["numba-step", "numpy-step"])
def compiled(request, monkeypatch):
    """Each step: the compiled one, and NumPy's (``RLX_HOST_JIT=0``)."""
    if not request.param:
        monkeypatch.setenv(jit.ENV, "0")
    return request.param


def _label(fields: dict) -> str:
    return ".".join(k if v is True else f"{k}={v}" for k, v in fields.items())


SSM_CASES = [("selective_scan", f) for f in SCAN_FIELDS] + [("mamba2", f) for f in MAMBA2_FIELDS]


@pytest.mark.parametrize("seq", [1, 3])
@pytest.mark.parametrize("op,fields", SSM_CASES, ids=[f"{op}-{_label(f)}" for op, f in SSM_CASES])
def test_ssm_steps_match_the_reference(op, fields, seq, compiled, calls):
    """Decode and a few tokens with each §8 field and their combination (packed sequences: test_ssm_v2's 37
    tokens in five sequences, one empty, through the step path), f32: one compiled call a thunk."""
    params, tensors = make(op, np.random.default_rng(len(fields) + seq), fields,
                           seq=37 if fields.get("varlen") else seq)
    thunk, got, want = run(op, "f32", params, tensors, path="step")
    check_close(thunk, got, want, f"{op} seq {seq}")
    assert calls[op] == int(compiled)


@pytest.mark.parametrize("n", [16, 17, 40])
def test_selective_scan_state_sizes(n, compiled, calls):
    """Mamba's d_state 16 (a row of the state one 16-lane vector, its own loop) and sizes around it, with
    every field, at S=1 and S=2."""
    rng = np.random.default_rng(n)
    for seq in (1, 2):
        b, h, g = 3, 6, 2
        params = dict(batch=b, seq=seq, hidden=h, state_size=n, groups=g, d=True, z=True, delta_bias=True,
                      delta_softplus=True, carry_state=True, state=True)
        tensors = {"x": rng.standard_normal((b, seq, h)), "delta": rng.uniform(-3.0, 0.5, (b, seq, h)),
                   "a": -rng.uniform(0.05, 2.0, (h, n)), "b": rng.standard_normal((b, seq, g, n)),
                   "c": rng.standard_normal((b, seq, g, n)), "d": rng.standard_normal(h),
                   "z": rng.standard_normal((b, seq, h)), "delta_bias": rng.uniform(-0.5, 0.5, h),
                   "state": rng.standard_normal((b, h, n))}
        thunk, got, want = run("selective_scan", "f32", params, tensors, path="step")
        check_close(thunk, got, want, f"N={n} seq {seq}")
    assert calls["selective_scan"] == 2 * int(compiled)


@pytest.mark.parametrize("seq", [1, 3])
@pytest.mark.parametrize("per_channel", [False, True], ids=["per-head", "per-channel"])
@pytest.mark.parametrize("case", list(V2_CASES))
def test_gdn_steps_match_the_reference(case, per_channel, seq, compiled, calls):
    """Grouped value heads, K != V, scale, q/k L2-norm, packed sequences (one empty, one of a single
    token) and slots, with and without a carried state, per-head and per-channel gates."""
    fields = dict(V2_CASES[case])
    params, tensors = v2_case(np.random.default_rng(len(case) + seq), per_channel=per_channel, seq=seq, **fields)
    got, got_state, want, want_state = v2_run("f32", params, tensors, path="step")
    for name, values, reference in (("dst", got, want), ("state", got_state, want_state)):
        if values is not None:
            err = np.max(np.abs(values - reference)) / max(np.max(np.abs(reference)), 1e-30)
            assert np.all(np.isfinite(values)) and err <= GDN_TOL, f"{name}: relative error {err:.3g}"
    assert calls["gated_delta_net"] == int(compiled)


def _ssm_everything(op: str) -> dict:
    bias, soft = ("delta_bias", "delta_softplus") if op == "selective_scan" else ("dt_bias", "dt_softplus")
    fields = {"carry_state": True, "slots": True, "d": True, "z": True, bias: True, soft: True, "groups": 2}
    return fields if op == "selective_scan" else {**fields, "dt_limit": [0.0, None]}


def _poison(tensors: dict, rng: np.random.Generator, fields: tuple[str, ...], count: int) -> dict:
    """``tensors`` with ``count`` NaN, +inf or -inf (and for a gate, -inf) placed at random in ``fields``."""
    tensors = {f: np.array(v, np.float64) if f in fields else v for f, v in tensors.items()}
    for _ in range(count):
        field = fields[rng.integers(len(fields))]
        index = tuple(int(rng.integers(n)) for n in tensors[field].shape)
        tensors[field][index] = rng.choice([np.nan, np.inf, -np.inf])
    return tensors


def _both(op: str, params: dict, tensors: dict, monkeypatch) -> list[dict]:
    """The outputs of the compiled step and of NumPy's, from the same arena."""
    thunk, arena = lay_out(op, "f32", params, tensors)
    results = []
    for env in ("1", "0"):
        monkeypatch.setenv(jit.ENV, env)
        out = arena.copy()
        host_fallback.execute(thunk, out, path="step")
        results.append({f: read(thunk, out, f) for f in ("dst", "state") if f != "state" or params["carry_state"]})
    return results


@pytest.mark.parametrize("seq", [1, 3])
@pytest.mark.parametrize("op", list(STEPS))
def test_nan_and_inf_land_where_numpy_puts_them(op, seq, monkeypatch, calls):
    """One to four NaN/±inf in the inputs, the parameters or the carried state (and gates of -inf, a
    softplus of a huge step, saturated silu): the compiled step's NaN, +inf and -inf positions are NumPy's,
    its finite values NumPy's to f32 rounding."""
    reached = set()
    for seed in range(10):
        rng = np.random.default_rng([seed, seq, list(STEPS).index(op)])
        if op == "gated_delta_net":
            params, tensors = v2_case(rng, per_channel=bool(seed % 2), seq=seq, heads=2, value_heads=4, k=8, v=6,
                                       slots=[2, 0], num_slots=3, l2norm=seed % 3 == 0)
            fields = ("q", "k", "v", "g", "beta", "state")
        else:
            params, tensors = make(op, rng, _ssm_everything(op), seq=seq)
            fields = tuple(f for f in tensors if f not in ("cu_seqlens", "state_slots"))
            tensors["z"] = tensors["z"] * 100  # silu of ±100: exp(-z) overflows, y * 0 or y * z
        compiled, numpy_step = _both(op, params, _poison(tensors, rng, fields, int(rng.integers(1, 5))), monkeypatch)
        for name, a in compiled.items():
            b = numpy_step[name]
            where = f"seed {seed}, {name}"
            np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=f"{where}: NaN positions")
            np.testing.assert_array_equal(np.isposinf(a), np.isposinf(b), err_msg=f"{where}: +inf positions")
            np.testing.assert_array_equal(np.isneginf(a), np.isneginf(b), err_msg=f"{where}: -inf positions")
            finite = np.isfinite(a)
            np.testing.assert_allclose(a[finite], b[finite], rtol=1e-4, atol=1e-4, err_msg=where)
            reached |= {"nan" if np.isnan(a).any() else "", "finite" if finite.any() else ""}
    assert {"nan", "finite"} <= reached  # the cases reach both classes
    assert calls[op] == 10


#: (label, op, how the thunk or the call differs from a compiled f32 step): where NumPy's path runs.
NOT_COMPILED = [
    ("bf16 storage", "mamba2", dict(dtype="bf16")),
    ("f64 storage", "selective_scan", dict(dtype="f64")),
    ("an f64 state", "gated_delta_net", dict(state_dtype="f64")),
    ("f64 parameters", "selective_scan", dict(param_dtype="f64")),
    ("two workers forced", "mamba2", dict(workers=2)),
    ("the fast path forced", "selective_scan", dict(path="blocked")),
    ("a sequence past the step path", "gated_delta_net", dict(seq=40)),
    ("dst overlapping an input", "gated_delta_net", dict(overlap=True)),
]


@pytest.mark.parametrize("label,op,change", NOT_COMPILED, ids=[c[0] for c in NOT_COMPILED])
def test_numpy_runs_where_the_compiled_step_does_not_apply(label, op, change, calls):
    change = dict(change)
    dtype, options = change.pop("dtype", "f32"), {k: change.pop(k) for k in ("workers", "path") if k in change}
    overlap, seq = change.pop("overlap", False), change.pop("seq", 2)
    if op == "gated_delta_net":
        params, tensors = v2_case(np.random.default_rng(0), seq=seq, **change)
    else:
        params, tensors = make(op, np.random.default_rng(0), {"carry_state": True, **change}, seq=seq)
    thunk, arena = lay_out(op, dtype, params, tensors)
    if overlap:  # dst over k's last tokens (outside the ABI: the host still reads every input first)
        thunk = {**thunk, "dst": thunk["k"] + 4}
    host_fallback.execute(thunk, arena, **options)
    assert calls[op] == 0


@pytest.mark.parametrize("op", list(STEPS))
def test_without_numba_the_numpy_step_runs(op, monkeypatch, calls):
    monkeypatch.setattr(jit, "_kernels", lambda: None)  # as after a failed import
    if op == "gated_delta_net":
        got, got_state, want, want_state = v2_run("f32", *v2_case(np.random.default_rng(0), seq=1), path="step")
        np.testing.assert_allclose(got_state, want_state, rtol=GDN_TOL, atol=GDN_TOL)
    else:
        thunk, got, want = run(op, "f32", *make(op, np.random.default_rng(0), _ssm_everything(op), seq=1))
        check_close(thunk, got, want, op)
    assert calls[op] == 0


@pytest.mark.parametrize("op", list(STEPS))
def test_a_prepared_step_binds_each_arena_it_is_given(op, calls):
    """``PREPARE[op]`` on arena A, B, then A again with new inputs written in place: each run against the
    float64 reference of what that arena held, each through the compiled step."""
    thunks, arenas = [], []
    for seed in (1, 2, 3):
        rng = np.random.default_rng(seed)
        if op == "gated_delta_net":
            params, tensors = v2_case(rng, seq=1, slots=[1, 0], num_slots=2, l2norm=True)
        else:
            params, tensors = make(op, rng, _ssm_everything(op), seq=1)
        thunk, arena = lay_out(op, "f32", params, tensors)
        thunks.append(thunk)
        arenas.append(arena)
    a, b, fresh = arenas
    run_step = host_fallback.PREPARE[op](thunks[0])
    for arena in (a, b, a):
        if arena is a and calls[op]:
            a[:] = fresh  # the same array object, new contents
        expected = arena.copy()
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(jit.ENV, "0")
            host_fallback.execute(thunks[0], expected, path="step")
        run_step(arena)
        for field in outputs(thunks[0]) if op != "gated_delta_net" else ("dst", "state"):
            np.testing.assert_allclose(read(thunks[0], arena, field), read(thunks[0], expected, field),
                                       rtol=2e-5, atol=2e-5, err_msg=field)
    assert calls[op] == 3


@numba.njit(error_model="numpy")
def _apply(kind, x, out):  # the kernels' functions in a loop, as they run them
    for i in range(x.size):
        if kind == 0:
            out[i] = jit_math._exp_subnormal(x[i])
        elif kind == 1:
            out[i] = jit_math._log(x[i])
        else:
            out[i] = jit_math._softplus(x[i])


def _ulps(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """|got - want| in units of the last place of want rounded to float32 (subnormals' spacing below)."""
    spacing = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
    return np.abs(got.astype(np.float64) - want) / spacing


def test_exp_reaches_the_subnormals_and_keeps_nan_and_inf():
    """Within an ulp down to float32's subnormals (where the lstm's ``_exp`` gives 0), 0 below them."""
    x = np.concatenate([np.linspace(-104.5, 88.7, 300_001, dtype=np.float32),
                        np.random.default_rng(0).uniform(-1, 1, 10_000).astype(np.float32)])
    got = np.empty_like(x)
    _apply(0, x, got)
    want = np.exp(x.astype(np.float64))
    normal = want >= 2.0 ** -126
    assert np.max(np.abs(got[normal] / want[normal] - 1)) <= 2 ** -23  # as test_host_jit's for the lstm's
    assert np.max(np.abs(got[~normal] - want[~normal])) <= 2.0 ** -149  # one subnormal step
    assert got[(x > -103.0) & (x < -87.4)].min() > 0  # subnormal, not flushed
    ends = np.array([np.nan, np.inf, -np.inf, 88.73, -104.0, -1e30], np.float32)
    got = np.empty_like(ends)
    _apply(0, ends, got)
    assert np.isnan(got[0]) and got[1] == np.inf and got[3] == np.inf and not got[[2, 4, 5]].any()


def test_log_and_softplus_against_float64():
    """``_log`` within two ulps over the normal floats; ``_softplus`` (ABI.md §8) within a few ulps wherever
    it is no subnormal, exactly ``u`` above 20, NaN for NaN, 0 at -inf."""
    rng = np.random.default_rng(1)
    w = np.concatenate([np.geomspace(np.finfo(np.float32).tiny, 3.4e38, 200_001), rng.uniform(0.5, 2.0, 100_000),
                        1 + np.geomspace(1e-7, 1, 10_000)]).astype(np.float32)
    got = np.empty_like(w)
    _apply(1, w, got)
    assert _ulps(got, np.log(w.astype(np.float64))).max() <= 2.0
    u = np.concatenate([np.linspace(-100, 30, 260_001), rng.uniform(-5, 5, 10_000)]).astype(np.float32)
    got = np.empty_like(u)
    _apply(2, u, got)
    u64 = u.astype(np.float64)
    want = np.where(u64 > 20, u64, np.log1p(np.exp(u64)))
    normal = want >= 2.0 ** -126
    assert _ulps(got[normal], want[normal]).max() <= 4.0
    np.testing.assert_array_equal(got[u > 20], u[u > 20])
    ends = np.array([np.nan, np.inf, -np.inf], np.float32)
    got = np.empty_like(ends)
    _apply(2, ends, got)
    assert np.isnan(got[0]) and got[1] == np.inf and got[2] == 0
