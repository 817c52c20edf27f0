"""The host's selective_scan with a saved forward (ABI.md §9.1; what holds for every state-space op:
``test_state_space_reserve.py``): the reserve holds the state leaving every chunk of 32 tokens, checked against
the step recurrence's."""
from __future__ import annotations

import numpy as np

from host_fallback.ssm import reserve_views
from support.gradient_check import read
from support.saved_forward import filled_reserve, laid_case


def test_the_saved_states_are_the_recurrences_after_every_32_tokens():
    thunk, arena, forward = laid_case("selective_scan", "f64", "groups.d.z")
    states = reserve_views(thunk, filled_reserve(thunk, arena, forward, path="step"))["states"]
    values = read(thunk, arena)
    delta, x, a = values["delta"], values["x"], values["a"]
    bsz, seq, hidden = x.shape
    b = np.repeat(values["b"], hidden // 2, axis=2)  # [B, S, H, N]: each channel's group
    h = np.zeros((bsz, hidden, a.shape[1]))
    for t in range(seq):
        h = np.exp(delta[:, t, :, None] * a) * h + (delta[:, t] * x[:, t])[..., None] * b[:, t]
        if (t + 1) % 32 == 0 or t + 1 == seq:
            np.testing.assert_allclose(states[:, t // 32], h, rtol=1e-12, atol=1e-12)