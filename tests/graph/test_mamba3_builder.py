"""Graph.mamba3 (ABI.md §11) through the builder: packed sequences into state slots with every optional input,
then Graph.grad through mamba3_backward (the four carried states' gradients included), on the host, against
the float64 reference; and the builder's refusals."""
from __future__ import annotations

import numpy as np
import pytest

from rlx_gpu.conformance import reference_mamba3 as ref
from rlx_gpu.errors import GraphError
from rlx_gpu.graph.builder import Graph

B, S, H, G, P, N, A = 1, 12, 4, 2, 3, 6, 2
CU, SLOTS, ENTRIES = [0, 5, 5, 12], [2, 0, 3], 4
SHAPES = dict(q=(B, S, G, N), k=(B, S, G, N), v=(B, S, H, P), adt=(B, S, H), dt=(B, S, H), trap=(B, S, H),
              angles=(B, S, H, A), q_bias=(H, N), k_bias=(H, N), d=(H,), z=(B, S, H, P))
STATE_SHAPES = dict(angle=(ENTRIES, H, A), ssm=(ENTRIES, H, P, N), k_state=(ENTRIES, H, N), v_state=(ENTRIES, H, P))


def _graph() -> Graph:
    g = Graph("f32")
    x = {f: g.input(f, shape) for f, shape in SHAPES.items()}
    pools = [g.input(f, shape) for f, shape in STATE_SHAPES.items()]
    cu, slots = g.input("cu", (len(CU),), "i32"), g.input("slots", (len(SLOTS),), "i32")
    y, finals = g.mamba3(x["q"], x["k"], x["v"], x["adt"], x["dt"], x["trap"], x["angles"], q_bias=x["q_bias"],
                         k_bias=x["k_bias"], D=x["d"], z=x["z"], initial_states=pools, cu_seqlens=cu,
                         state_slots=slots, name="m3")
    d_y = g.input("d_y", (B, S, H, P))
    wrt = list(x.values()) + pools
    for field, grad in zip(list(SHAPES) + list(STATE_SHAPES), g.grad(y, wrt, d_outputs=d_y)):
        g.output(f"d_{field}", grad)
    g.output("y", y)
    return g


def test_builder_forward_and_grad_match_the_reference():
    rng = np.random.default_rng(4)
    args = {f: rng.standard_normal(shape) for f, shape in {**SHAPES, **STATE_SHAPES, "d_y": (B, S, H, P)}.items()}
    args["adt"], args["dt"] = -np.abs(args["adt"]), np.abs(args["dt"])
    args = {k: v.astype(np.float32) for k, v in args.items()}
    out = _graph().compile("host").run(**args, cu=np.array(CU, np.int32), slots=np.array(SLOTS, np.int32))
    x = {k: v.astype(np.float64) for k, v in args.items()}
    pools = [x[f] for f in STATE_SHAPES]
    kw = dict(q_bias=x["q_bias"], k_bias=x["k_bias"], d=x["d"], z=x["z"], cu_seqlens=CU, state_slots=SLOTS)
    inputs = [x[f] for f in ("q", "k", "v", "adt", "dt", "trap", "angles")]
    y, finals = ref.mamba3(*inputs, states=pools, **kw)
    grads = ref.mamba3_backward(*inputs, x["d_y"], states=pools, d_states=[np.zeros_like(p) for p in pools], **kw)
    tol = dict(rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(out["y"], y, **tol)
    for field, final in zip(ref.STATES, finals):
        np.testing.assert_allclose(out[f"m3.{field}"], final, **tol, err_msg=field)
    names = dict(zip(STATE_SHAPES, ref.STATES))
    for field in list(SHAPES) + list(STATE_SHAPES):
        np.testing.assert_allclose(out[f"d_{field}"], grads[f"d_{names.get(field, field)}"], **tol, err_msg=field)


def test_the_builder_refuses_groups_that_do_not_divide_the_heads_and_a_short_state_tuple():
    g = Graph("f32")
    q, v = g.input("q", (1, 4, 3, 6)), g.input("v", (1, 4, 4, 2))
    step = [g.input(f, (1, 4, 4)) for f in ("adt", "dt", "trap")]
    angles = g.input("angles", (1, 4, 4, 2))
    with pytest.raises(GraphError, match="3 groups of q"):
        g.mamba3(q, q, v, *step, angles)
    q2 = g.input("q2", (1, 4, 2, 6))
    with pytest.raises(GraphError, match="expected 4"):
        g.mamba3(q2, q2, v, *step, angles, initial_states=[np.zeros((1, 4, 2))])
