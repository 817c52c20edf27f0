"""``gated_delta_net_backward``'s chunked path: the backward of the WY / UT-transform form (``gdn_backward``'s
docstring gives its formulas), lanes whose gradients come out non-finite redone by the step path."""
from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from . import jit
from .chunked import (chunk_major, chunk_view, decay_ratios, dot_last, floor_log_decays, scratch, to_chunks,
                      unit_lower_inverse)
from .gdn_backward_grads import _FLOATS, _Decayed, channel_gradients, head_gradients
from .gdn_backward_step import _step
from .gdn_grams import CHANNEL_SPREAD, _channel_grams_fast, _upper
from .gdn_step import _split, _swap

Array = np.ndarray


def _chunked(q, k, v, g, beta, s0, dsf, d_out, scale, length, out, saved=None):
    """The chunked backward over ``[B, S, H, ...]`` arrays (``_step_path``'s layout): the gradients of ``q, k, v, g,
    beta`` written into ``out`` (five arrays of their layout, views of the caller's), the initial state's returned.
    ``saved``: a saved forward's views by slot name (``abi.gdn.reserve_slots``, ``[B, C, HV, ...]``, chunks of
    ``length``), read instead of forming the decayed products, the inverses, the states entering each chunk and
    ``U``."""
    seq, heads, n = q.shape[1:]
    b, group = q.shape[0], v.shape[2] // heads
    per_channel = g.ndim == 4
    low, high = float(g.min(initial=0.0)), float(g.max(initial=0.0))
    g = floor_log_decays(g, low)
    qc, kc = (to_chunks(x, length, f"gdnb.{f}")[:, :, :, None] for f, x in (("q", q), ("k", k)))  # [C, B, H, 1, L, K]
    vc, oc = (_split(chunk_view(x, length), group, 2) for x in (v, d_out))  # [C, B, H, G, L, V]
    gc, bc = (_split(to_chunks(x, length), group, 2) for x in (g, beta))  # [C, B, H, G, L(, K)]
    count = qc.shape[0]
    read = None if saved is None else _chunk_major(saved, group)
    kt = None if read is not None else _copy("kt", _swap(kc))  # [C, B, H, 1, K, L], for the decayed products
    products = None if read is None else (read["qk"], read["kk"])
    lanes = (*gc.shape[:4],)  # [C, B, H, G]
    shape = (*lanes, length, n)
    compiled = None if per_channel else _head_operands(qc, kc, gc, bc, shape)
    qk, kk, gamma, to_end, through, pairs = _decays(qc, kc, kt, gc, per_channel, max(-low, high), products,
                                                    None if compiled is None else compiled[:4])
    inverse = unit_lower_inverse(kk * bc[..., None]) if read is None else read["inverse"]  # (I + A)^-1
    # gamma K, [..., L, K]: for the recomputed forward and per-channel gates' beta gradient (per head the compiled
    # pass and the reverse scale K by the step's one decay themselves)
    gk = np.multiply(gamma, kc, out=_temp("gk", shape, kc.dtype)) if read is None or per_channel else None
    kd = np.multiply(kc, to_end, out=_temp("kd", shape, kc.dtype)) if compiled is None else compiled[4]  # KD
    # [scale dO; Y] by [S0^T | U^T] (``gdn_backward_grads``, whose scale is then 1): the states entering the chunks and
    # U are written transposed into the right operand (``_right_operand``), Y by the reverse into the left's lower half
    width = vc.shape[-1]
    oy = _temp("oy", (*lanes, 2 * length, width), vc.dtype)
    np.multiply(oc, scale, out=oy[..., :length, :])
    su = _temp("su", (*lanes, width, n + length), vc.dtype)
    u, leaving = _forward(vc, gk, inverse, bc, kd, through, _split(s0, group, 1), read)
    compiled_reverse = _right_operand(su, _split(s0, group, 1), leaving, u)
    starts = _swap(su[..., :n])  # [C, ..., K, V]

    # the reverse over chunks: Y = (I + A)^-T (scale M^T dO + KD dS_L), dV = beta Y and dS0 = gamma_L dS_L + scale
    # (gamma Q)^T dO - (beta gamma K)^T Y; what does not depend on dS_L is formed for every chunk at once first
    y = oy[..., length:, :]  # (I + A)^-T M^T dO as (M (I + A)^-1)^T dO: an L x L product first
    np.matmul(_swap(np.matmul(qk, inverse, out=_temp("mt", inverse.shape, y.dtype))), oy[..., :length, :], out=y)
    w = np.matmul(_swap(inverse), kd, out=_temp("w", shape, kd.dtype))  # (I + A)^-T KD
    gb = _gamma_operands(qc, kc, gk, gamma, bc, shape) if compiled is None else compiled[5]
    carried = _temp("carried", (*lanes, n, width), vc.dtype)  # [C, ..., K, V]: each chunk's dS0, by the reverse
    final = _split(dsf, group, 1)
    # each chunk's dS_L (the next one's dS0, the final state's gradient for the last), transposed: [C, ..., V, K]
    leave_t = _temp("leave_t", (*lanes, width, n), vc.dtype)
    # dv straight into the caller's array where it can (``_targets``), as the compiled passes write dq and dk; V read
    # where it lies alike (``_targets``' layout, a chunk-major copy where the caller's is not it)
    dv, values = _targets("dv", out[2], lanes, length, False), _read_from("v", v, vc, lanes, length)
    sums = _temp("check", lanes, y.dtype), _temp("dots", lanes, y.dtype)
    # beta's gradient through R = V - (gamma K) S0 as Y.V - (Y S0^T).(gamma K), no R kept (Y S0^T (beta gamma) is minus
    # the gradient of gamma K), and through A (Y U^T is minus its gradient, strictly lower): Y.V by the reverse
    dbeta = _temp("dbeta", (*lanes, length), y.dtype)
    ds, sums = _reverse(compiled_reverse, w, gb, through, carried, final, oy, leave_t, bc, dv, su, (s0, leaving, u),
                        sums, values, dbeta)

    # every other gradient, all chunks at once
    prods = np.matmul(oy, su, out=_temp("prods", (*lanes, 2 * length, n + length), vc.dtype))
    dkd = np.matmul(u, leave_t, out=_temp("dkd", shape, kd.dtype))  # of KD, over to_end
    raw = (prods, dkd, gamma, to_end, bc, 1.0)
    # dq and dk (and per key channel dg) where the compiled passes write them: the caller's arrays where they can
    places = [_targets(f, x, lanes, length, True) for f, x in (("dq", out[0]), ("dk", out[1]))]
    if per_channel:
        places.append(_targets("dg_channels", out[3], lanes, length, False))
    dq, dk, dg, compiled_grads = (
        channel_gradients(pairs, qc, kc, kk, *raw, su, leave_t, through, gk, dbeta, sums, places) if per_channel
        else head_gradients(pairs, qc, kc, qk, kk, *raw, su, leave_t, through, dbeta, sums, places))
    # the compiled passes add their gradients' sums to the reverse's (``sums[0]``, dv's); NumPy's are summed there
    grads = [dq, dk, dv.chunks, dg, dbeta]
    unchecked = grads if sums is None else [] if compiled_grads else [dq, dk, dg, dbeta]
    _redo_nonfinite(grads, ds, (qc, kc, vc, gc, bc, oc), starts, final, scale, None if sums is None else sums[0],
                    unchecked)
    placed = [compiled_grads and places[0].direct, compiled_grads and places[1].direct, dv.direct,
              compiled_grads and per_channel and places[2].direct, False]
    for f, (x, dest) in enumerate(zip(grads, out)):  # dq and dk per value head: summed over each key head's group
        if not placed[f]:
            _unchunk(x.sum(axis=3) if f < 2 and group > 1 else x.reshape(count, b, -1, *x.shape[4:]), dest)
    return ds.reshape(s0.shape)


