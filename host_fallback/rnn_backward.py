"""Host kernels for ``lstm_backward``, ``gru_backward`` and ``rnn_backward`` (ABI.md §9).

A backward thunk recomputes its forward (ABI.md §3 and §8: every layer and direction, sequence
lengths, reverse, clip, activations, both GRU forms, peepholes, coupled input-forget gates and
projections), keeping what the reverse pass needs per step: the pre-activations, the gate values,
the state entering each step and, for an lstm, the new cell; with a saved forward (ABI.md §9.1's
``reserve``, ``rnn_reserve``) it reads those instead, which the forward thunk kept there running the same
recurrences (``forward_saving``: no forward GEMM left for the backward). Then backpropagation through time,
top layer first, each direction walking its steps in the opposite order:

- A step computes only what depends on the step before it: the gradients of the gate
  pre-activations, and from them the gradients of the state entering the step (one GEMM by
  ``W_hh``). Everything else is a GEMM over the whole sequence afterwards, with the ``seq*batch``
  rows of the saved gradients as the long dimension: ``d_w_ih``, ``d_w_hh``, ``d_w_hr``, the layer
  input's gradient (the layer below's output gradient, or ``d_x``), and the bias and peephole sums.
- A row past its length (``seq_lens``) takes no step: its state passes through unchanged, so its
  gradient does too, and its output (written as 0) passes none back.
- Where an activation or a clamp has a kink, the gradient is the derivative of the branch the
  forward takes there (ABI.md §9): ``relu`` and ``thresholded_relu`` 0 at the kink, ``leaky_relu``
  and ``elu`` 1, and ``clip`` and ``hard_sigmoid`` pass the gradient at their bounds.

A small f32-inside lstm that ``lstm_sequence`` covers runs each layer-direction's forward and its steps back
through time as one compiled call each (``_compiled_lstm_forward``, ``_compiled_lstm_reverse``: the same
recurrence, with the GEMMs over the whole sequence still NumPy's), where NumPy's ~40 array passes a step
were the time (B=8 S=24 H=32, 2 layers: the thunk 2.5 ms to 0.4).

16-bit storage computes in f32 (every gradient sum included), f64 in f64; only the outputs are
rounded on store. The order of every sum is fixed, so a thunk gives the same bytes on every run.

The parts: ``rnn_backward_cell`` (activations and their derivatives, a direction's flags),
``rnn_backward_steps`` (each op's recurrence, forward again and back through time); this module runs a thunk.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from . import lstm_sequence, rnn_reserve, threads
from .abi import Region, complete, forward_thunk, regions
from .abi.rnn import ACTIVATION_SLOTS, layer_input_sizes, output_width, recurrent_dims
from .arena import COMPUTE
from .bound import Bound
from .implementations import KERNELS, PREPARE
from .rnn_backward_cell import _Activation, _Cell
from .rnn_backward_steps import _FORWARD, _REVERSE, _compiled_lstm_forward, _compiled_lstm_reverse, _sum_outer, _where

Array = np.ndarray


def _each_direction(jobs: list[Callable[[], None]]) -> None:
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


def _walk(t: Mapping[str, Any], dr: int) -> range:
    """The steps direction ``dr`` walks, in its order."""
    backwards = dr == 1 or t["reverse"]
    return range(t["seq"] - 1, -1, -1) if backwards else range(t["seq"])


@dataclass
class _Setup:
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

    def start(self, states: Mapping[str, Array] | None, ld: int, width: int) -> tuple[Array, Array | None]:
        """Layer-direction ``ld``'s ``(h, c)`` from ``states`` (the initial ones, or the final ones' gradients;
        None: zero; ``c`` only for an lstm)."""
        fwd, dt = self.fwd, COMPUTE[self.fwd["dtype"]]
        h = states["h0"][ld] if states else np.zeros((fwd["batch"], width), dt)
        if fwd["op"] != "lstm":
            return h, None
        return h, states["c0"][ld] if states else np.zeros((fwd["batch"], fwd["hidden"]), dt)


def _setup(fwd: Mapping[str, Any], b: Bound) -> _Setup:
    gates, dirs = recurrent_dims(fwd)
    states = ("h0", "c0") if fwd["op"] == "lstm" else ("h0",)
    init = {f: b.load(f) for f in states} if fwd["carry"] else None
    cells = [_cell(fwd, dr) for dr in range(dirs)]  # a direction's activations and flags, alike in every layer
    return _Setup(fwd, b, _valid(fwd, b), cells, _spans(fwd, gates * fwd["hidden"], dirs), init)


def _forward_pass(s: _Setup, forwards: Callable, reserve: tuple[list[dict], list[Array]] | None = None
                  ) -> tuple[list[Array], list[list[dict]], list[Array], dict]:
    """The forward, bottom up: ``(every layer's input, what each layer-direction keeps, the top layer's
    outputs by direction, the final states by field)``; with a ``reserve`` (``rnn_reserve.slots``) kept in it."""
    fwd, b = s.fwd, s.b
    gates, dirs = recurrent_dims(fwd)
    S, B, H, width = fwd["seq"], fwd["batch"], fwd["hidden"], output_width(fwd)
    w_ih = b.load("w_ih")
    x = np.ascontiguousarray(b.load("x").transpose(1, 0, 2))
    inputs, kept = [x], []
    finals = {f: np.empty_like(v) for f, v in s.init.items()} if s.init else {}
    for layer, layer_spans in enumerate(s.spans):
        outs: list[Array] = [None] * dirs
        layer_kept: list[dict] = [None] * dirs

        def forward(dr: int, lo: int, hi: int, in_l: int, layer: int = layer) -> None:
            ld = layer * dirs + dr
            w = w_ih[lo:hi].reshape(gates * H, in_l)
            into = reserve[0][ld] if reserve else None
            if into is not None:
                xp = into[rnn_reserve.projection_slot(fwd, s.cells[dr])]
                np.matmul(inputs[-1].reshape(S * B, in_l), w.T, out=xp.reshape(S * B, gates * H))
            else:
                xp = (inputs[-1].reshape(S * B, in_l) @ w.T).reshape(S, B, gates * H)
            xp += b.load(s.biases[0], ld)
            h, c = s.start(s.init, ld, width)
            outs[dr], (h, c), layer_kept[dr] = forwards(s.cells[dr], xp, s.weights(ld), h, c, s.valid, _walk(fwd, dr),
                                                        into)
            for f, value in zip(finals, (h, c)):
                finals[f][ld] = value

        _each_direction([lambda dr=dr, span=span: forward(dr, *span) for dr, span in enumerate(layer_spans)])
        if layer + 1 < len(s.spans):  # the next layer's input
            inputs.append(np.concatenate(outs, axis=2, out=reserve[1][layer] if reserve else None))
        kept.append(layer_kept)
    return inputs, kept, outs, finals


def _reverse_pass(t: Mapping[str, Any], s: _Setup, inputs: list[Array], kept: list[list[dict]],
                  reverses: Callable) -> None:
    """The reverse, top down, storing every gradient: ``d_y`` is the gradient of a layer's output, then of
    its input."""
    fwd, b = s.fwd, s.b
    gates, dirs = recurrent_dims(fwd)
    S, B, H, width, dt = fwd["seq"], fwd["batch"], fwd["hidden"], output_width(fwd), COMPUTE[fwd["dtype"]]
    w_ih = b.load("w_ih")
    d_w_ih = np.zeros_like(w_ih)
    grads = {f: np.zeros(b.regions[f].shape, dt) for f in ("w_hh", *s.biases, *s.optional)}
    d_final = {f: b.load(f"d_{f}") for f in s.init} if s.init else None
    d_init = {f: np.zeros_like(v) for f, v in s.init.items()} if s.init else {}
    d_y = _where(s.valid, b.load("d_dst").transpose(1, 0, 2), 0)
    for layer in reversed(range(len(s.spans))):
        d_ins: list[Array] = [None] * dirs

        def reverse(dr: int, lo: int, hi: int, in_l: int, layer: int = layer) -> None:
            ld = layer * dirs + dr
            dh, dc = s.start(d_final, ld, width)
            d_pre, d_bias, d_w, (dh, dc) = reverses(s.cells[dr], kept[layer][dr], s.weights(ld),
                                                    d_y[..., dr * width: (dr + 1) * width], dh, dc, s.valid,
                                                    _walk(fwd, dr)[::-1])
            d_w_ih[lo:hi] = _sum_outer(d_pre, inputs[layer]).reshape(-1)
            d_ins[dr] = (d_pre.reshape(S * B, -1) @ w_ih[lo:hi].reshape(gates * H, in_l)).reshape(S, B, in_l)
            for f, g in {**d_bias, **d_w}.items():
                grads[f][ld] = g
            for f, value in zip(d_init, (dh, dc)):
                d_init[f][ld] = value

        _each_direction([lambda dr=dr, span=span: reverse(dr, *span) for dr, span in enumerate(s.spans[layer])])
        kept[layer] = []  # the layer's saved steps are no longer needed
        d_in = d_ins[0]
        if dirs == 2:
            d_in += d_ins[1]  # in direction order: the same bytes every run
        d_y = _where(s.valid, d_in, 0) if layer else d_in
    b.store("d_x", d_y.transpose(1, 0, 2))
    b.store("d_w_ih", d_w_ih)
    for f, g in {**grads, **d_init}.items():
        b.store(f"d_{f}", g)


def prepare(thunk: Mapping[str, Any]) -> Callable[[np.ndarray], None]:
    """The thunk-only setup once (``host_fallback.PREPARE``): the completed fields and the regions, which a
    small thunk's run would otherwise spend a tenth of its time on (lstm B=8 S=24 H=32, 2 layers)."""
    t = complete(thunk)
    by_field = {r.field: r for r in regions(t)}
    return lambda arena: _backward(t, arena, by_field)


