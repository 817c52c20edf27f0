"""host_fallback gated_delta_net_backward (ABI.md §9) against float64 central finite differences of the
conformance reference's forward, and against torch autograd of a float64 torch rewrite of fla's
naive recurrent gated delta rule (per-head gates) and of its per-channel (KDA) form.

Every ``d_`` output is checked, the initial state's gradient included, along a random direction per
input (one directional derivative covers every element: an error in any element shows unless it is
orthogonal to a random vector). Both host paths run: the step reverse and the chunked WY backward
(chunks of 16 here, so a short sequence spans several).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import host_fallback
from host_fallback.abi import complete, gradient, regions
from host_fallback.arena import view
from support.gradient_check import check_finite_differences, copy_inputs, laid, read as _read
from rlx_gpu.conformance.references import REFERENCES
from rlx_gpu.conformance.runner import sample

OP = "gated_delta_net_backward"
BASE = dict(batch=2, seq=5, heads=2, state_size=4, gate_per_channel=False, carry_state=True)
#: Every version-2 field at once: grouped value heads, K != V, L2-norm, a scale, packed sequences (one
#: empty, one starting inside the second chunk of 16) through state slots.
FIELDS = dict(batch=1, seq=40, value_heads=4, value_size=3, qk_l2norm=True, scale=0.7, cu_seqlens=[0, 2, 2, 23, 40],
              state_slots=[3, 0, 4, 1], num_slots=5)


def _laid(params: dict, dtype: str = "f64", seed: int = 0, g_scale: float = 1.0) -> tuple[dict, np.ndarray]:
    """A backward thunk and its arena, every input sampled as the conformance cases sample it
    (``g_scale`` stretches the log-decays)."""
    def draw(field: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
        return sample(OP, params, field, shape, rng) * (g_scale if field == "g" else 1.0)
    return laid(OP, dtype, params, draw, seed)


def _backward(thunk: dict, arena: np.ndarray, **options) -> dict[str, np.ndarray]:
    out = arena.copy()
    host_fallback.execute(thunk, out, **options)
    return {f: v for f, v in _read(thunk, out).items() if f.startswith("d_") and f != "d_dst"}


PATHS = [dict(path="step"), dict(path="chunked", chunk=16)]
#: (the fields a case exercises, its params)
FD_CASES = [
    ("per-head", BASE),
    ("per-channel", dict(BASE, gate_per_channel=True, seq=20)),
    ("every field, per-channel", dict(BASE, gate_per_channel=True, **FIELDS)),
    ("every field, per-head, no carry", dict(BASE, carry_state=False, **{k: v for k, v in FIELDS.items()
                                                                          if k not in ("state_slots", "num_slots")})),
]


@pytest.mark.parametrize("options", PATHS, ids=["step", "chunked"])
@pytest.mark.parametrize("label,params", FD_CASES, ids=[c[0] for c in FD_CASES])
def test_every_gradient_matches_central_finite_differences(label, params, options):
    thunk, arena = _laid(params)
    grads = _backward(thunk, arena, **options)
    assert ("d_state" in grads) == params["carry_state"]
    check_finite_differences(thunk, arena, grads)  # every gradient field, each along a random direction


def test_chunks_whose_per_channel_decays_spread_widely_match_the_reference():
    """Per-channel log-decays of ~-4 a step spread far past what one factored GEMM may hold inside a chunk
    (``gdn_grams.CHANNEL_SPREAD``): those chunks take the pairwise form, and every gradient stays finite."""
    thunk, arena = _laid(dict(BASE, gate_per_channel=True, seq=40), g_scale=16.0)
    values = _read(thunk, arena)
    want = REFERENCES[OP](complete(thunk), lambda f: values[f])
    got = _backward(thunk, arena, path="chunked", chunk=32)
    for name, value in want.items():
        assert np.isfinite(got[name]).all()
        np.testing.assert_allclose(got[name], value, rtol=1e-9, atol=1e-11, err_msg=name)


# --- torch autograd of fla's naive recurrent form, rewritten in float64 torch -------------------------
def _torch_recurrent(q, k, v, g, beta, state, scale, l2norm):
    """fla's ``naive_recurrent_gated_delta_rule`` math ([B, T, H, K] layout, state [B, HV, K, V]); with
    per-channel ``g [B, T, HV, K]`` it is the KDA recurrence. Key heads are repeated over their value heads."""
    group = v.shape[2] // q.shape[2]
    q, k = (torch.repeat_interleave(x, group, dim=2) for x in (q, k))
    if l2norm:
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    h, outs = state, []
    for t in range(q.shape[1]):
        decay = torch.exp(g[:, t])
        h = h * (decay[..., None] if g.dim() == 4 else decay[..., None, None])
        correction = v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], h)
        h = h + k[:, t, :, :, None] * (correction * beta[:, t, :, None])[:, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, h))
    return torch.stack(outs, 1), h


TORCH_CASES = [("per-head", dict(BASE, seq=20)),
               ("per-channel GVA K!=V l2norm", dict(BASE, seq=20, gate_per_channel=True, value_heads=4, value_size=3,
                                                    qk_l2norm=True, scale=0.6))]


@pytest.mark.parametrize("label,params", TORCH_CASES, ids=[c[0] for c in TORCH_CASES])
def test_every_gradient_matches_torch_autograd(label, params):
    thunk, arena = _laid(params, seed=3)
    values = _read(thunk, arena)
    leaves = {f: torch.tensor(values[f], requires_grad=True) for f in ("q", "k", "v", "g", "beta", "state")}
    scale = params.get("scale", params["state_size"] ** -0.5)
    out, final = _torch_recurrent(*leaves.values(), scale, params.get("qk_l2norm", False))
    loss = (out * torch.tensor(values["d_dst"])).sum() + (final * torch.tensor(values["d_state"])).sum()
    loss.backward()
    for options in PATHS:
        got = _backward(thunk, arena, **options)
        for f, leaf in leaves.items():
            np.testing.assert_allclose(got[gradient(f)], leaf.grad.numpy(), rtol=1e-9, atol=1e-11,
                                       err_msg=f"{label} {options} d_{f}")


# --- dtypes and determinism ---------------------------------------------------------------------------
#: NMSE of each gradient of a 16-bit / f32 thunk against the f64 backward on the same stored inputs: the
#: outputs are rounded once (bf16 2^-8, f16 2^-11 relative) and everything before that is f32.
NMSE = {"f32": 1e-10, "f16": 1e-6, "bf16": 1e-4}


@pytest.mark.parametrize("dtype", list(NMSE))
def test_each_dtype_accumulates_in_f32_and_gives_the_same_bytes_twice(dtype):
    params = dict(BASE, seq=50, gate_per_channel=True, value_heads=4)
    thunk, arena = _laid(params, dtype)
    first, second = arena.copy(), arena.copy()
    host_fallback.execute(thunk, first, chunk=16, workers=2)
    host_fallback.execute(thunk, second, chunk=16, workers=2)
    assert np.array_equal(first, second)
    wide, wide_arena = _laid(params)
    copy_inputs(thunk, arena, wide, wide_arena)  # the f64 thunk gets the values the narrow one stores
    want, got = _backward(wide, wide_arena, chunk=16), _read(thunk, first)
    for name, value in want.items():
        err = np.mean((got[name] - value) ** 2) / max(np.mean(value ** 2), 1e-30)
        assert err <= NMSE[dtype], (name, err)


def test_a_nan_in_d_dst_reaches_only_the_steps_before_it_on_the_chunked_path():
    """The chunked GEMMs would spread it over the whole chunk (``0 * nan``): the lane is redone step by step."""
    params = dict(BASE, seq=48, value_heads=4)
    thunk, arena = _laid(params)
    d_dst = next(r for r in regions(thunk) if r.field == "d_dst")
    view(arena, d_dst.offset, "f64", d_dst.shape)[0, 30, 1, 2] = np.nan  # batch row 0, step 30, value head 1
    with np.errstate(invalid="ignore"):
        got = _backward(thunk, arena, path="chunked", chunk=16)
    for name in ("d_v", "d_beta", "d_g"):  # per value head
        bad = np.isnan(got[name])
        assert bad[0, :31, 1].any() and not bad[0, 31:].any() and not bad[:, :, [0, 2, 3]].any(), name
        assert not bad[1].any(), name
    for name in ("d_q", "d_k"):  # key head 0 serves value heads 0 and 1
        bad = np.isnan(got[name])
        assert bad[0, :31, 0].any() and not bad[0, 31:].any() and not bad[:, :, 1].any() and not bad[1].any(), name
    assert np.isnan(got["d_state"][0, 1]).any() and not np.isnan(got["d_state"][[1]]).any()
    assert not np.isnan(got["d_state"][0, [0, 2, 3]]).any()


def test_graph_backward_of_a_gated_delta_net_call_matches_torch_autograd():
    """``Graph.backward`` emits this op's thunk: the caller's initial state is read, its gradient returned."""
    from rlx_gpu.graph.builder import Graph
    b, s, h, hv, n, width = 1, 20, 1, 2, 4, 3
    rng = np.random.default_rng(5)
    values = {"q": rng.standard_normal((b, s, h, n)), "k": rng.standard_normal((b, s, h, n)),
              "v": rng.standard_normal((b, s, hv, width)), "g": -0.3 * rng.random((b, s, hv, n)),
              "beta": rng.random((b, s, hv)), "state": rng.standard_normal((b, hv, n, width)),
              "dy": rng.standard_normal((b, s, hv, width)), "ds": rng.standard_normal((b, hv, n, width))}
    g = Graph("f64")
    t = {f: g.input(f, x.shape) for f, x in values.items()}
    y, _ = g.gated_delta_net(t["q"], t["k"], t["v"], t["g"], t["beta"], gate_per_channel=True,
                             initial_state=t["state"], use_qk_l2norm=True)
    grads = g.backward(y, t["dy"], {"state": t["ds"]})
    assert list(grads) == ["q", "k", "v", "g", "beta", "state"]
    for name, grad in grads.items():
        g.output(f"d_{name}", grad)
    out = g.compile("host").run(**values)
    leaves = {f: torch.tensor(values[f], requires_grad=True) for f in ("q", "k", "v", "g", "beta", "state")}
    o, final = _torch_recurrent(*leaves.values(), n ** -0.5, True)
    ((o * torch.tensor(values["dy"])).sum() + (final * torch.tensor(values["ds"])).sum()).backward()
    for f, leaf in leaves.items():
        np.testing.assert_allclose(out[f"d_{f}"], leaf.grad.numpy(), rtol=1e-9, atol=1e-11, err_msg=f)