class _Target(NamedTuple):
    """Where a compiled pass writes one gradient (``_targets``): step ``t`` of lane ``j`` into row ``rows[j, t]`` of
    ``flat [R, X]``; ``chunks [C, B, H, G, L, X]`` the same memory chunk-major (``_unchunk``'s layout; NumPy's passes
    and ``_redo_nonfinite`` write there); ``direct``: whether that memory is the caller's."""
    rows: Array
    flat: Array
    chunks: Array
    direct: bool


def _targets(name: str, dest: Array, lanes: tuple[int, ...], length: int, per_key: bool) -> _Target:
    """The ``_Target`` of the gradient ``dest [B, S, heads, X]`` (``out``'s, a view of the caller's) for ``lanes [C, B,
    H, G]`` of ``length`` steps: ``dest`` itself where it lies contiguous and its steps fill whole chunks (and, for a
    gradient per key head, ``per_key``, without grouped value heads: those sum over the group after), else the scratch
    array ``name``."""
    count, b, heads, group = lanes
    width, seq = dest.shape[-1], dest.shape[1]
    if dest.flags.c_contiguous and seq == count * length and not (per_key and group > 1):
        return _Target(_row_map(*lanes, length, True), dest.reshape(-1, width),
                       _split(chunk_view(dest, length), group, 2), True)
    chunks = _temp(name, (*lanes, length, width), dest.dtype)
    return _Target(_row_map(*lanes, length, False), chunks.reshape(-1, width), chunks, False)


