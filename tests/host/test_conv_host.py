"""causal_conv1d's host core (host_fallback.conv, conv_backward) against the float64 reference of ABI.md §10
(rlx_gpu.conformance.reference_conv), the reference's gradients against its own finite differences, and both
against Dao-AILab's semantics written here in torch (a depthwise F.conv1d padded by width-1, the initial
states prepended, then silu)."""
from __future__ import annotations

import numpy as np
import pytest

from host_fallback import conv, conv_backward
from host_fallback.conv_backward import causal_conv1d_backward
from rlx_gpu.conformance import reference_conv as ref

#: packed sequences: empty ones (first, middle, last), shorter than width-1, and longer than a slab
CU = [0, 0, 1, 3, 3, 40, 41, 41]
#: the pool entry of each of CU's sequences, out of 9
SLOTS = [4, 0, 7, 2, 8, 1, 5]


@pytest.fixture(autouse=True)
def small_slabs(monkeypatch):
    """Slabs of 16 tokens at these channel counts, so that sequences cross slabs."""
    monkeypatch.setattr(conv, "SLAB_BYTES", 64)


def _case(width: int, *, varlen: bool, carry: bool, slots: bool, bias: bool, seed: int = 0, dtype=np.float64):
    rng = np.random.default_rng(seed + width)
    dim = 5
    shape = (1, CU[-1], dim) if varlen else (3, 37, dim)
    rows = len(CU) - 1 if varlen else shape[0]
    entries = 9 if slots else rows
    args = dict(
        x=rng.standard_normal(shape), weight=rng.standard_normal((dim, width)),
        bias=rng.standard_normal(dim) if bias else None,
        state=rng.standard_normal((entries, dim, width - 1)) if carry else None,
        cu_seqlens=np.array(CU) if varlen else None,
        state_slots=np.array(SLOTS if varlen else [2, 0, 1]) if slots else None)
    if slots and not varlen:
        args["state"] = rng.standard_normal((4, dim, width - 1))
    d = dict(d_dst=rng.standard_normal(shape), d_state=None if args["state"] is None else
             rng.standard_normal(args["state"].shape))
    cast = {k: v.astype(dtype) if isinstance(v, np.ndarray) and v.dtype.kind == "f" else v for k, v in args.items()}
    return cast, {k: None if v is None else v.astype(dtype) for k, v in d.items()}


def _host_forward(args, activation, workers=None):
    pool = None if args["state"] is None else args["state"].copy()
    y = conv.causal_conv1d(args["x"], args["weight"], args["bias"], activation, pool, args["cu_seqlens"],
                           args["state_slots"], workers=workers)
    return y, pool


def _host_backward(args, grads, activation, workers=None):
    d_pool = None if grads["d_state"] is None else grads["d_state"].copy()
    d_x, d_w, d_b = causal_conv1d_backward(args["x"], args["weight"], grads["d_dst"], args["bias"], activation,
                                           args["state"], d_pool, args["cu_seqlens"], args["state_slots"],
                                           workers=workers)
    return {"d_x": d_x, "d_weight": d_w, **({"d_bias": d_b} if d_b is not None else {}),
            **({"d_state": d_pool} if d_pool is not None else {})}


FIELD_CASES = [dict(varlen=v, carry=c, slots=s, bias=b) for v, c, s, b in
               [(False, False, False, False), (False, True, False, True), (False, True, True, False),
                (True, False, False, True), (True, True, False, False), (True, True, True, True)]]


