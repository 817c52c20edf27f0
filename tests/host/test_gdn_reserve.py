"""The host's gated_delta_net with a saved forward (ABI.md §9.1): a training forward writes the reserve (the
states leaving every chunk of 32 tokens, each chunk's decayed products q·k and k·k, the inverse of ``I +
diag(beta) kk`` and what each token adds to the state), the backward reads it instead of recomputing them.
Its gradients against the backward that recomputes (the same values by another GEMM order: equal within
rounding), the forward's outputs unchanged by writing it, the saved values against the recurrence and the
definitions, the same bytes on every run, and packed sequences refused."""
from __future__ import annotations

import numpy as np
import pytest

import host_fallback
import rlx_gpu
from host_fallback.abi import regions
from host_fallback.gdn import reserve_views
from rlx_gpu.conformance.cases import lay_out, schedule_of
from rlx_gpu.conformance.runner import sample
from support.gradient_check import read, with_gradients
from support.saved_forward import filled_reserve, gradients, laid_with_reserve, run_forward, without_reserve

OP = "gated_delta_net"
#: three chunks of 32, the last one partial
BASE = dict(batch=2, seq=70, heads=2, state_size=4, gate_per_channel=False, carry_state=False)
CASES = [
    ("per_head", {}),
    ("per_channel", dict(gate_per_channel=True)),
    ("exact_chunks", dict(seq=64)),
    ("one_chunk", dict(seq=20, gate_per_channel=True)),
    ("groups.width.l2.scale", dict(value_heads=4, value_size=3, qk_l2norm=True, scale=0.7)),
    ("carry.slots", dict(carry_state=True, state_slots=[2, 0], num_slots=3, gate_per_channel=True)),
    ("state_f64", dict(carry_state=True, state_dtype="f64")),  # an f64 reserve whatever the dtype
]
IDS = [label for label, _ in CASES]
#: Largest difference from the recomputing backward, relative to the gradient's largest magnitude.
TOL = {"f64": 1e-11, "f32": 2e-5, "bf16": 2e-2}


def _laid(dtype: str, extra: dict) -> tuple[dict, np.ndarray, dict]:
    params = {**BASE, **extra}
    return laid_with_reserve(OP, dtype, params,
                             lambda field, shape, rng: sample(f"{OP}_backward", params, field, shape, rng))


@pytest.mark.parametrize("dtype", ["f64", "f32", "bf16"])
@pytest.mark.parametrize("extra", [e for _, e in CASES], ids=IDS)
def test_gradients_read_from_the_reserve_match_the_recomputed_ones(extra, dtype):
    thunk, arena, forward = _laid(dtype, extra)
    saved = filled_reserve(thunk, arena, forward)
    got, expected = gradients(thunk, saved), gradients(without_reserve(thunk), arena)
    assert set(got) == set(expected)
    for name in expected:
        scale = np.abs(expected[name]).max() + 1e-30
        np.testing.assert_allclose(got[name], expected[name], rtol=0, atol=TOL[dtype] * scale, err_msg=name)
    start = thunk["reserve"]  # the reserve is read: other values give other gradients
    saved[start: start + thunk["reserve_bytes"]] = 0
    assert not np.array_equal(gradients(thunk, saved)["d_v"], got["d_v"])


@pytest.mark.parametrize("extra", [e for _, e in CASES], ids=IDS)
def test_the_forward_writing_a_reserve_gives_the_outputs_of_one_without(extra):
    _, arena, forward = _laid("f64", extra)
    with_reserve, without = run_forward(forward, arena), run_forward(without_reserve(forward), arena)
    for r in regions(without_reserve(forward)):
        if r.writes:
            np.testing.assert_array_equal(read(forward, with_reserve)[r.field], read(forward, without)[r.field],
                                          err_msg=r.field)


