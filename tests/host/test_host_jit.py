"""host_fallback.jit: the lstm step compiled by Numba (the ``jit`` extra, which the ``test`` extra installs).

Its exp against float64's, its whole-matrix transpose against NumPy's; the step kernel alone against a float64 formula of its contract over every
way it splits columns and units, and its refusals; its use exactly where it applies; the compiled and
the NumPy step each against the float64 reference (rlx_gpu/conformance/reference_rnn.py, through
test_rnn_host's ``check``) over the fields it handles, their non-finite classes against each other, and
the NumPy step where Numba is missing or turned off.
"""
from __future__ import annotations

import numpy as np
import pytest

from host_fallback import jit, lstm_sequence, rnn_cell, threads
from support.rnn_host import build, check, read, run_host

numba = pytest.importorskip("numba", reason="the jit extra (Numba) is not installed")
from host_fallback import jit_lstm, jit_math  # noqa: E402  (needs Numba)


#: The vector widths (float32 lanes) the tiles come in: each is tested on every machine (LLVM splits 16 lanes
#: into two 8-lane vectors where the CPU has no AVX-512).
LANES = sorted(jit_lstm.PANEL_ROWS)


#: ``lstm_sequence``'s bound, for the tests that lift ``_step_route``'s pin
SEQUENCE_MAX_STEP = lstm_sequence.MAX_STEP


@pytest.fixture(autouse=True)
def _step_route(monkeypatch):
    """The lstms here run the per-step route: the whole-sequence kernels, which would take the small ones, are
    test_host_jit_lstm_sequence's."""
    monkeypatch.setattr(lstm_sequence, "MAX_STEP", -1)
    monkeypatch.setattr(lstm_sequence, "MAX_BACKWARD_STEP", -1)


@pytest.fixture
def calls(monkeypatch):
    """Counts the compiled lstm step's calls (it still runs) and the lanes of the tiles they ran (read
    from the packed bias's rows)."""
    counted = {"n": 0, "lanes": set()}
    real = jit_lstm.lstm_step
    lanes_of = {rows: lanes for lanes, rows in jit_lstm.PANEL_ROWS.items()}

    def spy(*args):
        counted["n"] += 1
        counted["lanes"].add(lanes_of[args[4].shape[1]])
        real(*args)
    monkeypatch.setattr(jit_lstm, "lstm_step", spy)
    return counted


@pytest.fixture(params=LANES, ids=[f"{n}-lanes" for n in LANES])
def lanes(request, monkeypatch):
    """Each width of the tiles, forced through RLX_HOST_JIT_WIDTH."""
    monkeypatch.setenv(jit.WIDTH_ENV, str(request.param))
    return request.param


@numba.njit(fastmath=jit_math._FLAGS)
def _exp_over(x, out):  # the kernels' exp in a loop, as they run it (vectorized)
    for k in range(x.size):
        out[k] = jit_math._exp(x[k])


@numba.njit
def _transposed_at(dst, col, src):  # the kernels' whole-matrix transpose, as they call it
    jit_math._transposed(dst, col, src)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rows,cols", [(8, 8), (37, 20), (3, 5), (64, 16)])
def test_a_matrix_transposed_into_a_column_offset_leaves_the_rest(dtype, rows, cols):
    """``jit_math._transposed``: ``dst[v, col + i] = src[i, v]``, 8 x 8 vector blocks and their edges (float32,
    C-contiguous) or a value at a time (float64; a strided view), nothing outside written; NaN and inf moved as
    they are."""
    rng = np.random.default_rng(rows * cols)
    src = rng.standard_normal((rows, cols)).astype(dtype)
    src[0, -1], src[-1, 0] = np.nan, -np.inf
    for source in (src, np.repeat(src, 2, axis=1)[:, ::2]):  # C-contiguous, then the same values strided
        dst = np.full((cols + 1, rows + 7), 9, dtype)
        _transposed_at(dst, 3, source)
        np.testing.assert_array_equal(dst[:cols, 3:3 + rows], src.T)
        outside = np.ones(dst.shape, bool)
        outside[:cols, 3:3 + rows] = False
        assert (dst[outside] == 9).all()


