"""Reverse mode: every body op's rule and whole-scan gradients against central finite differences (f64)."""
from __future__ import annotations

import numpy as np
import pytest

from rlx_gpu.graph.autodiff import vjp
from rlx_gpu.graph.builder import Graph, GraphError

EPS, RTOL = 1e-6, 1e-3
rng = np.random.default_rng(7)


def finite_diff(loss, args, i):
    """Central differences of scalar ``loss(*args)`` with respect to ``args[i]``."""
    grad = np.zeros_like(args[i])
    for idx in np.ndindex(args[i].shape):
        plus, minus = [a.copy() for a in args], [a.copy() for a in args]
        plus[i][idx] += EPS
        minus[i][idx] -= EPS
        grad[idx] = (loss(*plus) - loss(*minus)) / (2 * EPS)
    return grad


def assert_close(got, want):
    scale = max(np.abs(want).max(), 1e-3)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * scale)


def check_rule(build, shapes, positive=False):
    """``build(g, a, b) -> y``; checks vjp's da and db against differences of the compiled forward."""
    fwd = Graph("f64")
    a, b = fwd.input("a", shapes[0]), fwd.input("b", shapes[1])
    y = build(fwd, a, b)
    fwd.output("y", y)
    forward = fwd.compile("host")
    back = vjp(fwd, wrt=0).compile("host")
    args = [rng.uniform(0.5, 2.0, s) if positive else rng.normal(size=s) for s in shapes]
    d = rng.normal(size=y.shape)
    out = back.run(a=args[0], b=args[1], d_output=d)
    loss = lambda a_, b_: float((forward.run(a=a_, b=b_)["y"] * d).sum())  # noqa: E731
    assert_close(out["dcarry"], finite_diff(loss, args, 0))
    assert_close(out["dx"], finite_diff(loss, args, 1))


@pytest.mark.parametrize("fn", ["exp", "log", "tanh", "sigmoid", "relu", "neg", "sqrt", "rsqrt", "square", "abs",
                                "recip", "softplus", "step"])
def test_unary_rules(fn):
    # b enters through a product so that both inputs have a gradient; positive inputs suit log/sqrt/rsqrt.
    positive = fn in ("log", "sqrt", "rsqrt")
    check_rule(lambda g, a, b: g.unary(fn, a if positive else a * b) * b, [(2, 3), (2, 3)], positive)


@pytest.mark.parametrize("fn", ["add", "sub", "mul", "div", "max", "min"])
@pytest.mark.parametrize("sa,sb", [((2, 3), (2, 3)), ((2, 3), (3,)), ((4, 1, 3), (2, 1)), ((), (2, 2))])
def test_binary_rules_reduce_over_broadcast_axes(fn, sa, sb):
    check_rule(lambda g, a, b: g.binary(fn, a, b), [sa, sb], positive=fn == "div")


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
@pytest.mark.parametrize("batched_a", [False, True])
def test_matmul_rules(ta, tb, batched_a):
    m, k, n = 2, 3, 4
    sa = ((2,) if batched_a else ()) + ((k, m) if ta else (m, k))
    sb = (n, k) if tb else (k, n)
    check_rule(lambda g, a, b: g.matmul(a, b, trans_a=ta, trans_b=tb), [sa, sb])


def test_reduce_sum_cast_copy_reshape_fill_rules():
    def build(g, a, b):
        s = g.reduce_sum(a * b, (0, 2), keepdims=True)  # [1, 3, 1]
        s = g.cast(g.cast(g.reshape(s, (3, 1)), "f32"), "f64")  # f32 round trip: derivative 1 (to f32 precision)
        return g.copy(s) * g.reduce_sum(b, 0) + g.fill((3, 4), 2.0, "f64")

    fwd = Graph("f64")
    a, b = fwd.input("a", (2, 3, 4)), fwd.input("b", (2, 3, 4))
    fwd.output("y", build(fwd, a, b))
    back = vjp(fwd, wrt=0).compile("host")
    av, bv, d = rng.normal(size=(2, 3, 4)), rng.normal(size=(2, 3, 4)), rng.normal(size=(3, 4))
    out = back.run(a=av, b=bv, d_output=d)
    # y[c, j] = s[c]·Σ_i b[i, c, j] + 2 with s[c] = Σ_ij a·b, differentiated by hand
    s, bsum = (av * bv).sum(axis=(0, 2)), bv.sum(axis=0)  # [3], [3, 4]
    ds = (d * bsum).sum(axis=1)  # [3]
    np.testing.assert_allclose(out["dcarry"], ds[None, :, None] * bv, rtol=1e-6)
    np.testing.assert_allclose(out["dx"], ds[None, :, None] * av + (d * s[:, None])[None], rtol=1e-6)


def test_vjp_refuses_non_body_ops_and_bad_wrt():
    g = Graph()
    x = g.input("x", (1, 2, 3))
    g.output("y", g.rnn(x, np.zeros(12), np.zeros(16), np.zeros(4), hidden=4))
    with pytest.raises(GraphError, match="only body ops"):
        vjp(g)
    body = Graph()
    body.output("y", body.unary("exp", body.input("h", (2,))))
    with pytest.raises(GraphError, match="wrt=1 names no per-step input"):
        vjp(body, wrt=1)


# ----------------------------------------------------------------------------- whole scans
L, B, H, I = 5, 2, 3, 2


def _sig(v):
    return 1.0 / (1.0 + np.exp(-v))


