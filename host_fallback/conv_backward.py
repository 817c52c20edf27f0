"""The host kernel of ``causal_conv1d_backward`` (ABI.md §9, §10) on NumPy arrays.

With ``g[t] = d_dst[t] * act'(pre[t])`` (the pre-activation recomputed; silu's derivative
``s (1 + u (1 - s))``, ``s = sigmoid(u)``), every product ``weight[d,w] * e[t+w]`` of the forward gives
``d_weight[d,w] += g[t] e[t+w]`` and ``d_e[t+w] += g[t] weight[d,w]``; ``d_bias = sum g``; the final state,
e's last ``W-1`` values, adds ``d_state`` (its gradient) there. ``d_x`` is ``d_e`` past the first ``W-1``
values, the initial state's gradient the first ``W-1`` (written over ``d_state`` in place).

The work is the forward's full-width slabs of tokens (``conv.block_tokens``), sequence after sequence, in
chunks of :data:`CHUNK_SLABS` consecutive slabs: a grid set by the shapes alone, whose chunks the threads take
in disjoint runs. A chunk walks each of its sequences' pieces last slab first: a slab's
``d_x[t] = sum_k weight[W-1-k] g[t+k]`` needs ``g`` of the ``W-1`` tokens after it, which the slab walked
before left in the same buffer, or, past the piece, the chunk recomputes. ``d_weight`` and ``d_bias`` sum per
slab (over its tokens, in order), slab by slab within a chunk (as it walks them) into the chunk's own partial,
then chunk by chunk in order: a fixed order, the same bytes on every run and every thread count. The ends of
the sequences (``d_state`` read before any chunk runs, added and written after all have) are the caller's.
"""
from __future__ import annotations

import numpy as np

from typing import Any, Mapping

from .bound import Bound
from .conv import (Slabs, block_tokens, check, convolve, entry_of, initial_window, iter_slabs, optional_inputs,
                   over_slabs, pool_of, rows)
from .implementations import KERNELS

#: Slabs per chunk: the unit a thread takes and a ``d_weight`` partial sums (8 slabs of a few hundred KiB).
CHUNK_SLABS = 8


