"""The compiled decode steps of the state-space ops: ``selective_scan_step``, ``mamba2_step`` and
``gated_delta_net_step``, each a thunk's whole step path in one call (where they apply and their
arguments: ``compiled_step``). Imported only through ``jit``."""
from __future__ import annotations

import numba
import numpy as np
from numba import types

from .jit_math import _F32, _FLAGS, _exp, _exp_subnormal, _softplus


# --- the state-space decode steps: selective_scan, mamba2, gated_delta_net -----------------------------
# One call runs a thunk's step path whole: every row (batch row, or packed sequence), channel or head,
# token, with the v2 fields, the state updated where it lies in the arena. Rows are the step path's: row
# r is batch row r over all tokens, or with ``varlen`` sequence r (tokens cu[r]..cu[r+1]-1 of batch row 0);
# its state is pool entry ``slots[r]`` (``r`` where ``slots`` is empty), or, where the pool is empty (no
# ``carry_state``), a zeroed work state that is not kept. Optional inputs (biases, d, z) are empty arrays
# where the thunk has none. The arithmetic is ABI.md §4/§8's in its order, so non-finite values land where
# NumPy's step path puts them; only the dot products' sums are reassociated (``_dot``), as a BLAS's are.
# Loops run over a state's rows as views, the inner loop over a row's contiguous N (or V) values, which LLVM
# vectorizes (indexing flat arrays at computed offsets instead left it scalar, 6x slower).

_T1, _T2 = types.Array(types.float32, 1, "C"), types.Array(types.float32, 2, "C")
_T3, _T4 = types.Array(types.float32, 3, "C"), types.Array(types.float32, 4, "C")
_INDEX = types.Array(types.int32, 1, "C")
_L2_EPS = _F32(1e-6)  # gdn.L2_EPS


@numba.njit(fastmath=_FLAGS, inline="always")
def _silu(z):
    return z / (_F32(1.0) + _exp(-z))


@numba.njit(fastmath={"reassoc", "nsz", "contract"}, nogil=True, error_model="numpy", boundscheck=False)
def _dot(a, b, n):
    """``sum(a[:n] * b[:n])``, its sum reassociated (only here) so that LLVM runs it in vector lanes."""
    total = _F32(0.0)
    for i in range(n):
        total += a[i] * b[i]
    return total


@numba.njit(inline="always")
def _span(r, varlen, cu, seq):
    """Row ``r``'s batch row and tokens ``lo..hi-1``."""
    if varlen:
        return 0, cu[r], cu[r + 1]
    return r, 0, seq


@numba.njit(inline="always")
def _rows(varlen, cu, batch):
    return cu.size - 1 if varlen else batch


@numba.njit(inline="always")
def _state(pool, work, slots, r):
    """Row ``r``'s state: pool entry ``slots[r]`` (``r`` without slots), updated in place, or where the pool is
    empty (no ``carry_state``) the zeroed ``work``, an entry's shape."""
    if pool.shape[0] > 0:
        return pool[slots[r] if slots.size > 0 else r]
    work[:] = 0
    return work


@numba.njit(fastmath=_FLAGS, inline="always")
def _gated(y, z, gated, out):
    """``out = y * silu(z)`` where ``gated`` (ABI.md §8's ``z``), else ``y``."""
    if gated:
        for i in range(y.size):
            out[i] = y[i] * _silu(z[i])
    else:
        for i in range(y.size):
            out[i] = y[i]


@numba.njit(fastmath=_FLAGS, inline="always")
def _decay_row(h, a, b, step, dx, n):
    """One channel's ``h = exp(delta a) h + (delta x) b`` over its ``n`` state values."""
    for k in range(n):
        h[k] = _exp_subnormal(step * a[k]) * h[k] + dx * b[k]


@numba.njit(types.void(_T3, _T3, _T2, _T4, _T4, _T1, _T1, _T3, _T3, _T3, _INDEX, _INDEX, types.boolean,
                       types.boolean), fastmath=_FLAGS, nogil=True, cache=True, error_model="numpy",
            boundscheck=False)
