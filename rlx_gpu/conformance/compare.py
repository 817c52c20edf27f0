"""The comparison rules: non-finite classes position by position, then normalized mean squared error.

The bounds it is held to live in ``configs/default.yaml`` under ``tolerances`` (read with
``Config.tolerance``): per dtype for one thunk (``thunk``, or an op's own entry) and for a whole
schedule compared with the host (``schedule``, used by ``rlx-gpu run --check``).
"""
from __future__ import annotations

from typing import Any

import numpy as np

#: Floor of the reference's energy, so an all-zero reference gives the absolute squared error.
TINY_ENERGY = 1e-30


#: The non-finite classes compared position by position, each on its own: NaN, and Inf with its sign.
NON_FINITE = (("NaN", np.isnan), ("+Inf", np.isposinf), ("-Inf", np.isneginf))


def non_finite_mismatch(got: Any, want: Any) -> tuple[str, np.ndarray] | None:
    """The first class of :data:`NON_FINITE` whose positions differ between ``got`` and ``want``, with the
    (flat) positions that differ; None when NaN, +Inf and -Inf each sit at the same positions in both."""
    got, want = np.asarray(got, np.float64).reshape(-1), np.asarray(want, np.float64).reshape(-1)
    for name, test in NON_FINITE:
        differ = np.flatnonzero(test(got) != test(want))
        if differ.size:
            return name, differ
    return None


def nmse(got: Any, want: Any) -> float:
    """``sum((got - want)^2) / sum(want^2)`` in float64 over the positions where ``want`` is finite.

    Non-finite reference values are left to the caller (which compares NaN and Inf positions
    exactly); a non-finite ``got`` where ``want`` is finite makes the result Inf or NaN, so it never
    passes a bound.
    """
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    finite = np.isfinite(want)
    err = float(np.sum((got[finite] - want[finite]) ** 2))
    return err / max(float(np.sum(want[finite] ** 2)), TINY_ENERGY)
