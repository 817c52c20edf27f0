"""host_fallback mamba2_backward (ABI.md §9) against float64 central finite differences of the conformance
reference's forward, and against torch autograd (float64) of two torch forwards written here: the SSD
chunked form (the math of mamba_ssm's ``ssd_minimal_discrete``) and the per-step recurrence.

Every ``d_`` output is checked, ``d_state`` included, along a random direction per input (one directional
derivative covers every element of it), on both host paths (the step path from checkpoints and the
chunked form, with chunks short enough that a tiny sequence spans several). Then the dtypes: 16-bit
thunks against the f64 backward on the same stored values, and the same bytes on every run.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import host_fallback
from support.gradient_check import check_finite_differences, laid, read, with_gradients
from host_fallback.abi import gradient, regions
from host_fallback.arena import view

BASE = dict(batch=2, seq=7, heads=2, head_dim=3, state_size=4)
#: Packed sequences, one empty and one crossing chunks of 4, through slots of a pool of 5.
PACKED = dict(batch=1, seq=20, cu_seqlens=[0, 3, 3, 12, 20], state_slots=[4, 0, 2, 1], num_slots=5)
CARRIED = dict(carry_state=True, state=True)
KNOBS = dict(dt_bias=True, dt_softplus=True, dt_limit=[0.3, 1.2], d=True, z=True)  # some dt clamped, most not


def _params(**extra) -> dict:
    return with_gradients("mamba2", {**BASE, **extra})


def _sample(field: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random inputs, step sizes positive and decays negative."""
    values = rng.standard_normal(shape)
    if field == "dt":
        return np.abs(values) * 0.5 + 0.05
    if field == "a":
        return -np.abs(values) - 0.1
    return values


def _laid(dtype: str, params: dict, seed: int = 0) -> tuple[dict, np.ndarray]:
    """A backward thunk and its arena with every input random."""
    return laid("mamba2_backward", dtype, params, _sample, seed)


def _backward(thunk: dict, arena: np.ndarray, **options) -> dict[str, np.ndarray]:
    out = arena.copy()
    host_fallback.execute(thunk, out, **options)
    return {f: v for f, v in read(thunk, out).items() if f.startswith("d_") and f != "d_dst"}


#: (label, params) of the finite-difference cases: each field alone and all of them at once
FIELDS = [
    ("base", {}),
    ("groups.d.z", dict(heads=4, groups=2, d=True, z=True)),
    ("dt_knobs", dict(dt_bias=True, dt_softplus=True, dt_limit=[0.3, 1.2])),
    ("carry", CARRIED),
    ("packed.slots.all", dict(PACKED, heads=4, groups=1, **CARRIED, **KNOBS)),
    ("packed", dict(PACKED, dt_bias=True)),
]


@pytest.mark.parametrize("path", ["step", "chunked"])
@pytest.mark.parametrize("label,extra", FIELDS, ids=[label for label, _ in FIELDS])
def test_every_gradient_matches_central_finite_differences(label, extra, path):
    thunk, arena = _laid("f64", _params(**extra), seed=len(label))
    check_finite_differences(thunk, arena, _backward(thunk, arena, path=path, chunk=4))


def test_a_dt_at_a_limit_or_past_the_softplus_knee_passes_its_gradient():
    """ABI.md §9: softplus above 20 is the identity and the clamp passes the gradient at its bounds. A thunk
    with softplus and ``dt_limit [0, 21]`` against one without either, given the dt the first computes."""
    knobs = _params(batch=1, seq=3, heads=1, dt_softplus=True, dt_limit=[0.0, 21.0])
    thunk, arena = _laid("f64", knobs)
    plain, plain_arena = _laid("f64", _params(batch=1, seq=3, heads=1))
    raw = np.array([21.0, 30.0, 0.5])  # softplus: 21 (at the bound), 30 (clamped to 21), log1p(e^0.5)
    for t, a, dt in ((thunk, arena, raw), (plain, plain_arena, [21.0, 21.0, np.log1p(np.exp(0.5))])):
        for r in regions(t):
            source = next(x for x in regions(thunk) if x.field == r.field)
            view(a, r.offset, r.dtype, r.shape)[...] = view(arena, source.offset, source.dtype, source.shape)
        view(a, t["dt"], "f64", (3,))[...] = dt
    got, want = _backward(thunk, arena)["d_dt"].ravel(), _backward(plain, plain_arena)["d_dt"].ravel()
    assert got[0] == want[0] != 0  # at the upper bound and past the knee: slope 1
    assert got[1] == 0 != want[1]  # past the bound: clamped
    assert got[2] == pytest.approx(want[2] / (1 + np.exp(-0.5)), rel=1e-12)  # softplus' slope, sigmoid


