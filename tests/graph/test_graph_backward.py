"""``Graph.backward``: one ABI.md §9 backward thunk per fused-op call, its fields taken from the forward's."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from rlx_gpu.graph.builder import Graph, GraphError
from rlx_gpu.graph.lowering import lower
from rlx_gpu.graph.torch_weights import pack_recurrent
from rlx_gpu.schedule.model import ABI_V2


def test_lstm_backward_matches_torch_autograd_with_a_partial_state_gradient():
    torch.manual_seed(0)
    b, s, i, h = 2, 4, 3, 5
    lstm = torch.nn.LSTM(i, h, batch_first=True, num_layers=2, bidirectional=True).double()
    weights = pack_recurrent(lstm)
    g = Graph("f64")
    x, h0, c0 = g.input("x", (b, s, i)), g.input("h0", (4, b, h)), g.input("c0", (4, b, h))
    dy, dh = g.input("dy", (b, s, 2 * h)), g.input("dh", (4, b, h))
    w = {k: g.input(k, np.shape(v)) for k, v in weights.items()}
    y, _, _ = g.lstm(x, w["w_ih"], w["w_hh"], w["bias"], hidden=h, num_layers=2, bidirectional=True, h0=h0, c0=c0)
    grads = g.backward(y, dy, {"h0": dh})  # c_n's gradient left out: zero
    assert list(grads) == ["x", "w_ih", "w_hh", "bias", "h0", "c0"]
    for name, t in grads.items():
        g.output(f"d_{name}", t)
    exe = g.compile("host")
    assert exe.schedule.abi == ABI_V2

    xt, h0t, c0t = (torch.randn(*shape, dtype=torch.float64, requires_grad=True)
                    for shape in ((b, s, i), (4, b, h), (4, b, h)))
    yt, (hn, _) = lstm(xt, (h0t, c0t))
    dyt, dht = torch.randn_like(yt), torch.randn_like(hn)
    ((yt * dyt).sum() + (hn * dht).sum()).backward()
    out = exe.run(x=xt.detach().numpy(), h0=h0t.detach().numpy(), c0=c0t.detach().numpy(), dy=dyt.numpy(),
                  dh=dht.numpy(), **{k: np.asarray(v) for k, v in weights.items()})
    for name, want in (("x", xt.grad), ("h0", h0t.grad), ("c0", c0t.grad)):
        np.testing.assert_allclose(out[f"d_{name}"], want.numpy(), rtol=1e-9, atol=1e-12)
    d_ih = torch.cat([p.grad.reshape(-1) for n, p in lstm.named_parameters() if n.startswith("weight_ih")])
    np.testing.assert_allclose(out["d_w_ih"].reshape(-1), d_ih.numpy(), rtol=1e-9, atol=1e-12)


def test_state_space_backward_thunk_reads_the_initial_state_and_writes_its_gradient_in_place():
    g = Graph("f32")
    x, delta = g.input("x", (1, 6, 4)), g.input("delta", (1, 6, 4))
    a, bc = g.input("a", (4, 3)), g.input("b", (1, 6, 3))
    pool, slots = g.input("pool", (5, 4, 3)), g.input("slots", (2,), "i32")
    y, _ = g.selective_scan(x, delta, a, bc, bc, D=g.input("D", (4,)), initial_state=pool, state_slots=slots,
                            cu_seqlens=np.array([0, 2, 6]))
    grads = g.backward(y, g.input("dy", (1, 6, 4)))
    assert list(grads) == ["x", "delta", "a", "b", "c", "d", "state"]
    assert grads["state"].shape == (5, 4, 3)
    for name, t in grads.items():
        g.output(f"d_{name}", t)
    schedule, _ = lower(g)
    thunk = next(t for t in schedule["thunks"] if t["op"] == "selective_scan_backward")
    assert thunk["state"] == schedule["tensors"]["pool"]["offset"]  # the caller's initial state
    assert thunk["d_state"] == schedule["tensors"]["d_state"]["offset"]
    assert thunk["state_slots"] == schedule["tensors"]["slots"]["offset"] and "d_state_slots" not in thunk
    assert schedule["abi"] == ABI_V2


def test_backward_refuses_what_it_cannot_differentiate():
    g = Graph("f32")
    x = g.input("x", (1, 3, 2))
    y = g.rnn(x, np.zeros((4, 2)), np.zeros((4, 4)), np.zeros(4), hidden=4)
    with pytest.raises(GraphError, match="no output of a lstm, gru, rnn"):
        g.backward(x * 2.0, np.zeros((1, 3, 2)))
    with pytest.raises(GraphError, match="d_state names h0, but it was given no initial state"):
        g.backward(y, np.zeros((1, 3, 4)), {"h0": np.zeros((1, 1, 4))})
    with pytest.raises(GraphError, match=r"rnn_backward: d_y .* has shape \[1, 3, 2\], expected \[1, 3, 4\]"):
        g.backward(y, np.zeros((1, 3, 2)))


def test_a_reshaped_view_of_the_output_does_not_hide_the_call_that_wrote_it():
    g = Graph("f64")
    x = g.input("x", (1, 3, 2))
    y = g.rnn(x, np.zeros((4, 2)), np.zeros((4, 4)), np.zeros(4), hidden=4)
    g.reshape(y, (3, 4))  # a later view of y's buffer
    grads = g.backward(y, np.ones((1, 3, 4)))
    assert g.nodes[-1].op == "rnn_backward" and set(grads) == {"x", "w_ih", "w_hh", "bias"}
