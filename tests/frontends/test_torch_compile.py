"""rlx_gpu.torch under torch.compile, torch.export and torch.library.opcheck.

Every function and module compiles with ``fullgraph=True`` (a graph break raises) on the backends
``eager``, ``aot_eager`` and ``inductor``, forward and backward, to the eager results; every
``torch.ops.rlx_gpu`` op passes ``opcheck`` (schema, fake tensors, autograd registration, AOT
dispatch); an exported LSTM model and a Mamba-2 block run to the eager outputs; a decode loop
compiles whole.
"""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import rlx_gpu.torch as rt
from rlx_gpu.torch.library import NAMESPACE

from support.torch_devices import device, host  # noqa: F401  (fixtures)

B, L, D, N, H, P, G, K = 2, 5, 4, 3, 4, 3, 2, 4


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_()


def _cases() -> dict[str, tuple[Callable[..., Any], tuple[torch.Tensor, ...]]]:
    """name -> (a function of tensors calling rlx_gpu.torch, its tensors), each tensor a fresh leaf."""
    torch.manual_seed(0)
    u, delta, z = torch.randn(B, D, L), torch.rand(B, D, L), torch.randn(B, D, L)
    x, dt = torch.randn(B, L, H, P), torch.rand(B, L, H)
    q, v = torch.randn(B, L, H, K), torch.randn(B, L, H, K)
    k = F.normalize(torch.randn(B, L, H, K), dim=-1)
    cases: dict[str, tuple[Callable[..., Any], tuple[torch.Tensor, ...]]] = {
        "selective_scan_fn": (
            lambda u, delta, A, Bm, Cm, Dv, z, bias: rt.selective_scan_fn(
                u, delta, A, Bm, Cm, Dv, z, bias, delta_softplus=True, return_last_state=True),
            (u, delta, -torch.rand(D, N), torch.randn(B, N, L), torch.randn(B, N, L), torch.randn(D), z,
             torch.randn(D))),
        "mamba_chunk_scan_combined": (
            lambda x, dt, A, Bm, Cm, Dv, z, bias, s0: rt.mamba_chunk_scan_combined(
                x, dt, A, Bm, Cm, 4, D=Dv, z=z, dt_bias=bias, initial_states=s0, dt_softplus=True,
                return_final_states=True),
            (x, dt, -torch.rand(H), torch.randn(B, L, G, N), torch.randn(B, L, G, N), torch.randn(H),
             torch.randn(B, L, H, P), torch.randn(H), torch.randn(B, H, P, N))),
        "mamba_chunk_scan_combined seq_idx": (  # packed sequences: a size known only when the op runs
            lambda x, dt, A, Bm, Cm, s0: rt.mamba_chunk_scan_combined(
                x, dt, A, Bm, Cm, 4, initial_states=s0, seq_idx=torch.tensor([[0, 0, 1, 1, 1], [2, 2, 2, 3, 3]]),
                return_final_states=True),
            (x, dt, -torch.rand(H), torch.randn(B, L, G, N), torch.randn(B, L, G, N), torch.randn(B, H, P, N))),
        "chunk_gated_delta_rule": (
            lambda q, k, v, g, beta, s0: rt.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0,
                                                                   output_final_state=True),
            (q, k, v, -torch.rand(B, L, H), torch.rand(B, L, H), torch.randn(B, H, K, K))),
        "fused_recurrent_gated_delta_rule": (
            lambda q, k, v, g, beta, s0: rt.fused_recurrent_gated_delta_rule(
                q, k, v, g=g, beta=beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True),
            (q, k, v, -torch.rand(B, L, H), torch.rand(B, L, H), torch.randn(B, H, K, K))),
        "chunk_kda": (
            lambda q, k, v, g, beta: rt.chunk_kda(q, k, v, g, beta, output_final_state=True),
            (q, k, v, -torch.rand(B, L, H, K), torch.rand(B, L, H))),
    }
    for name, cls, kwargs in (("LSTM", rt.LSTM, dict(proj_size=2, num_layers=2, bidirectional=True)),
                              ("GRU", rt.GRU, dict(num_layers=2)), ("RNN", rt.RNN, dict(nonlinearity="relu"))):
        module = cls(3, 4, batch_first=True, **kwargs)
        cases[name] = (lambda xs, m=module: m(xs), (torch.randn(B, L, 3),))
    return {name: (fn, tuple(_leaf(t) for t in tensors)) for name, (fn, tensors) in cases.items()}


