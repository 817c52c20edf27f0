"""host_fallback's compiled chunk gates of a recurrent backward without a saved forward (``lstm_chunk_gates``,
``gru_chunk_gates``; where they apply: ``rnn_backward_gates``): every gradient of an f32 thunk whose chunks they
rebuild against the float64 conformance reference (written from ABI.md) on the values the thunk stores, across
chunk boundaries, both directions and row lengths; the kernels run exactly where they apply, once per chunk
rebuilt (every chunk but the last of each walk where the forward pass kept that one); and they refuse shapes
that do not fit."""
from __future__ import annotations

import numpy as np
import pytest

import host_fallback
from host_fallback import jit, lstm_sequence, rnn_backward_passes
from host_fallback.abi import complete
from host_fallback.rnn_backward_passes import MIN_CHUNK_STEPS
from rlx_gpu.conformance.references import REFERENCES
from support.gradient_check import laid, read
from support.host_jit import count_calls
from support.rnn_backward_cases import backward_params

numba = pytest.importorskip("numba", reason="the jit extra (Numba) is not installed")
from host_fallback import jit_rnn_chunk  # noqa: E402  (needs Numba)

KERNELS = ("lstm_chunk_gates", "gru_chunk_gates")
K = MIN_CHUNK_STEPS
SEQ = 2 * K + 5  # three chunks a layer-direction
#: An lstm takes the gates at once only past the whole-sequence kernel's width (lstm_sequence.MAX_HIDDEN).
SHAPES = {"lstm": dict(batch=2, input_size=5, hidden=lstm_sequence.MAX_HIDDEN + 8), "gru": dict(batch=4, hidden=12)}
#: NMSE of an f32 gradient against float64's.
NMSE = 1e-9


@pytest.fixture
def calls(monkeypatch):
    """Counts each kernel's calls (they still run); every thunk checkpoints (none kept whole)."""
    monkeypatch.setattr(rnn_backward_passes, "KEPT_WHOLE_ROWS", 0)
    return count_calls(monkeypatch, jit_rnn_chunk, KERNELS)


def _sample(field: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Standard normal values, the weights at torch's scale (1/sqrt(hidden)) so no gate saturates."""
    return rng.standard_normal(shape) * (0.1 if field.startswith("w_") else 1.0)


def _check(op: str, extra: dict) -> None:
    thunk, arena = laid(f"{op}_backward", "f32", backward_params(op, seq=SEQ, **SHAPES[op], **extra), _sample, 3)
    values = read(thunk, arena)
    want = REFERENCES[thunk["op"]](complete(thunk), lambda f: values[f])
    out = arena.copy()
    host_fallback.execute(thunk, out)
    got = read(thunk, out)
    for name, value in want.items():
        err = np.mean((got[name] - value) ** 2) / max(np.mean(value ** 2), 1e-30)
        assert err <= NMSE, (op, name, err)


CASES = [("lstm", {}), ("lstm", dict(seq_lens=[SEQ, K + 1])), ("lstm", dict(reverse=True, bidirectional=False)),
         ("gru", {}), ("gru", dict(seq_lens=[K, SEQ, 0, 2 * K + 1]))]


@pytest.mark.parametrize("op,extra", CASES, ids=[f"{op}-{'-'.join(e) or 'plain'}" for op, e in CASES])
def test_the_compiled_chunks_match_the_float64_reference(op, extra, calls):
    _check(op, extra)
    layer_directions = 2 * (2 if extra.get("bidirectional", True) else 1)
    # the first two chunks of each walk (a gru's forward pass kept the last one as it ran it; an lstm's with lengths)
    rebuilt = layer_directions * (2 if op == "gru" or "seq_lens" in extra else 3)
    assert calls == {f"{o}_chunk_gates": rebuilt if o == op else 0 for o in ("lstm", "gru")}


@pytest.mark.parametrize("op,extra", [("lstm", dict(clip=0.5)), ("lstm", dict(input_forget=True)),
                                      ("gru", dict(linear_before_reset=False)), ("gru", dict(clip=0.5)),
                                      ("gru", dict(activations=[["sigmoid", 0, 0], ["relu", 0, 0]] * 2))],
                         ids=["lstm-clip", "lstm-input_forget", "gru-not-linear_before_reset", "gru-clip",
                              "gru-relu"])
def test_numpy_s_passes_run_where_the_kernels_do_not_apply(op, extra, calls):
    _check(op, extra)
    assert calls == dict.fromkeys(KERNELS, 0)


def test_off_the_kernels_do_not_run(calls, monkeypatch):
    monkeypatch.setenv(jit.ENV, "0")
    _check("gru", {})
    assert calls == dict.fromkeys(KERNELS, 0)


def test_the_kernels_refuse_shapes_that_do_not_fit():
    f32 = np.float32
    u, c, kept = np.zeros((3, 2, 8), f32), np.zeros((2, 2), f32), np.zeros((3, 2, 2), f32)
    with pytest.raises(ValueError, match="lstm_chunk_gates: the arrays' shapes do not fit together"):
        jit_rnn_chunk.lstm_chunk_gates(u, c, np.empty(0, np.int64), False, kept, kept, np.zeros((3, 2, 3), f32))
    with pytest.raises(ValueError, match="gru_chunk_gates: the arrays' shapes do not fit together"):
        jit_rnn_chunk.gru_chunk_gates(np.zeros((3, 2, 6), f32), np.zeros((3, 2, 6), f32), np.zeros(5, f32))