def test_exp_is_within_an_ulp_and_keeps_nan_and_inf():
    x = np.concatenate([np.linspace(-87.3, 88.7, 400_001, dtype=np.float32),
                        np.random.default_rng(0).uniform(-1, 1, 10_000).astype(np.float32)])
    got = np.empty_like(x)
    _exp_over(x, got)
    want = np.exp(x.astype(np.float64))
    normal = want >= 2.0 ** -125  # below (x < -87.0, e^x < 2.4e-38): 0, which a gate adds to 1
    rel = np.abs(got[normal] / want[normal] - 1)
    assert rel.max() <= 2 ** -23, f"max relative error {rel.max():.3g} at x={x[normal][rel.argmax()]}"
    tiny_got, tiny_want = got[~normal], want[~normal]
    assert np.all((tiny_got == 0) | (np.abs(tiny_got / tiny_want - 1) <= 2 ** -23))
    ends = np.array([np.nan, np.inf, -np.inf, 88.73, 1e30, -87.34, -1e30, 0.0, -0.0], np.float32)
    got = np.empty_like(ends)
    _exp_over(ends, got)
    assert np.isnan(got[0]) and got[1] == np.inf and got[2] == 0
    np.testing.assert_array_equal(got[3:], [np.inf, np.inf, 0, 0, 1, 1])


# (label, build/check arguments): the fields the compiled step handles, at narrow blocks (batch x hidden
# below EXP_TANH_MIN_ELEMENTS: g's rows at z) and wide ones (at -2z), one and two threads.
# (the batch: 13 columns padded to 16, with 8 lanes one two-vector tile, with 16 one one-vector tile; 24,
# with 8 lanes a two-vector tile and a one-vector one, with 16 padded to one two-vector tile; hidden: a
# part-filled last group of units at either width)
NARROW = dict(batch=13, seq=20, input_size=3, hidden=5, num_layers=2, bidirectional=True, carry=True)
WIDE = dict(batch=24, seq=18, input_size=3, hidden=100, num_layers=2, bidirectional=True, carry=True)
CASES = [
    ("narrow", NARROW, {}),
    ("narrow-unidirectional-reverse", {**NARROW, "bidirectional": False}, dict(reverse=True)),
    ("narrow-clip", NARROW, dict(clip=0.3)),
    ("narrow-input_forget", NARROW, dict(input_forget=True)),
    ("narrow-proj_size", NARROW, dict(proj_size=3)),
    ("narrow-seq_lens", NARROW, dict(seq_lens=[20, 0, 2, 13, 7, 20, 1, 9, 3, 20, 20, 11, 5])),
    ("narrow-everything", NARROW, dict(input_forget=True, proj_size=2, clip=0.5,
                                       seq_lens=[1, 20, 0, 3, 5, 20, 2, 11, 4, 19, 20, 8, 6])),
    ("wide", WIDE, {}),
    ("wide-clip", WIDE, dict(clip=0.3)),
    ("wide-seq_lens", WIDE, dict(seq_lens=[18, 0, 5, 17, 9, 2] * 4)),
    ("wide-input_forget-proj_size", WIDE, dict(input_forget=True, proj_size=24)),
]