@pytest.mark.parametrize("extra", [CASES[1][1], CASES[4][1]], ids=[IDS[1], IDS[4]])
def test_the_saved_values_are_the_recurrences_states_and_each_chunks_products(extra):
    thunk, arena, forward = _laid("f64", extra)
    saved, values = reserve_views(thunk, filled_reserve(thunk, arena, forward, path="step")), read(thunk, arena)
    group = thunk.get("value_heads", thunk["heads"]) // thunk["heads"]
    q, k = (np.repeat(values[f], group, axis=2) for f in ("q", "k"))  # [B, S, HV, K]
    if thunk.get("qk_l2norm"):
        q, k = (x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6) for x in (q, k))
    v, beta = values["v"], values["beta"]
    g = values["g"] if thunk["gate_per_channel"] else values["g"][..., None] * np.ones(k.shape)
    seq = q.shape[1]
    s = np.zeros(saved["states"].shape[:1] + saved["states"].shape[2:])  # [B, HV, K, V]
    for t in range(seq):  # the recurrence of ABI.md §4: u is what the token adds to the (decayed) state
        s = np.exp(g[:, t])[..., None] * s
        u = beta[:, t, :, None] * (v[:, t] - np.einsum("bhk,bhkv->bhv", k[:, t], s))
        s = s + k[:, t, ..., None] * u[..., None, :]
        np.testing.assert_allclose(saved["u"][:, t // 32, :, t % 32], u, rtol=1e-10, atol=1e-12)
        if (t + 1) % 32 == 0 or t + 1 == seq:
            np.testing.assert_allclose(saved["states"][:, t // 32], s, rtol=1e-10, atol=1e-12)
    assert not saved["u"][:, -1, :, seq % 32 or 32:].any()  # (tokens past seq)
    for c, lo in enumerate(range(0, seq, 32)):
        span = slice(lo, min(seq, lo + 32))
        cum = np.cumsum(g[:, span], axis=1)  # [B, L, HV, K]
        decay = np.exp(cum[:, :, None] - cum[:, None, :])  # [B, r, s, HV, K]
        qk, kk = (np.einsum("brhk,brshk,bshk->bhrs", x[:, span], decay, k[:, span]) for x in (q, k))
        n = qk.shape[-1]
        want = {"qk": np.tril(qk), "kk": np.tril(kk, -1)}
        want["inverse"] = np.linalg.inv(np.eye(n) + beta[:, span].transpose(0, 2, 1)[..., None] * want["kk"])
        for name, x in want.items():
            got = saved[name][:, c]
            np.testing.assert_allclose(got[..., :n, :n], x, rtol=1e-10, atol=1e-12, err_msg=name)
            padding = got.copy()  # rows and columns of tokens past seq: those of zero inputs
            padding[..., :n, :n] = np.eye(n) if name == "inverse" else 0
            np.testing.assert_array_equal(padding, np.broadcast_to(np.eye(32) if name == "inverse" else 0,
                                                                   padding.shape), err_msg=name)


def test_the_reserve_and_the_gradients_are_the_same_bytes_on_every_run():
    thunk, arena, forward = _laid("f32", CASES[4][1])
    first, second = run_forward(forward, arena), run_forward(forward, arena)
    assert np.array_equal(first, second)
    arena = filled_reserve(thunk, arena, forward)
    runs = [arena.copy(), arena.copy()]
    for run in runs:
        host_fallback.execute(thunk, run)
    assert np.array_equal(runs[0], runs[1])


def test_a_saved_forward_of_packed_sequences_is_refused():
    params = dict(batch=1, seq=20, heads=2, state_size=4, gate_per_channel=False, carry_state=False,
                  cu_seqlens=[0, 7, 20], num_seqs=2)
    need = rlx_gpu.reserve_bytes({"op": OP, "dtype": "f32", **params})
    for op in (OP, f"{OP}_backward"):
        thunk, nbytes = lay_out(op, "f32", {**with_gradients(OP, params), "reserve": True, "reserve_bytes": need})
        with pytest.raises(rlx_gpu.ScheduleError, match=rf"\({op}\), field 'reserve': a saved forward of packed seq"):
            rlx_gpu.load_schedule(schedule_of(thunk, nbytes))
        rlx_gpu.load_schedule(schedule_of(*lay_out(op, "f32", with_gradients(OP, params))))


def test_a_forward_with_a_reserve_refuses_another_chunk_length():
    _, arena, forward = _laid("f32", {})
    with pytest.raises(ValueError, match="chunks of 32, got chunk=64"):
        run_forward(forward, arena, chunk=64)
