"""The chunked path of ``mamba2_backward`` (``chunked_backward``; ``mamba2_backward`` says the form): mamba_ssm's
chunk kernels in NumPy, with ``cum`` the log-decay summed from each chunk's start, ``M_ij = exp(cum_i - cum_j)``
(``i >= j``) and the decayed scores ``W = (c b^T) * M``:

1. per chunk, by GEMMs over every chunk at once: the state it builds from zero and the gradient its outputs send
   to the state entering it (``Σ_i exp(cum_i) gy_i (x) c_i``);
2. two short loops over the chunks: the states entering each chunk, forward from the initial state, and the
   gradients of the states leaving each, backward from ``d_state``;
3. per slab of chunks, by GEMMs (``W`` and ``gy u^T * M`` factored through the chunk's midpoint, as the forward's
   scores are): ``du = W^T gy + decay-to-end * b dS_end``, ``dc = (gy u^T * M) b + exp(cum) gy S_0``, ``db =
   (gy u^T * M)^T c + decay-to-end * u dS_end``, and the log-decay's gradient as the reverse cumulative sum of
   ``d cum_i = gy_i . y_i - u_i . du_i`` (plus the leaving state's term at a chunk's end); ``y`` whole only where
   ``z``'s gradient needs it.

States and their gradients keep the forward's ``[P, N]`` layout, and each GEMM's operands are laid as OpenBLAS takes
them fastest (the transposed ones written so once); the causal products (``W``, ``gy u^T * M`` and those by them)
run by blocks of ``CAUSAL_BLOCK`` rows that read only up to or from their diagonal block. With a saved forward
(ABI.md §9.1) step 2's forward loop and three GEMMs per chunk are read instead, the states where they lie. Where
Numba is there and the thunk computes in f32, the passes between the GEMMs are compiled (``jit_mamba2_backward``:
the decayed products' operands, the loop back over the chunks, and what follows each slab's GEMMs: the shares added,
the dots (``gy . y`` too), the reverse sums and the check for non-finite values, about ten array passes in NumPy);
with a saved forward step 3 is one compiled pass over every chunk, its GEMMs too (``jit_mamba2_saved``'s
``mamba2_backward_saved``, in ``jit_lstm``'s register tiles). ``RLX_HOST_JIT=0`` keeps NumPy's; without a saved
forward both paths share every GEMM.
"""
from __future__ import annotations

import numpy as np

from . import jit
from .chunked import chunk_view, decay_ratios, dot_last, scratch, sum_from_end, swap
from .ssm_ssd import MAMBA2_SPREAD

#: Bytes of the per-slab temporaries of the chunked path (a few ``[L, L]`` and ``[L, N]`` arrays per chunk
#: and lane): slabs of chunks keep the backward's memory near the forward's at long sequences.
SLAB_BYTES = 16 << 20

#: Rows of the blocks a causal product is cut into (``_lower_times``, ``_upper_times``, ``_decayed``): each block
#: of rows reads only the columns up to (or from) its diagonal block, so the GEMMs skip most of the zeros of a
#: triangular operand (at 4 blocks of 16, 5/8 of the full product's multiply-adds).
CAUSAL_BLOCK = 16

#: ``mamba2_backward_gradients``' chain rule arrays where there is none to apply
_NO_CHAIN = (np.zeros((1, 1, 1, 1), np.float32), np.zeros((1, 1, 1), np.float32), np.zeros((1, 1, 1, 1), np.float32),
             np.zeros((1, 1, 1), np.float32))


def _leaving_states(lu, lb, to_end, through, s0, work, states):
    """The states leaving each chunk, ``[B, C, H, P, N]`` (a saved forward's layout): a saved forward's ``states``
    where given (copied only where not C-contiguous), else built chunk by chunk from the initial state ``s0`` and
    what each chunk builds from zero (``Σ_j decay-to-end_j u_j (x) b_j``)."""
    if states is not None:
        return np.ascontiguousarray(states)
    scaled = np.multiply(lu, to_end[..., None], out=work("scaled", lu.shape))
    built = np.matmul(swap(scaled), lb, out=work("built", (*lu.shape[:3], lu.shape[-1], lb.shape[-1])))
    ends = np.empty((s0.shape[0], len(built), *s0.shape[1:]), s0.dtype)
    s = s0
    for k in range(len(built)):
        s = ends[:, k] = through[k] * s + built[k]
    return ends


