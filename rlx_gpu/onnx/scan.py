"""ONNX's Scan node as one scan thunk (ABI.md §6) per batch row (opset 8) or per node (opset 9 on).

The scan's carry is one flat buffer: the N state variables, then one slot per scan output. The body
reads its states out of the carry and writes the next carry as the states it computed followed by
its scan outputs; with scan outputs the thunk saves its trajectory, whose rows hold every step's
scan outputs and, in the last row, the final states. Scan inputs are moved to their scan axis and
direction first (``scan_input_axes``, ``scan_input_directions``), scan outputs back after
(``scan_output_axes``, ``scan_output_directions``). Values of the outer graph that the body names
are its constants (known ones) or broadcast inputs (run-time ones).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..graph.builder import Graph
from .importer import FLOAT_TYPES, Handler, Importer
from .values import Value, View, concat, reshape, take


def _free_names(proto: Any) -> list[str]:
    """Names a graph's nodes read that the graph itself does not define (outer-scope values), in order."""
    defined = {i.name for i in proto.input} | {i.name for i in proto.initializer}
    free: list[str] = []
    for node in proto.node:
        for name in node.input:
            if name and name not in defined and name not in free:
                free.append(name)
        defined.update(node.output)
    return free


def _size(shape: Sequence[int]) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _flat(importer: Importer, value: Value) -> Value:
    return reshape(importer.graph, value, (_size(value.shape),))


def _segment(importer: Importer, flat: Value, start: int, shape: Sequence[int]) -> Value:
    """Elements ``start .. start+size`` of a 1-D value, as ``shape``."""
    return reshape(importer.graph, take(importer.graph, flat, 0, range(start, start + _size(shape))), shape)


class _Body:
    """One import of a Scan body into a fresh graph, with its states, per-step rows and outer values bound."""

    def __init__(self, outer: Importer, node: Any, proto: Any, dtype: str, states: list[tuple[int, ...]],
                 rows: list[tuple[int, ...]], carry_size: int | None):
        self.graph = Graph(dtype)
        self.importer = Importer(self.graph, outer.handlers, outer.opset)
        names = [i.name for i in proto.input]
        n = len(states)
        if carry_size is None:  # the first import, which finds the scan outputs' shapes
            for name, shape in zip(names, states):
                self.importer.values[name] = View.of(self.graph.input(name, shape, dtype))
        else:
            carry = View.of(self.graph.input("scan carry", (carry_size,), dtype))
            start = 0
            for name, shape in zip(names, states):
                self.importer.values[name] = _segment(self.importer, carry, start, shape)
                start += _size(shape)
        for name, shape in zip(names[n:], rows):
            self.importer.values[name] = View.of(self.graph.input(name, shape, dtype))
        self.bcast: list[Value] = []
        for name in _free_names(proto):
            if name not in outer.values:
                raise outer.error(node, f"the body reads {name!r}, which no outer value defines")
            value = outer.values[name]
            if isinstance(value, View):
                self.bcast.append(value)
                value = View.of(self.graph.input(f"outer.{name}", value.shape, value.dtype))
            self.importer.values[name] = value
        self.importer.import_graph(proto)
        self.outputs = [self.importer.values[o.name] for o in proto.output]


def _scan_one(importer: Importer, node: Any, proto: Any, states: list[Value], xs: list[Value],
              out_axes: list[int], out_reverse: list[bool]) -> list[Value]:
    """One scan over ``xs`` (already ``[length, ...]`` in step order) from ``states``: finals, then outputs."""
    graph = importer.graph
    views = [v for v in (*states, *xs) if isinstance(v, View)]
    dtype = views[0].dtype if views else FLOAT_TYPES[1]
    length = xs[0].shape[0]
    shapes = [tuple(s.shape) for s in states]
    rows = [tuple(x.shape[1:]) for x in xs]
    first = _Body(importer, node, proto, dtype, shapes, rows, None)
    out_shapes = [tuple(v.shape) for v in first.outputs[len(states):]]
    carry_size = sum(_size(s) for s in shapes + out_shapes)
    body = _Body(importer, node, proto, dtype, shapes, rows, carry_size)
    pieces = [_flat(body.importer, v) for v in body.outputs]
    body.graph.output("scan next carry", body.importer.dense(concat(body.graph, pieces, 0), dtype))

    init = concat(graph, [_flat(importer, s) for s in states] + [np.zeros(_size(s), np.float32) for s in out_shapes], 0)
    saving = bool(out_shapes)
    result = View.of(graph.scan(body.graph, importer.dense(init, dtype), [importer.dense(x, dtype) for x in xs],
                                [importer.dense(b) for b in body.bcast], length=length, save_trajectory=saving))
    last = reshape(graph, take(graph, result, 0, [length - 1]), (carry_size,)) if saving else result
    outs, start = [], 0
    for shape in shapes:
        outs.append(_segment(importer, last, start, shape))
        start += _size(shape)
    out_axes = _axes(importer, node, "scan_output_axes", len(out_shapes), [len(s) + 1 for s in out_shapes],
                     out_axes)
    for shape, axis, reverse in zip(out_shapes, out_axes, out_reverse):
        columns = take(graph, result, 1, range(start, start + _size(shape)))
        stacked = reshape(graph, columns, (length, *shape))
        if reverse:
            stacked = take(graph, stacked, 0, range(length - 1, -1, -1))
        perm = [*range(1, axis + 1), 0, *range(axis + 1, len(shape) + 1)]
        outs.append(stacked.transpose(perm))
        start += _size(shape)
    return outs


