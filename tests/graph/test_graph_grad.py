"""``Graph.grad``: reverse mode over whole graphs, through body ops, fused ops (their backward thunks) and scans.

Gradients are checked against float64 central finite differences of the compiled forward graph, and the
fused lstm's gradients (``lstm_backward``) against those of the same LSTM written as a scan cell
(``scan_backward`` over body ops).
"""
from __future__ import annotations

import numpy as np
import pytest

from rlx_gpu.graph.builder import Graph, GraphError

EPS = 1e-6
rng = np.random.default_rng(11)


def finite_diff(loss, values: dict[str, np.ndarray], name: str) -> np.ndarray:
    """Central differences of scalar ``loss(values)`` with respect to ``values[name]``."""
    grad = np.zeros_like(values[name])
    for idx in np.ndindex(grad.shape):
        plus, minus = dict(values), dict(values)
        plus[name], minus[name] = values[name].copy(), values[name].copy()
        plus[name][idx] += EPS
        minus[name][idx] -= EPS
        grad[idx] = (loss(plus) - loss(minus)) / (2 * EPS)
    return grad


def check_against_differences(build, shapes: dict[str, tuple[int, ...]], scale: dict[str, float] | None = None):
    """``build(g, inputs) -> scalar loss``: every input's ``Graph.grad`` against differences of the forward."""
    fwd, back = Graph("f64"), Graph("f64")
    for g in (fwd, back):
        ins = {k: g.input(k, s) for k, s in shapes.items()}
        loss = build(g, ins)
        g.output("loss", loss)
    grads = back.grad(back.outputs["loss"], list(back.inputs.values()))
    for name, d in zip(back.inputs, grads):
        back.output(f"d_{name}", d)
    forward, backward = fwd.compile("host"), back.compile("host")
    values = {k: rng.normal(size=s) * (scale or {}).get(k, 1.0) for k, s in shapes.items()}
    got = backward.run(**values)
    for name in shapes:
        want = finite_diff(lambda v: float(forward.run(**v)["loss"]), values, name)
        np.testing.assert_allclose(got[f"d_{name}"], want, rtol=1e-5, atol=1e-7, err_msg=name)
    return backward.schedule


# ------------------------------------------------------------------ fused op + matmul + scan
B, S, I, H, O = 2, 3, 2, 3, 2


def rows_cell() -> Graph:
    """A scan body over the lstm's batch rows: ``c' = tanh(c·u + z_b)``, carry ``[S, O]``."""
    body = Graph("f64")
    c, z, u = body.input("c", (S, O)), body.input("z", (S, O)), body.input("u", (O, O))
    body.output("c_next", body.unary("tanh", c @ u + z))
    return body


LSTM_SHAPES = {"x": (B, S, I), "w_ih": (4 * H, I), "w_hh": (4 * H, H), "bias": (4 * H,), "h0": (1, B, H),
               "c0": (1, B, H), "w_out": (H, O), "u": (O, O), "init": (S, O), "pick": (1, B, H)}


def lstm_matmul_scan(g: Graph, v: dict) -> object:
    """An lstm (carried state), a projection, a scan over its rows, and a loss reading both ends."""
    y, h_n, c_n = g.lstm(v["x"], v["w_ih"], v["w_hh"], v["bias"], hidden=H, h0=v["h0"], c0=v["c0"])
    final = g.scan(rows_cell(), v["init"], [y @ v["w_out"]], [v["u"]])
    return g.reduce_sum(final * final, (0, 1)) + g.reduce_sum(h_n * v["pick"] + c_n * c_n, (0, 1, 2))


def test_lstm_matmul_scan_graph_matches_finite_differences():
    schedule = check_against_differences(lstm_matmul_scan, LSTM_SHAPES, {"w_ih": 0.5, "w_hh": 0.5})
    ops = [t.op for t in schedule.thunks]
    assert ops.count("lstm_backward") == 1 and ops.count("scan_backward") == 1
    assert ops.count("scan_backward_xs") == 2  # the projection's rows and the broadcast u