class _Chunks:
    """Steps 1 and 2 of a call (the module's docstring), what each slab of step 3 reads: the inputs as
    ``[C, B, H, L, ...]`` chunks, ``cum``, ``to_end``, ``grown = exp(cum) gy``, the initial state ``s0`` and the
    states leaving each chunk (``ends`` ``[B, C, H, P, N]``: the one entering chunk ``k > 0`` is ``ends[:, k - 1]``),
    the gradients of those leaving it (``leaving`` ``[P, N]``, ``leaving_t`` ``[N, P]``), ``end_dot`` (``<dS, S>`` at
    each chunk's end) and a saved forward's ``y`` and ``W``."""

    def __init__(self, logd, u, b, c, s0, gy, ds, length, saved, compiled: bool):
        ch = lambda v: chunk_view(v, length)  # noqa: E731  [C, B, H, L, ...]
        self.u, self.b, self.c, self.gy = ch(u), ch(b), ch(c), ch(gy)
        # the compiled passes read the inputs as laid, [B, S, H, ...]
        self.laid = {"u": u, "b": b, "c": c, "gy": gy} if compiled else None
        if compiled and saved is not None:
            self.laid["y"] = np.ascontiguousarray(saved[1])
        self.operands = jit.kernel("mamba2_backward_operands") if compiled else None
        self.seq = u.shape[1]
        self.work = lambda key, shape: scratch(f"m2b.{key}", shape, u.dtype)  # noqa: E731  (temporaries, reused)
        cum = self.cum = np.ascontiguousarray(np.cumsum(ch(logd), axis=-1))  # [C, B, H, L]
        self.to_end = np.ascontiguousarray(np.exp(cum[..., -1:] - cum))  # the decay from each step to its chunk's end
        through = np.exp(cum[..., -1])[..., None, None]
        self.s0 = s0
        self.ends = _leaving_states(self.u, self.b, self.to_end, through, s0, self.work,
                                    None if saved is None else saved[0])
        # the grown gy gives the gradient each chunk's outputs send to the state entering it, and that state's
        # share of dc ("scaled": _leaving_states is done with it)
        self.grown = np.multiply(self.gy, np.exp(cum)[..., None], out=self.work("scaled", self.gy.shape))
        self.leaving = swap(self.grown) @ self.c  # then leaving[k]: d loss / d (state after chunk k)
        self._state_gradients(ds, through, compiled)
        self.ys = None if saved is None else ch(saved[1])
        self.saved_w = None if saved is None else np.moveaxis(saved[2], 1, 0)

    def _state_gradients(self, ds, through, compiled: bool) -> None:
        """``leaving`` made the gradients of the states leaving each chunk (from the final state's, ``ds``), with
        ``leaving_t`` (``[N, P]``, so that each GEMM takes both operands as laid), ``end_dot`` and ``ds0``:
        compiled in one pass (``mamba2_backward_state_gradients``) where the thunk's other passes are."""
        leaving = self.leaving
        self.end_dot = np.empty(leaving.shape[:3], leaving.dtype)
        if compiled:
            self.leaving_t, self.ds0 = np.empty_like(swap(leaving), order="C"), np.array(ds, order="C")
            jit.kernel("mamba2_backward_state_gradients")(np.ascontiguousarray(through[..., 0, 0]), leaving,
                                                          self.leaving_t, self.ends, self.ds0, self.end_dot)
            return
        d = ds
        for k in reversed(range(len(leaving))):
            d, leaving[k] = through[k] * d + leaving[k], d
        self.ds0 = d
        self.leaving_t = np.ascontiguousarray(swap(leaving))
        flat = lambda v: v.reshape(*v.shape[:-2], v.shape[-2] * v.shape[-1])  # noqa: E731
        self.end_dot[...] = dot_last(flat(leaving), flat(np.moveaxis(self.ends, 1, 0)))

    def times_entering(self, ks: slice, left: np.ndarray, out: np.ndarray, transposed: bool = False) -> np.ndarray:
        """``out = left @ S`` (``S^T`` where ``transposed``) for the state ``S`` entering each chunk of ``ks``
        (``left``, ``out`` ``[K, B, H, ...]``): the initial state for the first chunk, then those leaving the one
        before."""
        turn = swap if transposed else lambda v: v  # noqa: E731
        first = int(ks.start == 0)
        if first:
            np.matmul(left[0], turn(self.s0), out=out[0])
        np.matmul(left[first:], turn(np.moveaxis(self.ends[:, ks.start + first - 1: ks.stop - 1], 1, 0)),
                  out=out[first:])
        return out


