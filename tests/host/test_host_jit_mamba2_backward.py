"""host_fallback's compiled passes of mamba2's chunked backward (``jit_mamba2_backward``: the decayed products'
operands and what follows each slab's GEMMs; ``jit_mamba2_saved``: every chunk with a saved forward; bound by
``mamba2_backward_chunked``) beside NumPy's (``RLX_HOST_JIT=0``).

Both paths of an f32 thunk against the float64 conformance reference (``reference_mamba2_backward``, one step at a
time from ABI.md's formulas) on the values the thunk stores: every version-2 field, chunks that end inside the
sequence, packed sequences through state slots, a saved forward (ABI.md §9.1) read in place of the recomputed states,
16-bit storage computed in f32; NaN where the step recurrence puts it; the same bytes on every run and on one thread
or two; NumPy's path where the passes do not apply (a thunk computing in f64).
"""
from __future__ import annotations

from collections import ChainMap

import numpy as np
import pytest

import host_fallback
from host_fallback.abi import complete
from rlx_gpu.conformance.reference_mamba2_backward import backward as float64_backward
from support.gradient_check import laid, read, with_gradients
from support.host_jit import compiled, count_calls, gradients  # noqa: F401  (compiled: a fixture)
from support.saved_forward import filled_reserve, laid_with_reserve

numba = pytest.importorskip("numba", reason="the jit extra (Numba) is not installed")
from host_fallback import jit, jit_mamba2_backward, jit_mamba2_saved  # noqa: E402  (needs Numba)

OP = "mamba2"
KERNELS = ("mamba2_backward_gradients", "mamba2_backward_operands", "mamba2_backward_state_gradients")
#: the pass with a saved forward: every chunk in one, its GEMMs in jit_lstm's register tiles
SAVED_KERNEL = "mamba2_backward_saved"
#: NMSE of each f32 gradient against float64's (test_mamba2_backward's bound for f32), and of 16-bit storage
NMSE = {"f32": 1e-10, "f16": 1e-6, "bf16": 1e-4}
CARRIED = dict(carry_state=True, state=True)
KNOBS = dict(dt_bias=True, dt_softplus=True, dt_limit=[0.05, 1.2], d=True, z=True)
#: (label, params, chunk): 45 tokens in chunks of 16 end a chunk inside the sequence; 32 in chunks of 8 do not
CASES = [
    ("base", dict(batch=2, seq=45, heads=2, head_dim=5, state_size=6), 16),
    ("exact-chunks", dict(batch=1, seq=32, heads=2, head_dim=4, state_size=3), 8),
    ("every-field", dict(**CARRIED, **KNOBS, batch=2, seq=45, heads=4, groups=2, head_dim=5, state_size=6,
                         state_slots=[2, 0], num_slots=3), 16),
]
#: packed sequences through state slots, every field: one empty sequence, one crossing chunks
PACKED = dict(**CARRIED, **KNOBS, batch=1, seq=40, heads=2, head_dim=3, state_size=4, cu_seqlens=[0, 9, 9, 40],
              state_slots=[3, 0, 1], num_slots=4)


