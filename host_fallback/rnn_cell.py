"""One ``lstm``/``gru``/``rnn`` layer-direction's weights and fields in its time loop's form (``_Cell``): gates in
the internal order, rows scaled for the exp route, clips at their scale, and where it applies the compiled lstm
step (``jit``) with ``w_hh`` packed for it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np

from . import jit
from .abi.rnn import ACTIVATION_SLOTS
from .activations import Activation, activation, stored_scale
from .bound import Bound
from .rnn_packing import _ORDER, _Dims

#: The activation slot (ABI.md §8: lstm f g h, gru f g, rnn f) that drives each internal gate.
_SLOT = {"lstm": (0, 0, 0, 1), "gru": (0, 0, 1), "rnn": (0,)}
#: Smallest batch the compiled lstm step runs (``jit``): its narrowest tile is one vector (8 or 16 columns), so
#: below 8 lanes idle (8 lanes, unidirectional H=256, its time over NumPy's step's: B=1 3.3x, B=4 1.26x, B=8
#: 1.12x, B=16 0.95x; 16 lanes take the time of 8 at B=8).
_COMPILED_MIN_BATCH = 8
#: The compiled step runs on one core. Where NumPy's step would run each GEMM on two (one direction at a
#: time on a two-thread BLAS) the compiled one wins from a batch of 12 up to about this many flops a step
#: (B=12 H=256: 12.6 MFLOP, 0.86x NumPy's time; B=32 H=256: 33.6, 0.94x) and loses past it (B=16 H=512: 67,
#: 0.98x; B=64 H=512: 268, 1.20x) or below it (B=8 H=256: 1.12x; B=8 H=512: 1.74x); with more BLAS threads
#: the bound shrinks in proportion.
_COMPILED_SHARED_MIN_BATCH = 12
_COMPILED_SHARED_STEP_FLOPS = 40_000_000


def _internal(w: np.ndarray, d: _Dims, scales: Sequence[float]) -> np.ndarray:
    """A ``[gates*hidden, ...]`` block in internal gate order and compute type, the rows of each
    internal gate times its ``scales`` entry; a 1-D block (a bias) comes back as a column.

    With ``d.stored`` a weight matrix is the stored block itself and a bias a private copy, both in
    the ABI's gate order and not scaled.
    """
    if d.stored:
        return w.reshape(d.gates * d.hidden, -1) if w.ndim == 2 else w.astype(d.compute).reshape(-1, 1)
    src = w.reshape(d.gates, d.hidden, -1)
    out = np.empty(src.shape, d.compute)
    for k, g in enumerate(_ORDER[d.op]):
        if scales[k] != 1:
            np.multiply(src[g], scales[k], out=out[k], dtype=d.compute)
        else:
            out[k] = src[g]
    return out.reshape(d.gates * d.hidden, -1) if w.ndim == 2 else out.reshape(-1, 1)


class _Compiled(NamedTuple):
    """The Numba kernels of the compiled lstm step (``jit``), and the width of its tiles (``jit.lanes``)."""

    lstm_panels: Callable
    lstm_panel_bias: Callable
    lstm_step: Callable
    lanes: int

    def pack(self, w: np.ndarray, scales: Sequence[float]) -> np.ndarray:
        """A stored ``[4H, K]`` weight block packed for the step's tiles: ``_internal``'s reordered, scaled
        rows, read from the stored ones in one pass (16-bit storage converted to f32 first)."""
        return self.lstm_panels(np.require(w, np.float32, ("C", "A")), np.array(_ORDER["lstm"], np.int64),
                                np.array(scales, np.float32), self.lanes)


@dataclass
class _Cell:
    """One layer-direction's weights and the fields its loop reads, in the loop's form."""

    w_hh: np.ndarray
    h_bias: np.ndarray | None  # gru with linear_before_reset: b_hn, spread over the batch or a column
    acts: tuple[Activation, ...]  # one per slot
    clips: tuple[float, ...]  # per internal gate: the clip bound at the scale its rows are stored at; 0: none
    peepholes: tuple[np.ndarray, np.ndarray, np.ndarray] | None  # lstm p_i, p_f, p_o as columns, scaled as their rows
    input_forget: bool
    w_hr: np.ndarray | None
    linear_before_reset: bool
    compiled: _Compiled | None  # lstm: Numba's kernels (``jit``) where they apply; w_hh is then packed for them


def _cell(t: Mapping[str, Any], b: Bound, d: _Dims, ld: int, dr: int, inputs: int,
          blas_cores: int) -> tuple[_Cell, np.ndarray]:
    """The loop's form of layer-direction ``ld`` (direction ``dr``, ``inputs`` features in), and its input-side
    bias column; ``blas_cores``: the threads a GEMM of NumPy's step would run on."""
    specs = _specs(t, d, dr)
    scales = _scales(specs, d)
    slot_scale = dict(zip(_SLOT[d.op], scales))  # lstm's h (slot 2) reads the cell itself, never scaled
    acts = tuple(activation(spec, slot_scale.get(s, 1.0), _block(d)) for s, spec in enumerate(specs))
    clips = tuple(abs(k) * float(t["clip"]) for k in scales)
    h_bias, lbr = None, bool(t.get("linear_before_reset", True))
    if d.op == "gru":
        b_ih, b_hh = _internal(b.view("b_ih")[ld], d, scales), _internal(b.view("b_hh")[ld], d, scales)
        two = 2 * d.hidden
        if lbr:  # b_hn sits inside r⊙(W_hn·h + b_hn)
            b_ih[:two] += b_hh[:two]
            # added once per step: broadcast from its column for one step (a decode) or one batch row,
            # else spread over the batch once (a contiguous add per step is faster; the spread costs a step's add)
            once = d.batch == 1 or d.seq == 1
            h_bias = b_hh[two:] if once else np.ascontiguousarray(np.broadcast_to(b_hh[two:], (d.hidden, d.batch)))
        else:
            b_ih += b_hh
        x_bias = b_ih
    else:
        x_bias = _internal(b.view("bias")[ld], d, scales)
    peepholes = None
    if t.get("peepholes") is not None:
        p = b.view("peepholes")[ld].astype(d.compute).reshape(3, d.hidden, 1)  # ONNX order i, o, f
        k = scales[0]  # i f o: the rows of slot f
        peepholes = (k * p[0], k * p[2], k * p[1])
    w_hr = None
    if t.get("w_hr") is not None:
        w_hr = b.view("w_hr")[ld]
        w_hr = w_hr if w_hr.dtype == d.compute else w_hr.astype(d.compute)
    compiled = None
    step_flops = 2 * d.gates * d.hidden * (d.width + inputs) * d.batch
    if (d.op == "lstm" and not d.stored and d.compute == np.float32 and d.batch >= _COMPILED_MIN_BATCH
            and (blas_cores == 1 or (d.batch >= _COMPILED_SHARED_MIN_BATCH
                                     and step_flops * blas_cores <= 2 * _COMPILED_SHARED_STEP_FLOPS))
            and peepholes is None and [spec[0] for spec in specs] == ["sigmoid", "tanh", "tanh"]):
        kernels = [jit.kernel(name) for name in _Compiled._fields[:-1]]  # all but lanes
        compiled = None if None in kernels else _Compiled(*kernels, jit.lanes())
    w_hh = b.view("w_hh")[ld]
    w_hh = _internal(w_hh, d, scales) if compiled is None else compiled.pack(w_hh, scales)
    return _Cell(w_hh, h_bias, acts, clips, peepholes, bool(t.get("input_forget", False)), w_hr,
                 lbr, compiled), x_bias

def _specs(t: Mapping[str, Any], d: _Dims, dr: int) -> Sequence[Sequence[Any]]:
    """The ``[name, alpha, beta]`` of each activation slot of direction ``dr``."""
    slots = ACTIVATION_SLOTS[d.op]
    return t["activations"][dr * slots: (dr + 1) * slots]


def _block(d: _Dims) -> int:
    """Elements of a step's activation block as the exp route counts them (``activations.stored_scale``).
    An rnn's activation writes straight into the layer's output slot, strided, where NumPy's one
    ``tanh`` pass beats the route's four (rnn B=32 H=256: 8% slower through exp), so there it is 0."""
    return 0 if d.op == "rnn" else d.hidden * d.batch


def _scales(specs: Sequence[Sequence[Any]], d: _Dims) -> list[float]:
    """The factor each internal gate's rows are stored at (``activations.stored_scale``; 1 in decode)."""
    return [1.0 if d.stored else stored_scale(specs[s][0], _block(d)) for s in _SLOT[d.op]]