def _run(thunk: Mapping[str, Any], arena: np.ndarray) -> None:
    """Run one lstm/gru/rnn backward thunk in place."""
    prepare(thunk)(arena)


def _backward(t: Mapping[str, Any], arena: np.ndarray, by_field: Mapping[str, Region]) -> None:
    """The forward again, or its reserve read (ABI.md §9.1), then the reverse pass."""
    fwd = forward_thunk(t)
    s = _setup(fwd, Bound(t, arena, by_field))
    compiled = lstm_sequence.applies(fwd)
    if t.get("reserve") is not None:
        above, kept = rnn_reserve.load(fwd, arena, s.cells)
        inputs = [np.ascontiguousarray(s.b.load("x").transpose(1, 0, 2)), *above]
    else:
        inputs, kept, _, _ = _forward_pass(s, _compiled_lstm_forward if compiled else _FORWARD[fwd["op"]])
    _reverse_pass(t, s, inputs, kept, _compiled_lstm_reverse if compiled else _REVERSE[fwd["op"]])


def forward_saving(thunk: Mapping[str, Any]) -> Callable[[np.ndarray], None]:
    """The forward kernel of a thunk with a reserve (``rnn.prepare`` hands it over): the recurrences of the
    backward pass (whose kept arrays the reserve's layout is; a small lstm's whole-sequence kernel keeps
    the ones its reverse reads), then ``dst``, the final states and the reserve stored."""
    t = complete(thunk)
    by_field = {r.field: r for r in regions(t)}
    forwards = _compiled_lstm_forward if lstm_sequence.applies(t) else _FORWARD[t["op"]]

    def run(arena: np.ndarray) -> None:
        s = _setup(t, Bound(t, arena, by_field))
        reserve = rnn_reserve.slots(t, arena)
        inputs, kept, outs, finals = _forward_pass(s, forwards, reserve)
        s.b.store("dst", np.concatenate(outs, axis=2).transpose(1, 0, 2))
        for f, value in finals.items():
            s.b.store(f, value)
        rnn_reserve.save(t, reserve, s.cells, inputs, kept)
    return run


KERNELS.add(("lstm_backward", "gru_backward", "rnn_backward"), _run)
PREPARE.add(("lstm_backward", "gru_backward", "rnn_backward"), prepare)
