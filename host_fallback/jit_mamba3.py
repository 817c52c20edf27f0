"""The compiled decode step of ``mamba3`` (``mamba3_state_step``): §11's steps 4-6 for one token of every row and
head in one pass over the state, where NumPy's step makes four (the decay, the rank-2 update, its sum, the
read-out). Imported only through ``jit``."""
from __future__ import annotations

import numba
from numba import types

from .jit_math import _FLAGS
from .jit_ssm_steps import _dot

_C2, _C3, _C4 = (types.Array(types.float32, d, "C") for d in (2, 3, 4))

__all__ = ["mamba3_state_step"]


@numba.njit((_C4, _C3, _C3, _C2, _C2, _C2, _C3, _C3, _C3, _C3), fastmath=_FLAGS, nogil=True, error_model="numpy",
            boundscheck=False, cache=True)
def mamba3_state_step(big_s, k_bar, v_bar, alpha, beta, gamma, v, k_rot, q_rot, y):
    """One token, float32, every array C-contiguous: ``S = α·S + β·v̄⊗k̄ + γ·v⊗k̃`` in place (``big_s [R,H,P,N]``), then
    ``y = S·q̃`` (``y [R,H,P]``) and ``k̄, v̄ = k̃, v``; ``alpha, beta, gamma [R,H]``, ``v, v_bar [R,H,P]``, ``k_rot,
    k_bar, q_rot [R,H,N]``."""
    rows, heads, p_size, n_size = big_s.shape
    for r in range(rows):
        for h in range(heads):
            a, b, g = alpha[r, h], beta[r, h], gamma[r, h]
            kb, kr, q = k_bar[r, h], k_rot[r, h], q_rot[r, h]
            for p in range(p_size):
                bv, gv = b * v_bar[r, h, p], g * v[r, h, p]
                row = big_s[r, h, p]
                for n in range(n_size):
                    row[n] = a * row[n] + bv * kb[n] + gv * kr[n]
                y[r, h, p] = _dot(row, q, n_size)
            for n in range(n_size):
                kb[n] = kr[n]
            for p in range(p_size):
                v_bar[r, h, p] = v[r, h, p]