def test_a_graph_with_lstm_matmul_and_scan_trains():
    g = Graph("f64")
    v = {k: g.input(k, s) for k, s in LSTM_SHAPES.items()}
    loss = g.output("loss", lstm_matmul_scan(g, v))
    names = ["w_ih", "w_hh", "bias", "w_out", "u"]
    for name, d in zip(names, g.grad(loss, [v[n] for n in names])):
        g.output(f"d_{name}", d)
    step = g.compile("host")
    values = {k: rng.normal(size=s) * 0.5 for k, s in LSTM_SHAPES.items()}
    losses = []
    for _ in range(8):
        out = step.run(**values)
        losses.append(float(out["loss"]))
        values.update({n: values[n] - 0.05 * out[f"d_{n}"] for n in names})
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.8 * losses[0], losses


def test_checkpointed_trajectory_and_the_final_state_alone():
    body = rows_cell()

    def build(g, v):
        traj = g.scan(body, v["init"], [v["zs"]], [v["u"]], save_trajectory=True, num_checkpoints=2)  # steps 1, 4
        return g.reduce_sum(traj * v["w"], (0, 1, 2))

    check_against_differences(build, {"init": (S, O), "zs": (5, S, O), "u": (O, O), "w": (2, S, O)})


def test_a_graph_with_mamba2_and_matmul_matches_finite_differences():
    b, s, h, p, n = 2, 4, 2, 2, 3
    shapes = {"x": (b, s, h, p), "dt": (b, s, h), "a": (h,), "b": (b, s, 1, n), "c": (b, s, 1, n), "d": (h,),
              "z": (b, s, h, p), "dt_bias": (h,), "state0": (b, h, p, n), "w": (p, 2)}

    def build(g, v):
        y, state = g.mamba2(v["x"], v["dt"], v["a"], v["b"], v["c"], D=v["d"], z=v["z"], dt_bias=v["dt_bias"],
                            dt_softplus=True, initial_state=v["state0"])
        q = y @ v["w"]
        return g.reduce_sum(q * q, (0, 1, 2, 3)) + g.reduce_sum(state * v["state0"], (0, 1, 2, 3))

    schedule = check_against_differences(build, shapes, {"a": 0.5, "dt": 0.5})
    assert [t.op for t in schedule.thunks].count("mamba2_backward") == 1


@pytest.mark.parametrize("carried", [False, True])
def test_a_graph_with_gated_delta_net_matches_finite_differences(carried):
    b, s, h, n = 1, 3, 1, 2
    shapes = {"q": (b, s, h, n), "k": (b, s, h, n), "v": (b, s, h, n), "g": (b, s, h), "beta": (b, s, h),
              **({"state0": (b, h, n, n)} if carried else {})}

    def build(g, v):
        out = g.gated_delta_net(v["q"], v["k"], v["v"], v["g"], g.unary("sigmoid", v["beta"]),
                                initial_state=v.get("state0"))
        y, extra = (out[0], g.reduce_sum(out[1] * v["state0"], (0, 1, 2, 3))) if carried else (out, 0.0)
        return g.reduce_sum(y * y, (0, 1, 2, 3)) + extra

    schedule = check_against_differences(build, shapes, {"g": 0.3})
    assert [t.op for t in schedule.thunks].count("gated_delta_net_backward") == 1


# ------------------------------------------------------------------ the same LSTM, fused and as a scan cell
def lstm_cell(batch: int, inputs: int, hidden: int) -> Graph:
    """One LSTM step (gates i, f, g, o) of body ops; the carry is ``[batch, 2·hidden]``: h, then c.

    Slices and concatenations are products with 0/1 matrices, which are exact.
    """
    cell = Graph("f64")
    carry, x = cell.input("carry", (batch, 2 * hidden)), cell.input("x", (batch, inputs))
    w_ih, w_hh = cell.input("w_ih", (4 * hidden, inputs)), cell.input("w_hh", (4 * hidden, hidden))
    bias = cell.input("bias", (4 * hidden,))
    halves, quarters = np.eye(2 * hidden), np.eye(4 * hidden)
    take_h, take_c = (cell.constant(halves[:, k * hidden:(k + 1) * hidden]) for k in range(2))
    gate = [cell.constant(quarters[:, k * hidden:(k + 1) * hidden]) for k in range(4)]
    h, c = carry @ take_h, carry @ take_c
    z = cell.matmul(x, w_ih, trans_b=True) + cell.matmul(h, w_hh, trans_b=True) + bias
    i, f, o = (cell.unary("sigmoid", z @ gate[k]) for k in (0, 1, 3))
    c_next = f * c + i * cell.unary("tanh", z @ gate[2])
    h_next = o * cell.unary("tanh", c_next)
    cell.output("carry_next", cell.matmul(h_next, take_h, trans_b=True) + cell.matmul(c_next, take_c, trans_b=True))
    return cell