@pytest.mark.parametrize("step", [*LANES, None], ids=[*(f"numba-step-{n}-lanes" for n in LANES), "numpy-step"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("label,shape,v2", CASES, ids=[c[0] for c in CASES])
def test_both_steps_match_the_reference(label, shape, v2, dtype, step, calls, monkeypatch):
    if step is None:
        monkeypatch.setenv(jit.ENV, "0")
    else:
        monkeypatch.setenv(jit.WIDTH_ENV, str(step))
    parallel = "wide" in label
    check("lstm", dtype, options={"parallel_directions": parallel}, **shape, **v2)
    # one call per step of every layer-direction; with seq_lens the steps where some row still runs
    steps = max(min(n, shape["seq"]) for n in v2.get("seq_lens", [shape["seq"]]))
    layer_directions = shape["num_layers"] * (2 if shape["bidirectional"] else 1)
    assert calls["n"] == (layer_directions * steps if step else 0)
    assert calls["lanes"] == ({step} if step else set())


@pytest.mark.parametrize("label,options", [
    ("decode: the stored weights", dict(seq=5)),
    ("peepholes", dict(peepholes=True)),
    ("f64", dict(dtype="f64")),
    ("another activation", dict(activations=[["sigmoid", 0, 0], ["relu", 0, 0], ["tanh", 0, 0]] * 2)),
    ("a batch below 8", dict(batch=7)),
], ids=lambda v: v if isinstance(v, str) else "")
def test_the_numpy_step_runs_where_the_compiled_one_does_not_apply(label, options, calls):
    options = dict(options)
    dtype = options.pop("dtype", "f32")
    check("lstm", dtype, **{**NARROW, **options})
    assert calls["n"] == 0


@pytest.mark.parametrize("parallel", [False, True], ids=["one-direction-at-a-time", "directions-in-two-threads"])
def test_a_big_step_keeps_numpy_s_on_a_shared_blas(parallel, monkeypatch, calls):
    """One direction at a time on a two-thread BLAS, NumPy's step runs each GEMM on both cores: past
    ``_COMPILED_SHARED_STEP_FLOPS`` it keeps that step; directions in two threads take the compiled one."""
    monkeypatch.setattr(rnn_cell, "_COMPILED_SHARED_STEP_FLOPS", 1000)  # NARROW's steps: ~4000 flops
    monkeypatch.setattr(threads, "cores", lambda: 2)
    check("lstm", "f32", options={"parallel_directions": parallel}, **NARROW)
    assert (calls["n"] > 0) == parallel


@pytest.mark.parametrize("op", ["gru", "rnn"])
def test_gru_and_rnn_keep_numpy_steps(op, calls):
    check(op, "f32", **NARROW)
    assert calls["n"] == 0


def test_without_numba_the_numpy_step_runs(monkeypatch, calls):
    monkeypatch.setattr(jit, "_kernels", lambda: None)  # as after a failed import
    assert jit.kernel("lstm_step") is None
    check("lstm", "f32", **NARROW)
    assert calls["n"] == 0


@pytest.mark.parametrize("value", ["0", "off", "False", " no "])
def test_rlx_host_jit_turns_it_off(monkeypatch, value):
    monkeypatch.setenv(jit.ENV, value)
    assert jit.kernel("lstm_step") is None
    monkeypatch.setenv(jit.ENV, "1")
    assert jit.kernel("lstm_step") is jit_lstm.lstm_step


@pytest.mark.parametrize("shape", [NARROW, WIDE], ids=["narrow", "wide"])
@pytest.mark.parametrize("route", ["step", "sequence"])
def test_nan_and_inf_land_where_numpy_puts_them(shape, lanes, route, monkeypatch, calls):
    """NaN, +inf and -inf in x, and weights large enough to saturate or overflow gates: the compiled
    step's (or the whole-sequence kernel's, which these lstms take by default) NaN and ±inf positions (at
    each width) are the NumPy step's, and its finite values agree."""
    if route == "sequence":
        monkeypatch.setattr(lstm_sequence, "MAX_STEP", SEQUENCE_MAX_STEP)
    thunk, arena, inp, writes = build("lstm", "f32", clip=0.0, **shape)
    x = inp["x"].astype(np.float32)
    rng = np.random.default_rng(5)
    for value in (np.nan, np.inf, -np.inf, 3e38, -3e38):
        b, t, i = (rng.integers(0, n) for n in x.shape)
        x[b, t, i] = value
    with np.errstate(over="ignore"):
        x[..., 0] *= 1e4  # saturated gates: exp(-z) overflows, σ = 0 and tanh = -1 exactly
    arena[thunk["x"]: thunk["x"] + x.nbytes] = x.view(np.uint8).ravel()
    results = []
    for env in ("1", "0"):
        monkeypatch.setenv(jit.ENV, env)
        out = run_host(thunk, arena, writes)
        results.append({f: read(out, thunk, f, s) for f, s in (
            ("dst", (shape["batch"], shape["seq"], 2 * shape["hidden"])),
            ("h0", (4, shape["batch"], shape["hidden"])), ("c0", (4, shape["batch"], shape["hidden"])))})
    compiled, numpy_step = results
    assert (calls["n"] > 0) == (route == "step")  # else the whole-sequence kernel ran (RLX_HOST_JIT=1)
    for field in compiled:
        a, b = compiled[field], numpy_step[field]
        assert np.isnan(a).any() and np.isfinite(a).any(), field  # the case reaches both classes
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=f"{field}: NaN positions")
        np.testing.assert_array_equal(np.isposinf(a), np.isposinf(b), err_msg=f"{field}: +inf positions")
        np.testing.assert_array_equal(np.isneginf(a), np.isneginf(b), err_msg=f"{field}: -inf positions")
        finite = np.isfinite(a)
        np.testing.assert_allclose(a[finite], b[finite], rtol=1e-5, atol=1e-6, err_msg=field)


def test_two_threads_give_the_bytes_of_one(calls):
    """The compiled step runs without the GIL: two threads running the directions give the bytes of one
    thread running them in turn (each GEMM on a one-thread BLAS in both)."""
    thunk, arena, _, writes = build("lstm", "f32", **WIDE)
    with threads.single_threaded_blas():
        serial = run_host(thunk, arena, writes, parallel_directions=False)
    threaded = run_host(thunk, arena, writes, parallel_directions=True)
    np.testing.assert_array_equal(serial, threaded)
    assert calls["n"] > 0


def _step_reference(w_hh, h, w_ih, x, bias, c, clip_ifo, clip_g, g_scale, coupled):
    """``lstm_step`` in float64 from ``jit.kernel``'s contract: rows of i f o at ``-z``, g's at ``-2z`` or ``z``."""
    hidden = c.shape[0]
    s = w_hh.astype(np.float64) @ h + w_ih.astype(np.float64) @ x + bias[:, None]
    si, sf, so, sg = (np.clip(s[k * hidden: (k + 1) * hidden], -b, b)
                      for k, b in enumerate((clip_ifo, clip_ifo, clip_ifo, clip_g)))
    i, f, o = (1 / (1 + np.exp(v)) for v in (si, sf, so))
    g = 2 / (1 + np.exp(g_scale * sg)) - 1
    f = 1 - i if coupled else f
    cell = f * c[:, : h.shape[1]] + i * g
    return cell, o * np.tanh(cell)


@pytest.mark.parametrize("hidden,width,inputs", [(1, 1, 1), (11, 3, 2), (12, 5, 0), (13, 4, 7), (16, 2, 3),
                                                  (25, 9, 16)])
@pytest.mark.parametrize("n", [1, 5, 8, 9, 16, 17, 24, 31, 40])
def test_the_compiled_step_against_float64(hidden, width, inputs, n, lanes):
    """At each width, every column count its tiles split differently (two-vector tiles, then one of one
    vector, the columns padded with zeros to a whole vector: 8 lanes 16 + 8 columns, 16 lanes 32 + 16),
    groups of units (12 at 8 lanes, 16 at 16) filled in part or whole, one group or two, h and x as views
    (x's columns not adjacent); clip, input_forget and g's rows at z (g_scale -2) or -2z; nothing written
    outside c's first n columns and out's slot. The weights are packed from blocks in another gate order,
    each gate scaled, as the packing reorders and scales them."""
    rng = np.random.default_rng(hidden * 100 + n)
    f32 = np.float32
    stored_hh = (rng.standard_normal((4 * hidden, width)) / np.sqrt(width)).astype(f32)
    stored_ih = (rng.standard_normal((4 * hidden, inputs)) / np.sqrt(max(inputs, 1))).astype(f32)
    order, scales = np.array([2, 0, 3, 1]), np.array([0.5, -1.0, 2.0, -0.25], f32)  # exact in float32
    w_hh, w_ih = ((w.reshape(4, hidden, -1)[order] * scales[:, None, None]).reshape(4 * hidden, -1)
                  for w in (stored_hh, stored_ih))
    bias = rng.standard_normal(4 * hidden).astype(f32)
    h = rng.standard_normal((width, n + 7)).astype(f32)[:, 3: 3 + n]
    x = rng.standard_normal((inputs, 2 * n + 2)).astype(f32)[:, 1: 1 + 2 * n: 2]  # columns apart, too
    c0 = rng.standard_normal((hidden, n + 3)).astype(f32)
    packed = (jit_lstm.lstm_panels(stored_hh, order, scales, lanes),
              jit_lstm.lstm_panels(stored_ih, order, scales, lanes), jit_lstm.lstm_panel_bias(bias, lanes))
    for clip, g_scale, coupled in [(np.inf, 1.0, False), (0.7, 1.0, True), (np.inf, -2.0, False)]:
        c, out = c0.copy(), np.full((hidden + 2, n + 6), 7.0, f32)
        jit_lstm.lstm_step(packed[0], h, packed[1], x, packed[2], c, out, 4, f32(clip), f32(2 * clip), f32(g_scale),
                              coupled)
        want_c, want_y = _step_reference(w_hh, h, w_ih, x, bias, c0, clip, 2 * clip, g_scale, coupled)
        np.testing.assert_allclose(c[:, :n], want_c, rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(out[:hidden, 4: 4 + n], want_y, rtol=2e-5, atol=2e-6)
        np.testing.assert_array_equal(c[:, n:], c0[:, n:])
        untouched = np.ones(out.shape, bool)
        untouched[:hidden, 4: 4 + n] = False
        assert np.all(out[untouched] == 7.0)


def _panels(w, lanes):
    """``w`` packed in its own gate order, unscaled."""
    return jit_lstm.lstm_panels(w, np.arange(4), np.ones(4, np.float32), lanes)


def test_the_compiled_step_refuses_arrays_that_do_not_fit():
    """Its tiles read through raw addresses, so every shape is checked first: a mismatch, weights packed
    for one width and the bias for the other included, is a ValueError and nothing is written."""
    f32 = np.float32
    hidden, width, inputs, n = 13, 4, 3, 10
    rng = np.random.default_rng(0)
    w_hh, w_ih = (_panels(rng.standard_normal((4 * hidden, k)).astype(f32), 8) for k in (width, inputs))
    bias = jit_lstm.lstm_panel_bias(np.zeros(4 * hidden, f32), 8)
    h, x = np.ones((width, n), f32), np.ones((inputs, n), f32)
    c, out = np.zeros((hidden, n), f32), np.zeros((hidden, n), f32)
    good = dict(w_hh=w_hh, h=h, w_ih=w_ih, x=x, bias=bias, c=c, out=out, out_col=0)
    bad = {"w_hh": _panels(np.zeros((4 * hidden, width + 1), f32), 8),
           "w_ih": _panels(np.zeros((4 * (hidden + 12), inputs), f32), 8),
           "x": np.ones((inputs, n - 1), f32), "bias": jit_lstm.lstm_panel_bias(np.zeros(4 * hidden + 52, f32), 8),
           "c": np.zeros((hidden, n - 1), f32), "out": np.zeros((hidden - 1, n), f32), "out_col": 1,
           "h": np.ones((width - 1, n), f32)}
    for field, value in [*bad.items(), ("bias", jit_lstm.lstm_panel_bias(np.zeros(4 * hidden, f32), 16)),
                         ("bias", np.zeros((12, 4), f32))]:
        args = {**good, field: value}
        with pytest.raises(ValueError, match="do not fit|not a tile's"):
            jit_lstm.lstm_step(*args.values(), f32(np.inf), f32(np.inf), f32(1), False)
        assert not c.any() and not out.any(), field
    with pytest.raises(ValueError, match="lanes must be 8 or 16"):
        _panels(np.zeros((4 * hidden, width), f32), 4)
    with pytest.raises(ValueError, match="lanes must be 8 or 16"):
        jit_lstm.lstm_panel_bias(np.zeros(4 * hidden, f32), 4)
    with pytest.raises(ValueError, match="one entry per gate"):
        jit_lstm.lstm_panels(np.zeros((4 * hidden, width), f32), np.arange(3), np.ones(3, f32), 8)


@pytest.mark.parametrize("avx512f,want", [(True, 16), (False, 8)])
def test_the_width_is_the_cpu_s_unless_forced(avx512f, want, monkeypatch):
    """16 lanes where LLVM reports AVX-512F, else 8; RLX_HOST_JIT_WIDTH forces either, and anything else
    there is refused naming the variable and what it takes, by an lstm the kernel would run too."""
    from llvmlite import binding

    monkeypatch.setattr(binding, "get_host_cpu_features", lambda: {"avx2": True, "avx512f": avx512f})
    monkeypatch.delenv(jit.WIDTH_ENV, raising=False)
    jit.host_lanes.cache_clear()
    try:
        assert jit.lanes() == want
        for forced in ("8", " 16 "):
            monkeypatch.setenv(jit.WIDTH_ENV, forced)
            assert jit.lanes() == int(forced)
        monkeypatch.setenv(jit.WIDTH_ENV, "32")
        with pytest.raises(ValueError, match=r"RLX_HOST_JIT_WIDTH='32': expected 8 or 16"):
            jit.lanes()
        thunk, arena, _, writes = build("lstm", "f32", **NARROW)  # and an lstm that would run the kernel
        with pytest.raises(ValueError, match=r"RLX_HOST_JIT_WIDTH='32'"):
            run_host(thunk, arena, writes)
    finally:
        jit.host_lanes.cache_clear()