CASES = list(_cases())


def _flat(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _flat(o)] if isinstance(out, (tuple, list)) else []


def _run(fn: Callable[..., Any], tensors: tuple[torch.Tensor, ...]) -> tuple[list[torch.Tensor], list[Any]]:
    """The outputs and the gradients of every tensor and parameter after a weighted sum of the outputs."""
    leaves = tuple(_leaf(t) for t in tensors)
    outs = _flat(fn(*leaves))
    params = [p for p in getattr(fn, "__defaults__", None) or () if isinstance(p, torch.nn.Module)]
    for m in params:
        m.zero_grad()
    loss = sum((o * torch.linspace(-1, 1, o.numel()).reshape(o.shape)).sum() for o in outs)
    loss.backward()
    grads = [t.grad for t in leaves] + [p.grad for m in params for p in m.parameters()]
    return [o.detach() for o in outs], grads


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
@pytest.mark.parametrize("name", CASES)
def test_fullgraph_compile_forward_and_backward_equal_eager(name, backend, host):
    fn, tensors = _cases()[name]
    expected = _run(fn, tensors)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, fullgraph=True)  # a graph break raises
    got = _run(_with_defaults(compiled, fn), tensors)
    for a, b in zip(got[0] + got[1], expected[0] + expected[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _with_defaults(compiled: Callable[..., Any], fn: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled`` carrying ``fn``'s defaults (a module's case binds its module as one), so ``_run`` finds
    the parameters to read gradients of."""
    def call(*tensors: torch.Tensor) -> Any:
        return compiled(*tensors)
    call.__defaults__ = fn.__defaults__
    return call


@pytest.mark.parametrize("name", ["selective_scan_fn", "mamba_chunk_scan_combined", "chunk_gated_delta_rule", "LSTM"])
def test_each_op_family_compiles_on_opencl(name, device):
    fn, tensors = _cases()[name]
    expected = _run(fn, tensors)
    torch._dynamo.reset()
    got = _run(_with_defaults(torch.compile(fn, backend="aot_eager", fullgraph=True), fn), tensors)
    for a, b in zip(got[0] + got[1], expected[0] + expected[1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def _op_samples() -> dict[str, tuple[Any, ...]]:
    """One sample argument tuple per registered op, captured from the calls the cases make."""
    samples: dict[str, tuple[Any, ...]] = {}
    for name, (fn, tensors) in _cases().items():
        with _Capture(samples):
            outs = _flat(fn(*tensors))
            sum(o.sum() for o in outs).backward()
    decode = torch.randn(3, H, P, N)
    with _Capture(samples):
        rt.selective_state_update(decode, torch.randn(2, H, P), torch.rand(2, H, P), -torch.rand(H, P, N),
                                  torch.randn(2, G, N), torch.randn(2, G, N), D=torch.randn(H, P), dt_softplus=True,
                                  state_batch_indices=torch.tensor([2, 0], dtype=torch.int32))
    return samples


class _Capture(TorchDispatchMode):
    """Records the first arguments each ``torch.ops.rlx_gpu`` op is called with (the backward ops inside
    autograd's backward pass included)."""

    def __init__(self, into: dict[str, tuple[Any, ...]]):
        super().__init__()
        self.into = into

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.OpOverload) and func.namespace == NAMESPACE:
            self.into.setdefault(func._opname, tuple(_detached(a) for a in args))
        return func(*args, **(kwargs or {}))


def _detached(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return a.detach().clone()
    return [_detached(t) for t in a] if isinstance(a, list) else a


def _fresh(a: Any, grad: bool) -> Any:
    """A copy of a sample argument, floating tensors requiring grad where ``grad``."""
    if isinstance(a, torch.Tensor):
        return a.clone().requires_grad_(grad and a.is_floating_point())
    return [_fresh(t, grad) for t in a] if isinstance(a, list) else a


OPS = ["selective_scan", "mamba2", "gated_delta_net", "lstm", "gru", "rnn", "selective_state_update", "packed_rows"]
#: The ops without a gradient (nothing to differentiate, or not differentiable, as mamba_ssm's decode step).
NOT_DIFFERENTIABLE = ("selective_state_update", "packed_rows")


def test_every_registered_op_is_exercised_here():
    registered = {name for name in dir(getattr(torch.ops, NAMESPACE)) if not name.startswith("_")}
    expected = set(OPS) | {f"{op}_backward" for op in OPS if op not in NOT_DIFFERENTIABLE}
    assert expected <= registered and set(_op_samples()) == expected


@pytest.mark.parametrize("op", OPS + [f"{op}_backward" for op in OPS if op not in NOT_DIFFERENTIABLE])
def test_opcheck_passes_for_every_op(op, host):
    differentiable = not op.endswith("_backward") and op not in NOT_DIFFERENTIABLE
    args = tuple(_fresh(a, differentiable) for a in _op_samples()[op])
    torch.library.opcheck(getattr(getattr(torch.ops, NAMESPACE), op).default, args)


@pytest.mark.parametrize("pool", [False, True], ids=["state", "state_batch_indices"])
def test_a_decode_loop_compiles_whole_and_keeps_the_state_in_place(pool, host):
    """A Mamba-2 block's decode step compiled whole, its state updated in place: the batch's own state, or
    rows of a pool named by ``state_batch_indices`` (a tensor the op reads itself, so tracing never needs
    its values)."""
    torch.manual_seed(3)
    A, Dv, bias = -torch.rand(H), torch.randn(H), torch.randn(H)
    steps = [(torch.randn(B, H, P), torch.rand(B, H), torch.randn(B, G, N), torch.randn(B, G, N)) for _ in range(4)]
    slots = torch.tensor([2, 0], dtype=torch.int32) if pool else None

    def step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, Bm: torch.Tensor, Cm: torch.Tensor) -> torch.Tensor:
        # per-head parameters broadcast along head_dim as stride-0 views, as the block passes them
        return rt.selective_state_update(state, x, dt[..., None].expand(B, H, P), A[:, None, None].expand(H, P, N),
                                         Bm, Cm, D=Dv[:, None].expand(H, P), dt_bias=bias[:, None].expand(H, P),
                                         dt_softplus=True, state_batch_indices=slots)

    compiled = torch.compile(step, backend="inductor", fullgraph=True)
    rows = 3 if pool else B
    eager_state, compiled_state = torch.zeros(rows, H, P, N), torch.zeros(rows, H, P, N)
    for args in steps:
        torch.testing.assert_close(compiled(compiled_state, *args), step(eager_state, *args))
    torch.testing.assert_close(compiled_state, eager_state)
    assert eager_state.abs().sum() > 0 and (not pool or eager_state[1].abs().sum() == 0)  # row 1: no slot names it


class _Mamba2Block(torch.nn.Module):
    """A Mamba-2 mixer's core: projections around ``mamba_chunk_scan_combined``."""

    def __init__(self) -> None:
        super().__init__()
        self.in_proj = torch.nn.Linear(8, H * P + 2 * G * N + H)
        self.A_log = torch.nn.Parameter(torch.rand(H))
        self.D = torch.nn.Parameter(torch.randn(H))
        self.out = torch.nn.Linear(H * P, 8)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        b, length, _ = hidden.shape
        x, Bm, Cm, dt = torch.split(self.in_proj(hidden), [H * P, G * N, G * N, H], dim=-1)
        y = rt.mamba_chunk_scan_combined(x.reshape(b, length, H, P), dt, -torch.exp(self.A_log),
                                         Bm.reshape(b, length, G, N), Cm.reshape(b, length, G, N), 4, D=self.D,
                                         dt_softplus=True)
        return self.out(y.reshape(b, length, H * P))


# export puts its own parameters in _parameters; the forward makes _flat_weights of them, as torch.nn.LSTM's does
# (torch warns of the attribute for both; the parameters are the program's, as torch.nn.LSTM's are)
@pytest.mark.filterwarnings("ignore:The tensor attributes self._flat_weights:UserWarning")
@pytest.mark.parametrize("kind", ["lstm", "mamba2"])
def test_torch_export_runs_the_exported_program_to_the_eager_outputs(kind, host):
    torch.manual_seed(4)
    model = rt.LSTM(3, 5, num_layers=2, batch_first=True) if kind == "lstm" else _Mamba2Block()
    x = torch.randn(2, 6, 3 if kind == "lstm" else 8)
    exported = torch.export.export(model, (x,))
    assert any(n.op == "call_function" and str(n.target).startswith(f"{NAMESPACE}.")
               for n in exported.graph.nodes)
    with torch.no_grad():
        for a, b in zip(_flat(exported.module()(x)), _flat(model(x))):
            torch.testing.assert_close(a, b)
