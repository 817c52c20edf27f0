"""host_fallback selective_scan_backward (ABI.md §9) against float64 central finite differences of the
conformance reference's forward, and against torch autograd of mamba_ssm's ``selective_scan_ref`` math
rewritten in float64 torch (``support.selective_scan_torch``).

Every ``d_`` output is checked, the initial state's gradient included, along a random direction per
input (one directional derivative covers every element of it). The shapes are tiny and the chunk short
(``chunk``), so every case crosses chunk boundaries, and packed sequences start inside chunks.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import host_fallback
from support.gradient_check import check_finite_differences, copy_inputs, laid, read, with_gradients
from support.selective_scan_torch import selective_scan_ref, torch_grads
from host_fallback.abi import OPS, OPTIONAL_INPUTS, gradient, regions
from host_fallback.arena import view
from rlx_gpu.conformance.references import V2_FIELDS

OP = "selective_scan_backward"
BASE = dict(batch=2, seq=7, hidden=6, state_size=4)
CARRIED = dict(carry_state=True, state=True)


def _params(**extra) -> dict:
    return with_gradients("selective_scan", {**BASE, **extra})


def _sample(field: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Inputs where the scan is well conditioned: step sizes (and their bias) above 0, decays below 1."""
    x = rng.standard_normal(shape)
    if field in ("delta", "delta_bias"):
        return np.abs(x) * 0.5 + 0.05
    if field == "a":
        return -np.abs(x) - 0.1
    return x


def _laid(dtype: str, params: dict, seed: int = 0) -> tuple[dict, np.ndarray]:
    return laid(OP, dtype, params, _sample, seed)


def _backward(thunk: dict, arena: np.ndarray, chunk: int | None = 3) -> dict[str, np.ndarray]:
    out = arena.copy()
    host_fallback.execute(thunk, out, **({} if chunk is None else {"chunk": chunk}))
    return {f: v for f, v in read(thunk, out).items() if f.startswith("d_") and f != "d_dst"}


_PACKED = dict(batch=1, seq=9, cu_seqlens=[0, 4, 4, 9])  # one empty sequence, the next starting inside a chunk
#: (the version-2 fields a case exercises, its params): each field alone, then sampled combinations
CASES = [
    (set(), {}),
    ({"groups"}, dict(groups=2)),
    ({"delta_bias"}, dict(delta_bias=True)),
    ({"delta_softplus"}, dict(delta_softplus=True)),
    ({"d"}, dict(d=True)),
    ({"z"}, dict(z=True)),
    ({"carry_state", "state"}, CARRIED),
    ({"cu_seqlens", "num_seqs"}, _PACKED),
    ({"carry_state", "state", "state_slots", "num_slots"}, dict(CARRIED, state_slots=[2, 0], num_slots=3)),
    ({"groups", "delta_bias", "delta_softplus", "d", "z"},
     dict(groups=3, delta_bias=True, delta_softplus=True, d=True, z=True)),
    ({"carry_state", "state", "cu_seqlens", "num_seqs", "state_slots", "num_slots", "z", "delta_softplus"},
     dict(_PACKED, **CARRIED, state_slots=[3, 0, 1], num_slots=4, z=True, delta_softplus=True)),
    ({"groups", "carry_state", "state", "d", "delta_bias"}, dict(CARRIED, groups=2, d=True, delta_bias=True)),
]


@pytest.mark.parametrize("fields,extra", CASES, ids=[".".join(sorted(f)) or "base" for f, _ in CASES])
def test_every_gradient_matches_central_finite_differences(fields, extra):
    thunk, arena = _laid("f64", _params(**extra))
    check_finite_differences(thunk, arena, _backward(thunk, arena))


def test_every_field_the_reference_implements_has_a_finite_difference_case():
    gradients = {gradient(name) for name in OPTIONAL_INPUTS["selective_scan"]}
    # (the saved forward, reserve, changes no gradient: test_selective_scan_reserve checks it against recomputing)
    for field in V2_FIELDS[OP] & set(OPS["selective_scan"].defaults) - {"state_dtype", "param_dtype", "reserve",
                                                                       "reserve_bytes"}:
        assert any(field in fields for fields, _ in CASES), f"no backward case of {field}"
    assert V2_FIELDS[OP] >= gradients  # the reference gives every optional gradient