@pytest.mark.parametrize("width", range(2, 9))
@pytest.mark.parametrize("fields", FIELD_CASES, ids=lambda f: "-".join(k for k, v in f.items() if v) or "plain")
@pytest.mark.parametrize("activation", ["none", "silu"])
def test_forward_and_backward_match_the_reference(width, fields, activation):
    args, grads = _case(width, **fields)
    y, pool = _host_forward(args, activation)
    want = ref.causal_conv1d(args["x"], args["weight"], bias=args["bias"], activation=activation,
                             state=args["state"], cu_seqlens=args["cu_seqlens"], state_slots=args["state_slots"])
    if pool is not None:
        want, final = want
        np.testing.assert_array_equal(pool, final)  # values moved, never computed: exact
    np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-12)
    got = _host_backward(args, grads, activation)
    expected = ref.causal_conv1d_backward(args["x"], args["weight"], grads["d_dst"], bias=args["bias"],
                                          activation=activation, state=args["state"], d_state=grads["d_state"],
                                          cu_seqlens=args["cu_seqlens"], state_slots=args["state_slots"])
    assert set(got) == set(expected)
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-11, atol=1e-11, err_msg=name)


@pytest.mark.parametrize("width", [2, 4, 8])
@pytest.mark.parametrize("activation", ["none", "silu"])
@pytest.mark.parametrize("carry", [False, True])
def test_f32_within_f32_rounding_and_the_same_bytes_on_every_run_and_thread_count(width, activation, carry):
    args, grads = _case(width, varlen=True, carry=carry, slots=carry, bias=True, dtype=np.float32)
    y1, p1 = _host_forward(args, activation, workers=1)
    y2, p2 = _host_forward(args, activation, workers=2)
    assert y1.dtype == np.float32 and y1.tobytes() == y2.tobytes()
    assert not carry or p1.tobytes() == p2.tobytes()
    want = ref.causal_conv1d(args["x"], args["weight"], bias=args["bias"], activation=activation,
                             state=args["state"], cu_seqlens=args["cu_seqlens"], state_slots=args["state_slots"])
    np.testing.assert_allclose(y1, want[0] if carry else want, rtol=1e-5, atol=1e-5)
    g1, g2 = (_host_backward(args, grads, activation, workers=w) for w in (1, 2))
    for name in g1:
        assert g1[name].tobytes() == g2[name].tobytes(), name
    expected = ref.causal_conv1d_backward(args["x"], args["weight"], grads["d_dst"], bias=args["bias"],
                                          activation=activation, state=args["state"], d_state=grads["d_state"],
                                          cu_seqlens=args["cu_seqlens"], state_slots=args["state_slots"])
    for name in expected:
        np.testing.assert_allclose(g1[name], expected[name], rtol=1e-4, atol=1e-4, err_msg=name)


def test_a_wider_pool_keeps_its_carried_values_exact():
    """An f64 pool beside f32 activations: the values still in a short sequence's window come back as they were."""
    args, _ = _case(4, varlen=True, carry=True, slots=False, bias=False, dtype=np.float32)
    pool = np.random.default_rng(3).standard_normal(args["state"].shape)  # float64, not f32-representable
    before = pool.copy()
    conv.causal_conv1d(args["x"], args["weight"], None, "none", pool, args["cu_seqlens"])
    np.testing.assert_array_equal(pool[1, :, :2], before[1, :, 1:])  # sequence 1: one token
    np.testing.assert_array_equal(pool[1, :, 2], args["x"][0, 0])
    np.testing.assert_array_equal(pool[0], before[0])  # an empty sequence leaves its entry as it is


