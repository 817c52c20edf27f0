"""The aliasing rule of ABI.md §1, written once: which bytes of one thunk may be shared.

In the outer arena a thunk's write ranges may not overlap any other of its ranges, except:
- exact in-place elementwise ops: ``unary``, ``binary`` (an input read densely, at the element it
  writes) and ``cast`` between equal element sizes, whose ``dst`` range equals an input range;
- state read and then written in place: the carried ``h0``/``c0`` of lstm/gru/rnn and the
  ``state`` of gated_delta_net are one read-write range each (they may not overlap one another);
- a scan's ``outer_init_off`` range may start where its ``outer_final_off`` range starts.
In a scan's body arena the slots the driver writes (carry in, xs rows, bcast inputs, the output
gradient) may not overlap one another nor the slots it reads back (the body's outputs), except
that the loop's own output slot may equal its input slot exactly (an in-place body). Output slots
may share bytes with each other: the driver only reads them.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

from .model import Checked, FieldError, Region, Rule

Thunk = Mapping[str, Any]

#: (input field, output field) pairs of the scan family's loop that may coincide exactly.
_IN_PLACE_SLOTS = {("body_input_off", "body_output_off"), ("body_d_output_off", "body_dcarry_out_off"),
                   ("forward_body_carry_in_off", "forward_body_output_off")}


def _overlap(a_off: int, a_len: int, b_off: int, b_len: int) -> bool:
    return a_len > 0 and b_len > 0 and a_off < b_off + b_len and b_off < a_off + a_len


def _dense_strides(shape: list[int]) -> list[int]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= d
    return strides[::-1]


def _reads_in_place(t: Thunk, field: str) -> bool:
    """Whether input ``field`` of an elementwise thunk is read at exactly the element ``dst`` writes."""
    op = t["op"]
    if op == "unary":
        return field == "x"
    if op == "cast":
        return field == "src"
    if op == "binary" and field in ("a", "b"):
        dense = _dense_strides(list(t["shape"]))
        return all(d == 1 or s == want for d, s, want in zip(t["shape"], t[f"{field}_strides"], dense))
    return False


def _allowed(t: Thunk, write: Region, other: Region) -> bool:
    same_range = write.offset == other.offset and write.nbytes == other.nbytes
    if write.field == "dst" and same_range and other.access == "r" and _reads_in_place(t, other.field):
        return True
    return (t["op"] == "scan" and {write.field, other.field} == {"outer_final_off", "outer_init_off"}
            and write.offset == other.offset)


def _describe(r: Region) -> str:
    kind = {"r": "read", "w": "written", "rw": "read and written"}[r.access]
    return f"{r.field} [{r.offset}, {r.offset + r.nbytes}) ({kind})"


def check(t: Thunk, regs: list[Region]) -> None:
    """Raise ``FieldError`` when ``t``'s ranges (``regs``: its regions) overlap in a way the aliasing rule forbids."""
    spans = [(r, r.offset, r.offset + r.nbytes) for r in regs if r.nbytes > 0]
    for w, w_start, w_end in spans:
        if not w.writes:
            continue
        for other, start, end in spans:
            if other is not w and start < w_end and w_start < end and not _allowed(t, w, other):
                raise FieldError(t["op"], w.field, f"{_describe(w)} overlaps {_describe(other)}; a thunk may "
                                                   "write in place only as ABI.md §1 allows (exact in-place "
                                                   "elementwise ops, carried state): give it its own bytes")
    if t["op"] in ("scan", "scan_backward", "scan_backward_xs"):
        check_slots(t)


def _slots(t: Thunk) -> Iterable[tuple[str, list[tuple[str, int, int]], list[tuple[str, int, int]]]]:
    """Per body: (body field, slots the driver writes, slots it reads back), as (field, offset, bytes)."""
    c = t["carry_bytes"]
    if t["op"] == "scan":
        written = [("body_input_off", t["body_input_off"], c)]
        written += [(f"xs_inputs[{i}]", off, n) for i, (off, _, n) in enumerate(t["xs_inputs"])]
        written += [(f"bcast_inputs[{i}]", off, n) for i, (off, _, n) in enumerate(t["bcast_inputs"])]
        yield "body", written, [("body_output_off", t["body_output_off"], c)]
        return
    steps = [n for _, n in t["outer_xs_offs"]]
    written = [("body_carry_in_off", t["body_carry_in_off"], c)]
    written += [(f"body_x_offs[{i}]", off, n) for i, (off, n) in enumerate(zip(t["body_x_offs"], steps))]
    written.append(("body_d_output_off", t["body_d_output_off"], c))
    read = [("body_dcarry_out_off", t["body_dcarry_out_off"], c)]
    if t["op"] == "scan_backward_xs":
        read.append(("body_dxs_out_off", t["body_dxs_out_off"], t["per_step_bytes"]))
    yield "body_vjp", written, read
    if t["forward_body"] is not None:
        written = [("forward_body_carry_in_off", t["forward_body_carry_in_off"], c)]
        written += [(f"forward_body_x_offs[{i}]", off, n)
                    for i, (off, n) in enumerate(zip(t["forward_body_x_offs"], steps))]
        yield "forward_body", written, [("forward_body_output_off", t["forward_body_output_off"], c)]


def check_slots(t: Thunk) -> None:
    """Raise ``FieldError`` when two body slots of a scan-family thunk overlap (see the module doc)."""
    for body, written, read in _slots(t):
        ordered = sorted((s for s in written if s[2] > 0), key=lambda s: s[1])
        for a, b in zip(ordered, ordered[1:]):
            if _overlap(a[1], a[2], b[1], b[2]):
                raise _slot_error(t, body, b, a)
        for out in read:
            for slot in written:
                exact = (slot[0], out[0]) in _IN_PLACE_SLOTS and slot[1:] == out[1:]
                if _overlap(slot[1], slot[2], out[1], out[2]) and not exact:
                    raise _slot_error(t, body, out, slot)


def _slot_error(t: Thunk, body: str, a: tuple[str, int, int], b: tuple[str, int, int]) -> FieldError:
    return FieldError(t["op"], a[0], f"{body} slot [{a[1]}, {a[1] + a[2]}) overlaps {b[0]} [{b[1]}, {b[1] + b[2]}); "
                                     "the slots a scan fills and reads back must be disjoint (only the loop's "
                                     "output may equal its input exactly)")


def _check(c: Checked) -> None:
    check(c.thunk, c.regions)


#: The aliasing rule as an entry of every op's rules.
ALIASING = Rule(_check, on_footprint=True)
