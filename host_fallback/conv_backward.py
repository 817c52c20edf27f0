"""The host kernel of ``causal_conv1d_backward`` (ABI.md §9, §10) on NumPy arrays.

With ``g[t] = d_dst[t] * act'(pre[t])`` (the pre-activation recomputed; silu's derivative
``s (1 + u (1 - s))``, ``s = sigmoid(u)``), every product ``weight[d,w] * e[t+w]`` of the forward gives
``d_weight[d,w] += g[t] e[t+w]`` and ``d_e[t+w] += g[t] weight[d,w]``; ``d_bias = sum g``; the final state,
e's last ``W-1`` values, adds ``d_state`` (its gradient) there. ``d_x`` is ``d_e`` past the first ``W-1``
values, the initial state's gradient the first ``W-1`` (written over ``d_state`` in place).

A sequence is walked a slab of tokens at a time (``conv.block_tokens``), last slab first: a slab's
``d_x[t] = sum_k weight[W-1-k] g[t+k]`` needs ``g`` of the ``W-1`` tokens after it, which the slab walked
before left in the same buffer. ``d_weight`` and ``d_bias`` sum per slab (over its tokens, in order), then
slab by slab (last first) and sequence by sequence (in order): a fixed order, the same on every run and
every thread count (the threads take disjoint channels).
"""
from __future__ import annotations

import numpy as np

from typing import Any, Mapping

from .bound import Bound
from .conv import (Slabs, block_tokens, check, convolve, entry_of, initial_window, iter_slabs, optional_inputs,
                   over_channels, pool_of, rows)
from .implementations import KERNELS


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
    ct = x.dtype
    taps = np.ascontiguousarray(weight.T, ct)  # [W, D]
    bias = None if bias is None else np.asarray(bias, ct)
    d_x = np.empty(x.shape, ct)
    d_taps = np.zeros(taps.shape, ct)
    d_bias = np.zeros(x.shape[2], ct)
    slots = None if state_slots is None else np.asarray(state_slots, np.intp)
    tokens = block_tokens(x.shape[2], ct.itemsize)

    def job(cs: slice) -> None:
        walk = _Walk(taps[:, cs], None if bias is None else bias[cs], activation, tokens, cs.stop - cs.start, ct)
        for b, r, lo, hi in rows(x.shape[0], x.shape[1], cu_seqlens):
            if hi == lo:
                continue  # an empty sequence: its final state is its initial one, d_state passes as it is
            entry = entry_of(r, slots)
            head = initial_window(state, entry, cs, len(taps), ct)
            d_final = None if d_state is None else d_state[entry, cs].T.astype(ct)
            d_head = walk.sequence(x[b, lo:hi, cs], d_dst[b, lo:hi, cs], head, d_final, d_x[b, lo:hi, cs],
                                   d_taps[:, cs], d_bias[cs])
            if d_state is not None:
                d_state[entry, cs] = d_head.T

    over_channels(x.shape[2], 2 * x.size * len(taps), workers, job)
    return d_x, np.ascontiguousarray(d_taps.T), None if bias is None else d_bias


class _Walk:
    """One thread's buffers and the slab walk over its channels of one sequence after another."""

    def __init__(self, taps: np.ndarray, bias: np.ndarray | None, activation: str, tokens: int, dim: int,
                 ct: np.dtype):
        self.taps, self.bias, self.silu, self.tokens = taps, bias, activation == "silu", tokens
        back = len(taps) - 1
        # g of a slab, then of the W-1 tokens after it (zero past the sequence), in one of two buffers
        self.grads = [np.empty((tokens + back, dim), ct) for _ in range(2)]
        self.pre, self.term, self.sig = (np.empty((tokens, dim), ct) for _ in range(3))
        self.part = np.empty(dim, ct)

    def sequence(self, xs, dys, head, d_final, dxs, d_taps, d_bias) -> np.ndarray:
        """``dxs`` of one non-empty sequence; its terms of ``d_taps`` and ``d_bias`` added; its initial
        state's gradient returned (``[W-1, channels]``)."""
        back = len(self.taps) - 1
        slabs = Slabs(xs, head)
        grads = self.grads[0]
        grads[:back] = 0  # no token after the last slab
        for lo, n in iter_slabs(len(xs), self.tokens, reverse=True):
            ahead, grads = grads, self.grads[1] if grads is self.grads[0] else self.grads[0]
            grads[n:n + back] = ahead[:back]
            src = slabs.source(lo, n)
            self._gradient(src, dys[lo:lo + n], grads[:n])
            self._inputs_gradient(grads, dxs[lo:lo + n])
            self._parameters_gradient(src, grads[:n], d_taps, d_bias)
        return self._ends(grads, len(xs), d_final, dxs)

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

    def _ends(self, grads, length, d_final, dxs) -> np.ndarray:
        """What the sequence's ends add: ``d_final`` to the last ``W-1`` extended positions (tokens, or the
        carried values where the sequence is shorter), and the initial values' gradient
        ``d_e[k] = sum_{w <= k} taps[w] g[k-w]`` from the first slab's g (``grads``), returned."""
        back = len(self.taps) - 1
        d_head = np.zeros((back, grads.shape[1]), grads.dtype)
        for k in range(back):
            for w in range(max(0, k - length + 1), k + 1):  # the tokens k - w of the sequence
                d_head[k] += self.taps[w] * grads[k - w]
        if d_final is not None:
            shown = min(back, length)  # the final positions that are tokens
            dxs[length - shown:] += d_final[back - shown:]
            if length < back:
                d_head[length:] += d_final[:back - length]
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
