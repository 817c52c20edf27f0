"""The compiled gradients of ``gated_delta_net``'s chunked backward from its GEMMs' products, per key channel
(``gdn_channel_gradients``) and per head (``gdn_head_gradients``; where they apply and their arguments:
``gdn_backward_grads``), the cumulative log-decays inside each chunk with their exponentials (``gdn_channel_decays``;
per head with the operands of the GEMMs before the reverse, ``gdn_head_operands``), and what a chunk of the reverse
over chunks does after its two GEMMs (``gdn_reverse_state``; both bound by ``gdn_backward_chunked``). Imported only
through ``jit``.

NumPy forms the four decayed products of ``_Decayed`` (each an elementwise pass, a batched GEMM over the full square
and another pass), then about fifteen passes of the channel gradients and a flipped cumulative sum along a strided
axis (per head: three square GEMMs and about twenty passes). Here one lane (chunk, batch row, key head, group member)
is one pass: the GEMMs' products scaled into the gradients they stand for (NumPy's ``_scaled``, nine passes there),
the decayed operands, the triangular products (only ``s <= r``: half a square's multiply-adds), the gradients and the
sums from the chunk's end, each loop running along the ``K`` contiguous key channels (LLVM vectorizes them). Every
sum runs in a fixed order (over steps; a dot product over the channels as its products' halves added down to 16
partial sums, ``_folded``): the same bytes on every run of one build. No fast-math flag but FMA contraction and the
sign of zero: NaN and inf propagate as NumPy's (a lane left non-finite is redone by ``_redo_nonfinite``, as on
NumPy's path); only products NumPy multiplies by a zero of the triangle's other side are skipped.
"""
from __future__ import annotations

import math

import numba
import numpy as np
from numba import types
from numba.extending import overload

from .jit_math import _FLAGS, _exp_subnormal, _transposed

__all__ = ["gdn_channel_decays", "gdn_channel_gradients", "gdn_head_gradients", "gdn_head_operands",
           "gdn_reverse_state"]  # the kernels ``jit.kernel`` hands out


def _signatures(arity: dict[str, int | str], scalars: int = 0, index: bool = False) -> list:
    """One signature per float type (f32, f64) for C-contiguous arrays of the given dimensions (of that type; a
    string such as ``"rows2"``: int64, 2-D), then ``scalars`` numbers of that type and an int64 (none with
    ``scalars`` 0; one alone with ``index``)."""
    def array(f, d):
        return types.Array(types.int64, int(d[-1]), "C") if isinstance(d, str) else types.Array(f, d, "C")
    return [types.void(*(array(f, d) for d in arity.values()), *([f] * scalars),
                       *([types.int64] if scalars or index else []))
            for f in (types.float32, types.float64)]


@numba.njit(fastmath=_FLAGS, inline="always")
def _folded(x):
    """The sum of ``x`` in a fixed order (``x`` overwritten): its halves added until 16 partial sums are left (one
    vector of float32 on AVX-512: each halving a vectorized pass, no reassociation asked of LLVM), then those in
    their order."""
    m = x.shape[0]
    while m > 16:
        half = (m + 1) // 2
        for i in range(m - half):
            x[i] += x[i + half]
        m = half
    total = x[0]
    for i in range(1, m):
        total += x[i]
    return total


_DECAYS = dict(g=3, cum=3, up=3, down=3, gamma=3, to_end=3, through=2)
_GRADIENTS = dict(q=3, k=3, up=3, down=3, gamma=3, to_end=3, beta=2, products=3, dkd=3, kk=3, entering=2,
                  dq=2, dk=2, rows="rows2", dg=2, dg_rows="rows2", dbeta=2, check=1, work=3, sums=2)


def _exp_of(x):
    """``e^x`` in ``x``'s float type: ``jit_math._exp_subnormal`` (vectorized, NumPy's subnormals) for float32,
    libm's for float64."""


@overload(_exp_of)
def _exp_of_type(x):
    if x == types.float32:
        return lambda x: _exp_subnormal(x)
    return lambda x: math.exp(x)


