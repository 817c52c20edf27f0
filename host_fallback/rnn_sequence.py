"""The whole-sequence gru and rnn kernels (``jit``'s ``gru_sequence``, ``gru_sequence_backward``, ``rnn_sequence``,
``rnn_sequence_backward``): where they apply, and a layer-direction's forward keeping what the reverse pass reads
and its steps back through time as ``rnn_backward_steps``' recurrences (whose NumPy steps they replace).

NumPy's steps make 15-25 array passes each around a BLAS call that repacks ``W_hh`` (B32 S128 I=H=256, 2 layers,
bidirectional, one thread: a gru's steps about 210 µs forward and 340 back, of which the GEMM about 110); one call
a layer-direction runs them in the tiles of the lstm's (``jit_lstm_sequence``). They cover an f32-inside gru with
``linear_before_reset`` and an rnn, with the default activations (sigmoid and tanh; tanh), no ``clip``, any layers,
directions, ``reverse``, ``seq_lens`` and carried state, up to ``lstm_sequence.MAX_BACKWARD_STEP``; NumPy's steps stay
everywhere else, and with ``RLX_HOST_JIT=0`` or without Numba. They keep what NumPy's keep (the gates activated in
place, the entering states, a gru's ``W_hn·h + b_hn``), so either reverse reads either forward's reserve.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from . import jit, lstm_sequence
from .arena import COMPUTE
from .rnn_backward_cell import _Cell
from .rnn_backward_steps import _array, _lengths, _sum, _sum_outer

Array = np.ndarray
_DEFAULT = {"gru": ("sigmoid", "tanh"), "rnn": ("tanh",)}
_NOTHING_KEPT = np.empty((0, 0, 0), np.float32)


def applies(t: Mapping[str, Any]) -> bool:
    """Whether the kernels run the layer-directions of the completed forward thunk ``t`` (a gru or rnn): the fields
    they cover, a step within ``lstm_sequence.MAX_BACKWARD_STEP``, and Numba there (not ``RLX_HOST_JIT=0``; read
    on every call)."""
    op = t["op"]
    if op not in _DEFAULT:
        return False
    slots = len(_DEFAULT[op])
    return (COMPUTE[t["dtype"]] == np.float32 and not t["clip"] and bool(t.get("linear_before_reset", True))
            and all(spec[0] == _DEFAULT[op][k % slots] for k, spec in enumerate(t["activations"]))
            and t["batch"] * t["hidden"] ** 2 <= lstm_sequence.MAX_BACKWARD_STEP
            and jit.kernel(f"{op}_sequence") is not None)


def _f32(a: Array) -> Array:
    return np.ascontiguousarray(a, np.float32)


def forward(op: str, u: Array, w_hh: Array, b_hh: Array | None, h: Array, lens: Array, backwards: bool,
            out: Array) -> None:
    """Every step of one layer-direction of a plain forward (``rnn``), keeping nothing: ``u [S, B, G*H]`` (float32,
    C-contiguous) the input projection plus the input-side bias (overwritten), ``w_hh`` and a gru's ``b_hh``, the
    state ``h [B, H]`` (updated to the final one), ``lens`` as ``lstm_sequence.lengths`` gives them, ``backwards``:
    from the last step, ``out [S, B, H]`` (0 past a row's length)."""
    if op == "gru":
        jit.kernel("gru_sequence")(u, _f32(w_hh), _f32(b_hh), h, lens, backwards, out, False, _NOTHING_KEPT,
                                   _NOTHING_KEPT, jit.lanes())
    else:
        jit.kernel("rnn_sequence")(u, _f32(w_hh), h, lens, backwards, out, False, _NOTHING_KEPT, jit.lanes())


def gru_forward(cell: _Cell, xp: Array, w: Mapping[str, Array], h: Array, c: None, valid: Array | None, order: range,
                into: Mapping[str, Array] | None = None):
    """``rnn_backward_steps._gru_forward`` in one call: ``xp`` becomes the gates."""
    S, B, _ = xp.shape
    keep = {k: _array(into, k, (S, B, h.shape[1]), xp.dtype) for k in ("h_prev", "hn")}
    keep.update(u=xp, y=xp, mask=None)
    out, h = np.empty_like(keep["hn"]), h.copy()
    jit.kernel("gru_sequence")(xp, _f32(w["w_hh"]), _f32(w["b_hh"]), h, _lengths(valid), order.step < 0, out,
                               True, keep["h_prev"], keep["hn"], jit.lanes())
    return out, (h, None), keep


def gru_reverse(cell: _Cell, keep, w: Mapping[str, Array], dy: Array, dh: Array, dc: None, valid: Array | None,
                order: range):
    """``rnn_backward_steps._gru_reverse`` of either forward's steps, in one call."""
    d_in, d_hid, dh = np.empty_like(keep["y"]), np.empty_like(keep["y"]), dh.copy()
    h_prev = _f32(keep["h_prev"])  # a rebuilt chunk's may be a view of the layer's output
    # ``order`` walks the forward's steps from the end: backwards where the forward walked forwards
    jit.kernel("gru_sequence_backward")(_f32(keep["y"]), h_prev, _f32(keep["hn"]), _f32(w["w_hh"]), _f32(dy), dh,
                                        _lengths(valid), order.step > 0, d_in, d_hid, jit.lanes())
    return d_in, {"b_ih": _sum(d_in), "b_hh": _sum(d_hid)}, {"w_hh": _sum_outer(d_hid, h_prev)}, (dh, None)


def rnn_forward(cell: _Cell, xp: Array, w: Mapping[str, Array], h: Array, c: None, valid: Array | None, order: range,
                into: Mapping[str, Array] | None = None):
    """``rnn_backward_steps._rnn_forward`` in one call: ``xp`` becomes the gate."""
    keep = {"h_prev": _array(into, "h_prev", xp.shape, xp.dtype), "u": xp, "y": xp, "mask": None}
    out, h = np.empty_like(xp), h.copy()
    jit.kernel("rnn_sequence")(xp, _f32(w["w_hh"]), h, _lengths(valid), order.step < 0, out, True, keep["h_prev"],
                               jit.lanes())
    return out, (h, None), keep


def rnn_reverse(cell: _Cell, keep, w: Mapping[str, Array], dy: Array, dh: Array, dc: None, valid: Array | None,
                order: range):
    """``rnn_backward_steps._rnn_reverse`` of either forward's steps, in one call."""
    y = _f32(keep["y"])  # a rebuilt chunk's is a view of the layer's output
    dz, dh = np.empty_like(y), dh.copy()
    jit.kernel("rnn_sequence_backward")(y, _f32(w["w_hh"]), _f32(dy), dh, _lengths(valid), order.step > 0, dz,
                                        jit.lanes())
    return dz, {"bias": _sum(dz)}, {"w_hh": _sum_outer(dz, keep["h_prev"])}, (dh, None)


FORWARD = {"gru": gru_forward, "rnn": rnn_forward}
REVERSE = {"gru": gru_reverse, "rnn": rnn_reverse}