def test_a_softplus_above_20_passes_the_gradient_unchanged():
    """ABI.md §9: softplus is the identity above 20, so delta's gradient there is the unbiased one's."""
    params = _params(delta_bias=True, delta_softplus=True)
    thunk, arena = _laid("f64", params)
    bias = next(r for r in regions(thunk) if r.field == "delta_bias")
    view(arena, bias.offset, "f64", bias.shape)[...] = 30.0  # every channel far past 20: delta + 30
    plain, plain_arena = _laid("f64", _params(delta_bias=True))
    copy_inputs(thunk, arena, plain, plain_arena)  # the same values, without softplus
    with_softplus, without = _backward(thunk, arena), _backward(plain, plain_arena)
    for name, value in without.items():
        np.testing.assert_array_equal(with_softplus[name], value, err_msg=name)


# --- torch autograd of mamba_ssm's reference math ------------------------------------------------------
TORCH = [{}, dict(groups=2, d=True, z=True, delta_bias=True, delta_softplus=True), dict(CARRIED, z=True)]


@pytest.mark.parametrize("extra", TORCH, ids=["base", "knobs", "carried"])
def test_every_gradient_matches_torch_autograd_of_mamba_ssm_reference(extra):
    thunk, arena = _laid("f64", _params(**extra, seq=40), seed=3)
    grads = _backward(thunk, arena, chunk=None)  # the default chunk: 40 steps take two
    want = torch_grads(thunk, read(thunk, arena))
    assert set(want) == set(grads)
    for name, value in want.items():
        np.testing.assert_allclose(grads[name], value, rtol=1e-10, atol=1e-12, err_msg=name)


# --- dtypes and determinism ---------------------------------------------------------------------------
#: NMSE of each gradient of a 16-bit / f32 thunk against the f64 backward on the same stored inputs: the
#: outputs are rounded once (bf16 2^-8, f16 2^-11 relative) and everything before that is f32.
NMSE = {"f32": 1e-10, "f16": 1e-6, "bf16": 1e-4}
#: every field at once over 70 steps (three chunks of 32): one empty sequence, one starting inside the first chunk
EVERY_FIELD = _params(**CARRIED, batch=1, seq=70, cu_seqlens=[0, 20, 20, 70], state_slots=[3, 0, 1], num_slots=4,
                      groups=2, d=True, z=True, delta_bias=True, delta_softplus=True)


@pytest.mark.parametrize("dtype", list(NMSE))
def test_each_dtype_accumulates_in_f32_and_gives_the_same_bytes_twice(dtype):
    thunk, arena = _laid(dtype, EVERY_FIELD)
    first, second = arena.copy(), arena.copy()
    host_fallback.execute(thunk, first)
    host_fallback.execute(thunk, second)
    assert np.array_equal(first, second)
    wide, wide_arena = _laid("f64", EVERY_FIELD)
    copy_inputs(thunk, arena, wide, wide_arena)  # the f64 thunk gets the values the narrow one stores
    want, got = _backward(wide, wide_arena, chunk=None), read(thunk, first)
    for name, value in want.items():
        err = np.mean((got[name] - value) ** 2) / max(np.mean(value ** 2), 1e-30)
        assert err <= NMSE[dtype], (name, err)


def test_a_wider_state_and_parameter_type_carries_a_16_bit_thunk_in_f32():
    """bf16 activations with f32 ``state`` and ``a``/``d``/``delta_bias`` (mamba_ssm's mix): those gradients are
    stored in f32, and match the f64 backward to f32 accuracy."""
    params = dict(EVERY_FIELD, state_dtype="f32", param_dtype="f32")
    thunk, arena = _laid("bf16", params)
    kinds = {r.field: r.dtype for r in regions(thunk)}
    assert {kinds[f] for f in ("d_a", "d_d", "d_delta_bias", "d_state")} == {"f32"}
    out = arena.copy()
    host_fallback.execute(thunk, out)
    got = read(thunk, out)
    wide, wide_arena = _laid("f64", EVERY_FIELD)
    copy_inputs(thunk, arena, wide, wide_arena)
    want = _backward(wide, wide_arena, chunk=None)
    for name in ("d_a", "d_d", "d_delta_bias", "d_state"):
        err = np.mean((got[name] - want[name]) ** 2) / np.mean(want[name] ** 2)
        assert err <= 1e-10, (name, err)


