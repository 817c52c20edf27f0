"""A state-space op's saved forward (ABI.md §9.1) laid out for the tests: the backward thunk with a reserve, its
arena, and the forward thunk that fills that reserve; the forward run into a longer arena (its ``dst`` placed past
the backward's tensors), the reserve copied over, and the gradients read back. ``OPS`` holds each op's cases."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


import numpy as np

import host_fallback
import rlx_gpu
from host_fallback.abi import regions

from rlx_gpu.conformance.runner import sample as catalog_sample

from .gradient_check import Sample, laid, read, with_gradients


def decaying_sampler(positive: str) -> Sample:
    """Inputs drawn from a normal law, the step ``positive`` (dt, delta) small and positive and ``a`` negative:
    every state decays."""
    def sample(field: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
        values = rng.standard_normal(shape)
        if field == positive:
            return np.abs(values) * 0.3 + 0.02
        return -np.abs(values) - 0.1 if field == "a" else values
    return sample


def laid_with_reserve(op: str, dtype: str, params: dict, sample: Sample) -> tuple[dict, np.ndarray, dict]:
    """``op``'s backward thunk with a reserve of ``rlx_gpu.reserve_bytes``, its arena (inputs drawn by ``sample``),
    and the forward thunk reading the same inputs and writing that reserve."""
    params = with_gradients(op, params)
    need = rlx_gpu.reserve_bytes({"op": op, "dtype": dtype, **params})
    thunk, arena = laid(f"{op}_backward", dtype, {**params, "reserve": True, "reserve_bytes": need}, sample)
    forward = {k: v for k, v in thunk.items() if not k.startswith("d_")}
    forward.update(op=op, dst=-(-arena.size // 16) * 16)
    return thunk, arena, forward


def run_forward(forward: dict, arena: np.ndarray, **options) -> np.ndarray:
    """The arena after ``forward``, lengthened to hold its ``dst``."""
    dst = next(r for r in regions(forward) if r.field == "dst")
    longer = np.zeros(dst.offset + dst.nbytes, np.uint8)
    longer[:arena.size] = arena
    host_fallback.execute(forward, longer, **options)
    return longer


def without_reserve(thunk: dict) -> dict:
    return {k: v for k, v in thunk.items() if k not in ("reserve", "reserve_bytes")}


def gradients(thunk: dict, arena: np.ndarray) -> dict[str, np.ndarray]:
    """The backward ``thunk``'s gradients (float64, by field) run on a copy of ``arena``."""
    out = arena.copy()
    host_fallback.execute(thunk, out)
    return {f: v for f, v in read(thunk, out).items() if f.startswith("d_") and f != "d_dst"}


def filled_reserve(thunk: dict, arena: np.ndarray, forward: dict, **options) -> np.ndarray:
    """A copy of ``arena`` whose reserve holds what ``forward`` (run with ``options``) wrote there."""
    start, end = thunk["reserve"], thunk["reserve"] + thunk["reserve_bytes"]
    out = arena.copy()
    out[start:end] = run_forward(forward, arena, **options)[start:end]
    return out


def matches_recomputed(thunk: dict, arena: np.ndarray, forward: dict, tol: float) -> tuple[dict, np.ndarray]:
    """Asserts that the gradients the backward ``thunk`` reads from the reserve ``forward`` wrote equal those it
    recomputes without one, within ``tol`` of each gradient's largest magnitude; returns them and the arena
    with the reserve filled."""
    saved = filled_reserve(thunk, arena, forward)
    got, expected = gradients(thunk, saved), gradients(without_reserve(thunk), arena)
    assert set(got) == set(expected)
    for name in expected:
        scale = np.abs(expected[name]).max() + 1e-30
        np.testing.assert_allclose(got[name], expected[name], rtol=0, atol=tol * scale, err_msg=name)
    return got, saved