@pytest.mark.parametrize("activation", ["none", "silu"])
def test_decode_steps_straight_on_the_pool_equal_one_prefill(activation):
    """A prefill of 4 tokens into slots, then 3 decode steps of one token per row, give the outputs and the
    pool of one 7-token prefill; entries no row names stay as they are."""
    rng = np.random.default_rng(7)
    dim, width, rows = 6, 4, 3
    x = rng.standard_normal((rows, 7, dim)).astype(np.float32)
    weight, bias = rng.standard_normal((dim, width)), rng.standard_normal(dim)
    weight, bias = weight.astype(np.float32), bias.astype(np.float32)
    slots = np.array([3, 0, 4])
    pool = rng.standard_normal((5, dim, width - 1)).astype(np.float32)
    whole_pool = pool.copy()
    whole = conv.causal_conv1d(x, weight, bias, activation, whole_pool, state_slots=slots)
    steps = [conv.causal_conv1d(x[:, :4], weight, bias, activation, pool, state_slots=slots)]
    steps += [conv.causal_conv1d(x[:, t:t + 1], weight, bias, activation, pool, state_slots=slots) for t in (4, 5, 6)]
    np.testing.assert_allclose(np.concatenate(steps, axis=1), whole, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(pool, whole_pool)
    # the same decode step with the rows packed (varlen, every sequence one token)
    packed_pool, rows_pool = pool.copy(), pool.copy()
    packed = conv.causal_conv1d(x[None, :, 6], weight, bias, activation, packed_pool, np.arange(rows + 1), slots)
    by_row = conv.causal_conv1d(x[:, 6:7], weight, bias, activation, rows_pool, state_slots=slots)
    np.testing.assert_array_equal(packed[0], by_row[:, 0])
    np.testing.assert_array_equal(packed_pool, rows_pool)


@pytest.mark.parametrize("activation", ["none", "silu"])
def test_nan_and_inf_reach_only_what_the_formula_reaches(activation):
    args, grads = _case(3, varlen=True, carry=True, slots=False, bias=True)
    args["x"][0, 10, 1] = np.nan  # sequence 4 (tokens 3..39): outputs 10..12 of channel 1
    args["x"][0, 39, 2] = np.inf  # its last token: output 39, and its final state
    args["state"][5, 3, 0] = -np.inf  # sequence 5 (one token): the carried value at tap 0
    y, pool = _host_forward(args, activation)
    want, final = ref.causal_conv1d(args["x"], args["weight"], bias=args["bias"], activation=activation,
                                    state=args["state"], cu_seqlens=args["cu_seqlens"])
    assert np.isnan(y).sum() >= 3 and np.isfinite(y[0, 13:39]).all() and np.isfinite(y[0, :10]).all()
    np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-12)  # same NaN / Inf positions
    np.testing.assert_array_equal(pool, final)
    got = _host_backward(args, grads, activation)
    expected = ref.causal_conv1d_backward(args["x"], args["weight"], grads["d_dst"], bias=args["bias"],
                                          activation=activation, state=args["state"], d_state=grads["d_state"],
                                          cu_seqlens=args["cu_seqlens"])
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-11, atol=1e-11, err_msg=name)


@pytest.mark.parametrize("activation", ["none", "silu"])
def test_reference_gradients_are_finite_differences_of_the_reference(activation):
    """One random direction per input: ``<grad, v>`` against the central difference of
    ``L = sum(y * d_dst) + sum(final pool * d_state)``."""
    args, grads = _case(3, varlen=True, carry=True, slots=True, bias=True)

    def loss(values):
        y, final = ref.causal_conv1d(values["x"], values["weight"], bias=values["bias"], activation=activation,
                                     state=values["state"], cu_seqlens=args["cu_seqlens"],
                                     state_slots=args["state_slots"])
        return float(np.sum(y * grads["d_dst"]) + np.sum(final * grads["d_state"]))

    expected = ref.causal_conv1d_backward(args["x"], args["weight"], grads["d_dst"], bias=args["bias"],
                                          activation=activation, state=args["state"], d_state=grads["d_state"],
                                          cu_seqlens=args["cu_seqlens"], state_slots=args["state_slots"])
    rng = np.random.default_rng(11)
    values = {f: args[f] for f in ("x", "weight", "bias", "state")}
    for field in values:
        v = rng.standard_normal(values[field].shape)
        plus, minus = ({**values, field: values[field] + s * 1e-6 * v} for s in (1, -1))
        numeric = (loss(plus) - loss(minus)) / 2e-6
        grad = expected[f"d_{field}"]  # d_state: entries no row names pass the final state's gradient on
        assert np.sum(grad * v) == pytest.approx(numeric, rel=1e-6, abs=1e-6), field


# --- Dao-AILab's semantics in torch: causal_conv1d_fn and causal_conv1d_update as their reference
# functions define them, written here from that definition, on channel-first tensors (batch, dim, seqlen)

