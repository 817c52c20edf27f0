"""The one accuracy measure: normalized mean squared error against a float64 reference.

The bounds it is held to live in ``configs/default.yaml`` under ``tolerances`` (read with
``Config.tolerance``): per dtype for one thunk (``thunk``, or an op's own entry) and for a whole
schedule compared with the host (``schedule``, used by ``rlx-gpu run --check``).
"""
from __future__ import annotations

from typing import Any

import numpy as np

#: Floor of the reference's energy, so an all-zero reference gives the absolute squared error.
TINY_ENERGY = 1e-30


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
