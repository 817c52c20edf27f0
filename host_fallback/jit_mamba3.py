"""The compiled steps of ``mamba3``: a thunk's whole step path in one call (``mamba3_step``: §11's steps 1-6 for
every row, head and token, the four carried states updated where they lie; where it applies and its arguments:
``mamba3.prepare``), where NumPy's step path makes some forty array passes and the Python around them (B1
decode); §11's steps 4-6 for one token of every row and head in one pass over the state (``mamba3_state_step``,
NumPy's step path's inner loop where the whole step does not apply: the backward's recomputation, f64 pools, two
threads), where NumPy's step makes four (the decay, the rank-2 update, its sum, the read-out); and its reverse
(``mamba3_state_step_back``), one pass over the state and its gradient where NumPy makes about ten. Imported only
through ``jit``."""
from __future__ import annotations

import numba
import numpy as np
from numba import types

from .jit_math import _F32, _FLAGS, _exp_subnormal
from .jit_ssm_steps import _INDEX, _dot, _rows, _silu, _span

_C1, _C2, _C3, _C4 = (types.Array(types.float32, d, "C") for d in (1, 2, 3, 4))
_PI, _TWO_PI = _F32(np.pi), _F32(2 * np.pi)

__all__ = ["mamba3_step", "mamba3_state_step", "mamba3_state_step_back"]
#: The reverse step's flags: its sums reassociated too, so that LLVM runs them in vector lanes (the same bytes on
#: every run of one build, as ``_dot``'s).
_REDUCING = _FLAGS | {"reassoc"}


@numba.njit(fastmath=_FLAGS, inline="always")
def _mamba3_token(qg, kg, vv, adt, dt, trap, angles, q_bias, k_bias, h, has_qb, has_kb, theta, s, kb, vb, qr, kr,
                  cos, sin, out):
    """§11 steps 1-4, 6 and step 5's read-out ``out = S q̃`` for one token of one row and head, the state ``theta,
    s, kb, vb`` advanced in place (``qr, kr, cos, sin``: scratch)."""
    lam = _F32(1.0) / (_F32(1.0) + _exp_subnormal(-trap))
    alpha = _exp_subnormal(adt)
    bprime = (_F32(1.0) - lam) * dt
    beta, gamma = bprime * alpha, lam * dt
    for i in range(theta.size):
        theta[i] += _PI * np.tanh(angles[i]) * dt
        cos[i], sin[i] = np.cos(theta[i]), np.sin(theta[i])
    for n in range(qr.size):
        qr[n] = qg[n] + q_bias[h, n] if has_qb else qg[n]
        kr[n] = kg[n] + k_bias[h, n] if has_kb else kg[n]
    for x in (qr, kr):
        for i in range(cos.size):
            even, odd = x[2 * i], x[2 * i + 1]
            x[2 * i] = even * cos[i] - odd * sin[i]
            x[2 * i + 1] = even * sin[i] + odd * cos[i]
    n_size = qr.size
    for p in range(vb.size):
        bv, gv = beta * vb[p], gamma * vv[p]
        row = s[p]
        for n in range(n_size):
            row[n] = alpha * row[n] + bv * kb[n] + gv * kr[n]
        out[p] = _dot(row, qr, n_size)
    for n in range(n_size):
        kb[n] = kr[n]
    for p in range(vb.size):
        vb[p] = vv[p]


@numba.njit(types.void(_C4, _C4, _C4, _C3, _C3, _C3, _C4, _C2, _C2, _C1, _C4, _C3, _C4, _C3, _C3, _INDEX, _INDEX,
                       types.boolean, _C4), fastmath=_FLAGS, nogil=True, error_model="numpy", boundscheck=False,
            cache=True)
def mamba3_step(q, k, v, adt, dt, trap, angles, q_bias, k_bias, d, z, angle_state, state, k_state, v_state, cu,
                slots, varlen, dst):
    """``mamba3``'s step path (ABI.md §11, §8), float32, every array C-contiguous: ``q, k [B,S,G,N]``, ``v, z, dst
    [B,S,H,P]``, ``adt, dt, trap [B,S,H]``, ``angles [B,S,H,A]``, ``q_bias, k_bias [H,N]``, ``d [H]``, the pools
    ``angle_state [E,H,A]``, ``state [E,H,P,N]``, ``k_state [E,H,N]``, ``v_state [E,H,P]``; an optional tensor or
    the pools empty where the thunk has none (rows then start from zeros, kept nowhere). Rows as
    ``jit_ssm_steps``' (``_span``; pool entry ``slots[r]``, else ``r``). Per token the arithmetic is NumPy's step
    path's, in its order (``mamba3.tokens``, ``mamba3_state_step``, ``mamba3.gate``; silu as the other steps'
    ``jit_ssm_steps._silu``); a row's angle is written reduced to [0, 2π] after its last token, and a row of no
    tokens is left as it was."""
    bsz, seq, groups, n_size = q.shape
    heads, p_size, a_size = v.shape[2], v.shape[3], angles.shape[3]
    per_group, carried = heads // groups, state.shape[0] > 0
    has_qb, has_kb, has_d, gated = q_bias.shape[0] > 0, k_bias.shape[0] > 0, d.shape[0] > 0, z.shape[0] > 0
    theta0, s0 = np.empty(a_size, _F32), np.empty((p_size, n_size), _F32)  # a row's state where none is carried
    kb0, vb0 = np.empty(n_size, _F32), np.empty(p_size, _F32)
    qr, kr, cos, sin = np.empty(n_size, _F32), np.empty(n_size, _F32), np.empty(a_size, _F32), np.empty(a_size, _F32)
    for r in range(_rows(varlen, cu, bsz)):
        row, lo, hi = _span(r, varlen, cu, seq)
        entry = slots[r] if slots.size > 0 else r
        for h in range(heads):
            if carried:
                theta, s, kb, vb = angle_state[entry, h], state[entry, h], k_state[entry, h], v_state[entry, h]
            else:
                theta, s, kb, vb = theta0, s0, kb0, vb0
                theta[:] = 0
                s[:] = 0
                kb[:] = 0
                vb[:] = 0
            for t in range(lo, hi):
                _mamba3_token(q[row, t, h // per_group], k[row, t, h // per_group], v[row, t, h], adt[row, t, h],
                              dt[row, t, h], trap[row, t, h], angles[row, t, h], q_bias, k_bias, h, has_qb, has_kb,
                              theta, s, kb, vb, qr, kr, cos, sin, dst[row, t, h])
                o, vv = dst[row, t, h], v[row, t, h]
                for p in range(p_size):
                    y = o[p]
                    if has_d:
                        y = y + d[h] * vv[p]
                    if gated:
                        y = y * _silu(z[row, t, h, p])
                    o[p] = y
            if carried and hi > lo:
                for i in range(a_size):
                    theta[i] = theta[i] - _TWO_PI * np.floor(theta[i] / _TWO_PI)


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
