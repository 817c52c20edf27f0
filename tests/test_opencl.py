"""OpenCL backend conformance: every op x dtype x representative shape on a guarded arena.

Each case lays its tensors out with >= 1 KiB of canary bytes around every one, runs the thunk on
the device, and checks (1) every byte the thunk may not write is unchanged, (2) the outputs match
a float64 reference written here from ABI.md, (3) they match ``host_fallback.execute`` on the same
bytes, and (4) NaN/Inf positions agree. ``RLX_OPENCL_TEST_DEVICE=opencl:P:D`` picks the device
(default: the first non-simulator); ``RLX_OPENCL_SMALL=1`` keeps the small shapes only (Oclgrind).
Every test runs at both targets (cpu and gpu kernel shapes) on that device.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

import host_fallback
from host_fallback.arena import STORAGE
from host_fallback.layout import layer_input_sizes, regions

opencl = pytest.importorskip("rlx_gpu.backends.opencl")
from rlx_gpu.backends import programs  # noqa: E402
from rlx_gpu.conformance.cases import lay_out as lay_out_case  # noqa: E402
from rlx_gpu.conformance.compare import nmse  # noqa: E402
from rlx_gpu.backends.base import BackendUnavailable  # noqa: E402
from rlx_gpu.errors import KernelBuildError  # noqa: E402
from rlx_gpu.runtime.config import default_config_path, load_config  # noqa: E402
from rlx_gpu.schedule.ops import DTYPES  # noqa: E402
from rlx_gpu.launches.limits import TARGET_ENV, TARGETS  # noqa: E402

GUARD = 1024
SMALL = os.environ.get("RLX_OPENCL_SMALL") == "1"
# NMSE bounds of one thunk: the `tolerances` table of configs/default.yaml (with the measurements behind it).
BOUNDS = load_config(default_config_path())


@pytest.fixture(scope="module", params=TARGETS)
def session(request):
    """The test device, opened once per target: the gpu target (forced through RLX_TARGET) runs the
    GPU-shaped kernels on it, so they are checked here too."""
    try:
        infos = opencl.probe()
    except BackendUnavailable as err:
        pytest.skip(str(err))
    spec = os.environ.get("RLX_OPENCL_TEST_DEVICE")
    info = next((i for i in infos if i.spec == spec), None) if spec else infos[0]
    if info is None:
        pytest.skip(f"no OpenCL device {spec}; have {[i.spec for i in infos]}")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(TARGET_ENV, request.param)
        opened = opencl.open(info)
    assert opened.limits.target == request.param
    return opened


# ---------------------------------------------------------------- float64 references (ABI.md)
def sig(x):
    return 1 / (1 + np.exp(-x))


def ref_recurrent(t, L):
    gates, dirs = {"lstm": 4, "gru": 3, "rnn": 1}[t["op"]], 2 if t["bidirectional"] else 1
    B, S, H = t["batch"], t["seq"], t["hidden"]
    inp, w_ih, w_hh = L("x"), L("w_ih"), L("w_hh")
    nld = t["num_layers"] * dirs
    hs = L("h0") if t["carry"] else np.zeros((nld, B, H))
    cs = L("c0") if t["carry"] and t["op"] == "lstm" else np.zeros((nld, B, H))
    pos = 0
    for layer, in_l in enumerate(layer_input_sizes(t)):
        out = np.zeros((B, S, dirs * H))
        for d in range(dirs):
            ld = layer * dirs + d
            W = w_ih[pos: pos + gates * H * in_l].reshape(gates * H, in_l)
            pos += gates * H * in_l
            U, h, c = w_hh[ld], hs[ld].copy(), cs[ld].copy()
            for step in range(S):
                tt = step if d == 0 else S - 1 - step
                xt = inp[:, tt, :]
                if t["op"] == "gru":
                    gi, gh = xt @ W.T + L("b_ih")[ld], h @ U.T + L("b_hh")[ld]
                    r, z = sig(gi[:, :H] + gh[:, :H]), sig(gi[:, H:2 * H] + gh[:, H:2 * H])
                    n = np.tanh(gi[:, 2 * H:] + r * gh[:, 2 * H:])
                    h = (1 - z) * n + z * h
                else:
                    zz = xt @ W.T + h @ U.T + L("bias")[ld]
                    if t["op"] == "lstm":
                        i, f, g, o = (zz[:, k * H:(k + 1) * H] for k in range(4))
                        c = sig(f) * c + sig(i) * np.tanh(g)
                        h = sig(o) * np.tanh(c)
                    else:
                        h = np.maximum(zz, 0) if t["relu"] else np.tanh(zz)
                out[:, tt, d * H:(d + 1) * H] = h
            hs[ld], cs[ld] = h, c
        inp = out
    res = {"dst": inp}
    if t["carry"]:
        res["h0"] = hs
        if t["op"] == "lstm":
            res["c0"] = cs
    return res


def ref_selective_scan(t, L):
    x, delta, a, b, c = L("x"), L("delta"), L("a"), L("b"), L("c")
    B, S, H = x.shape
    y = np.zeros_like(x)
    for bt in range(B):
        h = np.zeros_like(a)
        for s in range(S):
            h = np.exp(delta[bt, s][:, None] * a) * h + delta[bt, s][:, None] * b[bt, s][None, :] * x[bt, s][:, None]
            y[bt, s] = h @ c[bt, s]
    return {"dst": y}


def ref_mamba2(t, L):
    x, dt, a, b, c = L("x"), L("dt"), L("a"), L("b"), L("c")
    B, S, HD, P = x.shape
    y = np.zeros_like(x)
    for bt in range(B):
        for hh in range(HD):
            st = np.zeros((P, t["state_size"]))
            for s in range(S):
                st = np.exp(dt[bt, s, hh] * a[hh]) * st + np.outer(dt[bt, s, hh] * x[bt, s, hh], b[bt, s, hh])
                y[bt, s, hh] = st @ c[bt, s, hh]
    return {"dst": y}


def ref_gdn(t, L):
    q, k, v, g, beta = L("q"), L("k"), L("v"), L("g"), L("beta")
    B, S, HD, N = q.shape
    state = L("state") if t["carry_state"] else np.zeros((B, HD, N, N))
    out = np.zeros_like(q)
    for bt in range(B):
        for hh in range(HD):
            st = state[bt, hh].copy()
            for s in range(S):
                gate = g[bt, s, hh]
                st = st * (np.exp(gate)[:, None] if t["gate_per_channel"] else np.exp(gate))
                u = (v[bt, s, hh] - st.T @ k[bt, s, hh]) * beta[bt, s, hh]
                st = st + np.outer(k[bt, s, hh], u)
                out[bt, s, hh] = st.T @ q[bt, s, hh] / np.sqrt(N)
            state[bt, hh] = st
    res = {"dst": out}
    if t["carry_state"]:
        res["state"] = state
    return res


UNARY = {
    "exp": np.exp, "log": np.log, "tanh": np.tanh, "sigmoid": sig, "relu": lambda x: np.maximum(x, 0),
    "neg": np.negative, "sqrt": np.sqrt, "rsqrt": lambda x: 1 / np.sqrt(x), "square": np.square, "abs": np.abs,
    "recip": lambda x: 1 / x, "softplus": lambda x: np.logaddexp(x, 0), "step": lambda x: np.where(x > 0, 1.0, 0.0),
}
BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "max": np.maximum, "min": np.minimum}


def ref_body(t, L):
    op = t["op"]
    if op == "unary":
        return {"dst": UNARY[t["fn"]](L("x"))}
    if op == "binary":
        a, b = (np.lib.stride_tricks.as_strided(L(f), t["shape"], [s * 8 for s in t[f + "_strides"]]) for f in "ab")
        return {"dst": BINARY[t["fn"]](a, b)}
    if op == "matmul":
        m, k, n = t["m"], t["k"], t["n"]
        a, b = L("a"), L("b")
        out = []
        for i in range(t["batch"]):
            A = a[i * t["a_batch_stride"]:][: m * k].reshape((k, m) if t["trans_a"] else (m, k))
            Bm = b[i * t["b_batch_stride"]:][: k * n].reshape((n, k) if t["trans_b"] else (k, n))
            out.append((A.T if t["trans_a"] else A) @ (Bm.T if t["trans_b"] else Bm))
        return {"dst": np.array(out)}
    if op == "reduce_sum":
        return {"dst": L("x").sum(axis=1)}
    if op == "fill":
        return {"dst": np.full(t["n"], t["value"])}
    if op == "cast":
        return {"dst": L("src")}
    return {"dst": L("src")}  # copy: bytes, compared exactly below


REFS = {"lstm": ref_recurrent, "gru": ref_recurrent, "rnn": ref_recurrent, "selective_scan": ref_selective_scan,
        "mamba2": ref_mamba2, "gated_delta_net": ref_gdn}


# ---------------------------------------------------------------- cases and guarded layout
def recurrent(op, b, s, i, h, layers, bidir, carry, **extra):
    t = dict(op=op, batch=b, seq=s, input_size=i, hidden=h, num_layers=layers, bidirectional=bidir, carry=carry)
    t.update({f: 0 for f in ("x", "w_ih", "w_hh", "bias", "b_ih", "b_hh", "h0", "c0", "dst")})
    if op != "gru":
        t.pop("b_ih"), t.pop("b_hh")
    else:
        t.pop("bias")
    if op != "lstm":
        t.pop("c0")
    if op == "rnn":
        t["relu"] = extra.pop("relu", False)
    return t


def gdn(b, s, heads, n, per_channel, carry):
    return dict(op="gated_delta_net", batch=b, seq=s, heads=heads, state_size=n, gate_per_channel=per_channel,
                carry_state=carry, q=0, k=0, v=0, g=0, beta=0, state=0, dst=0)


def cases():
    out = [
        (recurrent("lstm", 2, 5, 3, 4, 2, True, True), {}),
        (recurrent("lstm", 2, 5, 3, 4, 2, True, True), {"rnn_kernel": "step"}),
        (recurrent("gru", 2, 4, 3, 5, 2, True, True), {}),
        (recurrent("gru", 1, 3, 2, 6, 1, False, False), {"rnn_kernel": "step"}),
        (recurrent("rnn", 2, 4, 3, 5, 1, True, True, relu=True), {}),
        (recurrent("rnn", 2, 4, 3, 5, 2, False, False), {"rnn_kernel": "step"}),
        (dict(op="selective_scan", batch=2, seq=5, hidden=5, state_size=4, x=0, delta=0, a=0, b=0, c=0, dst=0), {}),
        # state_size 16 takes the fixed-width register path of kernels/ssm.cl
        (dict(op="selective_scan", batch=2, seq=9, hidden=7, state_size=16, x=0, delta=0, a=0, b=0, c=0, dst=0), {}),
        (dict(op="mamba2", batch=2, seq=4, heads=3, head_dim=4, state_size=6, x=0, dt=0, a=0, b=0, c=0, dst=0), {}),
        (gdn(2, 4, 2, 8, False, True), {}),
        (gdn(1, 3, 2, 5, True, False), {}),
        (dict(op="matmul", batch=2, m=5, k=7, n=3, trans_a=False, trans_b=False, a_batch_stride=35, b_batch_stride=0, a=0, b=0, dst=0), {}),
        (dict(op="matmul", batch=2, m=17, k=18, n=19, trans_a=True, trans_b=True, a_batch_stride=306, b_batch_stride=342, a=0, b=0, dst=0), {}),
        (dict(op="reduce_sum", outer=3, r=5, inner=7, x=0, dst=0), {}),
        (dict(op="binary", fn="add", shape=[2, 3, 4], a_strides=[12, 4, 1], b_strides=[0, 1, 0], a=0, b=0, dst=0), {}),
        (dict(op="copy", nbytes=37, src=0, dst=0), {}),
        (dict(op="fill", n=9, value=1.5, dst=0), {}),
    ]
    out += [(dict(op="unary", fn=fn, n=67, x=0, dst=0), {}) for fn in UNARY]
    out += [(dict(op="binary", fn=fn, shape=[3, 1, 5], a_strides=[5, 0, 1], b_strides=[0, 0, 1], a=0, b=0, dst=0), {})
            for fn in BINARY]
    if not SMALL:
        out += [
            (recurrent("lstm", 3, 16, 24, 40, 2, True, True), {}),
            (recurrent("gru", 2, 12, 16, 33, 1, True, False), {"rnn_kernel": "step"}),
            (dict(op="selective_scan", batch=2, seq=24, hidden=16, state_size=256, x=0, delta=0, a=0, b=0, c=0, dst=0), {}),
            (dict(op="mamba2", batch=1, seq=20, heads=2, head_dim=16, state_size=64, x=0, dt=0, a=0, b=0, c=0, dst=0), {}),
            (gdn(1, 16, 2, 256, True, True), {}),
            (gdn(2, 24, 3, 64, False, False), {}),
            (dict(op="matmul", batch=3, m=70, k=65, n=33, trans_a=False, trans_b=True, a_batch_stride=70 * 65, b_batch_stride=0, a=0, b=0, dst=0), {}),
        ]
    return out


def sample(t, field, shape, rng):
    """Inputs in the range each op is defined on (positive log args, decays below 1 ...)."""
    x = rng.standard_normal(shape)
    op = t["op"]
    if op == "unary" and t["fn"] in ("log", "sqrt", "rsqrt"):
        return np.abs(x) + 0.1
    if (op, field) in (("selective_scan", "delta"), ("mamba2", "dt")):
        return np.abs(x) * 0.5
    if (op, field) in (("selective_scan", "a"), ("mamba2", "a")):
        return -np.abs(x)
    if op == "gated_delta_net":
        if field == "g":
            return -np.abs(x) * 0.3
        if field == "beta":
            return sig(x)
        if field in ("k", "q"):
            return x / np.linalg.norm(x, axis=-1, keepdims=True) if field == "k" else x
    if op in ("lstm", "gru", "rnn") and field.startswith("w_"):
        return x * 0.5
    return x


def lay_out(t, dtype, rng, src_dtype=None):
    """Place every region of ``t`` with GUARD canary bytes around it; fill inputs with samples."""
    fields = dict(t, src_dtype=src_dtype) if t["op"] == "cast" else dict(t)
    t, arena_bytes = lay_out_case(fields.pop("op"), dtype, fields, guard=GUARD)
    placed = regions(t)
    arena = rng.integers(0, 256, arena_bytes, dtype=np.uint8)  # canaries everywhere, inputs overwrite below
    for r in placed:
        if r.reads and r.dtype != "u8":
            values = sample(t, r.field, r.shape, rng).astype(STORAGE[r.dtype])
            arena[r.offset: r.offset + r.nbytes] = values.reshape(-1).view(np.uint8)
    return t, arena, placed


def run_device(session, t, arena, **options):
    dev = session.alloc(arena.size)
    session.write(dev, 0, arena)
    session.launch(t, dev, **options)
    out = session.read(dev, 0, arena.size)
    session.finish()
    return out


def loader(t, arena, placed):
    by_field = {r.field: r for r in placed}

    def load(field):
        r = by_field[field]
        return arena[r.offset: r.offset + r.nbytes].view(STORAGE[r.dtype]).astype(np.float64).reshape(r.shape)
    return load


def check_guards(before, after, placed):
    mask = np.ones(before.size, bool)
    for r in placed:
        if r.writes:
            mask[r.offset: r.offset + r.nbytes] = False
    changed = np.flatnonzero((before != after) & mask)
    assert changed.size == 0, f"bytes outside the outputs changed at offsets {changed[:8]}"


def compare(t, got_arena, want, placed, bound, what):
    by_field = {r.field: r for r in placed}
    for field, values in want.items():
        r = by_field[field]
        got = got_arena[r.offset: r.offset + r.nbytes].view(STORAGE[r.dtype]).astype(np.float64).reshape(r.shape)
        want_st = np.asarray(values, np.float64).astype(STORAGE[r.dtype]).astype(np.float64).reshape(r.shape)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want_st), err_msg=f"{what} NaN positions of {field}")
        np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want_st), err_msg=f"{what} +Inf of {field}")
        np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want_st), err_msg=f"{what} -Inf of {field}")
        err = nmse(got, np.asarray(values, np.float64).reshape(r.shape))
        assert err <= bound, f"{what}: NMSE of {field} is {err:.3g} > {bound:.3g}"


def case_id(case):
    t, opts = case
    tag = t.get("fn", "")
    return "-".join(str(p) for p in (t["op"], tag, *opts.values()) if p != "")


CASES = cases()


def _run_case(session, t, dtype, options, rng, src_dtype=None, poison=None):
    t, arena, placed = lay_out(t, dtype, rng, src_dtype)
    if poison is not None:
        poison(t, arena, placed)
    if session.unsupported(t):
        pytest.skip(session.unsupported(t))
    got = run_device(session, t, arena, **options)
    check_guards(arena, got, placed)
    L = loader(t, arena, placed)
    if t["op"] == "copy":
        assert np.array_equal(got[t["dst"]: t["dst"] + t["nbytes"]], arena[t["src"]: t["src"] + t["nbytes"]])
    else:
        compare(t, got, REFS.get(t["op"], ref_body)(t, L), placed, BOUNDS.tolerance(t["op"], dtype), "vs float64 reference")
    if t["op"] in host_fallback.KERNELS:
        host = arena.copy()
        host_fallback.execute(t, host)
        written = [r for r in placed if r.writes]
        want = {r.field: host[r.offset: r.offset + r.nbytes].view(STORAGE[r.dtype]).astype(np.float64) for r in written}
        compare(t, got, want, placed, BOUNDS.tolerance(t["op"], dtype), "vs host_fallback")
    return got


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_conformance(session, case, dtype):
    t, options = case
    _run_case(session, t, dtype, options, np.random.default_rng(7))


@pytest.mark.parametrize("src_dtype", DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cast(session, dtype, src_dtype):
    _run_case(session, dict(op="cast", n=45, src=0, dst=0), dtype, {}, np.random.default_rng(3), src_dtype)


SPECIALS = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0])


def _poison(field):
    def poison(t, arena, placed):
        r = next(r for r in placed if r.field == field)
        view = arena[r.offset: r.offset + r.nbytes].view(STORAGE[r.dtype])
        view[: SPECIALS.size * 3: 3] = SPECIALS.astype(STORAGE[r.dtype])
    return poison


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("fn", list(UNARY) + list(BINARY))
def test_nan_inf_positions(session, fn, dtype):
    with np.errstate(all="ignore"):
        if fn in UNARY:
            _run_case(session, dict(op="unary", fn=fn, n=40, x=0, dst=0), dtype, {}, np.random.default_rng(1), poison=_poison("x"))
        else:
            t = dict(op="binary", fn=fn, shape=[40], a_strides=[1], b_strides=[1], a=0, b=0, dst=0)
            _run_case(session, t, dtype, {}, np.random.default_rng(1), poison=_poison("b"))


def test_registry_reasons(session):
    f64 = dict(op="unary", fn="exp", n=4, x=0, dst=0, dtype="f64")
    assert session.unsupported(f64) is None
    no_fp64 = opencl.open(dataclasses.replace(session.info, fp64=False))
    assert "cl_khr_fp64" in no_fp64.unsupported(f64)
    assert "cl_khr_fp64" in no_fp64.unsupported(dict(op="cast", n=4, src=0, dst=0, dtype="f32", src_dtype="f64"))
    assert no_fp64.unsupported(dict(f64, dtype="f32")) is None
    big = dict(gdn(1, 1, 1, 257, False, False), dtype="f32")
    assert "257" in session.unsupported(big) and "256" in session.unsupported(big)


def test_build_cache_and_error(session):
    prog = programs.program("opencl", "body", "f32", None, session.limits.target)
    assert session.program(prog) is session.program(prog)
    broken = dataclasses.replace(prog, source=prog.source.replace("return exp(x);", "return exp(x) +;"))
    with pytest.raises(KernelBuildError) as info:
        session.program(broken)
    err = info.value
    assert "error" in err.log.lower() and err.options == list(opencl.BUILD_OPTIONS)
    assert "return exp(x) +;" in str(err) and "    1  /* rlx_gpu body kernels" in str(err)


# ---------------------------------------------------------------- the scan family on the device
@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("op,save,k", [("scan", True, 0), ("scan", False, 0), ("scan_backward", True, 2),
                                       ("scan_backward_xs", False, 3)])
def test_scan_driver_on_device(session, op, save, k, dtype):
    """The shared driver over DeviceMemory: body thunks launch here; same bytes as the host driver."""
    from test_scan_host import Problem, Rnn  # the host scan suite's tanh-RNN cell, forward and vjp bodies

    p = Problem(Rnn(dtype, bcast_bias=True), length=5)
    thunk = p.scan(save, k) if op == "scan" else p.backward(op, save, k)
    host = p.arena.copy()
    host_fallback.execute(thunk, host, recompute="treeverse")
    got = run_device(session, thunk, p.arena, recompute="treeverse")
    written = [r for r in regions(thunk) if r.writes]
    for r in written:
        want = host[r.offset: r.offset + r.nbytes].view(STORAGE[dtype]).astype(np.float64)
        have = got[r.offset: r.offset + r.nbytes].view(STORAGE[dtype]).astype(np.float64)
        assert nmse(have, want) <= BOUNDS.tolerance(op, dtype), f"{op} {r.field}: NMSE {nmse(have, want):.3g}"
    mask = np.ones(host.size, bool)
    for r in written:
        mask[r.offset: r.offset + r.nbytes] = False
    assert np.array_equal(got[mask], p.arena[mask])
