"""The host's selective_scan with a saved forward (ABI.md §9.1): a training forward writes the reserve (the
state leaving every chunk of 32 tokens), the backward reads those states instead of its forward pass over the
chunks. Its gradients against the backward that recomputes, the forward's outputs unchanged by writing it,
the states against the step recurrence's, and packed sequences refused."""
from __future__ import annotations

import numpy as np
import pytest

import host_fallback
import rlx_gpu
from host_fallback.abi import regions
from host_fallback.ssm import reserve_views
from rlx_gpu.conformance.cases import lay_out, schedule_of
from support.gradient_check import laid, read, with_gradients

BASE = dict(batch=2, seq=100, hidden=6, state_size=4)  # four chunks, the last one partial
CASES = [
    ("base", {}),
    ("one_chunk", dict(seq=20)),
    ("groups.d.z", dict(groups=2, d=True, z=True)),
    ("knobs.carry.slots", dict(delta_bias=True, delta_softplus=True, carry_state=True, state=True,
                               state_slots=[2, 0], num_slots=3)),
]
IDS = [label for label, _ in CASES]
TOL = {"f64": 1e-12, "f32": 1e-5, "bf16": 1e-2}


def _sample(field: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    values = rng.standard_normal(shape)
    if field == "delta":
        return np.abs(values) * 0.3 + 0.02
    return -np.abs(values) - 0.1 if field == "a" else values


def _laid(dtype: str, extra: dict) -> tuple[dict, np.ndarray, dict]:
    params = with_gradients("selective_scan", {**BASE, **extra})
    need = rlx_gpu.reserve_bytes({"op": "selective_scan", "dtype": dtype, **params})
    thunk, arena = laid("selective_scan_backward", dtype, {**params, "reserve": True, "reserve_bytes": need}, _sample)
    forward = {k: v for k, v in thunk.items() if not k.startswith("d_")}
    forward.update(op="selective_scan", dst=-(-arena.size // 16) * 16)
    return thunk, arena, forward


def _run_forward(forward: dict, arena: np.ndarray, **options) -> np.ndarray:
    dst = next(r for r in regions(forward) if r.field == "dst")
    longer = np.zeros(dst.offset + dst.nbytes, np.uint8)
    longer[:arena.size] = arena
    host_fallback.execute(forward, longer, **options)
    return longer


def _without_reserve(thunk: dict) -> dict:
    return {k: v for k, v in thunk.items() if k not in ("reserve", "reserve_bytes")}


def _gradients(thunk: dict, arena: np.ndarray) -> dict[str, np.ndarray]:
    out = arena.copy()
    host_fallback.execute(thunk, out)
    return {f: v for f, v in read(thunk, out).items() if f.startswith("d_") and f != "d_dst"}


def _saved(thunk: dict, arena: np.ndarray, forward: dict, **options) -> np.ndarray:
    start, end = thunk["reserve"], thunk["reserve"] + thunk["reserve_bytes"]
    saved = arena.copy()
    saved[start:end] = _run_forward(forward, arena, **options)[start:end]
    return saved


@pytest.mark.parametrize("dtype", ["f64", "f32", "bf16"])
@pytest.mark.parametrize("extra", [e for _, e in CASES], ids=IDS)
def test_gradients_read_from_the_reserve_match_the_recomputed_ones(extra, dtype):
    thunk, arena, forward = _laid(dtype, extra)
    saved = _saved(thunk, arena, forward)
    got, expected = _gradients(thunk, saved), _gradients(_without_reserve(thunk), arena)
    assert set(got) == set(expected)
    for name in expected:
        scale = np.abs(expected[name]).max() + 1e-30
        np.testing.assert_allclose(got[name], expected[name], rtol=0, atol=TOL[dtype] * scale, err_msg=name)
    if thunk["seq"] > 32:  # the reserve is read: others states give other gradients
        start = thunk["reserve"]
        saved[start: start + thunk["reserve_bytes"]] = 0
        assert not np.array_equal(_gradients(thunk, saved)["d_c"], got["d_c"])


@pytest.mark.parametrize("extra", [e for _, e in CASES], ids=IDS)
def test_the_forward_writing_a_reserve_gives_the_outputs_of_one_without(extra):
    _, arena, forward = _laid("f64", extra)
    with_reserve, without = _run_forward(forward, arena), _run_forward(_without_reserve(forward), arena)
    for r in regions(_without_reserve(forward)):
        if r.writes:
            np.testing.assert_allclose(read(forward, with_reserve)[r.field], read(forward, without)[r.field],
                                       rtol=1e-13, atol=1e-13, err_msg=r.field)


def test_the_saved_states_are_the_recurrences_after_every_32_tokens():
    thunk, arena, forward = _laid("f64", CASES[2][1])
    states = reserve_views(thunk, _saved(thunk, arena, forward, path="step"))["states"]
    values = read(thunk, arena)
    delta, x, a = values["delta"], values["x"], values["a"]
    bsz, seq, hidden = x.shape
    b = np.repeat(values["b"], hidden // 2, axis=2)  # [B, S, H, N]: each channel's group
    h = np.zeros((bsz, hidden, a.shape[1]))
    for t in range(seq):
        h = np.exp(delta[:, t, :, None] * a) * h + (delta[:, t] * x[:, t])[..., None] * b[:, t]
        if (t + 1) % 32 == 0 or t + 1 == seq:
            np.testing.assert_allclose(states[:, t // 32], h, rtol=1e-12, atol=1e-12)


def test_a_saved_forward_of_packed_sequences_is_refused():
    params = dict(batch=1, seq=20, hidden=4, state_size=4, cu_seqlens=[0, 7, 20], num_seqs=2)
    need = rlx_gpu.reserve_bytes({"op": "selective_scan", "dtype": "f32", **params})
    for op in ("selective_scan", "selective_scan_backward"):
        thunk, nbytes = lay_out(op, "f32", {**with_gradients("selective_scan", params), "reserve": True,
                                            "reserve_bytes": need})
        with pytest.raises(rlx_gpu.ScheduleError, match=rf"\({op}\), field 'reserve': a saved forward of packed seq"):
            rlx_gpu.load_schedule(schedule_of(thunk, nbytes))
