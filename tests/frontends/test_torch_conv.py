"""rlx_gpu.torch.causal_conv1d_fn / causal_conv1d_update (Dao-AILab causal-conv1d's signatures and layouts,
ABI.md §10) against a torch reference written here (a depthwise F.conv1d padded by width-1, then silu): outputs,
final states, gradients (initial states included), seq_idx, a cache of any state_len with slots, and
torch.compile(fullgraph=True) of causal_conv1d_fn."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from rlx_gpu.runtime.registry import status  # noqa: E402
from rlx_gpu.torch import causal_conv1d_fn, causal_conv1d_update  # noqa: E402


def reference(x, weight, bias=None, initial_states=None, activation=None):
    """``(out, final_states)``: x (batch, dim, seqlen), the inputs extended by initial_states or zeros."""
    dim, width = weight.shape
    padded = (F.pad(x, (width - 1, 0)) if initial_states is None
              else torch.cat([initial_states.to(x.dtype), x], dim=-1))
    out = F.conv1d(padded, weight.unsqueeze(1), bias, groups=dim)
    out = F.silu(out) if activation in ("silu", "swish") else out
    return out, padded[..., -(width - 1):]


def _inputs(batch, dim, seqlen, width, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype)  # noqa: E731
    return make(batch, dim, seqlen), make(dim, width), make(dim), make(batch, dim, width - 1)


@pytest.mark.parametrize("width,activation,with_bias,with_state", [(2, None, False, False), (4, "silu", True, True),
                                                                   (8, "swish", True, True), (3, None, False, True)])
def test_fn_forward_final_states_and_gradients(width, activation, with_bias, with_state):
    x, w, b, s = _inputs(2, 3, 5, width, seed=width)
    b = b if with_bias else None
    leaves = [t.requires_grad_() for t in (x, w, *(b,) * with_bias, *(s,) * with_state)]
    out, final = causal_conv1d_fn(x, w, b, initial_states=s if with_state else None, return_final_states=True,
                                  activation=activation)
    want, want_final = reference(x, w, b, s if with_state else None, activation)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(final, want_final)
    d_out, d_final = torch.randn_like(out), torch.randn_like(final)
    got = torch.autograd.grad((out * d_out).sum() + (final * d_final).sum(), leaves)
    expected = torch.autograd.grad((want * d_out).sum() + (want_final * d_final).sum(), leaves)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


def test_fn_f32_channel_last_view_and_final_states_out():
    x, w, b, _ = _inputs(2, 6, 7, 4, torch.float32)
    x = x.transpose(1, 2).contiguous().transpose(1, 2)  # (batch, dim, seqlen) with dim the fastest axis
    into = torch.empty(2, 6, 3)
    out, final = causal_conv1d_fn(x, w, b, return_final_states=True, final_states_out=into, activation="silu")
    want, want_final = reference(x, w, b, activation="silu")
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert final is into
    torch.testing.assert_close(into, want_final)


def test_fn_seq_idx_restarts_at_every_change():
    x, w, b, _ = _inputs(2, 3, 8, 4)
    seq_idx = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 2, 2, 2]], dtype=torch.int32)
    out = causal_conv1d_fn(x, w, b, seq_idx=seq_idx)
    for r in range(2):
        for k in seq_idx[r].unique():
            cols = (seq_idx[r] == k).nonzero().reshape(-1)
            part = x[r:r + 1, :, cols]
            torch.testing.assert_close(out[r:r + 1, :, cols], reference(part, w, b)[0])


def test_fn_compiles_without_breaks():
    x, w, b, s = _inputs(2, 4, 6, 4, torch.float32)
    compiled = torch.compile(lambda *a: causal_conv1d_fn(*a, initial_states=s, activation="silu"), fullgraph=True,
                             backend="eager")
    torch.testing.assert_close(compiled(x, w, b), reference(x, w, b, s, "silu")[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("state_len,seqlen", [(3, None), (4, None), (6, 2)])
def test_update_shifts_the_whole_cache_through_slots(state_len, seqlen):
    width, dim = 4, 5
    x, w, b, _ = _inputs(2, dim, seqlen or 1, width, seed=state_len)
    x = x[..., 0] if seqlen is None else x
    cache = torch.randn(4, dim, state_len, dtype=torch.float64)
    slots = torch.tensor([3, 1], dtype=torch.int32)
    before = cache.clone()
    out = causal_conv1d_update(x, cache, w, b, activation="silu", conv_state_indices=slots)
    steps = x.unsqueeze(-1) if seqlen is None else x
    want, _ = reference(steps, w, b, before[slots.long()][..., -(width - 1):], "silu")
    torch.testing.assert_close(out, want.squeeze(-1) if seqlen is None else want)
    shifted = torch.cat([before[slots.long()], steps], dim=-1)[..., -state_len:]
    torch.testing.assert_close(cache[slots.long()], shifted)
    torch.testing.assert_close(cache[[0, 2]], before[[0, 2]])  # entries not named stay


def test_update_refuses_a_ring_buffer():
    x, w, _, s = _inputs(2, 3, 1, 4)
    with pytest.raises(NotImplementedError, match="cache_seqlens"):
        causal_conv1d_update(x[..., 0], s, w, cache_seqlens=torch.tensor([1, 2]))


def test_update_refuses_a_pool_index_outside_the_pool_or_named_twice_naming_the_argument():
    x, pool, weight = torch.randn(2, 4), torch.randn(3, 4, 3), torch.randn(4, 4)
    before = pool.clone()
    with pytest.raises(IndexError, match=r"conv_state_indices\[0\] = 5 is outside the state pool of 3 entries"):
        causal_conv1d_update(x, pool, weight, conv_state_indices=torch.tensor([5, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"conv_state_indices\[0\] and \[1\] both name state entry 1"):
        causal_conv1d_update(x, pool, weight, conv_state_indices=torch.tensor([1, 1], dtype=torch.int32))
    assert torch.equal(pool, before)  # nothing written


@pytest.mark.parametrize("state_len,seqlen,dtype", [(3, 1, torch.float64), (4, 1, torch.float32), (5, 7, torch.float64),
                                                    (4, 2, torch.bfloat16)])
@pytest.mark.parametrize("device", ["host", "opencl"])
def test_update_is_one_op_on_the_whole_pool(state_len, seqlen, dtype, device, monkeypatch):
    """torch.ops.rlx_gpu.causal_conv1d_update alone (no torch op around it) takes the pool and the slots; entries
    not named stay as they were, bit for bit, whatever the cache's dtype; on the host and on OpenCL."""
    if device == "opencl" and not status("opencl").available:
        pytest.fail(f"OpenCL is unavailable: {status('opencl').reason}")
    monkeypatch.setenv("RLX_DEVICE", device)
    width, dim = 4, 5
    x, w, b, _ = _inputs(3, dim, seqlen, width, seed=seqlen)
    x, w, b = x.to(dtype), w.to(dtype), b.to(dtype)
    cache = torch.randn(6, dim, state_len, dtype=torch.float32, generator=torch.Generator().manual_seed(state_len))
    slots = torch.tensor([4, 0, 2])
    before = cache.clone()
    with torch.profiler.profile() as prof:
        out = causal_conv1d_update(x, cache, w, b, activation="silu", conv_state_indices=slots)
    aten = {e.name for e in prof.events() if e.name.startswith("aten::")}
    assert "aten::index" not in aten and "aten::index_put_" not in aten  # nothing gathered or scattered by torch
    window = before[slots][..., -(width - 1):].to(dtype)
    want, _ = reference(x.double(), w.double(), b.double(), window.double(), "silu")
    tol = {torch.bfloat16: dict(rtol=2e-2, atol=2e-2), torch.float32: dict(rtol=1e-5, atol=1e-5)}.get(dtype, {})
    torch.testing.assert_close(out.double(), want, **tol)
    shifted = torch.cat([before[slots], x.to(cache.dtype)], dim=-1)[..., -state_len:]
    torch.testing.assert_close(cache[slots], shifted, rtol=0, atol=0)
    assert torch.equal(cache[[1, 3, 5]], before[[1, 3, 5]])


