"""What the passes of one ``lstm_backward``/``gru_backward``/``rnn_backward`` thunk share (``rnn_backward_passes``):
the forward thunk's tensors bound to the arena, the rows' valid steps, each direction's activations and flags,
where each layer-direction's block of ``w_ih`` lies, and the carried initial states."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from . import threads
from .abi.rnn import ACTIVATION_SLOTS, layer_input_sizes, recurrent_dims
from .arena import COMPUTE
from .bound import Bound
from .rnn_backward_cell import _Activation, _Cell

Array = np.ndarray


def each_direction(jobs: list[Callable[[], None]]) -> None:
    """Run a layer's directions, each with a one-thread BLAS: two at once on two threads where there are
    two cores, else one after the other. A step's GEMMs are small (``batch`` rows): a second BLAS
    thread mostly waits on the first, and on a busy machine it waits for a core (lstm B32 I=H=256
    S128 while the machine ran other work: 25 ms a step's W_hh GEMM with two threads, 1.4 ms with one)."""
    if len(jobs) > 1 and threads.cores() >= 2:
        threads.run_all(jobs)
        return
    with threads.single_threaded_blas():
        for job in jobs:
            job()


def _valid(t: Mapping[str, Any], b: Bound) -> Array | None:
    """``[seq, batch, 1]``: whether step ``t`` of row ``b`` is one of its ``seq_lens`` valid steps; ``None``
    without ``seq_lens`` (every step is)."""
    if t["seq_lens"] is None:
        return None
    return np.arange(t["seq"])[:, None, None] < b.view("seq_lens").astype(np.int64)[None, :, None]


def _cell(t: Mapping[str, Any], direction: int) -> _Cell:
    """Direction ``direction``'s activations and flags of the forward thunk ``t``."""
    slots = ACTIVATION_SLOTS[t["op"]]
    acts = tuple(_Activation(name, float(a), float(b))
                 for name, a, b in t["activations"][direction * slots: (direction + 1) * slots])
    return _Cell(acts, float(t["clip"]), bool(t.get("linear_before_reset", True)), bool(t.get("input_forget", False)))


def _spans(fwd: Mapping[str, Any], rows: int, dirs: int) -> list[list[tuple[int, int, int]]]:
    """Each layer's directions' ``(lo, hi, input size)``: where their ``[rows, input size]`` block lies in the
    flat ``w_ih``."""
    spans, offset = [], 0
    for in_l in layer_input_sizes(fwd):
        size = rows * in_l
        spans.append([(offset + k * size, offset + (k + 1) * size, in_l) for k in range(dirs)])
        offset += dirs * size
    return spans


def _weights(b: Bound, op: str, optional: tuple[str, ...], ld: int) -> dict[str, Array]:
    """Layer-direction ``ld``'s ``w_hh``, a gru's ``b_hh`` and the ``optional`` fields the thunk has."""
    out = {"w_hh": b.load("w_hh", ld)}
    if op == "gru":
        out["b_hh"] = b.load("b_hh", ld)
    for f in optional:
        out[f] = b.load(f, ld)
    return out


@dataclass
class Setup:
    """What the passes of one thunk share: the forward thunk ``fwd`` and its tensors (``b``, bound to the
    thunk run: the backward thunk, or the forward one writing a reserve), sizes, cells and weight spans."""

    fwd: Mapping[str, Any]
    b: Bound
    valid: Array | None
    cells: list[_Cell]
    spans: list[list[tuple[int, int, int]]]
    init: dict[str, Array] | None  # the carried initial states (None: zero)

    @property
    def biases(self) -> tuple[str, ...]:
        return ("bias",) if self.fwd["op"] != "gru" else ("b_ih", "b_hh")

    @property
    def optional(self) -> tuple[str, ...]:
        return tuple(f for f in ("peepholes", "w_hr") if self.fwd.get(f) is not None)

    def weights(self, ld: int) -> dict[str, Array]:
        return _weights(self.b, self.fwd["op"], self.optional, ld)

    def backwards(self, dr: int) -> bool:
        """Whether direction ``dr`` walks the steps from the last one."""
        return dr == 1 or bool(self.fwd["reverse"])

    def start(self, states: Mapping[str, Array] | None, ld: int, width: int) -> tuple[Array, Array | None]:
        """Layer-direction ``ld``'s ``(h, c)`` from ``states`` (the initial ones, or the final ones' gradients;
        None: zero; ``c`` only for an lstm)."""
        fwd, dt = self.fwd, COMPUTE[self.fwd["dtype"]]
        h = states["h0"][ld] if states else np.zeros((fwd["batch"], width), dt)
        if fwd["op"] != "lstm":
            return h, None
        return h, states["c0"][ld] if states else np.zeros((fwd["batch"], fwd["hidden"]), dt)


def setup(fwd: Mapping[str, Any], b: Bound) -> Setup:
    gates, dirs = recurrent_dims(fwd)
    states = ("h0", "c0") if fwd["op"] == "lstm" else ("h0",)
    init = {f: b.load(f) for f in states} if fwd["carry"] else None
    cells = [_cell(fwd, dr) for dr in range(dirs)]  # a direction's activations and flags, alike in every layer
    return Setup(fwd, b, _valid(fwd, b), cells, _spans(fwd, gates * fwd["hidden"], dirs), init)
