"""host_fallback's compiled selective_scan reverse (``jit_ssm_backward.selective_scan_backward_run``, bound by
``selective_scan_backward._Compiled``) beside its NumPy twin (``RLX_HOST_JIT=0``).

Both paths of an f32 thunk against torch autograd of mamba_ssm's reference math in float64
(``support.selective_scan_torch``; packed sequences, which it lacks: the float64 backward, itself checked against
finite differences by test_selective_scan_backward) on the values the thunk stores, over the version-2 fields,
N=16 (the kernel's own branch) and other state sizes, chunks that end inside the sequence, and a saved forward
(ABI.md §9.1) read in place of the forward pass; one kernel call a batch row (a sequence where packed); the same
bytes on every run and on one thread or two; 16-bit storage computed in f32; NumPy's path where the kernel does not
apply (a thunk computing in f64).
"""
from __future__ import annotations

import numpy as np
import pytest

import host_fallback
from support.gradient_check import copy_inputs, laid, read, with_gradients
from support.host_jit import compiled, gradients  # noqa: F401  (compiled: a fixture)
from support.saved_forward import filled_reserve, laid_with_reserve
from support.selective_scan_torch import torch_grads

numba = pytest.importorskip("numba", reason="the jit extra (Numba) is not installed")
from host_fallback import jit_ssm_backward  # noqa: E402  (needs Numba)

OP = "selective_scan"
#: NMSE of each f32 gradient against float64's: everything is f32, each gradient rounded once (test_selective_scan_
#: backward's bound for f32).
NMSE = 1e-10
#: ... and of 16-bit storage: each output rounded once (bf16 2^-8, f16 2^-11 relative; test_selective_scan_backward's)
NMSE_16 = {"f16": 1e-6, "bf16": 1e-4}
CARRIED = dict(carry_state=True, state=True)
#: (label, params): seq 45 ends a chunk of 32 inside the sequence; N=16 takes the kernel's 16-lane branch
CASES = [
    ("base-n16", dict(batch=2, seq=45, hidden=6, state_size=16)),
    ("knobs-n5", dict(batch=2, seq=45, hidden=6, state_size=5, groups=2, d=True, z=True, delta_bias=True,
                      delta_softplus=True)),
    ("carried-n16", dict(CARRIED, batch=2, seq=45, hidden=4, state_size=16, z=True)),
    ("every-field-n17", dict(CARRIED, batch=3, seq=70, hidden=6, state_size=17, groups=3, d=True, z=True,
                             delta_bias=True, delta_softplus=True)),
]
#: packed sequences and state slots, every field: one empty sequence, one starting inside the first chunk
PACKED = dict(CARRIED, batch=1, seq=70, hidden=4, state_size=16, cu_seqlens=[0, 20, 20, 70], state_slots=[3, 0, 1],
              num_slots=4, groups=2, d=True, z=True, delta_bias=True, delta_softplus=True)


