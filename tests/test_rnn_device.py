"""The recurrent device kernels with ABI.md §8's fields, on an OpenCL CPU implementation at both kernel targets.

Each case turns on several fields of one op at once (one compile-time variant of kernels/rnn.cl per
case), runs it through the device's runner (both recurrent kernels at the cpu target, the per-step one
with its hoisted input gemm at the gpu target) and compares with a float64 recurrence written here from
ABI.md §3 and §8, one batch row and step at a time.
"""
from __future__ import annotations

import numpy as np
import pytest

from host_fallback.abi import complete
from rlx_gpu import launches
from rlx_gpu.conformance import runner
from rlx_gpu.conformance.catalog import Case
from rlx_gpu.conformance.devices import find, open_device
from rlx_gpu.launches import rnn as rnn_launches
from rlx_gpu.launches.limits import RNN_FIELD_VARIANTS, TARGETS
from rlx_gpu.runtime.registry import status
from support.rnn_fields import BASE, FIELDS

#: the first OpenCL CPU implementation that runs here (PoCL, or Intel's runtime where PoCL cannot build)
OPENCL_CPU = [i.spec for i in status("opencl").devices if not i.details["simulator"]][:1]
pytestmark = pytest.mark.skipif(not OPENCL_CPU, reason=f"no OpenCL CPU device: {status('opencl').reason}")

# ------------------------------------------------------------------------------- float64 reference
ACT = {
    "sigmoid": lambda v, a, b: 1 / (1 + np.exp(-v)), "tanh": lambda v, a, b: np.tanh(v),
    "relu": lambda v, a, b: np.maximum(v, 0), "affine": lambda v, a, b: a * v + b,
    "leaky_relu": lambda v, a, b: np.where(v >= 0, v, a * v),
    "thresholded_relu": lambda v, a, b: np.where(v > a, v, 0.0),
    "scaled_tanh": lambda v, a, b: a * np.tanh(b * v),
    "hard_sigmoid": lambda v, a, b: np.clip(a * v + b, 0, 1),
    "elu": lambda v, a, b: np.where(v >= 0, v, a * (np.exp(v) - 1)),
    "softsign": lambda v, a, b: v / (1 + np.abs(v)), "softplus": lambda v, a, b: np.log1p(np.exp(v)),
}


def _step(t, acts, x, h, c, w, r, bias, b_hh, peep, w_hr):
    """One step of one batch row: acts the direction's [(fn, alpha, beta)] per slot."""
    H = t["hidden"]
    f, g = (lambda v, s=s: ACT[acts[s][0]](v, acts[s][1], acts[s][2]) for s in range(2)) if len(acts) > 1 else (None, None)
    clip = (lambda v: np.clip(v, -t["clip"], t["clip"])) if t["clip"] > 0 else (lambda v: v)
    if t["op"] == "rnn":
        return ACT[acts[0][0]](clip(w @ x + r @ h + bias), acts[0][1], acts[0][2]), c
    if t["op"] == "gru":
        a, rz = w @ x + bias, r[:2 * H] @ h + b_hh[:2 * H]
        rr, z = f(clip(a[:H] + rz[:H])), f(clip(a[H:2 * H] + rz[H:]))
        hn = r[2 * H:] @ h + b_hh[2 * H:] if t["linear_before_reset"] else r[2 * H:] @ (rr * h) + b_hh[2 * H:]
        n = g(clip(a[2 * H:] + (rr * hn if t["linear_before_reset"] else hn)))
        return (1 - z) * n + z * h, c
    z = w @ x + r @ h + bias
    zi, zf, zg, zo = (z[k * H:(k + 1) * H] for k in range(4))
    if peep is not None:
        zi, zf = zi + peep[:H] * c, zf + peep[2 * H:] * c
    i = f(clip(zi))
    fg = 1 - i if t["input_forget"] else f(clip(zf))
    c = fg * c + i * g(clip(zg))
    if peep is not None:
        zo = zo + peep[H:2 * H] * c
    m = f(clip(zo)) * ACT[acts[2][0]](c, acts[2][1], acts[2][2])
    return (w_hr @ m if w_hr is not None else m), c