def selective_scan_step(x, delta, a, b, c, delta_bias, d, z, state, dst, cu, slots, varlen, softplus):
    """``selective_scan``'s step path (ABI.md §4, §8): ``x, delta, z, dst [B, S, H]``, ``a [H, N]``, ``b, c
    [B, S, G, N]``, ``delta_bias, d [H]``, ``state [E, H, N]``."""
    bsz, seq, hidden = x.shape
    n, width = a.shape[1], hidden // b.shape[2]
    work = np.empty((0 if state.size else hidden, n), _F32)  # the state where no pool keeps it
    steps, inputs, y = np.empty(hidden, _F32), np.empty(hidden, _F32), np.empty(hidden, _F32)
    for r in range(_rows(varlen, cu, bsz)):
        row, lo, hi = _span(r, varlen, cu, seq)
        h = _state(state, work, slots, r)
        for t in range(lo, hi):
            for ch in range(hidden):
                steps[ch] = delta[row, t, ch]
            if delta_bias.size > 0:
                for ch in range(hidden):
                    steps[ch] += delta_bias[ch]
            if softplus:
                for ch in range(hidden):
                    steps[ch] = _softplus(steps[ch])
            for ch in range(hidden):
                inputs[ch] = steps[ch] * x[row, t, ch]
            for group in range(b.shape[2]):  # its channels read its b and c
                bs, cs = b[row, t, group], c[row, t, group]
                for i in range(width):  # h = exp(delta a) h + (delta x) b
                    # unsigned, so that no negative index's wraparound is left to select (B1 H1536 N16: 4 of 16 µs)
                    ch = np.uintp(group * width + i)
                    if n == 16:  # Mamba's d_state: a trip count LLVM knows, one 16-lane vector (8% faster)
                        _decay_row(h[ch], a[ch], bs, steps[ch], inputs[ch], 16)
                    else:
                        _decay_row(h[ch], a[ch], bs, steps[ch], inputs[ch], n)
                for i in range(width):
                    ch = np.uintp(group * width + i)
                    y[ch] = _dot(h[ch], cs, n)
            if d.size > 0:
                for ch in range(hidden):
                    y[ch] += x[row, t, ch] * d[ch]
            gated = z.size > 0
            _gated(y, z[row, t] if gated else y, gated, dst[row, t])


@numba.njit(types.void(_T4, _T3, _T1, _T4, _T4, _T1, _T1, _T4, _T4, _T4, _INDEX, _INDEX, types.boolean,
                       types.boolean, types.float32, types.float32), fastmath=_FLAGS, nogil=True, cache=True,
            error_model="numpy", boundscheck=False)