@functools.lru_cache(maxsize=32)
def _row_map(count: int, b: int, heads: int, group: int, length: int, direct: bool) -> Array:
    """``_Target.rows`` for lanes ``[C, B, H, G]`` of ``length`` steps (``[C B H G, L]``, int64): with ``direct``, the
    rows of the caller's ``[B, S, H G, X]`` (``S = C L``), else those of a chunk-major scratch array. Kept per shape
    (it costs as much as a pass over a gradient to form; the compiled passes only read it)."""
    if not direct:
        return np.arange(count * b * heads * group * length, dtype=np.int64).reshape(-1, length)
    c, row, h, g, t = np.ogrid[:count, :b, :heads, :group, :length]
    rows = (row * (count * length) + c * length + t) * (heads * group) + h * group + g
    return rows.astype(np.int64).reshape(-1, length)


def _read_from(name: str, x: Array, chunks: Array, lanes: tuple[int, ...], length: int) -> _Target:
    """``x [B, S, heads, X]`` (``chunks``: the same chunk-major) as a compiled pass reads it, ``_targets``' way:
    ``x`` itself where it lies so, else a copy of ``chunks`` in the scratch array ``name``."""
    where = _targets(name, x, lanes, length, False)
    if not where.direct:
        np.copyto(where.chunks, chunks)
    return where


def _unchunk(y: Array, dest: Array) -> None:
    """``y [C, B, H, L, ...]`` (``to_chunks``' layout) written into the first ``S`` steps of ``dest [B, S, H, ...]``
    where they lie: no array of ``dest``'s layout in between."""
    count, b, heads, length = y.shape[:4]
    seq = dest.shape[1]
    whole = seq // length
    if whole:  # splitting the steps' axis in two is a view
        split = dest[:, :whole * length].reshape(b, whole, length, heads, *dest.shape[3:])
        np.copyto(chunk_major(split), y[:whole])
    if whole < count:
        np.copyto(np.moveaxis(dest[:, whole * length:], 1, 2), y[whole, :, :, :seq - whole * length])


def _temp(name: str, shape: tuple[int, ...], dtype) -> Array:
    """The ``chunked.scratch`` array ``name``: an intermediate of ``_chunked`` (never one it returns), kept between
    calls so that its pages are not faulted in again on every call."""
    return scratch(f"gdnb.{name}", shape, dtype)


def _copy(name: str, x: Array) -> Array:
    """A contiguous copy of ``x`` in the scratch array ``name``."""
    out = _temp(name, x.shape, x.dtype)
    np.copyto(out, x)
    return out


def _chunk_major(saved, group):
    """A saved forward's slots ``[B, C, HV, ...]`` chunk-major, ``[C, B, H, G, ...]``: views, each matrix contiguous
    (a GEMM's operand as it lies; what wants another layout copies once)."""
    return {f: _split(x, group, 2).swapaxes(0, 1) for f, x in saved.items()}


def _forward(vc, gk, inverse, bc, kd, through, s0, saved):
    """The forward again: ``(U, leaving)``, ``U = T R`` (``T = (I + A)^-1 beta``, ``R = V - (gamma K) S0``) and the
    state leaving each chunk ``[C, ..., K, V]``, one chunk after another from ``s0``; or a saved forward's (``saved``:
    ``u`` and ``states``, ``[C, ...]``), as they are."""
    if saved is not None:
        return saved["u"], saved["states"]
    t = inverse * bc[..., None, :]
    kd_t = np.ascontiguousarray(_swap(kd))
    u, rest = np.empty(vc.shape, vc.dtype), np.empty(vc.shape[1:], vc.dtype)
    leaving = _temp("leaving", (len(vc), *s0.shape), vc.dtype)
    state = s0
    for c in range(len(vc)):
        np.subtract(vc[c], np.matmul(gk[c], state), out=rest)
        np.matmul(t[c], rest, out=u[c])
        np.matmul(kd_t[c], u[c], out=leaving[c])
        leaving[c] += state * through[c]
        state = leaving[c]
    return u, leaving


