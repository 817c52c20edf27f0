"""The scan family of ABI.md §6: one driver, written once over a small memory protocol.

The driver owns all control logic — body slots, broadcast inputs copied once, xs rows,
trajectories, checkpoint rows, upstream accumulation, recomputation from checkpoints (segment
cache or treeverse bisection). It moves bytes only through a :class:`Memory`, so the OpenCL and
CUDA backends run the same driver over device buffers; :class:`HostMemory` is the NumPy one.
"""
from __future__ import annotations

import base64
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np

from .abi import ELEM_SIZE
from .abi.scan import SCAN_OPS, check, upstream_dtype
from .arena import load, store
from .body import copy_bytes
from .implementations import KERNELS
from .scan_data import BodyData, Feed

Thunk = Mapping[str, Any]
Schedule = Mapping[str, Any]
Place = tuple[Any, int]  # (arena, byte offset)

STRATEGIES = ("segment", "treeverse")


class Memory(Protocol):
    """Arenas and the primitives the scan driver needs; an arena is whatever the backend allocates."""

    def alloc(self, nbytes: int) -> Any:
        """A zeroed arena of ``nbytes``."""

    def free(self, arena: Any) -> None:
        """Release an arena from :meth:`alloc`."""

    def write(self, arena: Any, offset: int, data: np.ndarray) -> None:
        """Copy host bytes (``numpy.uint8``) into ``arena`` at ``offset``."""

    def copy(self, src: Any, src_off: int, dst: Any, dst_off: int, nbytes: int) -> None:
        """Copy bytes between (or within) arenas; overlapping ranges raise ``ValueError``."""

    def read(self, arena: Any, offset: int, nbytes: int) -> np.ndarray:
        """``nbytes`` of ``arena`` at ``offset`` as host bytes (``numpy.uint8``): the run-time data checks."""

    def run(self, schedule: Schedule, arena: Any, before: Callable[[int], None]) -> None:
        """Run a nested schedule's thunks in order on ``arena``, calling ``before(i)`` before thunk ``i``
        (it checks the thunk's run-time data; see ``scan_data.BeforeThunk`` for when it may be skipped)."""

    def accumulate(self, dst: Any, dst_off: int, src: Any, src_off: int, count: int, dtype: str) -> None:
        """``dst[i] += src[i]`` for ``count`` elements of ``dtype`` (16-bit: in f32, rounded on store)."""

    def zero(self, arena: Any, offset: int, nbytes: int) -> None:
        """Set ``nbytes`` at ``offset`` to zero."""


class HostMemory:
    """:class:`Memory` over ``numpy.uint8`` arenas; counts body runs and the peak bytes it allocated.

    ``options`` are passed on to every body thunk, each kernel getting those it takes (a nested scan
    honours ``recompute``).
    """

    def __init__(self, **options: Any):
        self.options = options
        self.live = 0
        self.peak = 0  # most bytes held at once by alloc: the driver's extra memory
        self.runs = 0  # nested schedules run, forward bodies and vjp bodies together
        self._checked: set[tuple[int, int]] = set()  # (body, arena size) pairs whose bounds were checked
        self._kernels: dict[int, Any] = {}  # id(body thunk) -> its bound kernel (body schedules outlive this object)

    def alloc(self, nbytes: int) -> np.ndarray:
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        return np.zeros(nbytes, np.uint8)

    def free(self, arena: np.ndarray) -> None:
        self.live -= arena.nbytes

    def write(self, arena: np.ndarray, offset: int, data: np.ndarray) -> None:
        arena[offset: offset + data.size] = data

    def copy(self, src: np.ndarray, src_off: int, dst: np.ndarray, dst_off: int, nbytes: int) -> None:
        copy_bytes(src, src_off, dst, dst_off, nbytes)

    def read(self, arena: np.ndarray, offset: int, nbytes: int) -> np.ndarray:
        return arena[offset: offset + nbytes]

    def run(self, schedule: Schedule, arena: np.ndarray, before: Callable[[int], None]) -> None:
        from . import bound_kernel, check_bounds  # the package imports this module first

        self.runs += 1
        thunks = schedule["thunks"]
        if (id(schedule), arena.size) not in self._checked:  # a body runs once per step: check it once
            for thunk in thunks:
                check_bounds(thunk, arena.size)
            self._checked.add((id(schedule), arena.size))
        for index, thunk in enumerate(thunks):
            kernel = self._kernels.get(id(thunk))
            if kernel is None:
                kernel = self._kernels[id(thunk)] = bound_kernel(thunk, self.options)
            before(index)
            kernel(arena)

    def accumulate(self, dst: np.ndarray, dst_off: int, src: np.ndarray, src_off: int, count: int, dtype: str) -> None:
        total = load(dst, dst_off, dtype, (count,)) + load(src, src_off, dtype, (count,))
        store(dst, dst_off, dtype, total)

    def zero(self, arena: np.ndarray, offset: int, nbytes: int) -> None:
        arena[offset: offset + nbytes] = 0