def test_lstm_backward_and_the_scan_of_an_lstm_cell_agree():
    b, s, i, h = 2, 4, 3, 3
    weights = {"w_ih": (4 * h, i), "w_hh": (4 * h, h), "bias": (4 * h,)}
    values = {k: rng.normal(size=shape) * 0.6 for k, shape in weights.items()}
    x, h0, c0 = rng.normal(size=(b, s, i)), rng.normal(size=(1, b, h)), rng.normal(size=(1, b, h))
    dy, dh, dc = rng.normal(size=(b, s, h)), rng.normal(size=(1, b, h)), rng.normal(size=(1, b, h))

    fused = Graph("f64")
    ins = {k: fused.input(k, shape) for k, shape in {**weights, "x": x.shape, "h0": h0.shape, "c0": c0.shape}.items()}
    y, h_n, c_n = fused.lstm(ins["x"], ins["w_ih"], ins["w_hh"], ins["bias"], hidden=h, h0=ins["h0"], c0=ins["c0"])
    for name, d in zip(ins, fused.grad([y, h_n, c_n], list(ins.values()), [dy, dh, dc])):
        fused.output(f"d_{name}", d)
    got = fused.compile("host").run(**values, x=x, h0=h0, c0=c0)
    assert [t.op for t in fused.compile("host").schedule.thunks].count("lstm_backward") == 1

    scanned = Graph("f64")
    ins = {k: scanned.input(k, shape) for k, shape in {**weights, "xs": (s, b, i), "init": (b, 2 * h)}.items()}
    traj = scanned.scan(lstm_cell(b, i, h), ins["init"], [ins["xs"]], [ins["w_ih"], ins["w_hh"], ins["bias"]],
                        save_trajectory=True)
    d_traj = np.concatenate([dy.transpose(1, 0, 2), np.zeros((s, b, h))], axis=2)  # y is every step's h
    d_traj[-1] += np.concatenate([dh[0], dc[0]], axis=1)  # the last step's carry is the final state
    for name, d in zip(ins, scanned.grad(traj, list(ins.values()), d_traj)):
        scanned.output(f"d_{name}", d)
    init = np.concatenate([h0[0], c0[0]], axis=1)
    want = scanned.compile("host").run(**values, xs=x.transpose(1, 0, 2), init=init)
    assert {"scan_backward", "scan_backward_xs"} <= {t.op for t in scanned.compile("host").schedule.thunks}

    for name in weights:
        np.testing.assert_allclose(got[f"d_{name}"], want[f"d_{name}"], rtol=1e-10, atol=1e-12, err_msg=name)
    np.testing.assert_allclose(got["d_x"], want["d_xs"].transpose(1, 0, 2), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got["d_h0"][0], want["d_init"][:, :h], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got["d_c0"][0], want["d_init"][:, h:], rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------ what grad refuses, and what it leaves out
def test_grad_checks_its_arguments_and_gives_zero_where_nothing_depends():
    g = Graph("f64")
    x, unused = g.input("x", (2, 3)), g.input("unused", (4,))
    y = g.unary("tanh", x)
    with pytest.raises(GraphError, match="d_outputs is needed"):
        g.grad(y, x)
    with pytest.raises(GraphError, match=r"must be \[2, 3\] f64"):
        g.grad(y, x, np.ones((3, 2)))
    with pytest.raises(GraphError, match="2 d_outputs for 1 outputs"):
        g.grad([y], [x], [np.ones((2, 3))] * 2)
    other = Graph("f64").input("x", (2, 3))
    with pytest.raises(GraphError, match="tensor of this graph"):
        g.grad(y, other, np.ones((2, 3)))
    dx, du = g.grad(y, [x, unused], np.ones((2, 3)))
    g.output("dx", dx)
    g.output("du", du)
    out = g.compile("host").run(x=np.full((2, 3), 0.5), unused=np.ones(4))
    np.testing.assert_allclose(out["dx"], np.full((2, 3), 1 - np.tanh(0.5) ** 2))
    np.testing.assert_array_equal(out["du"], np.zeros(4))
    strided = g.strided_copy(x, (3, 2), (1, 3))  # a transpose: no derivative rule
    with pytest.raises(GraphError, match="strided_copy"):
        g.grad(g.reduce_sum(strided, (0, 1)), x)