def _along(importer: Importer, value: Value, axis: int, reverse: bool) -> Value:
    """``value`` with ``axis`` moved first, its order reversed when ``reverse``."""
    perm = [axis, *(a for a in range(len(value.shape)) if a != axis)]
    moved = value.transpose(perm)
    return take(importer.graph, moved, 0, range(moved.shape[0] - 1, -1, -1)) if reverse else moved


def _axes(importer: Importer, node: Any, name: str, count: int, rank: Sequence[int],
          given: Sequence[int] | None = None) -> list[int]:
    """The axes attribute ``name`` (``given`` when already read), one per tensor, non-negative."""
    given = list(given if given is not None else importer.attributes(node).get(name) or [0] * count)
    if len(given) != count:
        raise importer.unsupported(node, name, given, f"expected {count} entries")
    out = []
    for axis, r in zip(given, rank):
        if not -r <= axis < r:
            raise importer.unsupported(node, name, given, f"axis {axis} is out of range for rank {r}")
        out.append(axis % r)
    return out


def _scan(importer: Importer, node: Any, ins: list[Value | None]) -> list[Value | None]:
    attrs = importer.attributes(node)
    proto = next(a.g for a in node.attribute if a.name == "body")
    m = int(attrs["num_scan_inputs"])
    batched = importer.opset < 9  # Scan-8: every tensor has a batch axis first and sequence_lens first
    if batched:
        seq_lens, ins = ins[0], ins[1:]
    n = len(ins) - m
    states, xs = ins[:n], ins[n:]
    k = len(proto.output) - n
    in_dirs = attrs.get("directions" if batched else "scan_input_directions") or [0] * m
    out_dirs = attrs.get("scan_output_directions") or [0] * k
    for name, given, count in (("scan_input_directions", in_dirs, m), ("scan_output_directions", out_dirs, k)):
        if len(given) != count or any(d not in (0, 1) for d in given):
            raise importer.unsupported(node, name, given, f"expected {count} entries of 0 (forward) or 1 (reverse)")
    if not batched:
        in_axes = _axes(importer, node, "scan_input_axes", m, [len(x.shape) for x in xs])
        out_axes = importer.attributes(node).get("scan_output_axes") or [0] * k
        xs = [_along(importer, x, a, bool(d)) for x, a, d in zip(xs, in_axes, in_dirs)]
        return _scan_one(importer, node, proto, states, xs, out_axes, [bool(d) for d in out_dirs])
    batch = xs[0].shape[0]
    length = xs[0].shape[1]
    lengths = _sequence_lens(importer, node, seq_lens, batch, length)
    rows = []
    for b, steps in enumerate(lengths):
        def row(v: Value) -> Value:
            return reshape(importer.graph, take(importer.graph, v, 0, [b]), v.shape[1:])
        row_xs = [_along(importer, take(importer.graph, row(x), 0, range(steps)), 0, bool(d))
                  for x, d in zip(xs, in_dirs)]
        outs = _scan_one(importer, node, proto, [row(s) for s in states], row_xs, [0] * k,
                         [bool(d) for d in out_dirs])
        # a row shorter than the sequence has its scan outputs zero after its last step (as onnxruntime)
        outs = outs[:n] + [concat(importer.graph, [o, np.zeros((length - steps, *o.shape[1:]), np.float32)], 0)
                           if steps < length else o for o in outs[n:]]
        rows.append(outs)
    return [concat(importer.graph, [reshape(importer.graph, r[i], (1, *r[i].shape)) for r in rows], 0)
            for i in range(n + k)]


def _sequence_lens(importer: Importer, node: Any, seq_lens: Value | None, batch: int, length: int) -> list[int]:
    """The steps of every row of a Scan-8: ``length`` without ``sequence_lens``, else its values, checked.

    Each row is its own scan thunk, so a row's length is that scan's static ``length``: known lengths
    are exact, lengths known only at run time cannot be expressed (no scan length or select is data).
    """
    if seq_lens is None:
        return [length] * batch
    if not isinstance(seq_lens, np.ndarray):
        raise importer.error(node, "input sequence_lens is computed at run time; a Scan-8 is imported with the "
                                   "number of steps of every row fixed, so give sequence_lens as an initializer "
                                   "or a Constant (or leave it out: every row runs the whole sequence)")
    if not np.issubdtype(seq_lens.dtype, np.integer) or seq_lens.shape != (batch,) or \
            (seq_lens.size and not (seq_lens.min() >= 1 and seq_lens.max() <= length)):
        raise importer.error(node, f"input sequence_lens is {seq_lens.dtype} {seq_lens.tolist()}; expected {batch} "
                                   f"integers (int64 in ONNX) in 1..{length}, one per batch row (as onnxruntime)")
    return [int(v) for v in seq_lens]


HANDLERS = {
    "Scan": Handler(_scan, frozenset({"body", "num_scan_inputs", "directions", "scan_input_axes",
                                      "scan_input_directions", "scan_output_axes", "scan_output_directions"})),
}
