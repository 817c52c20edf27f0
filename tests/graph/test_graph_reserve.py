"""``Graph.backward`` and ``Graph.grad`` save a recurrent call's forward for its backward (ABI.md §9.1's
``reserve``) unless asked to recompute; both give torch autograd's gradients."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import rlx_gpu
from rlx_gpu.graph.builder import Graph
from rlx_gpu.graph.lowering import lower
from rlx_gpu.graph.torch_weights import pack_recurrent

MODULES = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU, "rnn": torch.nn.RNN}


def _graph(op: str, recompute: bool, b: int = 2, s: int = 4, i: int = 3, h: int = 5):
    torch.manual_seed(0)
    module = MODULES[op](i, h, batch_first=True, num_layers=2, bidirectional=True).double()
    weights = pack_recurrent(module)
    g = Graph("f64")
    x = g.input("x", (b, s, i))
    w = {k: g.input(k, np.shape(v)) for k, v in weights.items()}
    y = getattr(g, op)(x, *w.values(), hidden=h, num_layers=2, bidirectional=True)
    loss = g.reduce_sum(g.binary("mul", y, g.input("dy", y.shape)), list(range(3)))
    grads = g.grad(loss, [x, *w.values()], recompute=recompute)
    for name, t in zip(["x", *w], grads):
        g.output(f"d_{name}", t)
    return g, module, weights


@pytest.mark.parametrize("op", ["lstm", "gru", "rnn"])
def test_grad_saves_the_forward_by_default_and_recomputes_when_asked(op):
    outs = {}
    for recompute in (False, True):
        g, module, weights = _graph(op, recompute)
        schedule, _ = lower(g)
        forwards = [t for t in schedule["thunks"] if t["op"] == op]
        backward = next(t for t in schedule["thunks"] if t["op"] == f"{op}_backward")
        if recompute:  # no output reads the forward: its thunk is pruned, the backward runs it again
            assert not forwards and "reserve" not in backward
        else:
            (forward,) = forwards
            need = rlx_gpu.reserve_bytes(forward)
            assert forward["reserve"] == backward["reserve"] and forward["reserve_bytes"] == need
        xt = torch.randn(2, 4, 3, dtype=torch.float64, requires_grad=True)
        dyt = torch.randn(2, 4, 10, dtype=torch.float64)
        outs[recompute] = g.compile("host").run(x=xt.detach().numpy(), dy=dyt.numpy(),
                                                **{k: np.asarray(v) for k, v in weights.items()})
    yt, _ = module(xt)
    (yt * dyt).sum().backward()
    np.testing.assert_allclose(outs[False]["d_x"], xt.grad.numpy(), rtol=1e-9, atol=1e-12)
    for name in outs[True]:  # the recompute's checkpoint pass is the plain forward's loops: equal to rounding
        np.testing.assert_allclose(outs[False][name], outs[True][name], rtol=1e-12, atol=1e-15)


def test_a_second_backward_of_one_call_reads_the_same_reserve():
    g = Graph("f32")
    x = g.input("x", (2, 3, 4))
    w_ih, w_hh, bias = g.input("w_ih", (4 * 4,)), g.input("w_hh", (1, 4, 4)), g.input("bias", (1, 4))
    y = g.rnn(x, w_ih, w_hh, bias, hidden=4)
    first, second = g.backward(y, g.input("dy1", y.shape)), g.backward(y, g.input("dy2", y.shape))
    for name, t in {**{f"a_{k}": v for k, v in first.items()}, **{f"b_{k}": v for k, v in second.items()}}.items():
        g.output(name, t)
    schedule, _ = lower(g)
    reserves = {t["op"]: t["reserve"] for t in schedule["thunks"] if "reserve" in t}
    assert len([t for t in schedule["thunks"] if t["op"] == "rnn"]) == 1 and set(reserves) == {"rnn", "rnn_backward"}


def _mamba2_graph(recompute: bool, packed: bool = False):
    """A mamba2 call (three chunks of 64, the last partial; D, z and a carried state) and its gradients."""
    b, s, h, p, n = (1, 150, 2, 3, 4) if packed else (2, 150, 2, 3, 4)
    g = Graph("f64")
    x, z = g.input("x", (b, s, h, p)), g.input("z", (b, s, h, p))
    dt, a, d = g.input("dt", (b, s, h)), g.input("a", (h,)), g.input("D", (h,))
    bc = [g.input(k, (b, s, 1, n)) for k in "bc"]
    rows = 2 if packed else b
    state = g.input("state", (rows, h, p, n))
    y = g.mamba2(x, dt, a, *bc, D=d, z=z, dt_softplus=True, initial_state=state,
                 cu_seqlens=[0, 70, 150] if packed else None)
    y = y[0] if isinstance(y, tuple) else y
    loss = g.reduce_sum(g.binary("mul", y, g.input("dy", y.shape)), list(range(4)))
    for name, t in zip(["x", "dt", "a", "b", "c"], g.grad(loss, [x, dt, a, *bc], recompute=recompute)):
        g.output(f"d_{name}", t)
    rng = np.random.default_rng(1)
    values = {k: rng.standard_normal(shape) for k, shape in
              (("x", (b, s, h, p)), ("z", (b, s, h, p)), ("dt", (b, s, h)), ("b", (b, s, 1, n)), ("c", (b, s, 1, n)),
               ("state", (rows, h, p, n)), ("dy", (b, s, h, p)), ("D", (h,)))}
    values["a"] = -np.abs(rng.standard_normal(h)) - 0.1
    return g, values


@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
def test_grad_saves_a_mamba2_forward_unless_packed_or_asked_to_recompute(packed):
    outs = {}
    for recompute in (False, True):
        g, values = _mamba2_graph(recompute, packed)
        schedule, _ = lower(g)
        backward = next(t for t in schedule["thunks"] if t["op"] == "mamba2_backward")
        forwards = [t for t in schedule["thunks"] if t["op"] == "mamba2"]
        if recompute or packed:
            assert "reserve" not in backward and all("reserve" not in t for t in forwards)
        else:
            (forward,) = forwards
            assert forward["reserve"] == backward["reserve"]
            assert forward["reserve_bytes"] == rlx_gpu.reserve_bytes(forward)
        outs[recompute] = g.compile("host").run(**values)
    for name in outs[True]:
        np.testing.assert_allclose(outs[False][name], outs[True][name], rtol=1e-10, atol=1e-10, err_msg=name)


def test_grad_saves_a_selective_scan_forward_unless_asked_to_recompute():
    b, s, h, n = 2, 100, 4, 3
    rng = np.random.default_rng(2)
    values = {k: rng.standard_normal(shape) for k, shape in (("x", (b, s, h)), ("delta", (b, s, h)), ("z", (b, s, h)),
                                                             ("b", (b, s, n)), ("c", (b, s, n)), ("dy", (b, s, h)))}
    values["a"] = -np.abs(rng.standard_normal((h, n))) - 0.1
    outs = {}
    for recompute in (False, True):
        g = Graph("f64")
        t = {k: g.input(k, np.shape(v)) for k, v in values.items()}
        y = g.selective_scan(t["x"], t["delta"], t["a"], t["b"], t["c"], z=t["z"], delta_softplus=True)
        loss = g.reduce_sum(g.binary("mul", y, t["dy"]), list(range(3)))
        wrt = ["x", "delta", "a", "b", "c"]
        for name, d in zip(wrt, g.grad(loss, [t[k] for k in wrt], recompute=recompute)):
            g.output(f"d_{name}", d)
        schedule, _ = lower(g)
        backward = next(x for x in schedule["thunks"] if x["op"] == "selective_scan_backward")
        assert ("reserve" in backward) != recompute
        outs[recompute] = g.compile("host").run(**values)
    for name in outs[True]:
        np.testing.assert_allclose(outs[False][name], outs[True][name], rtol=1e-11, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_grad_saves_a_gated_delta_net_forward_unless_packed_or_asked_to_recompute(packed):
    b, s, h, hv, n = (1, 100, 2, 4, 3) if packed else (2, 70, 2, 4, 3)
    rng = np.random.default_rng(3)
    values = {k: rng.standard_normal(shape) for k, shape in (("q", (b, s, h, n)), ("k", (b, s, h, n)),
                                                             ("v", (b, s, hv, n)), ("dy", (b, s, hv, n)))}
    values.update(g=-np.abs(rng.standard_normal((b, s, hv, n))) * 0.3, beta=rng.uniform(0, 1, (b, s, hv)),
                  state=rng.standard_normal((2 if packed else b, hv, n, n)))
    outs = {}
    for recompute in (False, True):
        g = Graph("f64")
        t = {k: g.input(k, np.shape(v)) for k, v in values.items()}
        y, _ = g.gated_delta_net(t["q"], t["k"], t["v"], t["g"], t["beta"], gate_per_channel=True,
                                 initial_state=t["state"], use_qk_l2norm=True,
                                 cu_seqlens=[0, 40, 100] if packed else None)
        loss = g.reduce_sum(g.binary("mul", y, t["dy"]), list(range(4)))
        wrt = ["q", "k", "v", "g", "beta", "state"]
        for name, d in zip(wrt, g.grad(loss, [t[k] for k in wrt], recompute=recompute)):
            g.output(f"d_{name}", d)
        schedule, _ = lower(g)
        backward = next(x for x in schedule["thunks"] if x["op"] == "gated_delta_net_backward")
        assert ("reserve" in backward) == (not recompute and not packed)
        outs[recompute] = g.compile("host").run(**values)
    for name in outs[True]:
        np.testing.assert_allclose(outs[False][name], outs[True][name], rtol=1e-11, atol=1e-12, err_msg=name)