# --- torch autograd of two independent float64 forwards -----------------------------------------------
def _torch_ssd_chunked(xs, logd, b, c, init, length):
    """The SSD form over chunks (the math of mamba_ssm's ``ssd_minimal_discrete``): ``xs [B,S,H,P]``
    (dt*x), ``logd [B,S,H]`` (dt*a), ``b, c [B,S,H,N]``, ``init [B,H,P,N]``. Returns ``(y, final)``."""
    seq = xs.shape[1]
    state, ys = init, []
    for lo in range(0, seq, length):
        span = slice(lo, min(seq, lo + length))
        cum = torch.cumsum(logd[:, span], dim=1)  # [B,L,H]
        steps = cum.shape[1]
        lower = torch.tril(torch.ones(steps, steps, dtype=torch.bool))
        gaps = cum[:, :, None, :] - cum[:, None, :, :]  # [B,L(i),L(j),H]: cum_i - cum_j
        decay = torch.where(lower[None, :, :, None], torch.exp(torch.where(lower[None, :, :, None], gaps, 0.0)), 0.0)
        scores = torch.einsum("bihn,bjhn->bijh", c[:, span], b[:, span]) * decay
        y = torch.einsum("bijh,bjhp->bihp", scores, xs[:, span])
        y = y + torch.einsum("bihn,bhpn->bihp", c[:, span] * torch.exp(cum)[..., None], state)
        ys.append(y)
        to_end = torch.exp(cum[:, -1:] - cum)  # [B,L,H]
        state = torch.exp(cum[:, -1])[..., None, None] * state + \
            torch.einsum("bjh,bjhp,bjhn->bhpn", to_end, xs[:, span], b[:, span])
    return torch.cat(ys, dim=1), state


def _torch_ssd_steps(xs, logd, b, c, init):
    """The recurrence of ABI.md §4, one step at a time (same arguments as ``_torch_ssd_chunked``)."""
    state, ys = init, []
    for t in range(xs.shape[1]):
        state = torch.exp(logd[:, t])[..., None, None] * state + xs[:, t, ..., None] * b[:, t, ..., None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, c[:, t]))
    return torch.stack(ys, dim=1), state


def _torch_grads(thunk: dict, values: dict[str, np.ndarray], ssd) -> dict[str, np.ndarray]:
    """``gradient_check.loss`` through a torch forward (batch rows, no packing), and the gradient of every input."""
    leaves = {f: torch.tensor(v, requires_grad=True) for f, v in values.items()
              if not f.startswith("d_") and f in ("x", "dt", "a", "b", "c", "dt_bias", "d", "z", "state")}
    per_group = thunk["heads"] // thunk.get("groups", thunk["heads"])
    dt = leaves["dt"] + leaves["dt_bias"] if "dt_bias" in leaves else leaves["dt"]
    if thunk.get("dt_softplus"):
        dt = torch.nn.functional.softplus(dt, threshold=20.0)
    if thunk.get("dt_limit"):
        dt = torch.clamp(dt, *thunk["dt_limit"])
    b, c = (leaves[f].repeat_interleave(per_group, dim=2) for f in "bc")
    init = leaves["state"] if "state" in leaves else torch.zeros(thunk["batch"], thunk["heads"], thunk["head_dim"],
                                                                  thunk["state_size"], dtype=torch.float64)
    y, final = ssd(leaves["x"] * dt[..., None], dt * leaves["a"], b, c, init)
    if "d" in leaves:
        y = y + leaves["d"][:, None] * leaves["x"]
    if "z" in leaves:
        y = y * torch.nn.functional.silu(leaves["z"])
    loss = (y * torch.tensor(values["d_dst"])).sum()
    if "state" in leaves:
        loss = loss + (final * torch.tensor(values["d_state"])).sum()
    loss.backward()
    return {gradient(f): leaf.grad.numpy() for f, leaf in leaves.items()}


TORCH = [("base", dict(seq=30)), ("all", dict(seq=30, heads=4, groups=2, **CARRIED, **KNOBS))]


@pytest.mark.parametrize("form", ["chunked", "steps"])
@pytest.mark.parametrize("label,extra", TORCH, ids=[label for label, _ in TORCH])
def test_every_gradient_matches_torch_autograd(label, extra, form):
    thunk, arena = _laid("f64", _params(**extra), seed=3)
    ssd = (lambda *a: _torch_ssd_chunked(*a, 8)) if form == "chunked" else _torch_ssd_steps
    want = _torch_grads(thunk, read(thunk, arena), ssd)
    grads = _backward(thunk, arena, chunk=16)  # the host's chunks differ from the torch form's
    assert set(want) == set(grads)
    for name, value in want.items():
        np.testing.assert_allclose(grads[name], value, rtol=1e-9, atol=1e-11, err_msg=f"{label} {name}")


# --- dtypes and determinism ---------------------------------------------------------------------------
#: NMSE of each gradient of a 16-bit / f32 thunk against the f64 backward on the same stored values: the
#: outputs are rounded once (bf16 2^-8, f16 2^-11 relative) and everything before that is f32.
NMSE = {"f32": 1e-10, "f16": 1e-6, "bf16": 1e-4}
#: The per-head gradients, each a sum over every token, channel and state whose terms cancel to a value far below
#: them: at f32 the BLAS kernels' rounding moves them past NMSE's bound (d_a 2.3e-10 with OpenBLAS's Haswell
#: kernels on a Zen 5, 1.7e-11 with its SkylakeX ones; the other gradients ~1e-13 with either).
PER_HEAD, PER_HEAD_NMSE = ("d_a", "d_d", "d_dt_bias"), {"f32": 1e-9}
WIDE = dict(seq=150, heads=4, groups=2, head_dim=8, state_size=8, **CARRIED, **KNOBS)


