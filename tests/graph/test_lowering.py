"""Lowering: a carried state that is a top-level input read by nothing else is updated in place
(no copy thunk), and the results stay those of torch.nn.GRU step by step."""
from __future__ import annotations

import numpy as np
import torch

from rlx_gpu.graph.builder import Graph
from rlx_gpu.graph.torch_weights import pack_recurrent


def _decode_graph(model: torch.nn.GRU, also_output_h0: bool = False) -> Graph:
    g = Graph("f32")
    x, h0 = g.input("x", (1, 1, 4)), g.input("h0", (1, 1, 3))
    y, _ = g.gru(x, **pack_recurrent(model), hidden=3, h0=h0, name="gru")  # outputs gru.h_n itself
    g.output("y", y)
    if also_output_h0:
        g.output("h0_again", h0)
    return g


def test_a_carried_state_input_is_updated_in_place_and_decodes_like_torch():
    torch.manual_seed(0)
    model = torch.nn.GRU(4, 3, batch_first=True)
    exe = _decode_graph(model).compile("host")
    assert [t.op for t in exe.schedule.thunks] == ["gru"]
    assert exe.schedule.tensors["h0"].offset == exe.schedule.tensors["gru.h_n"].offset
    h = np.zeros((1, 1, 3), np.float32)
    th = torch.zeros(1, 1, 3)
    for _ in range(3):
        x = torch.randn(1, 1, 4)
        out = exe.run(x=x.numpy(), h0=h)
        with torch.no_grad():
            ty, th = model(x, th)
        np.testing.assert_allclose(out["y"], ty.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out["gru.h_n"], th.numpy(), rtol=1e-5, atol=1e-6)
        h = out["gru.h_n"]


def test_an_input_that_is_read_again_keeps_its_copy():
    model = torch.nn.GRU(4, 3, batch_first=True)
    exe = _decode_graph(model, also_output_h0=True).compile("host")
    assert [t.op for t in exe.schedule.thunks] == ["copy", "gru", "copy"]
    h0 = np.full((1, 1, 3), 0.25, np.float32)
    out = exe.run(x=np.ones((1, 1, 4), np.float32), h0=h0)
    np.testing.assert_array_equal(out["h0_again"], h0)  # the caller's state is intact
