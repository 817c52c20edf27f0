"""The recurrent backward ops (ABI.md §9) on an OpenCL CPU implementation at both kernel targets: kernels/rnn_backward.cl.

Each op runs once with every optional field of the catalog's combined-field cases (``support.rnn_fields``)
at once (the representative program variants that NVRTC and ptxas check), against the conformance suite's float64 reference (a step-by-step
reverse written from ABI.md) and the host; the same thunk run twice gives the same bytes; a NaN in ``d_dst``
stays causal. Every recurrent backward case of the conformance catalog has a device kernel at both targets.
"""
from __future__ import annotations

import numpy as np
import pytest

from host_fallback.abi import BACKWARD, complete
from rlx_gpu import launches
from rlx_gpu.conformance import catalog, runner
from rlx_gpu.conformance.catalog import Case
from rlx_gpu.launches.limits import REFERENCE_GPU, RNN_FIELD_VARIANTS, DeviceLimits
from rlx_gpu.runtime.config import default_config_path, load_config
from support.rnn_fields import BACKWARD_FIELDS, RECURRENT
from support.opencl_cpu import OPENCL_CPU, needs_opencl_cpu, passes_and_runs_the_same_bytes_twice

CONFIG = load_config(default_config_path())


@pytest.mark.parametrize("lim", [REFERENCE_GPU, DeviceLimits(1024, 1 << 20, True)], ids=["gpu", "cpu"])
def test_every_recurrent_backward_case_of_the_catalog_has_a_device_kernel(lim):
    backward = [c for c in catalog.cases() if BACKWARD.get(c.op) in RECURRENT and not c.refused]
    assert {c.op for c in backward} == {f"{op}_backward" for op in RECURRENT}
    assert any("reserve" in case.params for case in backward)  # the saved forward's cases (ABI.md §9.1) too
    for case in backward:
        assert launches.unsupported(complete(runner.lay_out(case).thunk), lim) is None, case.id


def test_the_cases_build_the_representative_variants():
    """The backward programs ptxas and NVRTC check (RNN_FIELD_VARIANTS) are the ones these cases run."""
    built = set()
    for op, params in BACKWARD_FIELDS.values():
        plan = launches.plan(runner.lay_out(Case(op, "f32", params)).thunk, REFERENCE_GPU)
        built |= {launch.defines for launch in plan.launches if launch.family == "rnn_backward"}
    assert built == set(RNN_FIELD_VARIANTS)


@needs_opencl_cpu
@pytest.mark.parametrize("op", RECURRENT)
def test_every_field_at_once_matches_the_float64_reverse_and_runs_the_same_bytes_twice(cpu_session, host, op):
    name, params = BACKWARD_FIELDS[op]
    case = Case(name, "f32", params, seed=4)
    laid, run = passes_and_runs_the_same_bytes_twice(cpu_session, host, case)
    assert not np.array_equal(run, laid)


@needs_opencl_cpu
def test_a_nan_gradient_stays_causal_with_every_field(cpu_session, host):
    """A NaN in d_dst at step 2 of row 0 (bidirectional, lengths, projection): NaN exactly where the float64
    reverse has it, i.e. row 0's inputs and every weight gradient, and no other row's d_x or d_h0."""
    name, params = BACKWARD_FIELDS["lstm"]
    case = Case(name, "f32", params, poison="d_dst", poison_step=2, poison_value=float("nan"), seed=5)
    outcome = runner.check(cpu_session, case, CONFIG, host)
    assert outcome.status == "pass", outcome.message
    laid = runner.lay_out(case)
    arena = cpu_session.upload(laid.arena)
    cpu_session.launch(laid.thunk, arena)
    got = cpu_session.read(arena, 0, laid.arena.size)
    d_x = laid.view(got, "d_x").reshape(params["batch"], params["seq"], -1)
    assert np.isnan(d_x[0]).any() and np.isfinite(d_x[1:]).all()


@needs_opencl_cpu
@pytest.mark.parametrize("recompute", [False, True], ids=["reserve", "recompute"])
def test_graph_backward_of_a_gru_on_the_device_matches_torch_autograd(recompute):
    """Graph.backward's gru and gru_backward thunks placed on an OpenCL CPU device (its own target), with the saved
    forward Graph.backward gives them by default or recomputing, f32, against torch autograd of nn.GRU in float64,
    with the final state's gradient."""
    import torch

    from rlx_gpu.graph.builder import Graph
    from rlx_gpu.graph.torch_weights import pack_recurrent

    torch.manual_seed(0)
    b, s, i, h = 3, 5, 4, 6
    gru = torch.nn.GRU(i, h, batch_first=True, num_layers=2, bidirectional=True).double()
    weights = pack_recurrent(gru)
    g = Graph("f32")
    x, h0, dy, dh = g.input("x", (b, s, i)), g.input("h0", (4, b, h)), g.input("dy", (b, s, 2 * h)), g.input("dh", (4, b, h))
    w = {k: g.input(k, np.shape(v)) for k, v in weights.items()}
    y, _ = g.gru(x, w["w_ih"], w["w_hh"], w["b_ih"], w["b_hh"], hidden=h, num_layers=2, bidirectional=True, h0=h0)
    for name, grad in g.backward(y, dy, {"h0": dh}, recompute=recompute).items():
        g.output(f"d_{name}", grad)
    exe = g.compile(OPENCL_CPU[0])
    placed = [p for p in exe.device.place(exe.schedule) if p.op in ("gru", "gru_backward")]
    assert len(placed) == 2 and {p.backend for p in placed} == {"opencl"}
    recurrent = [t for t in exe.schedule.thunks if t["op"] in ("gru", "gru_backward")]
    assert all((t.get("reserve") is not None) != recompute for t in recurrent)

    xt, h0t = (torch.randn(*shape, dtype=torch.float64, requires_grad=True) for shape in ((b, s, i), (4, b, h)))
    yt, hn = gru(xt, h0t)
    dyt, dht = torch.randn_like(yt), torch.randn_like(hn)
    ((yt * dyt).sum() + (hn * dht).sum()).backward()
    f32 = {k: np.asarray(v, np.float32) for k, v in weights.items()}
    out = exe.run(x=xt.detach().numpy().astype(np.float32), h0=h0t.detach().numpy().astype(np.float32),
                  dy=dyt.numpy().astype(np.float32), dh=dht.numpy().astype(np.float32), **f32)
    np.testing.assert_allclose(out["d_x"], xt.grad.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out["d_h0"], h0t.grad.numpy(), rtol=1e-4, atol=1e-5)
    d_hh = torch.stack([p.grad for n, p in gru.named_parameters() if n.startswith("weight_hh")])
    np.testing.assert_allclose(out["d_w_hh"], d_hh.numpy(), rtol=1e-4, atol=1e-5)
