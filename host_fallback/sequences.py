"""The rows of a state-space thunk (ABI.md §8): packed sequences and the carried-state pool.

A *row* is one independent recurrence over tokens: a batch row, or with ``cu_seqlens`` (batch 1)
one of the ``num_seqs`` sequences packed back to back. ``Sequences`` lists where each sequence's
tokens lie and cuts them at chunk boundaries for the chunked forms; ``StatePool`` reads the state
each row starts from (zero without ``carry_state``; entry ``state_slots[r]`` of the pool with
slots, else entry ``r``) and writes the final states back, once per thunk. ``cu_seqlens`` and
``state_slots`` are trusted: the runtime checks their values before a kernel runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import numpy as np

from .bound import Bound

Thunk = Mapping[str, Any]


@dataclass(frozen=True)
class Piece:
    """The tokens ``lo .. hi-1`` (chunk positions) of sequence ``row`` inside chunk ``chunk``;
    ``first``: the sequence starts here, ``last``: it ends here."""

    chunk: int
    lo: int
    hi: int
    row: int
    first: bool
    last: bool


class Sequences:
    """The sequences of a varlen thunk: sequence ``r`` holds tokens ``cu[r] .. cu[r+1]-1``."""

    def __init__(self, cu: np.ndarray):
        self.cu = [int(v) for v in cu]

    @classmethod
    def of(cls, thunk: Thunk, bound: Bound) -> "Sequences | None":
        """The thunk's sequences, ``None`` without ``cu_seqlens`` (then every batch row is one)."""
        return None if thunk["cu_seqlens"] is None else cls(bound.view("cu_seqlens"))

    def runs(self) -> Iterator[tuple[int, int, int]]:
        """``(row, lo, hi)`` of every non-empty sequence, in token order."""
        for r, (lo, hi) in enumerate(zip(self.cu, self.cu[1:])):
            if hi > lo:
                yield r, lo, hi

    def lanes(self, padding: float) -> list[list[tuple[int, int, int]]]:
        """The non-empty sequences (``runs``) dealt into lanes to run side by side, each lane as long as
        the longest (its tail padded): longest first, each into the lane with the fewest tokens so far
        (LPT). The most lanes whose padding stays within ``padding`` of the tokens (every lane at most
        as long as the longest sequence, by the count); one lane, unpadded, where no more fit."""
        runs = sorted(self.runs(), key=lambda r: r[1] - r[2])
        total = sum(hi - lo for _, lo, hi in runs)
        longest = runs[0][2] - runs[0][1] if runs else 0
        for count in range(min(len(runs), total // max(longest, 1)), 1, -1):
            lanes: list[list[tuple[int, int, int]]] = [[] for _ in range(count)]
            loads = [0] * count
            for run in runs:
                k = loads.index(min(loads))
                lanes[k].append(run)
                loads[k] += run[2] - run[1]
            if count * max(loads) <= (1 + padding) * total:
                return lanes
        return [sorted(runs, key=lambda r: r[1])]

    def pieces(self, length: int) -> list[Piece]:
        """Every non-empty sequence cut at the boundaries of chunks of ``length`` tokens, in token order."""
        out = []
        for r, lo, hi in self.runs():
            start = lo
            while start < hi:
                chunk = start // length
                end = min(hi, (chunk + 1) * length)
                out.append(Piece(chunk, start - chunk * length, end - chunk * length, r, start == lo, end == hi))
                start = end
        return out


class StatePool:
    """The carried state of a thunk: ``initial`` the state each row starts from, ``store`` the final ones.

    States are ``[rows, units, ...]`` in the compute type ``dtype`` (``units`` the channels or
    heads of a block). Without ``carry_state`` every row starts from zero and nothing is stored.
    """

    def __init__(self, thunk: Thunk, bound: Bound, dtype: np.dtype, shape: tuple[int, ...], field: str = "state"):
        """``shape``: one row's state per unit (``[N]`` for selective_scan, ``[P, N]`` for mamba2); ``field``:
        the tensor the pool lives in (a backward op's ``d_state`` is indexed as its ``state`` is)."""
        self.bound, self.dtype, self.shape, self.field = bound, np.dtype(dtype), tuple(shape), field
        self.carry = bool(thunk["carry_state"])
        self.varlen = thunk["cu_seqlens"] is not None
        self.count = thunk["num_seqs"] if self.varlen else thunk["batch"]
        self.slots = (np.asarray(bound.view("state_slots"), np.intp)
                      if self.carry and thunk["state_slots"] is not None else None)

    def rows(self, batch: slice) -> slice:
        """The state rows of a block of batch rows: all sequences with varlen (its batch is 1)."""
        return slice(0, self.count) if self.varlen else batch

    def initial(self, batch: slice, units: slice) -> np.ndarray:
        """The starting states of a block, ``[rows, units, *shape]``, which the kernel may update in place:
        the arena's own bytes where they are already in the compute type and no slot indirection
        applies (no copy in or out), else a fresh array."""
        rows = self.rows(batch)
        if not self.carry:
            return np.zeros((rows.stop - rows.start, units.stop - units.start, *self.shape), self.dtype)
        if self.slots is not None:
            return self.bound.view(self.field)[self.slots[rows], units].astype(self.dtype)
        own = self.bound.view(self.field)[rows, units]
        return own if own.dtype == self.dtype else own.astype(self.dtype)

    def store(self, batch: slice, units: slice, final: np.ndarray) -> None:
        """Write a block's final states back (rounded into ``state_dtype``), unless updated where they lie."""
        if not self.carry or np.may_share_memory(final, self.bound.arena):
            return
        rows = self.rows(batch)
        if self.slots is None:
            self.bound.store(self.field, final, (rows, units))
            return
        pool = self.bound.view(self.field)
        pool[self.slots[rows], units] = final.astype(pool.dtype)


def step_spans(seq: int, seqs: Sequences | None) -> list[tuple[int | None, int, int]]:
    """``(row, lo, hi)``: the token spans a step path walks. Without varlen one span, every batch row at
    once (``row`` None: the state rows are the batch rows); with it one per non-empty sequence."""
    return [(None, 0, seq)] if seqs is None else list(seqs.runs())