@pytest.mark.parametrize("dtype", list(NMSE))
def test_each_dtype_accumulates_in_f32_and_gives_the_same_bytes_twice(dtype):
    params = _params(**WIDE)
    thunk, arena = _laid(dtype, params)
    runs = [arena.copy() for _ in range(3)]
    for run, workers in zip(runs, (2, 2, 1)):
        host_fallback.execute(thunk, run, workers=workers)
    assert np.array_equal(runs[0], runs[1])
    assert np.array_equal(runs[0], runs[2])  # the split over threads changes no sum
    wide, wide_arena = _laid("f64", params)
    for r in regions(thunk):  # the f64 thunk gets the values the narrow one stores
        if r.reads and r.dtype != "i32":
            w = next(x for x in regions(wide) if x.field == r.field)
            view(wide_arena, w.offset, "f64", w.shape)[...] = view(arena, r.offset, r.dtype, r.shape)
    want, got = _backward(wide, wide_arena), read(thunk, runs[0])
    for name, value in want.items():
        err = np.mean((got[name] - value) ** 2) / max(np.mean(value ** 2), 1e-30)
        assert err <= (PER_HEAD_NMSE.get(dtype, NMSE[dtype]) if name in PER_HEAD else NMSE[dtype]), (name, err)


def test_a_state_kept_wider_than_the_thunk_carries_its_gradient_at_its_own_precision():
    """bf16 activations, f32 state and parameters (mamba_ssm's mix): d_state and d_a/d_d/d_dt_bias are f32."""
    params = _params(**WIDE, state_dtype="f32", param_dtype="f32")
    thunk, arena = _laid("bf16", params)
    got = _backward(thunk, arena)
    for field in ("d_state", "d_a", "d_d", "d_dt_bias"):
        assert next(r for r in regions(thunk) if r.field == field).dtype == "f32"
    wide, wide_arena = _laid("f64", _params(**WIDE))
    for r in regions(thunk):
        if r.reads and r.dtype != "i32":
            w = next(x for x in regions(wide) if x.field == r.field)
            view(wide_arena, w.offset, "f64", w.shape)[...] = view(arena, r.offset, r.dtype, r.shape)
    want = _backward(wide, wide_arena)
    for name in ("d_state", "d_a", "d_d", "d_dt_bias"):  # f32 storage: no bf16 rounding on these
        err = np.mean((got[name] - want[name]) ** 2) / np.mean(want[name] ** 2)
        assert err <= 1e-9, (name, err)


def test_graph_backward_of_a_mamba2_call_runs_on_the_host_and_matches_torch_autograd():
    """The builder's ``Graph.backward`` emits the thunk this kernel runs: the whole path, graph to gradients."""
    from rlx_gpu.graph.builder import Graph

    bsz, seq, heads, p, n = 2, 12, 2, 3, 4
    rng = np.random.default_rng(5)
    values = {"x": rng.standard_normal((bsz, seq, heads, p)), "dt": np.abs(rng.standard_normal((bsz, seq, heads))),
              "a": -np.abs(rng.standard_normal(heads)), "b": rng.standard_normal((bsz, seq, heads, n)),
              "c": rng.standard_normal((bsz, seq, heads, n)), "dt_bias": rng.standard_normal(heads),
              "d": rng.standard_normal(heads), "z": rng.standard_normal((bsz, seq, heads, p)),
              "state": rng.standard_normal((bsz, heads, p, n)), "d_dst": rng.standard_normal((bsz, seq, heads, p)),
              "d_state": rng.standard_normal((bsz, heads, p, n))}
    g = Graph("f64")
    t = {f: g.input(f"in_{f}", v.shape) for f, v in values.items()}  # the outputs take the d_ names
    y, _ = g.mamba2(t["x"], t["dt"], t["a"], t["b"], t["c"], D=t["d"], z=t["z"], dt_bias=t["dt_bias"],
                    dt_softplus=True, initial_state=t["state"])
    for name, grad in g.backward(y, t["d_dst"], {"state": t["d_state"]}).items():
        g.output(f"d_{name}", grad)
    out = g.compile("host").run(**{f"in_{f}": v for f, v in values.items()})
    thunk = dict(batch=bsz, heads=heads, head_dim=p, state_size=n, dt_softplus=True)
    want = _torch_grads(thunk, values, _torch_ssd_steps)
    assert set(want) == {f for f in out if f.startswith("d_")}
    for name, value in want.items():
        np.testing.assert_allclose(out[name], value, rtol=1e-9, atol=1e-11, err_msg=name)