@dataclass(frozen=True)
class SavedForwardOp:
    """The cases of one op's saved-forward tests: ``base`` params (several chunks, the last partial) and named
    ``cases`` over them; ``tol`` the largest gradient difference from recomputing, relative to the gradient's
    largest magnitude, per dtype; ``forward_tol`` how far a forward writing a reserve may be from one without
    (0: the same values); ``chunk`` the tokens a reserve's chunk holds; ``read`` a gradient that changes when
    the reserve does, from sequences of ``reads_from`` tokens (shorter ones' backward may need none of it);
    ``packed`` params of packed sequences; ``sample(params)`` the inputs' law."""

    base: dict
    cases: tuple[tuple[str, dict], ...]
    tol: dict
    forward_tol: float
    chunk: int
    read: str
    packed: dict
    sample: Callable[[dict], Sample]
    reads_from: int = 1


_GDN_BASE = dict(batch=2, seq=70, heads=2, state_size=4, gate_per_channel=False, carry_state=False)
_GRADIENT_TOL = {"f64": 1e-11, "f32": 2e-5, "bf16": 2e-2}

OPS = {
    "selective_scan": SavedForwardOp(
        base=dict(batch=2, seq=100, hidden=6, state_size=4),
        cases=(("base", {}), ("one_chunk", dict(seq=20)), ("groups.d.z", dict(groups=2, d=True, z=True)),
               ("knobs.carry.slots", dict(delta_bias=True, delta_softplus=True, carry_state=True, state=True,
                                          state_slots=[2, 0], num_slots=3))),
        tol={"f64": 1e-12, "f32": 1e-5, "bf16": 1e-2}, forward_tol=1e-13, chunk=32, read="d_c",
        packed=dict(batch=1, seq=20, hidden=4, state_size=4, cu_seqlens=[0, 7, 20], num_seqs=2),
        sample=lambda params: decaying_sampler("delta"), reads_from=33),
    "mamba2": SavedForwardOp(
        base=dict(batch=2, seq=150, heads=2, head_dim=3, state_size=4),
        cases=(("base", {}), ("exact_chunks", dict(seq=128)), ("one_chunk", dict(seq=40)),
               ("groups.d.z", dict(heads=4, groups=2, d=True, z=True)),
               ("dt_knobs", dict(dt_bias=True, dt_softplus=True, dt_limit=[0.0, 1.2], z=True)),
               ("carry.slots", dict(carry_state=True, state=True, state_slots=[2, 0], num_slots=3, d=True))),
        tol=_GRADIENT_TOL, forward_tol=0.0, chunk=64, read="d_c", reads_from=65,
        packed=dict(batch=1, seq=20, heads=2, head_dim=3, state_size=4, cu_seqlens=[0, 7, 20], num_seqs=2),
        sample=lambda params: decaying_sampler("dt")),
    "gated_delta_net": SavedForwardOp(
        base=_GDN_BASE,
        cases=(("per_head", {}), ("per_channel", dict(gate_per_channel=True)), ("exact_chunks", dict(seq=64)),
               ("one_chunk", dict(seq=20, gate_per_channel=True)),
               ("groups.width.l2.scale", dict(value_heads=4, value_size=3, qk_l2norm=True, scale=0.7)),
               ("carry.slots", dict(carry_state=True, state_slots=[2, 0], num_slots=3, gate_per_channel=True)),
               ("state_f64", dict(carry_state=True, state_dtype="f64"))),  # an f64 reserve whatever the dtype
        tol=_GRADIENT_TOL, forward_tol=0.0, chunk=32, read="d_v",
        packed=dict(_GDN_BASE, batch=1, seq=20, cu_seqlens=[0, 7, 20], num_seqs=2),
        sample=lambda params: (lambda field, shape, rng: catalog_sample("gated_delta_net_backward", params, field,
                                                                        shape, rng))),
}


def laid_case(op: str, dtype: str, case: str | dict) -> tuple[dict, np.ndarray, dict]:
    """``laid_with_reserve`` of ``op``'s base params updated by ``case``: the name of one of its ``cases`` or the
    params themselves."""
    spec = OPS[op]
    params = {**spec.base, **(dict(spec.cases)[case] if isinstance(case, str) else case)}
    return laid_with_reserve(op, dtype, params, spec.sample(params))