def _sample(field: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Step sizes positive and decays negative (test_mamba2_backward's)."""
    values = rng.standard_normal(shape)
    if field == "dt":
        return np.abs(values) * 0.5 + 0.05
    return -np.abs(values) - 0.1 if field == "a" else values


@pytest.fixture
def calls(monkeypatch):
    """Counts each compiled pass's calls (they still run)."""
    return ChainMap(count_calls(monkeypatch, jit_mamba2_backward, KERNELS),
                    count_calls(monkeypatch, jit_mamba2_saved, (SAVED_KERNEL,)))  # both kept current


def _reference(thunk: dict, arena: np.ndarray) -> dict[str, np.ndarray]:
    """The float64 reference's gradients on the values ``thunk`` stores in ``arena``."""
    values = read(thunk, arena)
    return float64_backward(complete(thunk), lambda field: values[field])


def _close(got: dict[str, np.ndarray], want: dict[str, np.ndarray], nmse: float) -> None:
    assert set(got) <= set(want)
    for name, value in got.items():
        err = np.mean((value - want[name]) ** 2) / max(np.mean(want[name] ** 2), 1e-30)
        assert err <= nmse, (name, err)


def _ran(calls: dict, compiled: bool, kernels: tuple[str, ...] = KERNELS) -> None:
    """Each of ``kernels`` ran where ``compiled``, and no other compiled pass; none ran on NumPy's path."""
    ran = {name for name, count in calls.items() if count}
    assert ran == (set(kernels) if compiled else set()), calls


@pytest.mark.parametrize("label,params,chunk", CASES, ids=[label for label, _, _ in CASES])
def test_both_paths_match_the_float64_reference(label, params, chunk, compiled, calls):
    thunk, arena = laid(f"{OP}_backward", "f32", with_gradients(OP, params), _sample, seed=len(label))
    _close(gradients(thunk, arena, path="chunked", chunk=chunk), _reference(thunk, arena), NMSE["f32"])
    _ran(calls, compiled)


def test_both_paths_of_packed_sequences_match_the_float64_reference(compiled, calls):
    thunk, arena = laid(f"{OP}_backward", "f32", with_gradients(OP, PACKED), _sample)
    _close(gradients(thunk, arena, path="chunked", chunk=8), _reference(thunk, arena), NMSE["f32"])
    _ran(calls, compiled)


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_16_bit_storage_computes_in_f32_on_both_paths(dtype, compiled, calls):
    """Inputs widened to f32, every output rounded once into its storage."""
    label, params, chunk = CASES[-1]
    thunk, arena = laid(f"{OP}_backward", dtype, with_gradients(OP, params), _sample)
    _close(gradients(thunk, arena, path="chunked", chunk=chunk), _reference(thunk, arena), NMSE[dtype])
    _ran(calls, compiled)


#: (head_dim, state_size) of the saved-forward cases: 32 wide is whole tiles at either width (16 or 32
#: columns), 3 and 4 are not; the chunk of 64 is whole blocks of rows with 16 lanes (8 rows), not with 8 (6 rows)
SAVED_DIMS = [(3, 4), (32, 32)]


@pytest.mark.parametrize("width", ["8", "16"])
@pytest.mark.parametrize("dims", SAVED_DIMS, ids=[f"P{p}N{n}" for p, n in SAVED_DIMS])
def test_a_saved_forward_is_read_on_both_paths(dims, width, compiled, calls, monkeypatch):
    """Chunks of 64 (ABI.md §9.1's), the last partial: the saved states, y and scores replace the recomputed ones
    (other values in the reserve give other gradients); the compiled pass in tiles of either width."""
    monkeypatch.setenv(jit.WIDTH_ENV, width)
    params = dict(CARRIED, batch=2, seq=150, heads=2, head_dim=dims[0], state_size=dims[1], d=True, z=True,
                  dt_bias=True)
    thunk, arena, forward = laid_with_reserve(OP, "f32", params, _sample)
    saved = filled_reserve(thunk, arena, forward)
    got = gradients(thunk, saved)
    _close(got, _reference(thunk, arena), NMSE["f32"])
    _ran(calls, compiled, (SAVED_KERNEL,))
    start = thunk["reserve"]
    saved[start: start + thunk["reserve_bytes"]] = 0
    assert not np.array_equal(gradients(thunk, saved)["d_c"], got["d_c"])


def test_a_nan_lands_where_the_step_recurrence_puts_it_on_both_paths(compiled, calls):
    """A NaN in one lane's ``x`` at step 20 (chunks of 8): that lane is redone on the step path, whose gradients
    are NaN exactly where the recurrence's are; every other lane stays finite."""
    label, params, chunk = CASES[0]
    thunk, arena = laid(f"{OP}_backward", "f32", with_gradients(OP, params), _sample)
    x = next(r for r in host_fallback.abi.regions(thunk) if r.field == "x")
    host_fallback.arena.view(arena, x.offset, "f32", x.shape)[1, 20, 0, 2] = np.nan
    got = gradients(thunk, arena, path="chunked", chunk=8)
    want = gradients(thunk, arena, path="step", chunk=8)
    for name, value in got.items():
        np.testing.assert_array_equal(np.isnan(value), np.isnan(want[name]), err_msg=name)
    # the states from step 20 on are NaN, so c's gradient there (the state's gradients, and x's, are not)
    assert np.isnan(got["d_c"][1, 20:, 0]).all() and not np.isnan(got["d_c"][1, :20, 0]).any()
    assert np.isfinite(got["d_c"][0]).all() and np.isfinite(got["d_c"][1, :, 1]).all()
    assert np.isfinite(got["d_x"]).all()
    _ran(calls, compiled)


def test_the_compiled_passes_give_the_same_bytes_on_every_run_and_split(calls):
    """Rows split across threads: the same bytes twice, and the same bytes as one thread."""
    label, params, chunk = CASES[-1]
    thunk, arena = laid(f"{OP}_backward", "f32", with_gradients(OP, params), _sample)
    runs = [arena.copy() for _ in range(3)]
    for out, workers in zip(runs, (2, 2, 1)):
        host_fallback.execute(thunk, out, path="chunked", chunk=chunk, workers=workers)
    assert np.array_equal(runs[0], runs[1]) and np.array_equal(runs[0], runs[2])
    _ran(calls, True)


def test_numpy_s_path_runs_where_the_passes_do_not_apply(calls):
    label, params, chunk = CASES[0]
    thunk, arena = laid(f"{OP}_backward", "f64", with_gradients(OP, params), _sample)
    _close(gradients(thunk, arena, path="chunked", chunk=chunk), _reference(thunk, arena), 1e-20)
    _ran(calls, False)
