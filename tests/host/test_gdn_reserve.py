"""The host's gated_delta_net with a saved forward (ABI.md §9.1; what holds for every state-space op:
``test_state_space_reserve.py``): the reserve holds the states leaving every chunk of 32 tokens, each chunk's
decayed products q·k and k·k, the inverse of ``I + diag(beta) kk`` and what each token adds to the state, each
checked against the recurrence or its definition."""
from __future__ import annotations

import numpy as np
import pytest

from host_fallback.gdn import reserve_views
from support.gradient_check import read
from support.saved_forward import filled_reserve, laid_case


@pytest.mark.parametrize("label", ["per_channel", "groups.width.l2.scale"])
def test_the_saved_values_are_the_recurrences_states_and_each_chunks_products(label):
    thunk, arena, forward = laid_case("gated_delta_net", "f64", label)
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