def test_the_chunk_length_changes_no_gradient_beyond_rounding():
    thunk, arena = _laid("f64", EVERY_FIELD)
    one, many = _backward(thunk, arena, chunk=1), _backward(thunk, arena, chunk=64)
    for name, value in one.items():
        np.testing.assert_allclose(many[name], value, rtol=1e-12, atol=1e-12, err_msg=name)


def test_a_chunk_below_one_step_is_refused():
    thunk, arena = _laid("f32", _params())
    with pytest.raises(ValueError, match="chunk must be at least 1 step, got 0"):
        host_fallback.execute(thunk, arena, chunk=0)


def test_rows_split_across_threads_give_the_gradients_of_one_thread_and_the_same_bytes_twice():
    params = _params(**CARRIED, batch=3, seq=40, d=True, delta_bias=True)
    thunk, arena = _laid("f32", params)
    split = [arena.copy(), arena.copy()]
    for out in split:
        host_fallback.execute(thunk, out, workers=2)
    assert np.array_equal(*split)
    one = arena.copy()
    host_fallback.execute(thunk, one, workers=1)
    got, want = read(thunk, split[0]), read(thunk, one)
    for r in regions(thunk):
        if r.field.startswith("d_") and r.field != "d_dst":
            np.testing.assert_allclose(got[r.field], want[r.field], rtol=1e-5, atol=1e-5, err_msg=r.field)


def test_a_graph_differentiates_its_selective_scan_on_the_host_as_torch_autograd_does():
    """``Graph.backward`` of a selective_scan with every knob and a carried state, compiled for the host."""
    from rlx_gpu.graph.builder import Graph

    rng = np.random.default_rng(5)
    B, S, H, N, G = 2, 40, 4, 3, 2
    values = {"x": rng.standard_normal((B, S, H)), "delta": _sample("delta", (B, S, H), rng),
              "a": _sample("a", (H, N), rng), "b": rng.standard_normal((B, S, G, N)),
              "c": rng.standard_normal((B, S, G, N)), "d": rng.standard_normal(H), "z": rng.standard_normal((B, S, H)),
              "delta_bias": _sample("delta_bias", (H,), rng), "state": rng.standard_normal((B, H, N)),
              "dy": rng.standard_normal((B, S, H)), "dstate": rng.standard_normal((B, H, N))}
    g = Graph("f64")
    t = {f: g.input(f, v.shape) for f, v in values.items()}
    y, _ = g.selective_scan(t["x"], t["delta"], t["a"], t["b"], t["c"], D=t["d"], z=t["z"], delta_bias=t["delta_bias"],
                            delta_softplus=True, initial_state=t["state"])
    for name, grad in g.backward(y, t["dy"], {"state": t["dstate"]}).items():
        g.output(f"d_{name}", grad)
    got = g.compile("host").run(**values)

    leaves = {f: torch.tensor(v, requires_grad=True) for f, v in values.items() if f not in ("dy", "dstate")}
    channel_major = lambda v: v.transpose(1, 2)  # noqa: E731
    out, last = selective_scan_ref(channel_major(leaves["x"]), channel_major(leaves["delta"]), leaves["a"],
                                    leaves["b"].permute(0, 2, 3, 1), leaves["c"].permute(0, 2, 3, 1), D=leaves["d"],
                                    z=channel_major(leaves["z"]), delta_bias=leaves["delta_bias"], delta_softplus=True,
                                    initial=leaves["state"])
    ((channel_major(out) * torch.tensor(values["dy"])).sum() + (last * torch.tensor(values["dstate"])).sum()).backward()
    assert {f for f in got if f.startswith("d_")} == {f"d_{f}" for f in leaves}
    for name, leaf in leaves.items():
        np.testing.assert_allclose(got[f"d_{name}"], leaf.grad.numpy(), rtol=1e-10, atol=1e-12, err_msg=name)