def _torch_fn(x, weight, bias, initial_states, activation):
    """``(out, final_states)``: the inputs extended by ``initial_states`` (or zero-padded by width-1), a
    depthwise ``F.conv1d`` over them, the first ``seqlen`` outputs, then silu."""
    import torch
    import torch.nn.functional as F

    width, seqlen = weight.shape[1], x.shape[-1]
    if initial_states is None:
        extended = F.pad(x, (width - 1, 0))
    else:
        extended = torch.cat([initial_states, x], dim=-1)
    out = F.conv1d(extended, weight.unsqueeze(1), bias, groups=x.shape[1])[..., :seqlen]
    return (F.silu(out) if activation == "silu" else out), extended[..., -(width - 1):]


@pytest.mark.parametrize("width", [2, 4, 7])
@pytest.mark.parametrize("activation", ["none", "silu"])
@pytest.mark.parametrize("carry", [False, True])
def test_matches_dao_ailab_semantics_forward_and_autograd(width, activation, carry):
    torch = pytest.importorskip("torch")
    args, grads = _case(width, varlen=False, carry=carry, slots=False, bias=True)
    as_torch = lambda a: torch.tensor(a, requires_grad=True)  # noqa: E731
    x, weight, bias = as_torch(args["x"].transpose(0, 2, 1)), as_torch(args["weight"]), as_torch(args["bias"])
    initial = as_torch(args["state"]) if carry else None
    out, final = _torch_fn(x, weight, bias, initial, activation)
    y, pool = _host_forward(args, activation)
    np.testing.assert_allclose(y, out.detach().numpy().transpose(0, 2, 1), rtol=1e-12, atol=1e-12)
    loss = (out * torch.tensor(grads["d_dst"].transpose(0, 2, 1))).sum()
    if carry:
        np.testing.assert_array_equal(pool, final.detach().numpy())
        loss = loss + (final * torch.tensor(grads["d_state"])).sum()
    loss.backward()
    got = _host_backward(args, grads, activation)
    np.testing.assert_allclose(got["d_x"], x.grad.numpy().transpose(0, 2, 1), rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(got["d_weight"], weight.grad.numpy(), rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(got["d_bias"], bias.grad.numpy(), rtol=1e-11, atol=1e-11)
    if carry:
        np.testing.assert_allclose(got["d_state"], initial.grad.numpy(), rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("activation", ["none", "silu"])
def test_decode_matches_dao_ailab_update_with_state_indices(activation):
    """``causal_conv1d_update(x, conv_state, weight, bias, activation, conv_state_indices)`` without a ring
    buffer: the state and the token concatenated, the state shifted in place, the last convolution output."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    rng = np.random.default_rng(5)
    dim, width = 8, 4
    x, weight, bias = rng.standard_normal((3, dim)), rng.standard_normal((dim, width)), rng.standard_normal(dim)
    pool, indices = rng.standard_normal((6, dim, width - 1)), np.array([5, 1, 2])
    conv_state = torch.tensor(pool)
    rows = torch.tensor(indices)
    extended = torch.cat([conv_state[rows], torch.tensor(x)[..., None]], dim=-1)
    conv_state[rows] = extended[..., 1:]
    out = F.conv1d(extended, torch.tensor(weight).unsqueeze(1), torch.tensor(bias), groups=dim)[..., -1]
    out = F.silu(out) if activation == "silu" else out
    y = conv.causal_conv1d(x[:, None], weight, bias, activation, pool, state_slots=indices)
    np.testing.assert_allclose(y[:, 0], out.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(pool, conv_state.numpy())


def test_the_reference_reads_a_thunk_by_its_field_names():
    """``forward(t, load)`` / ``backward(t, load)``: what the conformance runner calls, the §10 fields by name."""
    args, grads = _case(3, varlen=True, carry=True, slots=True, bias=True)
    values = {**{k: v for k, v in args.items() if v is not None}, **grads}
    t = dict(activation="silu", carry_state=True, bias=1, cu_seqlens=1, state_slots=1)
    out = ref.forward(t, values.__getitem__)
    y, final = ref.causal_conv1d(args["x"], args["weight"], bias=args["bias"], activation="silu", state=args["state"],
                                 cu_seqlens=args["cu_seqlens"], state_slots=args["state_slots"])
    assert set(out) == {"dst", "state"} and (out["dst"] == y).all() and (out["state"] == final).all()
    back = ref.backward(t, values.__getitem__)
    assert set(back) == {"d_x", "d_weight", "d_bias", "d_state"}
    no_carry = ref.forward({**t, "carry_state": False, "state_slots": None, "bias": None}, values.__getitem__)
    assert set(no_carry) == {"dst"}


@pytest.mark.parametrize("change, words", [
    (dict(weight=np.zeros((5, 9))), "2 <= W <= 8"), (dict(activation="gelu"), "activation='gelu'"),
    (dict(state=np.zeros((3, 5, 4))), "expected [entries, 5, 2]")])
def test_a_caller_hears_what_is_wrong(change, words):
    call = dict(x=np.zeros((3, 4, 5)), weight=np.zeros((5, 3)), activation="none", state=None)
    call.update(change)
    with pytest.raises(ValueError) as info:
        conv.causal_conv1d(call["x"], call["weight"], None, call["activation"], call["state"])
    assert words in str(info.value)


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("compiled", ["1", "0"], ids=["compiled-where-installed", "numpy"])
def test_a_decode_step_split_across_threads_gives_the_same_bytes(varlen, compiled, monkeypatch):
    """The decode step's rows on one thread or two (their entries through slots, the split forced past its
    threshold), compiled (where Numba is installed) or NumPy's: the same outputs and pool."""
    monkeypatch.setenv("RLX_HOST_JIT", compiled)
    monkeypatch.setattr(conv, "DECODE_SPLIT_WORK", {"compiled": 0, "numpy": 0})
    rng = np.random.default_rng(11)
    rows, dim, width = 5, 7, 4
    x = rng.standard_normal((1, rows, dim) if varlen else (rows, 1, dim)).astype(np.float32)
    weight, bias = rng.standard_normal((dim, width)).astype(np.float32), rng.standard_normal(dim).astype(np.float32)
    pool = rng.standard_normal((8, dim, width - 1)).astype(np.float32)
    slots, cu = np.array([6, 0, 3, 1, 7]), np.arange(rows + 1) if varlen else None
    runs = []
    for workers in (1, 2):
        p = pool.copy()
        runs.append((conv.causal_conv1d(x, weight, bias, "silu", p, cu, slots, workers=workers), p))
    assert runs[0][0].tobytes() == runs[1][0].tobytes() and runs[0][1].tobytes() == runs[1][1].tobytes()
    assert np.array_equal(runs[0][1][[2, 4, 5]], pool[[2, 4, 5]])  # entries no row names
    rolled = pool[slots].copy()
    rolled[..., :-1] = pool[slots][..., 1:]
    rolled[..., -1] = (x[0] if varlen else x[:, 0])
    assert np.array_equal(runs[0][1][slots], rolled)


@pytest.mark.parametrize("chunk", [1, 2])
def test_the_backward_in_chunks_of_single_slabs_matches_the_reference(chunk, monkeypatch):
    """A chunk boundary inside every sequence (chunks of one or two slabs of 16 tokens): the g after each piece
    recomputed, the partials summed chunk by chunk; the same as the reference, and as bytes at 1 and 3 threads."""
    monkeypatch.setattr(conv_backward, "CHUNK_SLABS", chunk)
    args, grads = _case(4, varlen=True, carry=True, slots=True, bias=True)
    got = [_host_backward(args, grads, "silu", workers=w) for w in (1, 3)]
    expected = ref.causal_conv1d_backward(args["x"], args["weight"], grads["d_dst"], bias=args["bias"],
                                          activation="silu", state=args["state"], d_state=grads["d_state"],
                                          cu_seqlens=args["cu_seqlens"], state_slots=args["state_slots"])
    for name in expected:
        np.testing.assert_allclose(got[0][name], expected[name], rtol=1e-11, atol=1e-11, err_msg=name)
        assert got[0][name].tobytes() == got[1][name].tobytes(), name
