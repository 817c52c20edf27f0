"""The run-time check of ABI.md §8's integer tensors (``seq_lens``, ``cu_seqlens``, ``state_slots``).

The thunks of scan bodies are checked by the scan driver (``host_fallback.scan_data``), on every
device; ``refused`` turns its ``DataError`` into the ``RunError`` naming the top-level thunk too.

Validation cannot see their values, so before a thunk that has them runs, the executor reads them
(one small read per tensor) and refuses values outside their rules with a ``RunError``. Values that no
earlier thunk of the schedule writes are checked before anything runs, so a refused run writes
nothing and leaves the caller's arena unchanged; values an earlier thunk produces are read just before
their thunk, after the ones before it ran.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from host_fallback.abi import Region, footprint, runtime_data

from ..errors import RunError
from ..schedule.model import Thunk

Reader = Callable[[Region], np.ndarray]


@dataclass(frozen=True)
class DataCheck:
    """One thunk's integer tensors; ``early``: no earlier thunk writes them, so they are checked first."""

    thunk: Thunk
    regions: tuple[Region, ...]
    early: bool
    check: Callable[[Reader], None]  # ``runtime_data.checker``'s, worked out once for the thunk

    def run(self, read: Reader) -> None:
        try:
            self.check(read)
        except runtime_data.DataError as err:
            raise refused(self.thunk, err) from None


def refused(thunk: Thunk, err: runtime_data.DataError) -> RunError:
    """The ``RunError`` of top-level thunk ``thunk`` for ``err``: raised by its own check or, for a scan,
    by the scan driver's check of a body thunk (``err.where`` names it)."""
    if not err.where:
        return RunError(f"thunk {thunk.index} ({thunk.op}), {err}; nothing of this thunk ran "
                        f"(ABI.md §8: integer tensors are checked before their thunk)")
    return RunError(f"thunk {thunk.index} ({thunk.op}), {err}; that body thunk did not run (ABI.md §8)")


def data_checks(thunks: Sequence[Thunk]) -> tuple[DataCheck, ...]:
    """The checks of a schedule's top-level thunks that read integer tensors, in thunk order."""
    checks, written = [], []
    for thunk in thunks:
        ints = runtime_data.int_regions(thunk)
        if ints:
            early = not any(w.offset < r.offset + r.nbytes and r.offset < w.offset + w.nbytes
                            for r in ints for w in written)
            checks.append(DataCheck(thunk, tuple(ints), early, runtime_data.checker(thunk)))
        written += footprint(thunk)[1]
    return tuple(checks)


def int32_reader(read_bytes: Callable[[int, int], np.ndarray]) -> Reader:
    """A reader of integer regions from ``read_bytes(offset, nbytes)`` (a host view or a device read)."""
    return lambda r: np.asarray(read_bytes(r.offset, r.nbytes)).view("<i4")