@numba.njit(_signatures(_DECAYS), fastmath=_FLAGS, nogil=True, error_model="numpy", boundscheck=False, cache=True)
def gdn_channel_decays(g, cum, up, down, gamma, to_end, through):
    """Per lane of ``g [N, L, K]`` (a chunk's floored log-decays): ``cum`` their cumulative sums along the ``L``
    steps, ``up = exp(cum - m)`` and ``down = exp(m - cum)`` (``m`` the cumulative log-decay of step ``(L - 1) // 2``,
    ``_Decayed``'s midpoint), ``gamma = exp(cum)``, ``to_end = exp(last - cum)`` (``[N, L, K]``) and ``through =
    exp(last) [N, K]`` (``last``: the chunk's last step's)."""
    lanes, length, n = g.shape
    middle = (length - 1) // 2
    for j in range(lanes):
        gj, cj = g[j], cum[j]
        cj[0] = gj[0]
        for t in range(1, length):
            prev, row, out = cj[t - 1], gj[t], cj[t]
            for i in range(n):
                out[i] = prev[i] + row[i]
        mid, last = cj[middle], cj[length - 1]
        for t in range(length):
            c, u, w, e, f = cj[t], up[j, t], down[j, t], gamma[j, t], to_end[j, t]
            for i in range(n):
                u[i] = _exp_of(c[i] - mid[i])
                w[i] = _exp_of(mid[i] - c[i])
                e[i] = _exp_of(c[i])
                f[i] = _exp_of(last[i] - c[i])
        out = through[j]
        for i in range(n):
            out[i] = _exp_of(last[i])


@numba.njit(_signatures(_GRADIENTS, scalars=1), fastmath=_FLAGS, nogil=True, error_model="numpy",
            boundscheck=False, cache=True)
