"""Inputs of mamba3 (ABI.md §11) as NumPy arrays, shared by its host and reference tests: every tensor of one
call drawn in the range the op's definition samples (a negative log-decay, a positive step)."""
from __future__ import annotations

import numpy as np

from host_fallback.abi.mamba3 import MAMBA3

INPUTS = ("q", "k", "v", "adt", "dt", "trap", "angles")
OPTIONAL = ("q_bias", "k_bias", "d", "z")
STATES = ("angle_state", "state", "k_state", "v_state")


def draw(batch: int, seq: int, heads: int, p: int, n: int, angles: int, *, groups: int | None = None,
         optional: tuple[str, ...] = OPTIONAL, entries: int | None = None, seed: int = 0) -> dict:
    """``{field: float64 array}`` of one call: the inputs, the ``optional`` ones, and with ``entries`` the four
    state pools of that many entries (``states``, a list in the anchor's order)."""
    rng = np.random.default_rng(seed)
    g = heads if groups is None else groups
    shapes = {"q": (batch, seq, g, n), "k": (batch, seq, g, n), "v": (batch, seq, heads, p), "adt": (batch, seq, heads),
              "dt": (batch, seq, heads), "trap": (batch, seq, heads), "angles": (batch, seq, heads, angles),
              "q_bias": (heads, n), "k_bias": (heads, n), "d": (heads,), "z": (batch, seq, heads, p)}
    out = {f: MAMBA3.sample(f, {}, rng.standard_normal(shapes[f])) for f in INPUTS + tuple(optional)}
    if entries is not None:
        rows = {"angle_state": (heads, angles), "state": (heads, p, n), "k_state": (heads, n), "v_state": (heads, p)}
        out["states"] = [rng.standard_normal((entries,) + rows[f]) for f in STATES]
    return out


def tokens(args: dict, lo: int, hi: int) -> dict:
    """The per-token inputs of ``args`` restricted to tokens ``lo .. hi-1`` (the rest as they are)."""
    return {k: v[:, lo:hi] if k in INPUTS + ("z",) else v for k, v in args.items()}