def mamba2_step(x, dt, a, b, c, dt_bias, d, z, state, dst, cu, slots, varlen, softplus, low, high):
    """``mamba2``'s step path (ABI.md §4, §8): ``x, z, dst [B, S, H, P]``, ``dt [B, S, H]``, ``a, dt_bias, d
    [H]``, ``b, c [B, S, G, N]``, ``state [E, H, P, N]``; ``dt`` clamped to ``[low, high]`` (-inf and inf
    where the thunk has no ``dt_limit``, so NaN stays NaN)."""
    bsz, seq, heads, p = x.shape
    n, per_group = b.shape[3], heads // b.shape[2]
    work = np.empty((0 if state.size else heads, p, n), _F32)
    y = np.empty(p, _F32)
    for r in range(_rows(varlen, cu, bsz)):
        row, lo, hi = _span(r, varlen, cu, seq)
        states = _state(state, work, slots, r)
        for hd in range(heads):
            s = states[hd]
            for t in range(lo, hi):
                step = dt[row, t, hd]
                if dt_bias.size > 0:
                    step += dt_bias[hd]
                if softplus:
                    step = _softplus(step)
                step = low if step < low else step
                step = high if step > high else step
                decay = _exp_subnormal(step * a[hd])
                xs, bs, cs = x[row, t, hd], b[row, t, hd // per_group], c[row, t, hd // per_group]
                for i in range(p):  # S = exp(dt a) S + (dt x) (x) b, a row of N at a time; y = S c
                    si, xi = s[i], step * xs[i]
                    for k in range(n):
                        si[k] = si[k] * decay + xi * bs[k]
                    y[i] = _dot(si, cs, n)
                if d.size > 0:
                    skip = d[hd]
                    for i in range(p):
                        y[i] += xs[i] * skip
                gated = z.size > 0
                _gated(y, z[row, t, hd] if gated else y, gated, dst[row, t, hd])


@numba.njit(types.void(_T4, _T4, _T4, _T4, _T3, _T4, _T4, _INDEX, _INDEX, types.boolean, types.boolean,
                       types.float32), fastmath=_FLAGS, nogil=True, cache=True, error_model="numpy",
            boundscheck=False)
def gated_delta_net_step(q, k, v, g, beta, state, dst, cu, slots, varlen, l2norm, scale):
    """``gated_delta_net``'s step path (ABI.md §4, §8): ``q, k [B, S, H, K]``, ``v, dst [B, S, HV, V]``, ``g [B,
    S, HV, K]`` per channel or ``[B, S, HV, 1]`` per head, ``beta [B, S, HV]``, ``state [E, HV, K, V]``.

    Per step, two passes over the state's rows (S[i, :], the values of key i): the first decays them and
    sums ``k^T S``, the second adds ``k u^T`` and sums ``q^T S`` of the updated state (step 4's order, so
    its NaN and each signed inf land where the ABI puts them)."""
    bsz, seq, heads, n = q.shape
    value_heads, width = v.shape[2], v.shape[3]
    group, per_channel = value_heads // heads, g.shape[3] > 1
    work = np.empty((0 if state.size else value_heads, n, width), _F32)
    qn, kn, decay = np.empty(n, _F32), np.empty(n, _F32), np.empty(n, _F32)
    ks, u, out = np.empty(width, _F32), np.empty(width, _F32), np.empty(width, _F32)
    for r in range(_rows(varlen, cu, bsz)):
        row, lo, hi = _span(r, varlen, cu, seq)
        states = _state(state, work, slots, r)
        for j in range(value_heads):
            s = states[j]
            for t in range(lo, hi):
                qs, kk = q[row, t, j // group], k[row, t, j // group]
                if l2norm:  # x / sqrt(sum x^2 + eps), per head vector
                    qnorm = np.sqrt(_dot(qs, qs, n) + _L2_EPS)
                    knorm = np.sqrt(_dot(kk, kk, n) + _L2_EPS)
                    for i in range(n):
                        qn[i] = qs[i] / qnorm
                        kn[i] = kk[i] / knorm
                    qs, kk = qn, kn
                gs = g[row, t, j]
                if per_channel:
                    for i in range(n):
                        decay[i] = _exp_subnormal(gs[i])
                else:
                    whole = _exp_subnormal(gs[0])
                    for i in range(n):
                        decay[i] = whole
                ks[:] = 0
                for i in range(n):  # S *= exp(g); ks = k^T S
                    si, di, ki = s[i], decay[i], kk[i]
                    for col in range(width):
                        value = si[col] * di
                        si[col] = value
                        ks[col] += ki * value
                vs, bt = v[row, t, j], beta[row, t, j]
                for col in range(width):
                    u[col] = (vs[col] - ks[col]) * bt
                out[:] = 0
                for i in range(n):  # S += k u^T; out = q^T S
                    si, ki, qi = s[i], kk[i], qs[i]
                    for col in range(width):
                        value = si[col] + ki * u[col]
                        si[col] = value
                        out[col] += qi * value
                o = dst[row, t, j]
                for col in range(width):
                    o[col] = scale * out[col]


__all__ = ["selective_scan_step", "mamba2_step", "gated_delta_net_step"]  # the kernels ``jit.kernel`` hands out