def tanh_cell():
    wx = rng.normal(size=(I, H)) * 0.7
    body = Graph("f64")
    h, x, u = body.input("h", (B, H)), body.input("x", (B, I)), body.input("u", (H, H))
    body.output("h_next", body.unary("tanh", x @ body.weight("wx", wx) + h @ u))
    return body, lambda h_, x_, u_: np.tanh(x_ @ wx + h_ @ u_[0])


def gru_cell():
    w = {k: rng.normal(size=(I, H)) * 0.7 for k in "rzn"}
    body = Graph("f64")
    h, x = body.input("h", (B, H)), body.input("x", (B, I))
    u = {k: body.input(f"u_{k}", (H, H)) for k in "rzn"}
    wt = {k: body.weight(f"w_{k}", w[k]) for k in "rzn"}
    r = body.unary("sigmoid", x @ wt["r"] + h @ u["r"])
    z = body.unary("sigmoid", x @ wt["z"] + h @ u["z"])
    n = body.unary("tanh", x @ wt["n"] + r * (h @ u["n"]))
    body.output("h_next", (1.0 - z) * n + z * h)

    def step(h_, x_, us):
        ur, uz, un = us
        r_, z_ = _sig(x_ @ w["r"] + h_ @ ur), _sig(x_ @ w["z"] + h_ @ uz)
        n_ = np.tanh(x_ @ w["n"] + r_ * (h_ @ un))
        return (1 - z_) * n_ + z_ * h_

    return body, step


@pytest.mark.parametrize("cell", [tanh_cell, gru_cell])
@pytest.mark.parametrize("upstream", ["final", "traj"])
@pytest.mark.parametrize("checkpoints", [0, 2])
def test_scan_grad_matches_finite_differences(cell, upstream, checkpoints):
    body, step = cell()
    n_bcast = len(body.inputs) - 2
    g = Graph("f64")
    h0, xs = g.input("h0", (B, H)), g.input("xs", (L, B, I))
    us = [g.input(f"u{j}", (H, H)) for j in range(n_bcast)]
    d = g.input("d", (B, H) if upstream == "final" else (L, B, H))
    grads = g.scan_grad(body, h0, [xs], us, num_checkpoints=checkpoints,
                        **{"d_final" if upstream == "final" else "d_traj": d})
    g.output("d_h0", grads.d_init)
    g.output("d_xs", grads.d_xs[0])
    for j, du in enumerate(grads.d_bcast):
        g.output(f"d_u{j}", du)
    ops = [t.op for t in g.compile("host").schedule.thunks]
    assert ops.count("scan_backward") == 1 and ops.count("scan_backward_xs") == 1 + n_bcast

    args = [rng.normal(size=(B, H)), rng.normal(size=(L, B, I))] + [rng.normal(size=(H, H)) * 0.5 for _ in us]
    dv = rng.normal(size=(B, H) if upstream == "final" else (L, B, H))

    def loss(h_, xs_, *us_):
        traj = []
        for t in range(L):
            h_ = step(h_, xs_[t], us_)
            traj.append(h_)
        return float(((h_ if upstream == "final" else np.array(traj)) * dv).sum())

    out = g.compile("host").run(h0=args[0], xs=args[1], d=dv, **{f"u{j}": args[2 + j] for j in range(n_bcast)})
    for i, name in enumerate(["d_h0", "d_xs"] + [f"d_u{j}" for j in range(n_bcast)]):
        assert_close(out[name], finite_diff(loss, args, i))


def test_scan_grad_prunes_unrequested_gradients_and_checks_upstream():
    body, _ = tanh_cell()
    g = Graph("f64")
    h0, xs, u = g.input("h0", (B, H)), g.input("xs", (L, B, I)), g.input("u", (H, H))
    grads = g.scan_grad(body, h0, [xs], [u], d_final=g.input("d", (B, H)))
    g.output("d_h0", grads.d_init)
    # no scan_backward_xs, no reduction for d_u: only the tiled u that the backward body reads remains
    assert [t.op for t in g.compile("host").schedule.thunks] == ["scan", "binary", "scan_backward"]
    with pytest.raises(GraphError, match="exactly one of d_final"):
        g.scan_grad(body, h0, [xs], [u])
    with pytest.raises(GraphError, match=r"must be \[5, 2, 3\]"):
        g.scan_grad(body, h0, [xs], [u], d_traj=g.input("bad", (B, H)))


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_scan_grad_in_16_bit_follows_f64(dtype):
    wx = rng.normal(size=(I, H)) * 0.7
    feed = {"h0": rng.normal(size=(B, H)), "xs": rng.normal(size=(L, B, I)), "u": rng.normal(size=(H, H)) * 0.5,
            "d": rng.normal(size=(L, B, H))}

    def grads(dt):
        body = Graph(dt)
        h, x, u = body.input("h", (B, H)), body.input("x", (B, I)), body.input("u", (H, H))
        body.output("h_next", body.unary("tanh", x @ body.weight("wx", wx) + h @ u))
        g = Graph(dt)
        ins = {k: g.input(k, v.shape) for k, v in feed.items()}
        r = g.scan_grad(body, ins["h0"], [ins["xs"]], [ins["u"]], d_traj=ins["d"], num_checkpoints=2)
        g.output("d_h0", r.d_init)
        g.output("d_u", r.d_bcast[0])
        return g.compile("host").run(**feed)

    low, ref = grads(dtype), grads("f64")
    for name in ("d_h0", "d_u"):
        np.testing.assert_allclose(low[name], ref[name], atol=0.05 * np.abs(ref[name]).max())