def _sample(field: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Step sizes (and their bias) above 0, decays below 1 (test_selective_scan_backward's)."""
    x = rng.standard_normal(shape)
    if field in ("delta", "delta_bias"):
        return np.abs(x) * 0.5 + 0.05
    return -np.abs(x) - 0.1 if field == "a" else x


@pytest.fixture
def calls(monkeypatch):
    """Counts the kernel's calls (it still runs)."""
    counted = [0]
    real = jit_ssm_backward.selective_scan_backward_run

    def spy(*args):
        counted[0] += 1
        real(*args)
    monkeypatch.setattr(jit_ssm_backward, "selective_scan_backward_run", spy)
    return counted


def _close(got: dict[str, np.ndarray], want: dict[str, np.ndarray], nmse: float = NMSE) -> None:
    assert set(got) == set(want)
    for name, value in want.items():
        err = np.mean((got[name] - value) ** 2) / max(np.mean(value ** 2), 1e-30)
        assert err <= nmse, (name, err)


@pytest.mark.parametrize("label,params", CASES, ids=[label for label, _ in CASES])
def test_both_paths_match_torch_autograd(label, params, compiled, calls):
    thunk, arena = laid(f"{OP}_backward", "f32", with_gradients(OP, params), _sample, seed=len(label))
    _close(gradients(thunk, arena), torch_grads(thunk, read(thunk, arena)))
    assert calls[0] == (params["batch"] if compiled else 0)  # one call a batch row


@pytest.mark.parametrize("dtype,extra", [("bf16", {}), ("f16", {}),
                                         ("bf16", dict(state_dtype="f32", param_dtype="f32"))],
                         ids=["bf16", "f16", "bf16-f32-state-and-parameters"])
def test_16_bit_storage_computes_in_f32_on_both_paths(dtype, extra, compiled, calls):
    """Inputs widened to f32, every output rounded once into its storage: within that rounding of torch's
    float64 gradients on the stored values."""
    params = {**CASES[-1][1], **extra}
    thunk, arena = laid(f"{OP}_backward", dtype, with_gradients(OP, params), _sample)
    _close(gradients(thunk, arena), torch_grads(thunk, read(thunk, arena)), NMSE_16[dtype])
    assert calls[0] == (params["batch"] if compiled else 0)


def test_both_paths_of_packed_sequences_match_the_float64_backward(compiled, calls):
    thunk, arena = laid(f"{OP}_backward", "f32", with_gradients(OP, PACKED), _sample)
    wide, wide_arena = laid(f"{OP}_backward", "f64", with_gradients(OP, PACKED), _sample)
    copy_inputs(thunk, arena, wide, wide_arena)  # the f64 thunk gets the values the f32 one stores
    _close(gradients(thunk, arena), gradients(wide, wide_arena))
    assert calls[0] == (2 if compiled else 0)  # one call a non-empty sequence


@pytest.mark.parametrize("chunk", [None, 5], ids=["saved", "chunk-5-recomputes"])
def test_a_saved_forward_read_in_place_of_the_forward_pass(chunk, compiled, calls):
    """The saved states of every 32 tokens (ABI.md §9.1) replace the forward pass where the chunks are 32 tokens;
    with another chunk length the reverse recomputes its own checkpoints (the reserve is left unread)."""
    params = dict(CARRIED, batch=2, seq=70, hidden=4, state_size=16, d=True, z=True, delta_bias=True,
                  delta_softplus=True)
    thunk, arena, forward = laid_with_reserve(OP, "f32", params, _sample)
    saved = filled_reserve(thunk, arena, forward)
    options = {} if chunk is None else {"chunk": chunk}
    got = gradients(thunk, saved, **options)
    values = {f: v for f, v in read(thunk, arena).items() if f != "reserve"}
    _close(got, torch_grads(thunk, values))
    start = thunk["reserve"]
    saved[start: start + thunk["reserve_bytes"]] = 0
    changed = not np.array_equal(gradients(thunk, saved, **options)["d_c"], got["d_c"])  # (d_x reads no state)
    assert changed == (chunk is None)
    assert calls[0] == (2 * 2 if compiled else 0)


def test_the_compiled_reverse_gives_the_same_bytes_on_every_run_and_split(calls):
    """Rows split across threads sum the parameters' gradients block by block: the same bytes twice, and the
    gradients of one thread."""
    thunk, arena = laid(f"{OP}_backward", "f32", with_gradients(OP, CASES[-1][1]), _sample)
    split = [arena.copy(), arena.copy()]
    for out in split:
        host_fallback.execute(thunk, out, workers=2)
    assert np.array_equal(*split)
    assert calls[0] == 2 * 3
    one, got = gradients(thunk, arena, workers=1), read(thunk, split[0])  # (d_state is overwritten: read, not rerun)
    for name, value in one.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("dtype,extra", [("f64", {}), ("bf16", dict(state_dtype="f64"))], ids=["f64", "f64-state"])
def test_numpy_s_path_runs_where_the_kernel_does_not_apply(dtype, extra, calls):
    params = dict(CARRIED, batch=2, seq=40, hidden=4, state_size=3, **extra)
    thunk, arena = laid(f"{OP}_backward", dtype, with_gradients(OP, params), _sample)
    gradients(thunk, arena)
    assert calls[0] == 0