def _right_operand(su: Array, s0: Array, leaving: Array, u: Array):
    """``jit``'s ``gdn_reverse_state`` where it applies (Numba there, not ``RLX_HOST_JIT=0``, f32 or f64), which then
    writes ``su [C, ..., V, K + L]``, ``[S0^T | U^T]``, itself; else None, ``su`` written here (the states entering the
    chunks: ``s0``, then the ``leaving`` ones but the last)."""
    kernel = jit.kernel("gdn_reverse_state") if su.dtype in _FLOATS else None
    if kernel is None:
        n = s0.shape[-2]
        su[0, ..., :n] = _swap(s0)
        su[1:, ..., :n] = _swap(leaving[:-1])
        su[..., n:] = _swap(u)
    return kernel


def _reverse(kernel, w, gb, through, carried, ds, oy, leave_t, bc, dv, su, sources, sums, values, dbeta):
    """The loop over chunks from the last, ``ds`` the gradient of the state leaving it: ``Y += W dS_L`` (``W = (I +
    A)^-T KD``; ``Y`` the lower half of ``oy``, which holds the rest of it), then ``dS0 = gamma_L dS_L + gb^T [scale dO;
    Y]`` (``gb = [gamma Q; -beta gamma K]``: one GEMM for both terms, ``Y`` whole) into ``carried [C, ..., K, V]``; each
    chunk's ``dS_L`` transposed into ``leave_t``, and ``dv = beta Y``. The GEMMs are OpenBLAS's; the rest of a chunk is
    one compiled pass, ``kernel`` (``jit``'s ``gdn_reverse_state``, or None where it does not apply: no Numba,
    ``RLX_HOST_JIT=0``, neither f32 nor f64; ``dv``: a ``_Target``), which also writes ``su [C, ..., V, K + L]``,
    ``[S0^T | U^T]``, from ``sources``: ``(s0 [B, HV, K, V], leaving, u)`` (``_forward``'s), fills ``sums``: each
    lane's sum of ``dv`` and ``S0 . dS_L`` (``[C, ...]`` each), and ``dbeta [C, ..., L]``: ``Y.V`` (``values``: V,
    a ``_Target``).
    Returns the first chunk's ``dS0`` (a fresh array) and ``sums`` (None where NumPy ran)."""
    length = oy.shape[-2] // 2
    rest = np.empty(dv.chunks.shape[1:], carried.dtype)
    leave_t[-1] = _swap(ds)
    count, (n, width) = len(carried), carried.shape[-2:]
    if kernel is not None:  # every argument laid [C, lanes, ...] once: the kernel takes chunk c's
        per = carried[0].size // (n * width)  # lanes a chunk
        first, (leaving, leaving_at), (u, u_at) = (_matrices(x) for x in sources)
        decays = np.empty(carried.shape[:-1], through.dtype)  # [C, ..., K]
        np.copyto(decays, through[..., 0])
        args = (carried.reshape(count, per, n, width), np.ascontiguousarray(ds).reshape(per, n, width),
                decays.reshape(count, per, n), leave_t.reshape(count, per, width, n),
                oy.reshape(count, per, 2 * length, width), np.ascontiguousarray(bc).reshape(count, per, length),
                dv.flat, dv.rows, *first, leaving, leaving_at.reshape(count, -1), u, u_at.reshape(count, -1),
                su.reshape(count, per, width, -1), sums[0].reshape(count, per), sums[1].reshape(count, per),
                values.flat, values.rows, dbeta.reshape(count, per, length))
    ws, gb_t, ys, states = list(w), list(_swap(gb)), list(oy[..., length:, :]), list(carried)  # each chunk's views
    for c in range(count - 1, -1, -1):
        ys[c] += np.matmul(ws[c], ds, out=rest)
        np.matmul(gb_t[c], oy[c], out=states[c])
        if kernel is not None:
            kernel(*args, c)
        else:
            states[c] += ds * through[c]
            if c:
                leave_t[c - 1] = _swap(states[c])
        ds = states[c]
    if kernel is None:
        np.multiply(oy[..., length:, :], bc[..., None], out=dv.chunks)
        dbeta[...] = dot_last(oy[..., length:, :], values.chunks)
    return ds.copy(), None if kernel is None else sums