def checkpoint_steps(length: int, num_checkpoints: int) -> list[int]:
    """Step whose carry output each trajectory row holds: ``c_k = ceil((k+1)·length/K) − 1``, or every step."""
    rows = num_checkpoints if 0 < num_checkpoints < length else length
    return [-(-(k + 1) * length // rows) - 1 for k in range(rows)]


def working_bytes(t: Thunk, recompute: str = "segment", _seen: dict[int, int] | None = None) -> int:
    """The most bytes the driver holds at once for ``t`` besides the outer arena.

    Its body arenas, the recompute cache of the longest checkpoint segment (``segment``: every carry
    of it; ``treeverse``: one carry per level of bisection), and the largest working memory of a scan
    nested in its bodies (those run one at a time). Computed from the fields alone, in time bounded by
    the number of distinct body schedules, so a device can refuse a schedule before anything runs.
    """
    seen = {} if _seen is None else _seen
    if id(t) in seen:
        return seen[id(t)]
    if t["op"] == "scan":
        bodies, cache = [t["body"]], 0
    else:
        length, k = t["length"], t["num_checkpoints"]
        longest = -(-length // k) if 0 < k < length else 1  # the forward body runs only to recompute
        bodies = [t["body_vjp"]] + ([t["forward_body"]] if longest > 1 else [])
        carries = longest - 1 if recompute == "segment" else max(longest - 1, 0).bit_length()
        cache = carries * t["carry_bytes"]
    nested = max((working_bytes(inner, recompute, seen) for body in bodies for inner in body["thunks"]
                  if inner["op"] in SCAN_OPS), default=0)
    seen[id(t)] = total = sum(body["arena_bytes"] for body in bodies) + cache + nested
    return total


def _pristine(mem: Memory, schedule: Schedule) -> Any:
    """A fresh body arena: ``init`` applied to zeros."""
    arena = mem.alloc(schedule["arena_bytes"])
    for entry in schedule.get("init") or ():
        mem.write(arena, entry["offset"], np.frombuffer(base64.b64decode(entry["b64"]), np.uint8))
    return arena


def _pass(mem: Memory, arena: Any, src_off: int, dst_off: int, nbytes: int) -> None:
    """Move a step's output into the next step's input slot (nothing to do for an in-place body)."""
    if src_off != dst_off:
        mem.copy(arena, src_off, arena, dst_off, nbytes)


def run_scan(mem: Memory, t: Thunk, outer: Any) -> None:
    """``scan``: run ``body`` ``length`` times, threading the carry and saving the trajectory or final carry."""
    check(t)
    length, c = t["length"], t["carry_bytes"]

    body, in_off, out_off, final = t["body"], t["body_input_off"], t["body_output_off"], t["outer_final_off"]
    data = BodyData("body", body, [Feed(b, o, n, 0) for b, o, n in t["bcast_inputs"]]
                    + [Feed(b, o, n, n) for b, o, n in t["xs_inputs"]], [(in_off, c)])
    data.check_given(mem, outer, length)
    saved = checkpoint_steps(length, t["num_checkpoints"]) if t["save_trajectory"] else []
    rows = {step: k for k, step in enumerate(saved)}
    arena = _pristine(mem, body)
    try:
        mem.copy(outer, t["outer_init_off"], arena, in_off, c)
        for body_off, outer_off, total in t["bcast_inputs"]:
            mem.copy(outer, outer_off, arena, body_off, total)
        for step in range(length):
            for body_off, outer_off, step_bytes in t["xs_inputs"]:
                mem.copy(outer, outer_off + step * step_bytes, arena, body_off, step_bytes)
            data.before(mem, arena, step).run()
            if step in rows:
                mem.copy(arena, out_off, outer, final + rows[step] * c, c)
            _pass(mem, arena, out_off, in_off, c)
        if not t["save_trajectory"]:
            mem.copy(arena, in_off, outer, final, c)
    finally:
        mem.free(arena)


def _body_data(t: Thunk) -> tuple[BodyData, BodyData | None]:
    """The run-time data of ``scan_backward``'s ``body_vjp`` and, when it recomputes, ``forward_body``."""
    c, length, k = t["carry_bytes"], t["length"], t["num_checkpoints"]

    def feeds(body_offs: Sequence[int]) -> list[Feed]:
        return [Feed(b, o, n, n) for b, (o, n) in zip(body_offs, t["outer_xs_offs"])]
    vjp = BodyData("body_vjp", t["body_vjp"], feeds(t["body_x_offs"]),
                   [(t["body_carry_in_off"], c), (t["body_d_output_off"], c)])
    if not 0 < k < length:
        return vjp, None
    return vjp, BodyData("forward_body", t["forward_body"], feeds(t["forward_body_x_offs"]),
                         [(t["forward_body_carry_in_off"], c)])


class _Reverse:
    """One execution of ``scan_backward`` / ``scan_backward_xs``: the vjp sweep and the recomputation."""

    def __init__(self, mem: Memory, t: Thunk, outer: Any, data: tuple[BodyData, BodyData | None]):
        self.mem, self.t, self.outer = mem, t, outer
        self.c = t["carry_bytes"]
        self.xs: Sequence[Sequence[int]] = t["outer_xs_offs"]
        self.dxs = t["op"] == "scan_backward_xs"
        self.upstream_dtype = upstream_dtype(t)
        self.vjp = _pristine(mem, t["body_vjp"])
        k, length = t["num_checkpoints"], t["length"]
        self.fwd = _pristine(mem, t["forward_body"]) if 0 < k < length else None  # only checkpoints recompute
        self.vjp_data, self.fwd_data = data

    def close(self) -> None:
        for arena in (self.vjp, self.fwd):
            if arena is not None:
                self.mem.free(arena)

    def carry_row(self, row: int) -> Place:
        """The carry a trajectory row holds; row -1 is ``init``."""
        t = self.t
        return (self.outer, t["outer_init_off"]) if row < 0 else (self.outer, t["outer_traj_off"] + row * self.c)

    def _xs_rows(self, step: int, arena: Any, body_offs: Sequence[int]) -> None:
        for body_off, (outer_off, step_bytes) in zip(body_offs, self.xs):
            self.mem.copy(self.outer, outer_off + step * step_bytes, arena, body_off, step_bytes)

    def vjp_step(self, step: int, carry: Place) -> None:
        """Fold upstream row ``step`` into dcarry, run ``body_vjp`` on carry_step, and keep its dcarry.

        dcarry lives in the ``body_d_output_off`` slot between steps: nothing else writes there.
        """
        mem, t, c, d_out = self.mem, self.t, self.c, self.t["body_d_output_off"]
        if t["save_trajectory"]:
            count = c // ELEM_SIZE[self.upstream_dtype]
            mem.accumulate(self.vjp, d_out, self.outer, t["outer_upstream_off"] + step * c, count, self.upstream_dtype)
        mem.copy(*carry, self.vjp, t["body_carry_in_off"], c)
        self._xs_rows(step, self.vjp, t["body_x_offs"])
        self.vjp_data.before(mem, self.vjp, step).run()
        if self.dxs:
            n = t["per_step_bytes"]
            mem.copy(self.vjp, t["body_dxs_out_off"], self.outer, t["outer_dxs_off"] + step * n, n)
        _pass(mem, self.vjp, t["body_dcarry_out_off"], d_out, c)

    def recompute(self, carry: Place, first: int, count: int, dst: Place, keep_all: bool) -> None:
        """Run ``forward_body`` over steps ``first .. first+count-1`` from ``carry``.

        The carry entering step ``first+count`` goes to ``dst``; with ``keep_all`` the carry entering
        each step ``first+1+i`` goes to ``dst`` row ``i`` instead.
        """
        mem, t, c = self.mem, self.t, self.c
        in_off, out_off = t["forward_body_carry_in_off"], t["forward_body_output_off"]
        mem.copy(*carry, self.fwd, in_off, c)
        for i in range(count):
            self._xs_rows(first + i, self.fwd, t["forward_body_x_offs"])
            self.fwd_data.before(mem, self.fwd, first + i).run()
            _pass(mem, self.fwd, out_off, in_off, c)
            if keep_all:
                mem.copy(self.fwd, in_off, dst[0], dst[1] + i * c, c)
        if not keep_all:
            mem.copy(self.fwd, in_off, dst[0], dst[1], c)

    def segment(self, first: int, count: int, carry: Place) -> None:
        """Reverse over ``count`` steps from ``first``: cache every carry of the segment once, then sweep."""
        cache = self.mem.alloc((count - 1) * self.c)
        try:
            self.recompute(carry, first, count - 1, (cache, 0), keep_all=True)
            for i in range(count - 1, 0, -1):
                self.vjp_step(first + i, (cache, (i - 1) * self.c))
            self.vjp_step(first, carry)
        finally:
            self.mem.free(cache)

    def treeverse(self, first: int, count: int, carry: Place) -> None:
        """Reverse over ``count`` steps from ``first`` by bisection: one carry held per level of recursion."""
        if count == 1:
            self.vjp_step(first, carry)
            return
        half = count // 2
        held = self.mem.alloc(self.c)
        try:
            self.recompute(carry, first, half, (held, 0), keep_all=False)
            self.treeverse(first + half, count - half, (held, 0))
        finally:
            self.mem.free(held)
        self.treeverse(first, half, carry)


def run_scan_backward(mem: Memory, t: Thunk, outer: Any, recompute: str = "segment") -> None:
    """``scan_backward`` / ``scan_backward_xs``: run ``body_vjp`` for ``t = length-1 .. 0``, carrying dcarry.

    Carries between checkpoints are recomputed by ``recompute`` ("segment" or "treeverse");
    the strategy never changes a result bit.
    """
    if recompute not in STRATEGIES:
        raise ValueError(f"recompute={recompute!r}; choose one of {STRATEGIES}")
    check(t)
    c, d_out = t["carry_bytes"], t["body_d_output_off"]
    data = _body_data(t)
    for body in data:
        if body is not None:
            body.check_given(mem, outer, t["length"])
    rev = _Reverse(mem, t, outer, data)
    try:
        if t["save_trajectory"]:
            mem.zero(rev.vjp, d_out, c)
        else:
            mem.copy(outer, t["outer_upstream_off"], rev.vjp, d_out, c)
        steps = checkpoint_steps(t["length"], t["num_checkpoints"])
        sweep = rev.segment if recompute == "segment" else rev.treeverse
        for row in range(len(steps) - 1, -1, -1):
            first = steps[row - 1] + 1 if row else 0
            count = steps[row] - first + 1
            if count == 1:  # carry saved: nothing to recompute
                rev.vjp_step(first, rev.carry_row(row - 1))
            else:
                sweep(first, count, rev.carry_row(row - 1))
        if t["op"] == "scan_backward":
            mem.copy(rev.vjp, d_out, outer, t["outer_dinit_off"], c)
    finally:
        rev.close()


# The scan kernels take every host option (``**options``): they hand each body thunk the ones its kernel takes.
def _scan_kernel(thunk: Thunk, arena: np.ndarray, *, recompute: str = "segment", **options: Any) -> None:
    run_scan(HostMemory(recompute=recompute, **options), thunk, arena)


def _backward_kernel(thunk: Thunk, arena: np.ndarray, *, recompute: str = "segment", **options: Any) -> None:
    run_scan_backward(HostMemory(recompute=recompute, **options), thunk, arena, recompute)


KERNELS.add("scan", _scan_kernel)
KERNELS.add(("scan_backward", "scan_backward_xs"), _backward_kernel)
