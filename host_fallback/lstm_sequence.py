"""The whole-sequence lstm kernels (``jit``'s ``lstm_sequence``, ``lstm_sequence_backward``): where they apply,
and their calls on a layer-direction's batch-major arrays.

Small lstms spend their time between the steps, not in them: at B=8 S=24 H=32, 2 layers, NumPy's backward
makes ~40 array passes and two BLAS calls a step (2.5 ms a thunk), and the forward one compiled call a step
(``lstm_step``) and the Python around it (0.3 ms). One Numba call per layer-direction runs every step instead:
``W_hh·h`` in the lstm step's register tiles with a group of batch rows as the panel, then the gates, the cell
and ``o·tanh(c)`` in vector loops over a row (``jit_lstm_sequence``). They cover an f32-inside lstm (f32, f16 or
bf16 storage) with the default activations, any layers, directions, ``reverse``, ``seq_lens`` and carried
state, and no ``clip``, peepholes, projection or coupled gates; ``rnn`` (forward) and ``rnn_backward`` keep
their NumPy loops for everything else, and everywhere with ``RLX_HOST_JIT=0`` or without Numba.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from . import jit
from .arena import COMPUTE

#: The most ``batch * hidden**2`` (a step's W_hh·h, in multiply-adds over 4) that the kernels take. One thread,
#: S=32, one layer, the backward thunk's time over NumPy's path's (CPU time, a loaded 2-core Zen 5): B8 H32 0.17,
#: B8 H64 0.21, B32 H64 0.71, B8 H128 0.63, B16 H128 0.74, B64 H64 0.74. At B32 H256 (2 layers, bidirectional,
#: S128) the two were within the machine's noise of each other (0.6-2x), so the bound stops short of it.
MAX_STEP = 16 * 128 * 128
#: The most ``batch * hidden**2`` that the kernels take in a backward thunk's recurrences (and a forward writing
#: a reserve, which runs them), where NumPy's path is ~40 array passes a step around its two BLAS calls rather
#: than the forward's compiled step: the bound is the weights' 1 MiB (H=256) in L2 at B=128. One thread, one
#: layer-direction, the kernels' time over NumPy's, forward / reverse (a 2-core Zen 5 at load 6-7): B32 H256
#: S128 0.46 / 0.68, B128 H256 0.80 / 0.91, B4 H1024 0.91 / 0.62, B32 H512 0.85 / 0.98; past it B64 H384
#: 1.17 / 1.21, B64 H512 1.42 / 1.45, B32 H1024 1.61 / 1.40.
MAX_BACKWARD_STEP = 128 * 256 * 256
#: The widest ``hidden`` they take: a step's tiles take batch rows 8 (or 6) at a time, so a batch below that
#: leaves rows idle, which past about this width costs more than NumPy's steps (B1 S16 H256, forward: 0.52 ms
#: NumPy's loop, about 0.64 the kernel's tiles).
MAX_HIDDEN = 128
#: The widest ``hidden`` they take at a batch of one row, whose forward reads ``W_hh`` where it lies (dot products,
#: no copy: ``copies_w_hh``) on one core; ``rnn`` holds a gru's and an rnn's kernels (``rnn_sequence``) to it too.
#: One torch thread, the wall time of ``rlx_gpu.torch``'s module call, NumPy's step route / the kernel (a 2-core
#: Xeon, AVX-512), µs: lstm S1 H64 65 / 44, H128 71 / 48, H256 157 / 122, S16 H256 586 / 575; gru S1 H64 64 / 41,
#: H256 116 / 85; rnn S1 H64 49 / 37, H256 60 / 45. Past it NumPy's GEMVs on two threads win (lstm S1 H512
#: 290 / 426, gru 232 / 350; rnn H1024 270 / 422).
MAX_ROW_HIDDEN = 256
_DEFAULT_ACTIVATIONS = ("sigmoid", "tanh", "tanh")
_NO_LENGTHS = np.empty(0, np.int64)
_NOTHING_KEPT = np.empty((0, 0, 0), np.float32)


def applies(t: Mapping[str, Any], backward: bool = False) -> bool:
    """Whether the kernels run the completed forward thunk ``t`` (``backward``: the recurrences of an
    lstm_backward, or of a forward writing a reserve): the fields they cover, a step within ``MAX_STEP`` and
    ``MAX_HIDDEN`` (``backward``: ``MAX_BACKWARD_STEP``), and Numba there (not ``RLX_HOST_JIT=0``; read on every
    call)."""
    step = t["batch"] * t["hidden"] ** 2
    if backward:
        within = step <= MAX_BACKWARD_STEP
    else:
        within = t["hidden"] <= (MAX_HIDDEN if copies_w_hh(t["batch"]) else MAX_ROW_HIDDEN) and step <= MAX_STEP
    return (t["op"] == "lstm" and COMPUTE[t["dtype"]] == np.float32 and not t["clip"]
            and not t.get("input_forget") and t.get("peepholes") is None and not t.get("proj_size")
            and all(spec[0] == _DEFAULT_ACTIVATIONS[k % 3] for k, spec in enumerate(t["activations"]))
            and within and jit.kernel("lstm_sequence") is not None)


def copies_w_hh(batch: int) -> bool:
    """Whether the forward kernel copies ``W_hh^T`` into its tiles' blocks at each call, a cost a call's steps
    must repay (``rnn._SEQUENCE_UNITS_PER_STEP``): at every batch but one row, whose products are dot products of
    ``W_hh``'s rows where they lie."""
    return batch != 1


def lengths(seq_lens: np.ndarray | None) -> np.ndarray:
    """The rows' valid steps as the kernels take them (int64; empty: every step of every row)."""
    return _NO_LENGTHS if seq_lens is None else np.ascontiguousarray(seq_lens, np.int64)


def forward(u: np.ndarray, w_hh: np.ndarray, h: np.ndarray, c: np.ndarray, lens: np.ndarray, backwards: bool,
            out: np.ndarray, kept: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> None:
    """Every step of one layer-direction: ``u [S, B, 4H]`` the input projection plus bias (ABI gate order),
    ``w_hh [4H, H]``, the states ``h``, ``c [B, H]`` (updated to the final ones), ``out [S, B, H]`` (0 past a
    row's length). ``kept``: ``(h_prev, c_prev, hc)`` ``[S, B, H]`` to fill for ``backward``, and ``u`` then
    holds the activated gates; ``None``: nothing kept."""
    h_prev, c_prev, hc = kept if kept is not None else (_NOTHING_KEPT,) * 3
    jit.kernel("lstm_sequence")(u, np.ascontiguousarray(w_hh, np.float32), h, c, lens, backwards, out,
                                kept is not None, h_prev, c_prev, hc, jit.lanes())


def backward(gates: np.ndarray, hc: np.ndarray, c_prev: np.ndarray, w_hh: np.ndarray, dy: np.ndarray, dh: np.ndarray,
             dc: np.ndarray, lens: np.ndarray, backwards: bool, dz: np.ndarray) -> None:
    """Backpropagation through the steps ``forward`` kept (``gates``, ``hc``, ``c_prev``; ``backwards``: the
    forward's walk): ``dy [S, B, H]`` the output's gradient, ``dh``, ``dc [B, H]`` the final state's (updated to
    the initial state's), ``dz [S, B, 4H]`` the gate pre-activations' (0 past a row's length)."""
    jit.kernel("lstm_sequence_backward")(gates, hc, c_prev, np.ascontiguousarray(w_hh, np.float32),
                                         np.ascontiguousarray(dy, np.float32), dh, dc, lens, backwards, dz,
                                         jit.lanes())
