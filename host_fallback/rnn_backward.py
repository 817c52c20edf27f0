"""Host kernels for ``lstm_backward``, ``gru_backward`` and ``rnn_backward`` (ABI.md §9).

A backward thunk recomputes its forward (ABI.md §3 and §8: every layer and direction, sequence
lengths, reverse, clip, activations, both GRU forms, peepholes, coupled input-forget gates and
projections), keeping what the reverse pass needs per step: the pre-activations, the gate values,
the state entering each step and, for an lstm, the new cell. Without a saved forward it does so in
checkpointed chunks of steps (``rnn_backward_passes``), so it holds a few chunks' worth of them at a time
(at S=4096 its peak extra memory is within 2x the forward's), or where the thunk has as few rows (steps x batch)
as a reserve's chunk (``kept_whole``) by running the forward that writes a reserve into arrays of its own (a
reserve's memory), which spares it the checkpoint pass and the chunks' rebuilt gates; with a saved forward (ABI.md §9.1's
``reserve``, ``rnn_reserve``) it reads them instead, which the forward thunk kept there running the same
recurrences (``forward_saving``: no forward GEMM left for the backward). Then backpropagation through time,
top layer first, each direction walking its steps in the opposite order:

- A step computes only what depends on the step before it: the gradients of the gate
  pre-activations, and from them the gradients of the state entering the step (one GEMM by
  ``W_hh``). Everything else is a GEMM over a chunk's steps afterwards (the whole sequence with a
  reserve), with its ``steps*batch`` rows of the saved gradients as the long dimension: ``d_w_ih``, ``d_w_hh``, ``d_w_hr``, the layer
  input's gradient (the layer below's output gradient, or ``d_x``), and the bias and peephole sums.
- A row past its length (``seq_lens``) takes no step: its state passes through unchanged, so its
  gradient does too, and its output (written as 0) passes none back.
- Where an activation or a clamp has a kink, the gradient is the derivative of the branch the
  forward takes there (ABI.md §9): ``relu`` and ``thresholded_relu`` 0 at the kink, ``leaky_relu``
  and ``elu`` 1, and ``clip`` and ``hard_sigmoid`` pass the gradient at their bounds.

A small f32-inside lstm that ``lstm_sequence`` covers runs each layer-direction's forward and its steps back
through time as one compiled call each (``_compiled_lstm_forward``, ``_compiled_lstm_reverse``: the same
recurrence, with the GEMMs over the whole sequence still NumPy's), where NumPy's ~40 array passes a step
were the time (B=8 S=24 H=32, 2 layers: the thunk 2.5 ms to 0.4). Up to ``lstm_sequence.MAX_BACKWARD_STEP``
the reverse takes them, and so does a forward writing a reserve (one call over the whole sequence), past the
plain forward's bound: at B=32 S=128 I=H=256, 2 layers, bidirectional, one thread, the reserve's forward
+ backward went from 1.28x torch autograd to 0.96-1.01x (the steps' forward 2.2x faster, the reverse 1.5x).
A gru (``linear_before_reset``) or rnn (tanh) that ``rnn_sequence`` covers does the same through its own kernels
(its reserve's forward + backward from 1.02-1.05x torch's to 0.76-0.79x for the gru, 0.91-0.93x for the rnn).

16-bit storage computes in f32 (every gradient sum included), f64 in f64; only the outputs are
rounded on store. The order of every sum is fixed, so a thunk gives the same bytes on every run.

The parts: ``rnn_backward_cell`` (activations and their derivatives, a direction's flags),
``rnn_backward_steps`` (each op's recurrence, forward again and back through time; a rebuilt chunk's gates
compiled where ``rnn_backward_gates`` applies), ``rnn_backward_setup``
(what a thunk's passes share), ``rnn_backward_passes`` (the passes, in chunks), ``rnn_backward_checkpoints`` (the
checkpoint pass through the plain forward's loops, where every row runs every step); this module runs a thunk.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from . import lstm_sequence, rnn_backward_checkpoints, rnn_reserve, rnn_sequence
from .abi import Region, complete, forward_thunk, regions
from .abi.rnn import reserve_slots
from .bound import Bound, given_views
from .implementations import GIVEN, GIVEN_OUTPUTS, KERNELS, PREPARE
from .rnn_backward_passes import (chunk_steps, forward_pass, kept_whole, read_from, recomputed, reserve_chunk_steps,
                                  reverse_pass, time_chunks)
from .rnn_backward_setup import setup
from .rnn_backward_steps import _CHUNK, _FORWARD, _REVERSE, _compiled_lstm_forward, _compiled_lstm_reverse


def _recurrences(fwd: Mapping[str, Any], whole_sequence: bool = False) -> tuple[Callable, Callable]:
    """The forward and reverse recurrences of a layer-direction of the forward thunk ``fwd``: the op's NumPy
    steps, or a gru's or rnn's compiled ones where ``rnn_sequence`` applies (its forward only over the whole
    sequence), or the compiled lstm's where ``lstm_sequence`` applies: its reverse, and its forward where that runs
    ``whole_sequence`` (a forward writing a reserve) within the backward's bound, or else within the plain
    forward's (a recompute runs the forward in chunks, or through the plain forward's loops:
    ``rnn_backward_checkpoints``, and its chunks' gates at once, ``_CHUNK``). The compiled reverse reads what
    either forward keeps."""
    op = fwd["op"]
    if rnn_sequence.applies(fwd):  # a gru's or rnn's: its forward over the whole sequence alone
        return rnn_sequence.FORWARD[op] if whole_sequence else _FORWARD[op], rnn_sequence.REVERSE[op]
    compiled_forward = lstm_sequence.applies(fwd, backward=whole_sequence)
    return (_compiled_lstm_forward if compiled_forward else _FORWARD[op],
            _compiled_lstm_reverse if lstm_sequence.applies(fwd, backward=True) else _REVERSE[op])


#: A prepared run: ``run(arena, given=None)``, with ``given`` (``implementations.GIVEN``: a field's arena offset
#: -> the caller's array in place of its arena view) whether it ran on them (False: they do not fit, nothing ran).
Run = Callable[..., "bool | None"]


def _on_given(t: Mapping[str, Any], by_field: Mapping[str, Region], body: Callable[[Bound], None]) -> Run:
    """``run(arena, given=None)``: ``body`` on the tensors of ``t`` bound to ``arena``, the ``given`` arrays in
    place of their views (``bound.given_views``; the reserve among them is read or written where the caller
    holds it)."""
    last: list[Bound] = []  # the views of the last arena: a training loop runs on one arena call after call

    def run(arena: np.ndarray, given: Mapping[int, np.ndarray] | None = None) -> bool | None:
        views = None if given is None else given_views(by_field, given)
        if given is not None and views is None:
            return False
        if not last or last[0].arena is not arena:
            last[:] = [Bound(t, arena, by_field).every_view()]
        if views is None:
            body(last[0])
            return None
        with np.errstate(all="ignore"):  # NaN and inf are data (``bound_kernel`` quiets the arena's runs alone)
            body(last[0].with_given(views))
        return True
    return run


def prepare(thunk: Mapping[str, Any]) -> Run:
    """The thunk-only setup once (``host_fallback.PREPARE``): the completed fields, the regions and the reserve's
    layout, which a small thunk's run would otherwise spend a tenth of its time on (lstm B=8 S=24 H=32, 2
    layers)."""
    t = complete(thunk)
    fwd = forward_thunk(t)
    layout = reserve_slots(fwd) if t.get("reserve") is not None else None
    return _on_given(t, {r.field: r for r in regions(t)}, lambda b: _backward(fwd, b, layout))


def _run(thunk: Mapping[str, Any], arena: np.ndarray) -> None:
    """Run one lstm/gru/rnn backward thunk in place."""
    prepare(thunk)(arena)


def _backward(fwd: Mapping[str, Any], b: Bound, layout: list | None) -> None:
    """The reverse pass of the backward thunk bound to ``b`` (``fwd``: its forward thunk): in chunks, each chunk's
    kept arrays read from the reserve (ABI.md §9.1, laid out as ``layout``), or its forward run again from the
    checkpoints of a forward pass; or over the whole sequence at once, after the forward that writes a reserve
    (``kept_whole``: at B32 S128 I=H=256, 2 layers, bidirectional, one thread, CPU time at load 2-3, the recompute's
    fwd+bwd went from 1.61x the reserve's to 1.33x for the lstm, 1.79x to 1.42x for the gru, 1.48x to 1.40x for the
    rnn)."""
    s = setup(fwd, b)
    forwards, reverses = _recurrences(fwd)
    if layout is not None:  # chunks of many rows, for the GEMMs after the steps (the whole sequence at B32 S128)
        above, kept = rnn_reserve.load(fwd, b.view("reserve"), layout, s.cells)
        long = time_chunks(fwd["seq"], reserve_chunk_steps(fwd["seq"], fwd["batch"]))
        reverse_pass(s, [None, *above, None], long, read_from(kept, long), reverses)
        return
    if kept_whole(fwd["seq"], fwd["batch"]):
        whole = [(0, fwd["seq"])]
        passed = forward_pass(s, _recurrences(fwd, whole_sequence=True)[0], whole)
        reverse_pass(s, passed.inputs, whole, recomputed(s, forwards, whole, passed), reverses)
        return
    chunks = time_chunks(fwd["seq"], chunk_steps(fwd["seq"]))
    compiled, peepholes = forwards is _compiled_lstm_forward, fwd.get("peepholes") is not None
    at_once = None if compiled or peepholes else _CHUNK[fwd["op"]]
    top = at_once is not None  # the top layer's output: its states
    if not compiled and rnn_backward_checkpoints.applies(fwd):  # the plain forward's faster loops
        # a gru's last chunk of each walk kept as the reserve's forward keeps it: B32 S128 I=H=256, 2 layers,
        # bidirectional, its recompute 3% faster (CPU time, medians of 15). Not an lstm's: there the compiled
        # whole-sequence steps take about 1.5x the loops' compiled step, as much as the rebuild they save (no
        # change measured); nor an rnn's, read off its output (or one GEMM), which costs less than its steps.
        keeping = _recurrences(fwd, whole_sequence=True)[0] if fwd["op"] == "gru" else None
        passed = rnn_backward_checkpoints.checkpoint_pass(s, chunks, top, keeping)
    else:
        passed = forward_pass(s, forwards, chunks, top=top)
    reverse_pass(s, passed.inputs, chunks, recomputed(s, forwards, chunks, passed, at_once), reverses)


def forward_saving(thunk: Mapping[str, Any]) -> Run:
    """The forward kernel of a thunk with a reserve (``rnn.prepare`` hands it over): the recurrences of the
    backward pass over the whole sequence as one chunk (whose kept arrays the reserve's layout is; a small
    lstm's whole-sequence kernel keeps the ones its reverse reads), then ``dst``, the final states and the
    reserve stored."""
    t = complete(thunk)
    forwards = _recurrences(t, whole_sequence=True)[0]
    layout = reserve_slots(t)

    def body(b: Bound) -> None:
        s = setup(t, b)
        reserve = rnn_reserve.slots(t, b.view("reserve"), layout)
        passed = forward_pass(s, forwards, [(0, t["seq"])], reserve, top=True)
        s.b.store("dst", passed.inputs[-1].transpose(1, 0, 2))
        for f, value in passed.finals.items():
            s.b.store(f, value)
        rnn_reserve.save(t, reserve, s.cells, passed.kept)
    return _on_given(t, {r.field: r for r in regions(t)}, body)


KERNELS.add(("lstm_backward", "gru_backward", "rnn_backward"), _run)
PREPARE.add(("lstm_backward", "gru_backward", "rnn_backward"), prepare)
GIVEN.update(("lstm_backward", "gru_backward", "rnn_backward"))
GIVEN_OUTPUTS.update(("lstm_backward", "gru_backward", "rnn_backward"))
