"""Graph.causal_conv1d (ABI.md §10) through the builder: packed sequences into slots, then Graph.grad through
causal_conv1d_backward (the carried state's gradient included), on the host and the tested OpenCL devices,
against the float64 reference; and the device planner's refusal of a state wider than the compute type."""
from __future__ import annotations

import numpy as np
import pytest

from rlx_gpu import launches
from rlx_gpu.conformance import reference_conv as ref
from rlx_gpu.graph.builder import Graph
from rlx_gpu.launches.limits import DeviceLimits
from support.conformance_devices import KERNEL_OPENCL

DIM, WIDTH, CU, SLOTS = 5, 4, [0, 2, 2, 9], [2, 0, 3]
LIMITS = DeviceLimits(1024, 48 << 10, True, target="cpu")


def _graph(activation: str | None) -> Graph:
    g = Graph("f32")
    x, w, b = g.input("x", (1, 9, DIM)), g.input("w", (DIM, WIDTH)), g.input("b", (DIM,))
    pool, cu, slots = g.input("pool", (4, DIM, WIDTH - 1)), g.input("cu", (4,), "i32"), g.input("slots", (3,), "i32")
    y, final = g.causal_conv1d(x, w, bias=b, activation=activation, initial_state=pool, cu_seqlens=cu,
                               state_slots=slots, name="conv")
    d_y = g.input("d_y", (1, 9, DIM))
    for field, grad in zip(("x", "w", "b", "pool"), g.grad(y, [x, w, b, pool], d_outputs=d_y)):
        g.output(f"d_{field}", grad)
    g.output("y", y)
    return g


@pytest.mark.parametrize("device", ["host", *KERNEL_OPENCL])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_builder_forward_and_grad_match_the_reference(device, activation):
    rng = np.random.default_rng(3)
    x, w, b = rng.standard_normal((1, 9, DIM)), rng.standard_normal((DIM, WIDTH)), rng.standard_normal(DIM)
    pool, d_y = rng.standard_normal((4, DIM, WIDTH - 1)), rng.standard_normal((1, 9, DIM))
    args = {k: v.astype(np.float32) for k, v in dict(x=x, w=w, b=b, pool=pool, d_y=d_y).items()}
    out = _graph(activation).compile(device).run(**args, cu=np.array(CU, np.int32), slots=np.array(SLOTS, np.int32))
    inputs = {k: v.astype(np.float64) for k, v in args.items()}
    kw = dict(bias=inputs["b"], activation=activation or "none", cu_seqlens=CU, state_slots=SLOTS)
    y, final = ref.causal_conv1d(inputs["x"], inputs["w"], state=inputs["pool"].copy(), **kw)
    grads = ref.causal_conv1d_backward(inputs["x"], inputs["w"], inputs["d_y"], state=inputs["pool"],
                                       d_state=np.zeros_like(pool), **kw)
    tol = dict(rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(out["y"], y, **tol)
    np.testing.assert_allclose(out["conv.state"], final, **tol)
    for field, want in (("x", "d_x"), ("w", "d_weight"), ("b", "d_bias"), ("pool", "d_state")):
        np.testing.assert_allclose(out[f"d_{field}"], grads[want], **tol, err_msg=field)


def test_a_state_wider_than_the_compute_type_runs_on_the_host():
    thunk = dict(op="causal_conv1d", dtype="f32", x=0, weight=0, dst=0, batch=1, seq=2, dim=3, width=2,
                 carry_state=True, state=0, state_dtype="f64")
    reason = launches.unsupported(thunk, LIMITS)
    assert reason and "state_dtype='f64'" in reason
    assert launches.unsupported(dict(thunk, state_dtype="f32"), LIMITS) is None