def _matrices(x: Array) -> tuple[Array, Array]:
    """``x [..., X, Y]`` as ``(stack, at)``: ``stack [M, X, Y]`` C-contiguous over ``x``'s memory (a copy only where
    ``x``'s matrices are not each contiguous and apart by whole matrices) and ``at``, int64, flat: the matrix of
    ``stack`` each of ``x``'s is, in ``x``'s order. Lets a compiled pass read a strided view (a saved forward's slots
    for some heads, chunk-major) matrix by matrix without a copy."""
    lead, (rows, cols) = x.shape[:-2], x.shape[-2:]
    if x.size == 0:
        return np.zeros((1, rows, cols), x.dtype), np.zeros(int(np.prod(lead)), np.int64)
    size, item = rows * cols * x.itemsize, x.itemsize
    if (x.strides[-1] != item or x.strides[-2] != cols * item or any(st < 0 or st % size for st in x.strides[:-2])
            or not x.flags.writeable):
        x = np.ascontiguousarray(x)
    at, extent = _stack_at(lead, tuple(st // size for st in x.strides[:-2]))
    return np.lib.stride_tricks.as_strided(x, (extent, rows, cols), (size, cols * item, item)), at


@functools.lru_cache(maxsize=64)
def _stack_at(lead: tuple[int, ...], steps: tuple[int, ...]) -> tuple[Array, int]:
    """``_matrices``' ``at`` for matrices ``lead`` apart by ``steps`` matrices per axis, and the stack's extent (its
    largest entry plus one). Kept per shape and strides (the compiled pass only reads it)."""
    at = np.zeros(lead, np.int64)
    for axis, (extent, step) in enumerate(zip(lead, steps)):
        at += (np.arange(extent, dtype=np.int64) * step).reshape([-1 if a == axis else 1 for a in range(len(lead))])
    return at.reshape(-1), int(at.max(initial=0)) + 1


def _gamma_operands(qc, kc, gk, gamma, bc, shape):
    """``[gamma Q; -beta gamma K] [..., 2L, K]`` (``shape [..., L, K]``; ``gk``: ``gamma K`` where the caller has it)
    by NumPy: ``_head_operands``' ``gb``."""
    length = shape[-2]
    gb = _temp("gb", (*shape[:-2], 2 * length, shape[-1]), qc.dtype)
    np.multiply(gamma, qc, out=gb[..., :length, :])
    steps = -bc[..., None] if gk is not None else gamma * -bc[..., None]  # what K or gamma K takes
    np.multiply(kc if gk is None else gk, steps, out=gb[..., length:, :])
    return gb


def _head_operands(qc, kc, gc, bc, shape):
    """Per-head gates: ``(ratios, gamma, to_end, through, kd, gb)`` in one compiled pass (``jit``'s
    ``gdn_head_operands``: ``_decays``' decays in its shapes, ``KD`` ``shape [..., L, K]`` and ``_gamma_operands``'
    ``gb``), or None where it does not apply (no Numba, ``RLX_HOST_JIT=0``, neither f32 nor f64)."""
    kernel = jit.kernel("gdn_head_operands")
    dtype = qc.dtype
    if kernel is None or dtype not in _FLOATS:
        return None
    lanes, (length, n) = shape[:-2], shape[-2:]
    ratios = _temp("ratios", (*lanes, length, length), dtype)
    gamma, to_end = (np.empty((*lanes, length, 1), dtype) for _ in range(2))
    through = np.empty((*lanes, 1, 1), dtype)
    kd, gb = _temp("kd", shape, dtype), _temp("gb", (*lanes, 2 * length, n), dtype)
    kernel(qc.reshape(-1, length, n), kc.reshape(-1, length, n), np.ascontiguousarray(gc).reshape(-1, length),
           np.ascontiguousarray(bc).reshape(-1, length), ratios.reshape(-1, length, length), gamma.reshape(-1, length),
           to_end.reshape(-1, length), through.reshape(-1), kd.reshape(-1, length, n), gb.reshape(-1, 2 * length, n))
    return ratios, gamma, to_end, through, kd, gb


def _decays(qc, kc, kt, gc, per_channel, steepest, products=None, head=None):
    """The decays inside each chunk, from the (floored) log-decays ``gc``: ``(qk, kk, gamma, to_end, through,
    pairs)``, the decayed products ``Q K^T`` (``r <= s``) and ``K K^T`` (``r < s``), the decay from the chunk's
    start through each step (``gamma``) and from each step to its end (``to_end``), both ``[..., L, K or 1]``,
    the chunk's decay ``through`` (``[..., K or 1, 1]``) and what pairs a later step with an earlier one: a
    ``_Decayed`` (per-channel gates) or the ratios ``[..., L, L]`` (per head). ``steepest``: the largest
    ``|g|``; ``products``: the decayed products ``(qk, kk)`` a saved forward holds, used as they are; ``head``: per
    head, ``(ratios, gamma, to_end, through)`` where ``_head_operands`` formed them."""
    length, n = kc.shape[-2:]
    with np.errstate(over="ignore", invalid="ignore"):
        if per_channel:
            compiled = _compiled_decays(gc)
            cum = np.cumsum(gc, axis=-2) if compiled is None else compiled[0]  # [C, B, H, G, L, K]
            bounded = steepest * (length // 2 + 1) <= CHANNEL_SPREAD
            lead = cum.shape[:-2]
            if products is None:
                qk, kk = _channel_grams_fast(np.broadcast_to(qc, (*lead, length, n)),
                                             np.broadcast_to(kc, (*lead, length, n)), kt, cum,
                                             np.ascontiguousarray(_swap(cum)), bounded)
                products = qk.copy(), kk.copy()  # scratch arrays of gdn's: kept here past other calls
            pairs = _Decayed(cum, bounded, None if compiled is None else compiled[1:3])
        else:
            compiled = None if head is None else (None, None, None, *head[1:])
            cum = np.cumsum(gc, axis=-1)[..., None] if head is None else None  # [C, B, H, G, L, 1]
            pairs = decay_ratios(cum[..., 0]) if head is None else head[0]
            if products is None:
                products = np.multiply(np.matmul(qc, kt), pairs), np.multiply(np.matmul(kc, kt), pairs)
                np.copyto(products[1], 0, where=_upper(length, 0))
        qk, kk = products
        if compiled is None:
            last = cum[..., -1:, :]
            gamma, to_end = np.exp(cum), np.exp(last - cum)  # [..., L, K or 1]
            through = np.exp(last[..., 0, :])[..., None]  # [..., K or 1, 1]: the chunk's decay
        else:
            gamma, to_end, through = compiled[3:]
    return qk, kk, gamma, to_end, through, pairs


def _compiled_decays(gc: Array) -> tuple[Array, ...] | None:
    """Per-channel gates: ``(cum, up, down, gamma, to_end, through)`` of ``gc [..., L, K]`` in one compiled pass
    (``jit``'s ``gdn_channel_decays``; ``through [..., K, 1]``), or None where it does not apply (no Numba,
    ``RLX_HOST_JIT=0``, neither f32 nor f64): ``_decays`` then forms them with NumPy."""
    kernel = jit.kernel("gdn_channel_decays")
    if kernel is None or gc.dtype not in _FLOATS:
        return None
    lanes = gc.shape[-2:]
    outs = [np.empty(gc.shape, gc.dtype) for _ in range(5)]
    through = np.empty((*gc.shape[:-2], lanes[1], 1), gc.dtype)
    kernel(np.ascontiguousarray(gc).reshape(-1, *lanes), *(x.reshape(-1, *lanes) for x in outs),
           through.reshape(-1, lanes[1]))
    return (*outs, through)


def _redo_nonfinite(grads, ds0, chunks, starts, dsf, scale, check, unchecked) -> None:
    """Redo with ``_step``, chunk by chunk from the checkpoints ``starts``, every lane (batch row, key
    head, group member) whose chunked gradients hold a NaN or Inf; writes into ``grads`` and ``ds0``. ``check [C,
    ...]``: each chunk's sum of some of its gradients, where the compiled passes formed them (else None); the others,
    ``unchecked``, are summed here."""
    lead = ds0.shape[:3]
    # a lane's sum is non-finite where any of its terms is (or, rarely, where it overflows: a lane redone needlessly)
    bad = ~np.isfinite(ds0.sum(axis=(-2, -1)))
    if check is not None:
        bad |= ~np.isfinite(check.sum(axis=0))
    for x in unchecked:
        bad |= ~np.isfinite(x.reshape(x.shape[0], *lead, -1).sum(axis=(0, -1)))
    if not bad.any():
        return
    pick = np.nonzero(bad)
    qc, kc, vc, gc, bc, oc = chunks
    key = (pick[0], pick[1], np.zeros_like(pick[2]))
    ds = dsf[pick]
    for c in range(starts.shape[0] - 1, -1, -1):
        *step, ds = _step(qc[c][key], kc[c][key], vc[c][pick], gc[c][pick], bc[c][pick], starts[c][pick], ds,
                          oc[c][pick], scale)
        for x, redone in zip(grads, step):
            x[c][pick] = redone
    ds0[pick] = ds