def test_update_compiles_without_breaks_and_writes_the_cache():
    x, w, b, _ = _inputs(2, 4, 1, 4, torch.float32)
    cache = torch.randn(3, 4, 4)
    want_cache = cache.clone()
    want = causal_conv1d_update(x[..., 0], want_cache, w, b, "silu", conv_state_indices=torch.tensor([2, 0]))
    compiled = torch.compile(lambda *a: causal_conv1d_update(*a, activation="silu",
                                                             conv_state_indices=torch.tensor([2, 0])),
                             fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x[..., 0], cache, w, b), want)
    torch.testing.assert_close(cache, want_cache)


def test_update_op_passes_opcheck():
    """Schema (the cache written in place), fake implementation and AOT tracing of rlx_gpu::causal_conv1d_update."""
    x, w, b, _ = _inputs(2, 4, 1, 4, torch.float32)
    args = (torch.randn(3, 4, 4), x[..., 0], w, b, "silu", torch.tensor([2, 0], dtype=torch.int32))
    torch.library.opcheck(torch.ops.rlx_gpu.causal_conv1d_update.default, args)


def _segments(row_idx):
    """The column indices of each run of equal values of one row's seq_idx, in order."""
    return [(row_idx == k).nonzero().reshape(-1) for k in row_idx.unique()]