def causal_conv1d_backward(x: np.ndarray, weight: np.ndarray, d_dst: np.ndarray, bias: np.ndarray | None = None,
                           activation: str = "none", state: np.ndarray | None = None,
                           d_state: np.ndarray | None = None, cu_seqlens: np.ndarray | None = None,
                           state_slots: np.ndarray | None = None, *,
                           workers: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``(d_x, d_weight, d_bias)`` of ``causal_conv1d`` (``d_bias`` None without ``bias``), ABI.md §10.

    The forward's arguments as ``conv.causal_conv1d`` takes them (``state``: the *initial* pool, read only),
    ``d_dst`` the output's gradient, all in the compute type. With ``state``, ``d_state`` (a pool shaped and
    indexed like it, any float type) is read as the final states' gradient and each named entry is
    overwritten by its initial state's.
    """
    check(x, weight, activation, state)
    if (state is None) != (d_state is None):
        raise ValueError("causal_conv1d_backward: d_state comes with state (a carried state), and only then")
    ct, dim, back = x.dtype, x.shape[2], weight.shape[1] - 1
    taps = np.ascontiguousarray(weight.T, ct)  # [W, D]
    bias = None if bias is None else np.asarray(bias, ct)
    d_x = np.empty(x.shape, ct)
    slots = None if state_slots is None else np.asarray(state_slots, np.intp)
    tokens = block_tokens(dim, ct.itemsize)
    sequences = rows(x.shape[0], x.shape[1], cu_seqlens)
    zeros = np.zeros((back, dim), ct)
    heads = [zeros if state is None or hi == lo else initial_window(state, entry_of(r, slots), slice(0, dim), back + 1,
                                                                     ct) for _, r, lo, hi in sequences]
    work = [(i, lo, n) for i, (_, _, first, end) in enumerate(sequences) for lo, n in iter_slabs(end - first, tokens)]
    chunks = [work[c:c + CHUNK_SLABS] for c in range(0, len(work), CHUNK_SLABS)]
    d_taps = np.zeros((len(chunks), *taps.shape), ct)
    d_bias = np.zeros((len(chunks), dim), ct)
    d_heads: dict[int, np.ndarray] = {}  # by sequence: the initial values' gradient from its tokens

    def job(run: list[int]) -> None:
        walk = _Walk(taps, bias, activation, tokens, dim, ct)
        for c in run:
            for i, lo, hi in _pieces(chunks[c]):
                b, _, first, end = sequences[i]
                slabs = Slabs(x[b, first:end], heads[i])
                head = walk.piece(slabs, d_dst[b, first:end], lo, hi, d_x[b, first:end], d_taps[c], d_bias[c])
                if head is not None:
                    d_heads[i] = head

    over_slabs(list(range(len(chunks))), 2 * x.size * len(taps), workers, job)
    for i, (b, r, lo, hi) in enumerate(sequences):
        if d_state is not None and hi > lo:  # an empty sequence: its d_state passes as it is
            entry = entry_of(r, slots)
            d_state[entry] = _ends(d_heads[i], hi - lo, d_state[entry].T.astype(ct), d_x[b, lo:hi]).T
    for c in range(1, len(chunks)):  # chunk by chunk, in order
        d_taps[0] += d_taps[c]
        d_bias[0] += d_bias[c]
    if not chunks:
        return d_x, np.zeros(weight.shape, ct), None if bias is None else np.zeros(dim, ct)
    return d_x, np.ascontiguousarray(d_taps[0].T), None if bias is None else d_bias[0].copy()


def _pieces(chunk: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """A chunk's slabs ``(sequence, lo, n)`` as ``(sequence, lo, hi)``: the token range of each sequence in it."""
    pieces: list[tuple[int, int, int]] = []
    for i, lo, n in chunk:
        if pieces and pieces[-1][0] == i:
            pieces[-1] = (i, pieces[-1][1], lo + n)
        else:
            pieces.append((i, lo, lo + n))
    return pieces


def _ends(d_head: np.ndarray, length: int, d_final: np.ndarray, dxs: np.ndarray) -> np.ndarray:
    """What a sequence's ends add: ``d_final`` to the last ``W-1`` extended positions (tokens, or the carried
    values where the sequence is shorter), to ``dxs`` and to ``d_head`` (its initial values' gradient from its
    tokens), which is returned."""
    back = len(d_head)
    shown = min(back, length)  # the final positions that are tokens
    dxs[length - shown:] += d_final[back - shown:]
    if length < back:
        d_head[length:] += d_final[:back - length]
    return d_head


