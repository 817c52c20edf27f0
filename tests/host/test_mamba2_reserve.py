"""The host's mamba2 with a saved forward (ABI.md §9.1; what holds for every state-space op:
``test_state_space_reserve.py``): the reserve holds the states leaving every chunk of 64 tokens, the output
before ``d`` and ``z`` and each chunk's decayed scores — the scores against their definition, and the same
reserve from the step and chunked forwards (the chunked form either way)."""
from __future__ import annotations

import numpy as np
import pytest

from host_fallback.ssm import reserve_views
from support.gradient_check import read
from support.saved_forward import filled_reserve, laid_case


@pytest.mark.parametrize("label", ["base", "carry.slots"])
def test_a_forward_asked_for_the_step_path_writes_the_chunked_forms_reserve(label):
    thunk, arena, forward = laid_case("mamba2", "f64", label)
    step, chunked = (reserve_views(thunk, filled_reserve(thunk, arena, forward, path=p)) for p in ("step", "chunked"))
    for name in ("states", "y", "scores"):
        np.testing.assert_array_equal(step[name], chunked[name], err_msg=name)


def test_the_saved_scores_are_the_decayed_scores_of_each_chunk():
    thunk, arena, forward = laid_case("mamba2", "f64", dict(seq=100))
    saved, values = reserve_views(thunk, filled_reserve(thunk, arena, forward)), read(thunk, arena)
    logd = values["dt"] * values["a"]
    b, c = values["b"], values["c"]
    for k, lo in enumerate(range(0, 100, 64)):
        span = slice(lo, min(100, lo + 64))
        cum = np.cumsum(logd[:, span], axis=1)  # [B, L, H]
        want = np.einsum("blhn,bshn->bhls", c[:, span], b[:, span]) * np.exp(cum.transpose(0, 2, 1)[..., :, None]
                                                                             - cum.transpose(0, 2, 1)[..., None, :])
        want = np.tril(want)
        got = saved["scores"][:, k]
        np.testing.assert_allclose(got[..., : want.shape[-1], : want.shape[-1]], want, rtol=1e-10, atol=1e-12)
        assert not got[..., want.shape[-1]:, :].any() and not got[..., want.shape[-1]:].any()