def reference(t, get):
    """(dst, h_final, c_final) of the completed thunk ``t``; ``get(field)`` gives a tensor in float64."""
    G = rnn_launches.GATES[t["op"]]
    D, H, B, S, L = 2 if t["bidirectional"] else 1, t["hidden"], t["batch"], t["seq"], t["num_layers"]
    K = t.get("proj_size") or H
    slots = len(t["activations"]) // D
    lens = [S] * B if t["seq_lens"] is None else [int(v) for v in get("seq_lens")]
    w_ih = get("w_ih").ravel()
    w_hh = get("w_hh").reshape(L * D, G * H, K)
    bias = get("b_ih" if t["op"] == "gru" else "bias").reshape(L * D, G * H)
    b_hh = get("b_hh").reshape(L * D, G * H) if t["op"] == "gru" else None
    peep = get("peepholes").reshape(L * D, 3 * H) if t.get("peepholes") is not None else None
    w_hr = get("w_hr").reshape(L * D, K, H) if t.get("w_hr") is not None else None
    h0 = get("h0").reshape(L * D, B, K) if t["carry"] else np.zeros((L * D, B, K))
    c0 = get("c0").reshape(L * D, B, H) if t["carry"] and t["op"] == "lstm" else np.zeros((L * D, B, H))
    hf, cf = h0.copy(), c0.copy()
    layer_in, off = get("x").reshape(B, S, -1), 0
    for layer in range(L):
        in_l = layer_in.shape[2]
        out = np.zeros((B, S, D * K))
        for d in range(D):
            ld = layer * D + d
            w = w_ih[off:off + G * H * in_l].reshape(G * H, in_l)
            off += G * H * in_l
            acts = t["activations"][d * slots:(d + 1) * slots]
            for b in range(B):
                h, c = h0[ld, b].copy(), c0[ld, b].copy()
                back = d == 1 or t["reverse"]
                for tt in (reversed(range(lens[b])) if back else range(lens[b])):
                    h, c = _step(t, acts, layer_in[b, tt], h, c, w, w_hh[ld], bias[ld],
                                 None if b_hh is None else b_hh[ld], None if peep is None else peep[ld],
                                 None if w_hr is None else w_hr[ld])
                    out[b, tt, d * K:(d + 1) * K] = h
                hf[ld, b], cf[ld, b] = h, c
        layer_in = out
    return layer_in, hf, cf


# ---------------------------------------------------------------------------------------- cases
#: single fields beside the FIELDS cases (support.rnn_fields): reverse (one direction), seq_lens with the default activations, peepholes
SINGLE = {
    "lstm reverse": ("lstm", dict(BASE, bidirectional=False, reverse=True, num_layers=1)),
    "gru lens": ("gru", dict(BASE, seq_lens=[6, 0, 3, 3, 1], num_layers=1)),
    "lstm peepholes": ("lstm", dict(BASE, peepholes=True, num_layers=1)),  # the forget gate's, which input_forget drops
}
KERNELS = {"cpu": ("persistent", "step"), "gpu": ("step",)}


@pytest.fixture(scope="module", params=TARGETS)
def session(request):
    return open_device(find(OPENCL_CPU[0]), request.param)


def _check(session, op, params, rnn_kernel, dtype="f32", tol=2e-5):
    laid = runner.lay_out(Case(op, dtype, params))
    thunk = complete(laid.thunk)
    assert launches.unsupported(thunk, session.limits) is None
    arena = session.upload(laid.arena)
    session.launch(laid.thunk, arena, rnn_kernel=rnn_kernel)
    got = session.read(arena, 0, laid.arena.size)
    dst, hf, cf = reference(thunk, lambda f: laid.view(laid.arena, f))
    want = {"dst": dst, "h0": hf, "c0": cf}
    for field in ("dst", "h0", "c0") if op == "lstm" else ("dst", "h0"):
        have = laid.view(got, field).reshape(want[field].shape)
        assert np.allclose(have, want[field], atol=tol, rtol=tol), (
            f"{op} {rnn_kernel} {field}: max error {np.abs(have - want[field]).max():.3g}")
    return laid, got


@pytest.mark.parametrize("op", sorted(FIELDS))
def test_every_field_at_once_matches_the_float64_recurrence(session, op):
    for rnn_kernel in KERNELS[session.limits.target]:
        laid, got = _check(session, op, FIELDS[op], rnn_kernel)
        dst = laid.view(got, "dst").reshape(BASE["batch"], BASE["seq"], -1)
        for b, n in enumerate(FIELDS[op]["seq_lens"]):
            assert not dst[b, n:].any(), "dst past a row's length is written 0"


@pytest.mark.parametrize("name", sorted(SINGLE))
def test_single_fields_match_the_float64_recurrence(session, name):
    op, params = SINGLE[name]
    for rnn_kernel in KERNELS[session.limits.target]:
        _check(session, op, params, rnn_kernel)


def test_the_cases_build_the_representative_variants():
    """The programs ptxas and NVRTC check (RNN_FIELD_VARIANTS) are the ones these cases run."""
    built = {rnn_launches.variant(complete(runner.lay_out(Case(op, "f32", p)).thunk)) for op, p in FIELDS.items()}
    assert built == set(RNN_FIELD_VARIANTS)


def test_a_version_1_thunk_keeps_its_program():
    for op in FIELDS:
        thunk = complete(runner.lay_out(Case(op, "f32", BASE)).thunk)
        assert rnn_launches.variant(thunk) == (("RNN_GATES", rnn_launches.GATES[op]),)
