"""``rlx-gpu run --check`` on the host: each thunk of a schedule against the float64 reference of ABI.md.

Comparing the host with itself proves nothing, so on the host every thunk is run by ``host_fallback``
in schedule order and, on the same input bytes, its outputs are compared with the float64 reference
of its op (``references.REFERENCES``). Each thunk is checked on its own inputs, so errors do not
compound; the bound is the config's per-thunk NMSE (the op's own entry, else ``thunk``). Ops without
a reference here (``copy``, the scan family) are listed as such.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

import host_fallback
from host_fallback.abi import regions
from host_fallback.arena import STORAGE

from ..runtime.config import Config
from ..schedule.model import Schedule
from .compare import nmse
from .references import REFERENCES

NO_REFERENCE = {
    "copy": "moves bytes; no arithmetic to check",
    "scan": "no float64 reference for a whole scan here; `rlx-gpu conformance` checks the scan family",
    "scan_backward": "no float64 reference for a whole scan here; `rlx-gpu conformance` checks the scan family",
    "scan_backward_xs": "no float64 reference for a whole scan here; `rlx-gpu conformance` checks the scan family",
}


@dataclass(frozen=True)
class ThunkCheck:
    """One thunk against its float64 reference; ``nmse`` is None where there is no reference (``note`` says why)."""

    index: int
    op: str
    dtype: str
    nmse: float | None
    max_err: float | None
    bound: float | None
    passed: bool
    note: str = ""


def check_on_host(schedule: Schedule, arena: np.ndarray, config: Config,
                  options: Mapping[str, object] | None = None) -> list[ThunkCheck]:
    """Run ``schedule`` on the host over a copy of ``arena`` (inputs written), checking every thunk."""
    arena = arena.copy()
    schedule.apply_init(arena)
    checks = []
    for thunk in schedule.thunks:
        placed = regions(thunk)
        before = arena.copy()
        host_fallback.execute(thunk, arena, **dict(options or {}))
        if thunk.op not in REFERENCES:
            checks.append(ThunkCheck(thunk.index, thunk.op, thunk.dtype, None, None, None, True,
                                     NO_REFERENCE.get(thunk.op, "no float64 reference for this op")))
            continue
        by_field = {r.field: r for r in placed}

        def load(field: str, source: np.ndarray = before) -> np.ndarray:
            r = by_field[field]
            return source[r.offset: r.offset + r.nbytes].view(STORAGE[r.dtype]).astype(np.float64).reshape(r.shape)

        with np.errstate(all="ignore"):
            want = REFERENCES[thunk.op](thunk, load)
        bound = config.tolerance(thunk.op, thunk.dtype)
        worst, max_err, positions_agree = 0.0, 0.0, True
        for field, exact in want.items():
            got, exact = load(field, arena).reshape(-1), np.asarray(exact, np.float64).reshape(-1)
            positions_agree &= all(np.array_equal(test(got), test(exact))
                                   for test in (np.isnan, np.isposinf, np.isneginf))
            finite = np.isfinite(exact) & np.isfinite(got)
            worst = max(worst, nmse(got, exact))
            max_err = max(max_err, float(np.max(np.abs(got[finite] - exact[finite]), initial=0.0)))
        passed = positions_agree and worst <= bound
        note = "" if positions_agree else "NaN/Inf positions differ from the reference"
        checks.append(ThunkCheck(thunk.index, thunk.op, thunk.dtype, worst, max_err, bound, passed, note))
    return checks