def test_fn_seq_idx_compiles_without_breaks_with_states_and_gradients():
    """seq_idx with initial and final states (a row's initial state feeds its first sequence, its final state
    is its last sequence's), under torch.compile(fullgraph=True): outputs, final states and every gradient
    against the reference run sequence by sequence in float64."""
    x, w, b, s = _inputs(2, 3, 8, 4, torch.float32)
    seq_idx = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 2, 2, 2]], dtype=torch.int32)
    compiled = torch.compile(lambda *a: causal_conv1d_fn(*a[:3], seq_idx=a[3], initial_states=a[4],
                                                         return_final_states=True, activation="silu"),
                             fullgraph=True, backend="eager")
    leaves = [t.clone().requires_grad_() for t in (x, w, b, s)]
    out, final = compiled(*leaves[:3], seq_idx, leaves[3])
    ref = [t.double().requires_grad_() for t in (x, w, b, s)]
    outs, finals = [], []
    for r in range(2):
        parts = []
        for k, cols in enumerate(_segments(seq_idx[r])):
            part, part_final = reference(ref[0][r:r + 1, :, cols], ref[1], ref[2],
                                         ref[3][r:r + 1] if k == 0 else None, "silu")
            parts.append(part)
        outs.append(torch.cat(parts, dim=-1))
        finals.append(part_final)
    want, want_final = torch.cat(outs), torch.cat(finals)
    torch.testing.assert_close(out, want.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, want_final.float())
    d_out, d_final = torch.randn_like(out), torch.randn_like(final)
    ((out * d_out).sum() + (final * d_final).sum()).backward()
    ((want * d_out.double()).sum() + (want_final * d_final.double()).sum()).backward()
    for got, expected in zip(leaves, ref):
        torch.testing.assert_close(got.grad, expected.grad.float(), rtol=1e-4, atol=1e-4)


def test_fn_refuses_a_decreasing_seq_idx_naming_itself():
    x, w, _, _ = _inputs(1, 3, 4, 4)
    with pytest.raises(NotImplementedError, match=r"causal_conv1d_fn: seq_idx falls from 1 to 0 at \[0, 2\]"):
        causal_conv1d_fn(x, w, seq_idx=torch.tensor([[0, 1, 0, 0]], dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("state_len", [3, 4])
def test_a_decode_loop_on_the_hot_path_shifts_the_cache_and_sees_the_weight_change(dtype, state_len, monkeypatch):
    """After a signature's first step ran the whole way (its checks once), later steps of a cache of width-1
    columns take its hot path (``bridge.hot_path``: x written straight into the arena, the cache updated where it
    lies): each step the reference's output and shifted cache, the cache's version advanced, a weight changed in
    place by an optimizer seen. A cache of width columns (Hugging Face's) keeps the whole way, with the same
    results; a step of a bad signature is checked in the caller's terms."""
    from rlx_gpu.torch import conv
    checks = []
    check = conv.check_causal_conv1d_update
    monkeypatch.setattr(conv, "check_causal_conv1d_update", lambda *a: checks.append(1) or check(*a))
    width, dim = 4, 6
    _, w, b, _ = _inputs(2, dim, 1, width, dtype=dtype, seed=state_len)
    weight = torch.nn.Parameter(w)
    cache = torch.randn(2, dim, state_len, dtype=dtype)
    tolerance = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        for step in range(4):
            if step == 2:
                weight.mul_(0.5)  # an optimizer's step: a new version, written again
            x = torch.randn(2, dim, dtype=dtype)
            before, version = cache.clone(), cache._version
            out = causal_conv1d_update(x, cache, weight, b, activation="silu")
            want, _ = reference(x.unsqueeze(-1), weight, b, before[..., -(width - 1):], "silu")
            torch.testing.assert_close(out, want.squeeze(-1), **tolerance)
            torch.testing.assert_close(cache, torch.cat([before, x.unsqueeze(-1)], dim=-1)[..., 1:], **tolerance)
            assert cache._version > version
    assert len(checks) == (1 if state_len == width - 1 else 4)
    with pytest.raises(ValueError, match=r"^causal_conv1d_update: conv_state has shape \[2, 5, "):
        causal_conv1d_update(torch.randn(2, dim, dtype=dtype), cache[:, :5], weight, b, activation="silu")
