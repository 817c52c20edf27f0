"""The compiled step of ``mamba3`` (``mamba3_state_step``): §11's steps 4-6 for one token of every row and head in
one pass over the state, where NumPy's step makes four (the decay, the rank-2 update, its sum, the read-out); and
its reverse (``mamba3_state_step_back``), one pass over the state and its gradient where NumPy makes about ten.
Imported only through ``jit``."""
from __future__ import annotations

import numba
from numba import types

from .jit_math import _F32, _FLAGS
from .jit_ssm_steps import _dot

_C2, _C3, _C4 = (types.Array(types.float32, d, "C") for d in (2, 3, 4))

__all__ = ["mamba3_state_step", "mamba3_state_step_back"]
#: The reverse step's flags: its sums reassociated too, so that LLVM runs them in vector lanes (the same bytes on
#: every run of one build, as ``_dot``'s).
_REDUCING = _FLAGS | {"reassoc"}


@numba.njit((_C4, _C4, _C3, _C3, _C2, _C2, _C2, _C3, _C3, _C3, _C3), fastmath=_FLAGS, nogil=True,
            error_model="numpy", boundscheck=False, cache=True)
def mamba3_state_step(big_s, new_s, k_bar, v_bar, alpha, beta, gamma, v, k_rot, q_rot, y):
    """One token, float32, every array C-contiguous: ``new_s = α·S + β·v̄⊗k̄ + γ·v⊗k̃`` (``big_s, new_s [R,H,P,N]``;
    the same array to update in place), then ``y = new_s·q̃`` (``y [R,H,P]``) and ``k̄, v̄ = k̃, v`` in place;
    ``alpha, beta, gamma [R,H]``, ``v, v_bar [R,H,P]``, ``k_rot, k_bar, q_rot [R,H,N]``."""
    rows, heads, p_size, n_size = big_s.shape
    for r in range(rows):
        for h in range(heads):
            a, b, g = alpha[r, h], beta[r, h], gamma[r, h]
            kb, kr, q = k_bar[r, h], k_rot[r, h], q_rot[r, h]
            for p in range(p_size):
                bv, gv = b * v_bar[r, h, p], g * v[r, h, p]
                row, out = big_s[r, h, p], new_s[r, h, p]
                for n in range(n_size):
                    out[n] = a * row[n] + bv * kb[n] + gv * kr[n]
                y[r, h, p] = _dot(out, q, n_size)
            for n in range(n_size):
                kb[n] = kr[n]
            for p in range(p_size):
                v_bar[r, h, p] = v[r, h, p]


@numba.njit((_C4, _C4, _C4, _C3, _C3, _C3, _C3, _C3, _C3, _C2, _C2, _C2, _C3, _C3, _C3, _C3, _C3, _C2, _C2, _C2),
            fastmath=_REDUCING, nogil=True, error_model="numpy", boundscheck=False, cache=True)
def mamba3_state_step_back(d_s, old_s, new_s, q_rot, k_rot, k_bar, v, v_bar, g, alpha, beta, gamma, d_kbar,
                           d_vbar, d_qrot, d_krot, d_v, d_alpha, d_beta, d_gamma):
    """The reverse of ``mamba3_state_step`` at one token, float32, every array C-contiguous. In: ``d_s [R,H,P,N]``,
    ``d_kbar [R,H,N]``, ``d_vbar [R,H,P]`` the gradients of the state after the token, ``g [R,H,P]`` the output's;
    ``old_s``/``new_s`` the state before and after it, ``k_bar``/``v_bar`` before it. Out, in place: ``d_s``,
    ``d_kbar``, ``d_vbar`` become the gradients of the state before the token; ``d_qrot``, ``d_krot [R,H,N]``,
    ``d_v [R,H,P]`` (written) and ``d_alpha``, ``d_beta``, ``d_gamma [R,H]`` the token's."""
    rows, heads, p_size, n_size = d_s.shape
    for r in range(rows):
        for h in range(heads):
            a, b, c = alpha[r, h], beta[r, h], gamma[r, h]
            q, kr, kb = q_rot[r, h], k_rot[r, h], k_bar[r, h]
            dq, dk, dkb = d_qrot[r, h], d_krot[r, h], d_kbar[r, h]
            for n in range(n_size):
                dq[n] = _F32(0.0)
                dk[n] = _F32(0.0)
            sum_alpha, sum_beta, sum_gamma = _F32(0.0), _F32(0.0), _F32(0.0)
            for p in range(p_size):
                gp, vp, vbp = g[r, h, p], v[r, h, p], v_bar[r, h, p]
                ds, olds, news = d_s[r, h, p], old_s[r, h, p], new_s[r, h, p]
                along_k, along_kbar = _F32(0.0), _F32(0.0)
                for n in range(n_size):
                    full = ds[n] + gp * q[n]  # y = S q̃
                    dq[n] += gp * news[n]
                    along_k += full * kr[n]
                    along_kbar += full * kb[n]
                    dk[n] += vp * full  # collects vᵀ dS; scaled by γ below
                    sum_alpha += full * olds[n]
                    ds[n] = full  # dS, before the decay's factor (applied below, after d_kbar reads it)
                sum_gamma += vp * along_k
                sum_beta += vbp * along_kbar
                d_v[r, h, p] = d_vbar[r, h, p] + c * along_k
                d_vbar[r, h, p] = b * along_kbar
            for n in range(n_size):
                prev = _F32(0.0)
                for p in range(p_size):
                    prev += v_bar[r, h, p] * d_s[r, h, p, n]
                dk[n] = dkb[n] + c * dk[n]
                dkb[n] = b * prev
            for p in range(p_size):
                row = d_s[r, h, p]
                for n in range(n_size):
                    row[n] *= a
            d_alpha[r, h], d_beta[r, h], d_gamma[r, h] = sum_alpha, sum_beta, sum_gamma