def times_dt(u, chain):
    """``u``, or where it is ``None`` ``dt x`` from ``chain``'s ``(x, dt, ...)``."""
    return u if u is not None else np.multiply(chain[0], chain[1][..., None])


def chunked_backward(logd, u, b, c, s0, gy, ds, length, need_y, saved=None, into=None, chain=None):
    """``mamba2_backward._steps`` in the chunked SSD form (the module's docstring): ``(y, du, dlogd, db, dc, ds0,
    nonfinite)``, ``y`` ``None`` unless ``need_y``, and ``nonfinite [B, H]`` where the compiled pass ran (else
    ``None``): finite exactly where the lane's ``du, dlogd, db, dc`` are. ``saved``: a saved forward's ``(states,
    y, scores)`` (``ssm.reserve_views``, chunks of ``length``), read instead of computing the states entering each
    chunk, the outputs ``y`` and the decayed scores ``W``. ``into``: C-contiguous ``[B, S, H, N]`` arrays by name
    (``"db"``, ``"dc"``) to write those results into where ``length`` divides ``S`` (then returned as they are).
    ``chain``: ``(x, dt, dx, xdu)`` of ``mamba2_backward.ssd_backward``, filled where the compiled pass runs (which
    with a saved forward then leaves ``du`` unwritten: the step path redoes a lane that is not finite); with it ``u``
    may be ``None``: ``dt x``, formed where read (by that compiled pass lane by lane, else by ``times_dt``)."""
    bsz, seq, heads, p = gy.shape
    n = b.shape[-1]
    padded = -(-seq // length) * length
    count = padded // length
    kernel = jit.kernel("mamba2_backward_gradients") if gy.dtype == np.float32 else None
    whole = kernel is not None and saved is not None  # every chunk in one compiled pass, which forms u itself
    u = u if whole and chain is not None else times_dt(u, chain)
    if kernel is not None:
        x, dt, dx, xdu = _NO_CHAIN if chain is None else chain  # the chain rule's arrays, or stand-ins
        links = (chain is not None, np.ascontiguousarray(x), np.ascontiguousarray(dt), dx, xdu)
        u, b, c, gy = (np.ascontiguousarray(v) for v in (links[1] if u is None else u, b, c, gy))
    widths = (("y", p),) * (need_y and saved is None) + (("du", p), ("db", n), ("dc", n))
    given = {} if into is None or padded != seq else into
    out = {name: given[name] if name in given else np.empty((bsz, padded, heads, w), u.dtype) for name, w in widths}
    out["dlogd"] = np.empty((bsz, padded, heads), u.dtype)
    nonfinite = None if kernel is None else np.zeros((bsz, heads), u.dtype)
    if whole:  # the state gradients too
        cum = np.ascontiguousarray(np.cumsum(chunk_view(logd, length), axis=-1))  # [C, B, H, L]
        d_state = np.array(ds, u.dtype, order="C")
        jit.kernel("mamba2_backward_saved")(jit.lanes(), seq, MAMBA2_SPREAD, cum, np.exp(cum[..., -1:] - cum),
                                            np.exp(cum[..., -1]), u, b, c, gy, np.ascontiguousarray(saved[1]),
                                            saved[2], np.ascontiguousarray(s0), np.ascontiguousarray(saved[0]),
                                            d_state, out["du"], out["dc"], out["db"], out["dlogd"], nonfinite, *links)
        return (saved[1].copy() if need_y else None, out["du"][:, :seq], out["dlogd"][:, :seq], out["db"][:, :seq],
                out["dc"][:, :seq], d_state, nonfinite)
    at = _Chunks(logd, u, b, c, s0, gy, ds, length, saved, kernel is not None)
    per_chunk = bsz * heads * (3 * length * length + 8 * length * (n + p)) * u.itemsize
    slab = max(1, SLAB_BYTES // max(per_chunk, 1))
    upper = np.triu(np.ones((length, length), bool), 1)
    for lo in range(0, count, slab):
        ks = slice(lo, min(count, lo + slab))
        if kernel is None:
            _slab(at, ks, out, need_y, upper, length)
        else:
            _slab_compiled(at, ks, out, need_y, upper, length, kernel, nonfinite, links)
    y = None if not need_y else out["y"][:, :seq] if saved is None else saved[1].copy()
    return (y, out["du"][:, :seq], out["dlogd"][:, :seq], out["db"][:, :seq], out["dc"][:, :seq], at.ds0,
            nonfinite)


def _products(at: _Chunks, ks: slice, out: dict, upper: np.ndarray, length: int):
    """The GEMMs of the slab ``ks``: ``W^T gy``, ``(gy u^T * M) b`` and ``(gy u^T * M)^T c`` into ``out``'s ``du``,
    ``dc`` and ``db``, and ``(W, the entering state's share of dc (exp(cum) gy) S_0, the leaving state's shares of du
    and db before their decay to the chunk's end, b dS^T and u dS)``."""
    views = {name: chunk_view(out[name], length)[ks] for name in ("du", "dc", "db")}
    kb, kc, ku, kg = at.b[ks], at.c[ks], at.u[ks], at.gy[ks]
    weights = _decayed(at, ks, "c", "b", upper, "w") if at.saved_w is None else at.saved_w[ks]
    d_scores = _decayed(at, ks, "gy", "u", upper, "dw")
    # in an order that reads each input again soon after its last read (u, gy, b, then c): cached still
    leaving_b = np.matmul(ku, at.leaving[ks], out=at.work("leaving_b", kb.shape))
    _upper_times(swap(weights), kg, views["du"])
    _lower_times(d_scores, kb, views["dc"])
    to_state = np.matmul(kb, at.leaving_t[ks], out=at.work("to_state", ku.shape))
    _upper_times(swap(d_scores), kc, views["db"])
    entering = at.times_entering(ks, at.grown[ks], at.work("entering", kb.shape))
    return weights, entering, to_state, leaving_b


def _intra(at: _Chunks, ks: slice, out: dict, need_y: bool, weights, entering, length: int) -> np.ndarray:
    """The terms of the slab's ``d cum_i`` before ``- u_i . du_i`` (row i of ``gy u^T * W`` less its column i, the
    entering state's share ``gy_i . (S_0 c_i exp(cum_i)) = c_i . entering_i``: so ``gy_i . y_i``), from the saved
    ``y`` or the recomputed one, which goes to ``out["y"]`` where ``z``'s gradient needs it."""
    kg = at.gy[ks]
    if at.ys is not None:
        return dot_last(kg, at.ys[ks])
    intra = _lower_times(weights, at.u[ks], at.work("intra", at.u[ks].shape))
    if need_y:
        np.copyto(chunk_view(out["y"], length)[ks], intra)
        _add_entering_share(at, ks, out, length)
    return dot_last(kg, intra) + dot_last(at.c[ks], entering)


def _add_entering_share(at: _Chunks, ks: slice, out: dict, length: int) -> None:
    """``out["y"]``'s steps of the chunks ``ks`` (their intra-chunk part) get the entering state's share,
    ``(c exp(cum)) S_0^T``."""
    grow = np.exp(at.cum[ks])[..., None]
    y = chunk_view(out["y"], length)[ks]
    y += at.times_entering(ks, np.multiply(at.c[ks], grow, out=at.work("c_grown", at.c[ks].shape)),
                           at.work("y_entering", y.shape), transposed=True)


def _slab(at: _Chunks, ks: slice, out: dict, need_y: bool, upper: np.ndarray, length: int) -> None:
    """Step 3 over the chunks ``ks``, into ``out``'s arrays, in NumPy."""
    weights, entering, to_state, leaving_b = _products(at, ks, out, upper, length)
    views = {name: chunk_view(v, length)[ks] for name, v in out.items()}
    decay_to_end = at.to_end[ks][..., None]
    views["du"] += np.multiply(to_state, decay_to_end, out=to_state)
    views["dc"] += entering
    views["db"] += np.multiply(leaving_b, decay_to_end, out=leaving_b)
    # d cum_i, plus <d S_end, S_end> at the chunk's end, summed from the chunk's end
    d_cum = _intra(at, ks, out, need_y, weights, entering, length) - dot_last(at.u[ks], views["du"])
    d_cum[..., -1] += at.end_dot[ks]
    views["dlogd"][...] = sum_from_end(d_cum, -1)


def _slab_compiled(at: _Chunks, ks: slice, out: dict, need_y: bool, upper: np.ndarray, length: int, kernel,
                   nonfinite, links) -> None:
    """``_slab``'s GEMMs, then the rest in one compiled pass (``mamba2_backward_gradients``, which forms the ``gy .
    y`` dots too: from the saved ``y``, else from ``W u``, laid ``[B, S, H, P]``, and ``c . entering``)."""
    weights, entering, to_state, leaving_b = _products(at, ks, out, upper, length)
    if at.ys is not None:
        ys, y_first = at.laid["y"], 0
    elif need_y:  # W u into y's steps (the entering state's share added after the pass)
        ys, y_first = out["y"], 0
        _lower_times(weights, at.u[ks], chunk_view(ys, length)[ks])
    else:  # into an array of the slab's steps
        bsz, _, heads, p = at.laid["u"].shape
        ys, y_first = at.work("intra", (bsz, (ks.stop - ks.start) * length, heads, p)), ks.start * length
        _lower_times(weights, at.u[ks], chunk_view(ys, length))
    kernel(ks.start, at.seq, to_state, entering, leaving_b, at.to_end, ys, y_first, at.laid["gy"], at.laid["c"],
           at.ys is None, at.end_dot, at.laid["u"], out["du"], out["dc"], out["db"], out["dlogd"], nonfinite, *links)
    if need_y and at.ys is None:
        _add_entering_share(at, ks, out, length)


def _blocks(length: int):
    """The ``(lo, hi)`` rows of each ``CAUSAL_BLOCK`` of a chunk of ``length`` steps."""
    return [(lo, min(length, lo + CAUSAL_BLOCK)) for lo in range(0, length, CAUSAL_BLOCK)]


def _lower_times(lower: np.ndarray, right: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out = lower @ right`` for ``lower [..., L, L]`` zero above its diagonal (its upper entries not read)."""
    for lo, hi in _blocks(lower.shape[-1]):
        np.matmul(lower[..., lo:hi, :hi], right[..., :hi, :], out=out[..., lo:hi, :])
    return out


def _upper_times(upper: np.ndarray, right: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out = upper @ right`` for ``upper [..., L, L]`` zero below its diagonal (its lower entries not read)."""
    for lo, hi in _blocks(upper.shape[-1]):
        np.matmul(upper[..., lo:hi, lo:], right[..., lo:, :], out=out[..., lo:hi, :])
    return out


def _decayed(at: _Chunks, ks: slice, left: str, right: str, upper: np.ndarray, key: str) -> np.ndarray:
    """``(left right^T) * M`` for the chunks ``ks`` (``[..., L, L]``, zero above the diagonal where read: the blocks
    above the diagonal's ``CAUSAL_BLOCK``-square blocks are neither computed nor read) of two of ``at``'s
    inputs: factored through the chunk's midpoint ``m`` as one GEMM of ``left exp(cum - m)`` by ``right exp(m -
    cum)`` (the right operand written transposed, so the GEMM takes both as laid; compiled with the thunk's other
    passes: ``mamba2_backward_operands``) where every ``|cum - m|`` is at most ``MAMBA2_SPREAD``, each ratio formed
    on its own (``decay_ratios``) elsewhere. The result and its operands live in ``at.work`` arrays (kept for one
    slab)."""
    cum, lv, rv = at.cum[ks], getattr(at, left)[ks], getattr(at, right)[ks]
    length = cum.shape[-1]
    lhs, rhs_t = at.work(f"{key}.lhs", lv.shape), at.work(f"{key}.rhs", swap(rv).shape)
    if at.operands is None:
        mid = cum[..., (length - 1) // 2 : (length + 1) // 2]
        spread = np.abs(cum - mid).max(axis=-1, initial=0.0) <= MAMBA2_SPREAD  # NaN: not factored
        with np.errstate(over="ignore", invalid="ignore"):
            np.multiply(lv, np.exp(cum - mid)[..., None], out=lhs)
            np.multiply(rv, np.exp(mid - cum)[..., None], out=swap(rhs_t))
    else:
        fits = at.work(f"{key}.fits", cum.shape[:-1])
        at.operands(ks.start, at.seq, at.laid[left], at.laid[right], at.cum, lhs, rhs_t, fits, MAMBA2_SPREAD)
        spread = fits > 0
    out = at.work(key, (*cum.shape, length))
    for lo, hi in _blocks(length):
        np.matmul(lhs[..., lo:hi, :], rhs_t[..., :hi], out=out[..., lo:hi, :hi])
        np.copyto(out[..., lo:hi, lo:hi], 0, where=upper[lo:hi, lo:hi])
    if not spread.all():
        pick = np.nonzero(~spread)
        out[pick] = (lv[pick] @ swap(rv[pick])) * decay_ratios(cum[pick])
    return out
