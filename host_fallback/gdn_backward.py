"""``gated_delta_net_backward`` of ABI.md §9: the gradients of the gated delta rule (§4, every field
of §8) with respect to ``q, k, v, g, beta`` and the initial state.

The chunked path is the backward of the WY / UT-transform form that ``gdn`` runs forward. Inside a
chunk of ``L`` steps entered with state ``S0`` (``gamma_r`` the decay from the chunk start through
step ``r``, per head or per key channel):

    (I + A) U = beta (V - (gamma K) S0),   A = beta * strictly-lower decayed K K^T,
    O = scale ((gamma Q) S0 + M U),        M = lower decayed Q K^T,
    S_L = gamma_L S0 + KD^T U,             KD_s = k_s gamma_L / gamma_s.

The forward is recomputed chunk-parallel (``gdn``'s decayed Gram products), and one sequential loop
over chunks forms ``R = V - (gamma K) S0`` and ``U`` and keeps the state entering each chunk: the
only per-chunk checkpoint, so the extra memory is ``O(S / L * state)`` (long sequences also run
fewer lanes at a time, ``BLOCK_STEPS``). A saved forward (ABI.md §9.1's ``reserve``, chunks of 32:
``abi.gdn.reserve_slots``) holds the Gram products, ``(I + A)^-1``, the states leaving each chunk and
``U``: the backward reads them instead (no Gram GEMM, no triangular inverse, no loop over the chunks), and,
the state entering every chunk there, runs a segment of ``SEGMENT_CHUNKS`` chunks at a time from the sequence's end.
The reverse loop over chunks carries the state's gradient back: ``dU = scale M^T dO + KD dS_L``, ``Y =
(I + A)^-T dU``, ``dV = beta Y`` and ``dS0 = gamma_L dS_L + scale (gamma Q)^T dO - (gamma K)^T dV`` (``Y``'s terms
without ``dS_L`` formed for every chunk before the loop; in it, ``dS0``'s products one GEMM by ``[scale dO; Y]``
once ``Y`` is whole: no product of ``dS_L``'s term of ``Y`` apart); every other gradient is a handful of GEMMs
over all chunks at once (``beta``'s through ``R`` as ``Y.V - (Y S0^T).(gamma K)``, so ``R`` is not kept; the
four products of ``[dO; Y]`` with ``S0`` and ``U`` one GEMM, ``gdn_backward_grads``), the gradients written
where the caller's lie. Decayed products with per-channel gates factor through the
chunk's midpoint as ``gdn`` does (``CHANNEL_SPREAD``), and chunks whose decays spread further take
an exact pairwise form. A log-decay's gradient is the reverse cumulative sum over the chunk of the
cumulative log-decays' gradients, which are ``x * dx`` summed over the terms in which ``x`` carries
that decay (minus for the terms that divide by it); per head, those of the ``[L, L]`` products are
their row sums minus their column sums.

The step path walks the recurrence back one step at a time (decode-sized sequences, up to
``STEP_MAX``). It also redoes every lane (batch row x value head) whose chunked gradients hold a NaN
or Inf, chunk by chunk from the checkpoints: the chunked GEMMs multiply later steps by exact zeros
(``0 * nan`` is NaN), the step order keeps a non-finite ``d_dst`` causal. Packed sequences run as
zero-padded batch rows (a padded step leaves the state and its gradient unchanged); state slots
gather the rows once and scatter the initial state's gradient once. 16-bit storage computes in f32,
a wider ``state_dtype`` widens the whole thunk; every sum has a fixed order.

The parts: ``gdn_backward_step`` (the step path), ``gdn_backward_chunked`` (the chunked path),
``gdn_backward_grads`` (its gradients from the GEMMs' products, NumPy's or ``jit_gdn_backward``'s compiled passes);
this module chooses a path and runs a thunk.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from . import threads
from .abi import complete
from .abi.gdn import RESERVE_CHUNK, gdn_scale
from .arena import COMPUTE
from .bound import Bound
from .chunked import pick_path
from .gdn import L2_EPS, reserve_views
from .gdn_backward_chunked import _chunked
from .gdn_backward_step import _step_path
from .implementations import KERNELS

Thunk = Mapping[str, Any]
Array = np.ndarray

#: Chunk length of the chunked path (a power of two, at least ``unit_lower_inverse``'s block).
CHUNK = 32
#: Longest sequence (a packed one: the longest sequence) that takes the step path. Measured (B2 H8 K=V=64 f32,
#: one thread, either gate kind): step 4.3 / chunked 8.4 ms at seq 1, 11 / 8 ms at seq 4, 61 / 9 ms at seq 32.
STEP_MAX = 2
#: Lanes (batch row x key head) times steps the chunked path takes at once: longer sequences run fewer lanes
#: at a time, so the per-chunk intermediates stay bounded (B2 H8 S4096 f32: four blocks of two lanes).
BLOCK_STEPS = 8192
#: Chunks the chunked path takes at once over a saved forward, from the sequence's end (``_segments``): each
#: segment's intermediates are still in the caches when the next pass over them reads them. B2 H8 S1024 f32, one
#: thread, paired: the backward 7-9% faster than over the whole sequence with either gate kind (6 and 16 chunks in
#: between).
SEGMENT_CHUNKS = 8


def _normed(x: Array) -> tuple[Array, Array]:
    """``(x / norm, norm)`` with ``norm = sqrt(sum x^2 + L2_EPS)`` over each head vector."""
    norm = np.sqrt(np.einsum("...i,...i->...", x, x)[..., None] + L2_EPS)
    return x / norm, norm


def _unnormed(x_hat: Array, norm: Array, d_hat: Array) -> Array:
    """The gradient of ``x`` from that of ``x_hat = x / norm``: ``(d_hat - x_hat (x_hat . d_hat)) / norm``."""
    return (d_hat - x_hat * np.einsum("...i,...i->...", x_hat, d_hat)[..., None]) / norm


def _blocks(bs: slice, hs: slice, lanes: int) -> list[tuple[slice, slice]]:
    """``bs x hs`` (batch rows x key heads) cut into blocks of at most ``lanes`` lanes (at least one lane),
    whole rows of heads where they fit."""
    rows, heads = bs.stop - bs.start, hs.stop - hs.start
    if rows * heads <= lanes:
        return [(bs, hs)]
    if heads <= lanes:
        per = lanes // heads
        return [(slice(r, min(r + per, bs.stop)), hs) for r in range(bs.start, bs.stop, per)]
    return [(slice(r, r + 1), slice(h, min(h + lanes, hs.stop))) for r in range(bs.start, bs.stop)
            for h in range(hs.start, hs.stop, lanes)]


def _segments(args: tuple, length: int, out: list[Array], saved: dict[str, Array] | None) -> Array:
    """``_chunked(*args, length, out, saved)`` (``args``: ``q, k, v, g, beta, s0, dsf, d_out, scale``), over a saved
    forward ``SEGMENT_CHUNKS`` chunks at a time from the last: each segment enters with the state the saved forward
    kept (the one leaving the chunk before it; ``s0`` for the first) and leaves with the gradient the segment after it
    returned (``dsf`` for the last). Returns the initial state's gradient."""
    q, k, v, g, beta, s0, ds, d_out, scale = args
    count = -(-q.shape[1] // length)
    if saved is None or count <= SEGMENT_CHUNKS:
        return _chunked(*args, length, out, saved)
    for first in range((count - 1) // SEGMENT_CHUNKS * SEGMENT_CHUNKS, -1, -SEGMENT_CHUNKS):
        steps, chunks = slice(first * length, (first + SEGMENT_CHUNKS) * length), slice(first, first + SEGMENT_CHUNKS)
        start = s0 if first == 0 else saved["states"][:, first - 1]
        ds = _chunked(*(x[:, steps] for x in (q, k, v, g, beta)), start, ds, d_out[:, steps], scale, length,
                      [x[:, steps] for x in out], {f: x[:, chunks] for f, x in saved.items()})
    return ds


def _choose(t: Thunk, longest: int, path: str | None, chunk: int | None) -> tuple[str, int]:
    length = chunk or CHUNK
    if length < 16 or length & (length - 1):
        raise ValueError(f"gated_delta_net_backward: chunk length must be a power of two >= 16, got {length}")
    return pick_path("gated_delta_net_backward", path, longest, STEP_MAX, "chunked"), length


def gated_delta_net_backward(thunk: Thunk, arena: np.ndarray, *, path: str | None = None, chunk: int | None = None,
                             workers: int | None = None) -> None:
    """Gradients of the gated delta rule: ``d_q d_k d_v d_g d_beta`` and, with ``carry_state``, ``d_state``
    (read as the final state's gradient, written back as the initial state's).

    ``path`` (``"step"`` or ``"chunked"``), ``chunk`` (a power-of-two chunk length, at least 16) and
    ``workers`` (threads over the batch x key-head lanes) override the choice.
    """
    t = complete(thunk)
    bound = Bound(t, arena)
    work = np.result_type(COMPUTE[t["dtype"]], COMPUTE[t["state_dtype"]])
    heads, hv, n, width = t["heads"], t["value_heads"], t["state_size"], t["value_size"]
    group, scale = hv // heads, gdn_scale(t)
    fields = ("q", "k", "v", "g", "beta", "d_dst")
    inputs = {f: bound.view(f) for f in fields}  # read where they lie when stored in the work type
    inputs.update({f: x.astype(work) for f, x in inputs.items() if x.dtype != work})
    if t["qk_l2norm"]:
        (inputs["q"], q_norm), (inputs["k"], k_norm) = _normed(inputs["q"]), _normed(inputs["k"])
    normed = {f: inputs[f] for f in ("q", "k")}  # as the thunk lays them out, for the normalisation's gradient
    varlen = t["cu_seqlens"] is not None
    rows = t["num_seqs"] if varlen else t["batch"]
    if varlen:  # each sequence a zero-padded batch row
        cu = bound.view("cu_seqlens").astype(np.int64)
        lengths = np.diff(cu)
        pad = np.arange(max(1, int(lengths.max(initial=0))))
        valid = pad[None, :] < lengths[:, None]  # [R, longest]
        tokens = (cu[:-1, None] + pad[None, :])[valid]
        for f in fields:
            padded = np.zeros((rows, valid.shape[1], *inputs[f].shape[2:]), work)
            padded[valid] = inputs[f][0, tokens]
            inputs[f] = padded
    slots = bound.view("state_slots").astype(np.intp) if t["state_slots"] is not None else slice(None)
    shape = (rows, hv, n, width)
    if t["carry_state"]:
        s0, dsf = bound.view("state")[slots].astype(work), bound.view("d_state")[slots].astype(work)
    else:
        s0, dsf = np.zeros(shape, work), np.zeros(shape, work)
    name, length = _choose(t, inputs["q"].shape[1], path, chunk)
    # the gradients go straight into the arena where nothing is left to do to them (ABI.md: no output overlaps an input)
    direct = not varlen and bound.view("d_q").dtype == work
    grads = {f: bound.view(f"d_{f}") if direct else np.empty_like(inputs[f]) for f in ("q", "k", "v", "g", "beta")}
    d_init = np.empty(shape, work)
    seq = inputs["q"].shape[1]
    # a saved forward (ABI.md §9.1) is read where its chunks are the backward's (packed sequences have none)
    views = reserve_views(t, arena) if name == "chunked" and length == RESERVE_CHUNK and not varlen else None

    def compute(bs: slice, hs: slice) -> list[tuple[slice, slice, Array]]:
        done = []
        for sub_bs, sub_hs in _blocks(bs, hs, 1 if name == "step" else max(1, BLOCK_STEPS // seq)):
            vs = slice(sub_hs.start * group, sub_hs.stop * group)
            q, k, v, g, beta, d_out = (inputs[f][sub_bs, :, sub_hs if f in ("q", "k") else vs] for f in fields)
            saved = None if views is None else {f: x[sub_bs, :, vs] for f, x in views.items()}
            args = (q, k, v, g, beta, s0[sub_bs, vs], dsf[sub_bs, vs], d_out, scale)
            # the gradients written where they go at once (no output overlaps an input); the initial state's kept
            out = [grads[f][sub_bs, :, sub_hs if f in ("q", "k") else vs] for f in ("q", "k", "v", "g", "beta")]
            done.append((sub_bs, vs, _step_path(*args, out) if name == "step" else _segments(args, length, out, saved)))
        return done

    def store(bs: slice, hs: slice, done: list[tuple[slice, slice, Array]]) -> None:
        for sub_bs, vs, ds0 in done:
            d_init[sub_bs, vs] = ds0

    lanes_work = rows * seq * hv * n * width
    threads.run_split(compute, store, rows, heads,
                      threads.parts_for("gated_delta_net_backward", lanes_work, rows, heads, workers))
    if varlen:
        grads = {f: x[valid][None] for f, x in grads.items()}
    if t["qk_l2norm"]:
        for f, norm in (("q", q_norm), ("k", k_norm)):
            grads[f][...] = _unnormed(normed[f], norm, grads[f])
    for f, x in grads.items() if not direct else ():
        bound.store(f"d_{f}", x)
    if t["carry_state"]:
        if isinstance(slots, slice):
            bound.store("d_state", d_init)
        else:
            pool = bound.view("d_state")
            pool[slots] = d_init.astype(pool.dtype)


KERNELS.add("gated_delta_net_backward", gated_delta_net_backward)