class _Walk:
    """One thread's buffers and the slab walk over the pieces of sequences its chunks hold."""

    def __init__(self, taps: np.ndarray, bias: np.ndarray | None, activation: str, tokens: int, dim: int,
                 ct: np.dtype):
        self.taps, self.bias, self.silu, self.tokens = taps, bias, activation == "silu", tokens
        back = len(taps) - 1
        # g of a slab, then of the W-1 tokens after it (zero past the sequence), in one of two buffers
        self.grads = [np.empty((tokens + back, dim), ct) for _ in range(2)]
        self.pre, self.term, self.sig = (np.empty((tokens, dim), ct) for _ in range(3))
        self.part = np.empty(dim, ct)

    def piece(self, slabs: Slabs, dys: np.ndarray, lo: int, hi: int, dxs: np.ndarray, d_taps: np.ndarray,
              d_bias: np.ndarray) -> np.ndarray | None:
        """``dxs[lo:hi]`` of a piece of one non-empty sequence (``slabs`` its extended inputs, ``dys`` and ``dxs``
        the whole sequence's); its terms of ``d_taps`` and ``d_bias`` added; the gradient of the sequence's
        initial values from its tokens returned where the piece starts it (else None)."""
        back, length = len(self.taps) - 1, len(dys)
        grads = self.grads[0]
        grads[:back] = 0  # no token after the sequence's last
        after = min(back, length - hi)  # the tokens after the piece whose g its last slab needs: recomputed
        if after:
            self._gradient(slabs.source(hi, after), dys[hi:hi + after], grads[:after])
        for off, n in iter_slabs(hi - lo, self.tokens, reverse=True):
            ahead, grads = grads, self.grads[1] if grads is self.grads[0] else self.grads[0]
            grads[n:n + back] = ahead[:back]
            src = slabs.source(lo + off, n)
            self._gradient(src, dys[lo + off:lo + off + n], grads[:n])
            self._inputs_gradient(grads, dxs[lo + off:lo + off + n])
            self._parameters_gradient(src, grads[:n], d_taps, d_bias)
        return self._head(grads, length) if lo == 0 else None

    def _gradient(self, src, dy, out) -> None:
        """``out = dy * act'(pre)`` of a slab's tokens, the pre-activation recomputed from ``src``."""
        if not self.silu:
            out[...] = dy
            return
        n = len(out)
        pre, sig = self.pre[:n], self.sig[:n]
        convolve(src, self.taps, self.bias, pre, self.term)
        with np.errstate(over="ignore", invalid="ignore"):  # the formula's own NaN (inf * 0) is the result
            np.exp(np.negative(pre, out=sig), out=sig)
            sig += 1
            np.reciprocal(sig, out=sig)  # s
            np.subtract(1, sig, out=out)
            out *= pre
            out += 1
            out *= sig
            out *= dy  # dy * s * (1 + u (1 - s))

    def _inputs_gradient(self, grads, dx) -> None:
        """``dx[t] = sum_k taps[W-1-k] * g[t+k]`` over a slab (``grads``: its g, then the next W-1)."""
        n, width = len(dx), len(self.taps)
        term = self.term[:n]
        np.multiply(grads[:n], self.taps[width - 1], out=dx)
        for k in range(1, width):
            dx += np.multiply(grads[k:k + n], self.taps[width - 1 - k], out=term)

    def _parameters_gradient(self, src, g, d_taps, d_bias) -> None:
        """A slab's terms: ``d_taps[w] += sum_t g[t] e[t+w]``, ``d_bias += sum_t g[t]`` (each summed over the
        slab first)."""
        n = len(g)
        for w in range(len(self.taps)):
            d_taps[w] += np.einsum("td,td->d", g, src[w:w + n], out=self.part)
        d_bias += np.sum(g, axis=0, out=self.part)

    def _head(self, grads: np.ndarray, length: int) -> np.ndarray:
        """The initial values' gradient ``d_e[k] = sum_{w <= k} taps[w] g[k-w]`` from the first slab's g
        (``grads``)."""
        back = len(self.taps) - 1
        d_head = np.zeros((back, grads.shape[1]), grads.dtype)
        for k in range(back):
            for w in range(max(0, k - length + 1), k + 1):  # the tokens k - w of the sequence
                d_head[k] += self.taps[w] * grads[k - w]
        return d_head


def kernel(t: Mapping[str, Any], arena: np.ndarray, *, workers: int | None = None) -> None:
    """``causal_conv1d_backward`` on a host arena: 16-bit storage computes in f32, ``d_state`` is overwritten in
    place (the initial states' gradients over the final states')."""
    bound = Bound(t, arena)
    state, d_state, copied = None, None, False
    if t["carry_state"]:
        state = bound.load("state")
        d_state, copied = pool_of(bound, "d_state")
    d_x, d_weight, d_bias = causal_conv1d_backward(bound.load("x"), bound.load("weight"), bound.load("d_dst"),
                                                   state=state, d_state=d_state, workers=workers,
                                                   **optional_inputs(t, bound))
    for field, values in (("d_x", d_x), ("d_weight", d_weight), ("d_bias", d_bias)):
        if values is not None:
            bound.store(field, values)
    if copied:
        bound.store("d_state", d_state)


KERNELS.add("causal_conv1d_backward", kernel)