def gdn_channel_gradients(q, k, up, down, gamma, to_end, beta, products, dkd, kk, entering, dq, dk, rows, dg, dg_rows,
                          dbeta, check, work, sums, scale, group):
    """Per lane ``j`` of ``N`` (key lane ``j // group`` of ``q, k [N / group, L, K]``), from the products' gradients as
    ``_chunked`` forms them by GEMMs, ``products [N, 2L, K + L]`` (``gdn_backward_grads``: ``dqg = O S0^T`` and ``dgk =
    Y S0^T`` ``[L, K]``, ``dqk = O U^T`` and ``dkk = Y U^T`` ``[L, L]``, of which only the lower triangle is read, and
    of ``dkk`` only below the diagonal) and ``dkd = U dS_L^T [N, L, K]``: scales them in place as ``_scaled`` does
    (``gamma``, ``to_end`` ``[N, L, K]``, ``beta [N, L]``, ``scale``; ``dqk`` and ``dkk`` on the fly); then with ``up =
    exp(cum - m)``, ``down = exp(m - cum)`` (``m`` the chunk's midpoint's cumulative log-decay), ``rows_x[r] = up_r
    sum_{s <= r} P[r, s] (k down)_s`` (``P``: ``dqk``, ``dkk``) and ``cols[s] = down_s sum_{r >= s} (dqk[r, s] (q
    up)_r + dkk[r, s] (k up)_r)``, writes ``dq = dqg + rows_q``, ``dk = rows_k + cols + dkd - dgk`` (step ``t`` of
    lane ``j`` into row ``rows[j, t]`` of ``dq, dk [R, K]``) and ``dg`` (into row ``dg_rows[j, t]`` of ``dg [R, K]``),
    the log-decays' gradient: the sums from the chunk's end of ``dcum = q dq - k (cols + dgk + dkd - rows_k)``, whose
    last step also takes ``sum_s k dkd + entering`` (``entering [N, K]``: the decayed entering state's term). Takes
    from ``dbeta [N, L]`` (which holds ``Y.V``) ``dgk.(gamma k)`` and ``sum_s dkk[r, s] kk[r, s]`` (unscaled; ``kk [N,
    L, L]`` the decayed ``K K^T``), as ``gdn_head_gradients`` does, and adds to ``check [N]`` the sum of every gradient
    the lane wrote. Scratch: ``work [3, L, K]``, ``sums [4, K]``."""
    lanes, length = dbeta.shape
    n = dq.shape[1]
    kd, qu, ku = work[0], work[1], work[2]
    acc, tail, unscaled, parts = sums[0], sums[1], sums[2], sums[3]
    for j in range(lanes):
        qj, kj, uj, wj, pj, bj = q[j // group], k[j // group], up[j], down[j], products[j], beta[j]
        at, g_at, kkj = rows[j], dg_rows[j], kk[j]
        tail[:] = entering[j]
        for t in range(length):
            kt, qt, ut, wt, et, ft = kj[t], qj[t], uj[t], wj[t], gamma[j, t], to_end[j, t]
            dt, gt, ht, bt = dkd[j, t], pj[length + t], pj[t], bj[t]
            for i in range(n):
                kd[t, i] = kt[i] * wt[i]
                qu[t, i] = qt[i] * ut[i]
                ku[t, i] = kt[i] * ut[i]
                dt[i] *= ft[i]
                unscaled[i] = gt[i] * et[i] * kt[i]
                gt[i] = gt[i] * bt * et[i]
                ht[i] = ht[i] * et[i] * scale
                tail[i] += kt[i] * dt[i]
            dbeta[j, t] -= _folded(unscaled)
        # rows: dq = dqg + up (dqk (k down)); rows_k = up (dkk (k down)) kept in dk until the columns' pass
        for r in range(length):
            acc[:] = 0
            low, br = dk[at[r]], -bj[r]
            low[:] = 0
            for s in range(r):  # dkk strictly lower: the diagonal's product is dqk's alone
                a, b, x = pj[r, n + s] * scale, pj[length + r, n + s] * br, kd[s]
                for i in range(n):
                    acc[i] += a * x[i]
                    low[i] += b * x[i]
                dbeta[j, r] -= pj[length + r, n + s] * kkj[r, s]  # dkk kk, unscaled
            a, x = pj[r, n + r] * scale, kd[r]
            for i in range(n):
                acc[i] += a * x[i]
            ur, out_q, given = uj[r], dq[at[r]], pj[r]
            for i in range(n):
                out_q[i] = given[i] + ur[i] * acc[i]
                low[i] *= ur[i]
        # columns, from the chunk's end: dk, and dg as the sums of dcum from there (tail starts as the last step's
        # extra term); each channel's sum of the lane's dq + dk + dg into parts, for check
        parts[:] = 0
        for s in range(length - 1, -1, -1):
            a, x = pj[s, n + s] * scale, qu[s]
            for i in range(n):
                acc[i] = a * x[i]
            for r in range(s + 1, length):
                a, b, x, y = pj[r, n + s] * scale, pj[length + r, n + s] * -bj[r], qu[r], ku[r]
                for i in range(n):
                    acc[i] += a * x[i] + b * y[i]
            ws, qs, ks, out_q, out_k, out_g = wj[s], qj[s], kj[s], dq[at[s]], dk[at[s]], dg[g_at[s]]
            ds, gs = dkd[j, s], pj[length + s]
            for i in range(n):
                cols, rows_k = ws[i] * acc[i], out_k[i]
                out_k[i] = rows_k + cols + ds[i] - gs[i]
                tail[i] += qs[i] * out_q[i] - ks[i] * (cols + gs[i] + ds[i] - rows_k)
                out_g[i] = tail[i]
                parts[i] += out_q[i] + out_k[i] + out_g[i]
        total = dbeta[j, 0]
        for t in range(1, length):
            total += dbeta[j, t]
        check[j] += total + _folded(parts)


_HEAD = dict(q=3, k=3, gamma=2, to_end=2, beta=2, ratios=3, qk=3, kk=3, products=3, dkd=3, entering=1, through=1,
             dq=2, dk=2, rows="rows2", dg=2, dbeta=2, check=1)
#: Steps a row of ``gdn_head_gradients``' triangular products takes at once (chunks are a multiple of it): one pass
#: over the output row for four input rows.
_BLOCK = 4


@numba.njit(fastmath=_FLAGS, inline="always")
def _rows(out_a, out_b, a, b, s, x):
    """``out_a += sum_t a[t] x[t]`` and ``out_b += sum_t b[t] x[t]`` along the channels, ``t`` the ``_BLOCK`` steps
    from ``s``."""
    a0, a1, a2, a3, b0, b1, b2, b3 = a[s], a[s + 1], a[s + 2], a[s + 3], b[s], b[s + 1], b[s + 2], b[s + 3]
    x0, x1, x2, x3 = x[s], x[s + 1], x[s + 2], x[s + 3]
    for i in range(out_a.shape[0]):
        out_a[i] += a0 * x0[i] + a1 * x1[i] + a2 * x2[i] + a3 * x3[i]
        out_b[i] += b0 * x0[i] + b1 * x1[i] + b2 * x2[i] + b3 * x3[i]


@numba.njit(fastmath=_FLAGS, inline="always")
def _columns(out, a, b, col, r, x, y):
    """``out += sum_t a[t, col] x[t] + b[t, col] y[t]`` along the channels, ``t`` the ``_BLOCK`` steps from ``r``."""
    a0, a1, a2, a3 = a[r, col], a[r + 1, col], a[r + 2, col], a[r + 3, col]
    b0, b1, b2, b3 = b[r, col], b[r + 1, col], b[r + 2, col], b[r + 3, col]
    x0, x1, x2, x3, y0, y1, y2, y3 = x[r], x[r + 1], x[r + 2], x[r + 3], y[r], y[r + 1], y[r + 2], y[r + 3]
    for i in range(out.shape[0]):
        out[i] += ((a0 * x0[i] + a1 * x1[i] + a2 * x2[i] + a3 * x3[i])
                   + (b0 * y0[i] + b1 * y1[i] + b2 * y2[i] + b3 * y3[i]))


@numba.njit(_signatures(_HEAD, scalars=1), fastmath=_FLAGS, nogil=True, error_model="numpy", boundscheck=False,
            cache=True)
def gdn_head_gradients(q, k, gamma, to_end, beta, ratios, qk, kk, products, dkd, entering, through, dq, dk, rows, dg,
                       dbeta, check, scale, group):
    """Per-head gates: ``gdn_channel_gradients``'s for lanes of one decay a step (``gamma``, ``to_end``, ``beta``
    ``[N, L]``): the products' gradients scaled as ``_scaled`` does (``products`` and ``dkd`` as there, in place),
    ``P_q = dqk ratios``, ``P_k = dkk ratios`` (``ratios [N, L, L]`` the decays ``exp(cum_r - cum_s)``), ``dq = dqg +
    P_q k``, ``dk = P_q^T q + (P_k + P_k^T) k + dkd - dgk`` (step ``t`` of lane ``j`` into row ``rows[j, t]`` of ``dq,
    dk [R, K]``: a scratch array's or the caller's layout) and ``dg [N, L]``, the sums from the chunk's end of
    ``dcum``: ``e = dqk qk + dkk kk`` (``qk``, ``kk [N, L, L]`` the decayed products) summed over each row minus over
    each column, plus ``q.dqg - k.(dgk + dkd)``, the last step also ``sum_s k.dkd`` and the decayed entering state's
    term, ``through [N]`` times ``entering [N]`` (``S0 . dS_L``, ``gdn_reverse_state``'s). Takes from
    ``dbeta [N, L]`` (which holds ``Y.V``) ``gamma (dgk.k)`` and ``sum_s dkk[r, s] kk[r, s]`` (unscaled). The triangles
    only (``s <= r``, in blocks of ``_BLOCK``); each dot product over the channels as a vector of products, summed
    by ``_folded``. Adds to ``check [N]`` the sum of every gradient the lane wrote (non-finite where one of them is:
    ``_redo_nonfinite``'s test)."""
    (lanes, length), n = dg.shape, dq.shape[1]
    # a step's terms of q.dqg - k.(dgk + dkd) and of k.dgk, a lane's of k.dkd, each channel's sum of dq + dk
    terms = np.empty((4, n), dq.dtype)
    step, unscaled, through_dkd, parts = terms[0], terms[1], terms[2], terms[3]
    pm = np.zeros((2, length, length), dq.dtype)  # P_q, P_k of a lane
    for j in range(lanes):
        qj, kj, pj, dkdj, rj, qkj, kkj = q[j // group], k[j // group], products[j], dkd[j], ratios[j], qk[j], kk[j]
        at, dgj, bj = rows[j], dg[j], beta[j]
        through_dkd[:] = 0
        for t in range(length):  # the scalings (``_scaled``'s, in place) and the channels' part of dcum
            et, ft, bt, qt, kt = gamma[j, t], to_end[j, t], bj[t], qj[t], kj[t]
            ht, gt, dt = pj[t], pj[length + t], dkdj[t]
            for i in range(n):
                h, w, d = ht[i] * et * scale, gt[i] * bt * et, dt[i] * ft
                unscaled[i] = gt[i] * kt[i]
                step[i] = qt[i] * h - kt[i] * (w + d)
                through_dkd[i] += kt[i] * d
                ht[i], gt[i], dt[i] = h, w, d
            dgj[t] = _folded(step)
            dbeta[j, t] -= et * _folded(unscaled)
        dgj[length - 1] += _folded(through_dkd) + entering[j] * through[j]
        # P_q and P_k (their upper triangles stay 0), and the products' part of dcum: + at the row, - at the column
        for r in range(length):
            row_q, row_k, rr, br = pj[r], pj[length + r], rj[r], -bj[r]
            for s in range(r):
                dqk, dkk = row_q[n + s] * scale, row_k[n + s] * br
                dbeta[j, r] -= row_k[n + s] * kkj[r, s]  # dkk kk, unscaled
                e = dqk * qkj[r, s] + dkk * kkj[r, s]
                dgj[r] += e
                dgj[s] -= e
                pm[0, r, s], pm[1, r, s] = dqk * rr[s], dkk * rr[s]
            pm[0, r, r] = row_q[n + r] * scale * rr[r]
        # rows: dq = dqg + P_q k, dk = P_k k; columns: dk += P_q^T q + P_k^T k + dkd - dgk; _BLOCK steps at a time
        for r in range(length):
            out_q, out_k, given = dq[at[r]], dk[at[r]], pj[r]
            for i in range(n):
                out_q[i] = given[i]
                out_k[i] = 0
            for s in range(0, r + 1, _BLOCK):
                _rows(out_q, out_k, pm[0, r], pm[1, r], s, kj)
        parts[:] = 0
        for s in range(length):
            out_q, out_k = dq[at[s]], dk[at[s]]
            for r in range(s - s % _BLOCK, length, _BLOCK):
                _columns(out_k, pm[0], pm[1], s, r, qj, kj)
            dt, gt = dkdj[s], pj[length + s]
            for i in range(n):  # dk += dkd - dgk; the step's dq + dk into each channel's sum, for check
                x = out_k[i] + (dt[i] - gt[i])
                out_k[i] = x
                parts[i] += out_q[i] + x
        total = dgj[length - 1] + dbeta[j, length - 1]
        for t in range(length - 2, -1, -1):  # the log-decays' gradient: dcum summed from the chunk's end
            dgj[t] += dgj[t + 1]
            total += dgj[t] + dbeta[j, t]
        check[j] += total + _folded(parts)


_REVERSE = dict(carried=4, final=3, through=3, leave_t=4, oy=4, beta=3, dv=2, rows="rows2", first=3,
                first_at="rows1", leaving=3, leaving_at="rows2", u=3, u_at="rows2", su=4, check=2, dots=2, values=2,
                value_rows="rows2", dbeta=3)


@numba.njit(_signatures(_REVERSE, index=True), fastmath=_FLAGS, nogil=True, error_model="numpy", boundscheck=False,
            cache=True)
def gdn_reverse_state(carried, final, through, leave_t, oy, beta, dv, rows, first, first_at, leaving, leaving_at, u,
                      u_at, su, check, dots, values, value_rows, dbeta, c):
    """Chunk ``c`` of the reverse over chunks (arrays ``[C, N, ...]``: every chunk's ``N`` lanes), per lane, after its
    GEMMs: ``dv = beta Y`` (``Y`` the lower half of ``oy [C, N, 2L, V]``, ``beta [C, N, L]``; step ``t`` of lane ``j``
    into row ``rows[c N + j, t]`` of ``dv [R, V]``); ``carried [C, N, K, V]`` (``gb^T [scale dO; Y]``) becomes the
    chunk's ``dS0 = carried + through ds`` (``ds`` the gradient of the state leaving the chunk: the next chunk's
    ``dS0``, ``final`` for the last; ``through [C, N, K]`` the chunk's decay per key channel, per head one value
    repeated), written transposed into ``leave_t [C, N, V, K]`` too (the previous chunk's ``dS_L^T``, from the rows just
    written; the last chunk's is there already); ``su [C, N, V, K + L]`` the GEMM operand ``[S0^T |
    U^T]`` (``S0`` the state entering the chunk: matrix ``first_at[j]`` of ``first [M, K, V]`` for the first chunk,
    else the previous chunk's, ``leaving_at[c - 1, j]`` of ``leaving``; ``U`` matrix ``u_at[c, j]`` of ``u [M, L,
    V]``); ``check [C, N]`` the sum of ``dv`` (for ``_redo_nonfinite``), ``dots [C, N]`` ``S0 . ds`` and ``dbeta [C, N,
    L]`` ``Y.V`` (V's step ``t`` of lane ``j``: row ``value_rows[c N + j, t]`` of ``values [R, V]``). One pass where
    NumPy makes four and three transposing copies (float32's in 8 x 8 vector transposes, ``jit_math._transposed``)."""
    count, lanes, n, width = carried.shape
    length = beta.shape[2]
    ds = final if c == count - 1 else carried[c + 1]
    parts = np.empty(max(width, n), dv.dtype)
    products = np.empty(width, dv.dtype)
    for j in range(lanes):
        parts[:] = 0
        at, value_at = rows[c * lanes + j], value_rows[c * lanes + j]
        for t in range(length):
            yt, out, b, vt = oy[c, j, length + t], dv[at[t]], beta[c, j, t], values[value_at[t]]
            for v in range(width):
                out[v] = yt[v] * b
                parts[v] += out[v]
                products[v] = yt[v] * vt[v]
            dbeta[c, j, t] = _folded(products)
        check[c, j] = _folded(parts)
        start = first[first_at[j]] if c == 0 else leaving[leaving_at[c - 1, j]]
        uj, sj, dj = u[u_at[c, j]], su[c, j], ds[j]
        state = parts[:width]
        state[:] = 0
        for i in range(n):  # S0 . ds
            a, d = start[i], dj[i]
            for v in range(width):
                state[v] += a[v] * d[v]
        dots[c, j] = _folded(state)
        _transposed(sj, 0, start)  # [S0^T | U^T]
        _transposed(sj, n, uj)
        cj, fj = carried[c, j], through[c, j]
        for i in range(n):
            row_i, drow, f = cj[i], dj[i], fj[i]
            for v in range(width):
                row_i[v] += drow[v] * f
        if c:
            _transposed(leave_t[c - 1, j], 0, cj)


_OPERANDS = dict(q=3, k=3, g=2, beta=2, ratios=3, gamma=2, to_end=2, through=1, kd=3, gb=3)


@numba.njit(_signatures(_OPERANDS), fastmath=_FLAGS, nogil=True, error_model="numpy", boundscheck=False,
            cache=True)
def gdn_head_operands(q, k, g, beta, ratios, gamma, to_end, through, kd, gb):
    """Per-head gates, per lane ``j`` of ``N`` (key lane ``j // group`` of ``q, k [N / group, L, K]``, ``group = N /
    len(q)``) from the chunk's (floored) log-decays ``g [N, L]`` and ``beta [N, L]``: the cumulative log-decays ``cum``
    (summed step after step), ``ratios [N, L, L]`` (``exp(cum_r - cum_s)`` for ``s <= r``, else 0), ``gamma =
    exp(cum)``, ``to_end = exp(last - cum)`` ``[N, L]``, ``through = exp(last) [N]`` (``last`` the chunk's last
    step's), and the operands ``kd = k to_end [N, L, K]`` and ``gb = [q gamma; -k beta gamma] [N, 2L, K]``: one pass
    where NumPy makes a dozen."""
    lanes, length = g.shape
    n, group = q.shape[2], g.shape[0] // q.shape[0]
    cum = np.empty(length, g.dtype)
    for j in range(lanes):
        gj, bj, qj, kj, rj = g[j], beta[j], q[j // group], k[j // group], ratios[j]
        cum[0] = gj[0]
        for t in range(1, length):
            cum[t] = cum[t - 1] + gj[t]
        last = cum[length - 1]
        through[j] = _exp_of(last)
        for r in range(length):
            row, here = rj[r], cum[r]
            for s in range(r + 1):
                row[s] = _exp_of(here - cum[s])
            for s in range(r + 1, length):
                row[s] = 0
            e, f = _exp_of(here), _exp_of(last - here)
            gamma[j, r], to_end[j, r] = e, f
            b = -(e * bj[r])
            qt, kt, x, y, z = qj[r], kj[r], kd[j, r], gb[j, r], gb[j, length + r]
            for i in range(n):
                x[i] = kt[i] * f
                y[i] = qt[i] * e
                z[i] = kt[i] * b
