"""The host kernel of ``mamba3`` (ABI.md §11) on NumPy arrays: Mamba-3 SISO — the trapezoidal, rotary-state
SSM — with §8's packed sequences, carried state and state slots.

Per row (a batch row, or a packed sequence) the state ``(θ, S, k̄, v̄)`` walks the tokens. What does not
depend on the state is computed for every token at once: ``λ = σ(trap)``, the step's weights, the running
angle (a cumulative sum that starts from the carried θ, so it adds in the step recurrence's order), and the
rotated, biased ``q̃``, ``k̃``. Two paths then run the recurrence, every row and head at once:

- ``step`` (decode and short sequences): §11's steps 4-6 token by token;
- ``chunked`` (prefill): §11's informative note — with ``c`` the cumulative log-decay, ``y_j = e^{c_j}·S⁰q̃_j +
  Σ_{s<j} e^{c_j−c_s}(γ_s + β'_{s+1})(q̃_j·k̃_s)v_s + γ_j(q̃_j·k̃_j)v_j``, where ``S⁰`` is the state entering
  the sequence plus the trapezoid's boundary term ``β'_0·v̄⊗k̄`` (``β' = (1−λ)·dt``: the decay at the next
  token supplies its ``α``) — is mamba2's SSD with the inputs ``(γ_s + β'_{s+1})·v_s``, keys ``k̃``, queries
  ``q̃`` and decays ``adt``, less ``β'_{t+1}·(q̃_t·k̃_t)·v_t`` on its diagonal: mamba2's chunked form
  (``ssm_ssd.ssd_chunked``, chunks of ``L`` tokens) runs it. A block whose outputs or state come out not all
  finite (a NaN or an Inf among its inputs, which the chunk sums would carry to earlier tokens) runs again by
  the step form.

Arrays are in the compute type (16-bit storage computes in f32, widened to the state's and inputs' wider
types); the four state pools are f32 or f64 and updated in place. Every result is a fixed sequence of NumPy
operations: the same bytes on every run. ``mamba3_backward`` holds the gradients.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from . import compiled_step, jit, threads
from .abi import Region, complete, regions
from .bound import Bound
from .chunked import floor_log_decays, pick_path
from .implementations import GIVEN, KERNELS, PATHS, PREPARE
from .ssm_ssd import ssd_chunked

#: The four carried states, in the anchor's order (angle, ssm, k, v).
STATES = ("angle_state", "state", "k_state", "v_state")
#: Tokens per chunk of the chunked form.
CHUNK = 64
#: Longest sequence that takes the step path.
STEP_MAX = 8

Thunk = Mapping[str, Any]


def sigmoid(u: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return 1 / (1 + np.exp(-u))


def turn_(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """``x [..., N]`` with each adjacent pair ``i < A`` turned by the angle of ``cos, sin [..., A]``, in place."""
    a = cos.shape[-1]
    even, odd = x[..., 0:2 * a:2].copy(), x[..., 1:2 * a:2]
    x[..., 0:2 * a:2] = even * cos - odd * sin
    x[..., 1:2 * a:2] = even * sin + odd * cos
    return x


def rotate(x: np.ndarray, theta: np.ndarray, sign: int = 1) -> np.ndarray:
    """§11 step 3's ``rot``: ``x [..., N]`` with each adjacent pair ``i < A`` turned by ``sign·theta [..., A]``."""
    return turn_(x.copy(), np.cos(theta), sign * np.sin(theta))


def wrap_angle(theta: np.ndarray) -> np.ndarray:
    """§11's written angle: ``θ − 2π·floor(θ/2π)``."""
    return theta - 2 * np.pi * np.floor(theta / (2 * np.pi))


@dataclass
class Tokens:
    """Everything about a block of rows ``[R, T, ...]`` that does not depend on the state, in the compute type:
    ``lam, alpha, beta, gamma, bprime [R,T,H]``, the angle after each token ``theta [R,T,H,A]``, the rotated,
    biased ``q_rot, k_rot [R,T,H,N]``, and ``v [R,T,H,P]``."""

    adt: np.ndarray
    dt: np.ndarray
    lam: np.ndarray
    alpha: np.ndarray
    beta: np.ndarray
    gamma: np.ndarray
    bprime: np.ndarray
    theta: np.ndarray
    q_rot: np.ndarray
    k_rot: np.ndarray
    v: np.ndarray


def tokens(q, k, v, adt, dt, trap, angles, q_bias, k_bias, theta0: np.ndarray, ct: np.dtype) -> Tokens:
    """§11 steps 1-3 for every token of a block of rows; ``theta0 [R,H,A]``: the angle each row starts from."""
    heads, groups = v.shape[2], q.shape[2]
    adt, dt, trap = (np.asarray(a, ct) for a in (adt, dt, trap))
    lam = sigmoid(trap)
    alpha = np.exp(adt)
    bprime = (1 - lam) * dt
    increments = np.pi * np.tanh(np.asarray(angles, ct)) * dt[..., None]
    theta = np.cumsum(np.concatenate([np.asarray(theta0, ct)[:, None], increments], axis=1), axis=1)[:, 1:]
    cos, sin = np.cos(theta), np.sin(theta)
    rotated = []
    for x, bias in ((q, q_bias), (k, k_bias)):  # [R,T,G,1,N] broadcast over the G groups' heads: one new array
        grouped = np.asarray(x, ct)[:, :, :, None]
        shape = grouped.shape[:3] + (heads // groups, grouped.shape[-1])
        biased = (grouped + np.asarray(bias, ct).reshape(shape[2:]) if bias is not None
                  else np.broadcast_to(grouped, shape).copy())
        rotated.append(turn_(biased.reshape(shape[:2] + (heads, shape[-1])), cos, sin))
    return Tokens(adt, dt, lam, alpha, bprime * alpha, lam * dt, bprime, theta, *rotated, np.asarray(v, ct))


def run_step(x: Tokens, lo: int, hi: int, state: list[np.ndarray], y: np.ndarray,
             history: np.ndarray | None = None) -> None:
    """§11 steps 4-6 for tokens ``lo .. hi-1`` of every row: ``y [R,T,H,P]`` gets their outputs before ``d`` and
    ``z``; ``state = [S, k̄, v̄]`` (``[R,H,P,N]``, ``[R,H,N]``, ``[R,H,P]``) is advanced in place, and with
    ``history`` (``[hi-lo, R,H,P,N]``) S after each token is kept there too. Compiled (``jit``: one pass over S a
    token) for f32 where Numba is installed; else NumPy, the two rank-1 terms of step 4 as one product of rank 2
    (``[β·v̄, γ·v] @ [k̄; k̃]``: one temporary the size of S)."""
    big_s, k_bar, v_bar = state
    compiled = jit.kernel("mamba3_state_step") if big_s.dtype == np.float32 and all(
        s.flags.c_contiguous for s in state) else None
    if compiled is not None:
        out, source = np.empty(v_bar.shape, big_s.dtype), big_s
        for t in range(lo, hi):
            token = (np.ascontiguousarray(a[:, t]) for a in (x.alpha, x.beta, x.gamma, x.v, x.k_rot, x.q_rot))
            target = big_s if history is None else history[t - lo]
            compiled(source, target, k_bar, v_bar, *token, out)
            y[:, t], source = out, target
        if history is not None and hi > lo:
            big_s[...] = source
        return
    values = np.empty(v_bar.shape + (2,), big_s.dtype)
    keys = np.empty(k_bar.shape[:-1] + (2, k_bar.shape[-1]), big_s.dtype)
    for t in range(lo, hi):
        k_rot, v = x.k_rot[:, t], x.v[:, t]
        np.multiply(x.beta[:, t, :, None], v_bar, out=values[..., 0])
        np.multiply(x.gamma[:, t, :, None], v, out=values[..., 1])
        keys[..., 0, :], keys[..., 1, :] = k_bar, k_rot
        big_s *= x.alpha[:, t, :, None, None]
        big_s += np.matmul(values, keys)
        y[:, t] = np.matmul(big_s, x.q_rot[:, t, ..., None])[..., 0]
        k_bar[...], v_bar[...] = k_rot, v
        if history is not None:
            history[t - lo] = big_s


def run_chunks(x: Tokens, state: list[np.ndarray], chunk: int) -> np.ndarray:
    """``run_step``'s result for every token of a block of rows (one sequence each) by the chunk form of the
    module's docstring, run as mamba2's SSD form (``ssm_ssd.ssd_chunked``): decays ``adt``, token ``s``'s input
    ``(γ_s + β'_{s+1})·v_s`` against key ``k̃_s``, read by ``q̃``, from the entering state plus the boundary
    term ``β'_0·v̄⊗k̄``; the SSD's diagonal carries ``γ_t + β'_{t+1}`` where §11 has ``γ_t``, so
    ``β'_{t+1}·(q̃_t·k̃_t)·v_t`` is taken off after. ``state`` is advanced in place."""
    big_s, k_bar, v_bar = state
    big_s += x.bprime[:, 0, :, None, None] * (v_bar[..., :, None] * k_bar[..., None, :])
    weight = x.gamma.copy()
    weight[:, :-1] += x.bprime[:, 1:]
    inputs = x.v * weight[..., None]
    y = ssd_chunked(floor_log_decays(x.adt), inputs, x.k_rot, x.q_rot, big_s, None, chunk)
    same = np.einsum("rthn,rthn->rth", x.q_rot[:, :-1], x.k_rot[:, :-1])
    y[:, :-1] -= (x.bprime[:, 1:] * same)[..., None] * x.v[:, :-1]
    k_bar[...], v_bar[...] = x.k_rot[:, -1], x.v[:, -1]
    return y


def recurrence(x: Tokens, state: list[np.ndarray], path: str, chunk: int) -> np.ndarray:
    """``y [R,T,H,P]`` (before ``d`` and ``z``) of a block of rows from ``state = [S, k̄, v̄]``, advanced in place.
    Where the chunk form's outputs or state are not all finite (a NaN or an Inf among the inputs, which its
    sums would carry to tokens before it) the step form runs the block again from the state it started from."""
    if path == "chunked":
        start = [s.copy() for s in state]
        y = run_chunks(x, state, chunk)
        if np.isfinite(np.sum(y)) and np.isfinite(np.sum(state[0])):
            return y
        for kept, s in zip(start, state):
            s[...] = kept
    y = np.empty(x.v.shape, x.v.dtype)
    run_step(x, 0, x.v.shape[1], state, y)
    return y


def gate(y: np.ndarray, v: np.ndarray, d: np.ndarray | None, z: np.ndarray | None) -> np.ndarray:
    """§11 step 5's skip and gate: ``y + d[h]·v``, then ``⊙ silu(z)``."""
    if d is not None:
        y = y + d[:, None] * v
    if z is not None:
        y = y * (z * sigmoid(z))
    return y


def row_blocks(batch: int, seq: int, cu_seqlens) -> list[tuple[Any, Any, Any]]:
    """``(batch index, token index, state rows)`` of each block of rows run together: every batch row at once,
    or with packed sequences every non-empty one alone, or all at once when they are equally long (decode)."""
    if cu_seqlens is None:
        return [(slice(None), slice(None), np.arange(batch))]
    cu = np.asarray(cu_seqlens, np.intp)
    lengths = np.diff(cu)
    if len(lengths) and lengths.min() == lengths.max() > 0:
        index = cu[:-1, None] + np.arange(lengths[0])
        return [(0, index, np.arange(len(lengths)))]
    return [(slice(0, 1), slice(lo, hi), np.array([r])) for r, (lo, hi) in enumerate(zip(cu, cu[1:])) if hi > lo]


def head_parts(heads: int, groups: int, parts: int) -> list[tuple[slice, slice]]:
    """``(heads, q/k groups)`` of each of ``parts`` ranges of whole groups (of single heads where one group
    serves them all), for the threads (``threads.run_all``)."""
    units, width = (groups, heads // groups) if groups > 1 else (heads, 1)
    edges = [units * i // parts for i in range(parts + 1)]
    return [(slice(lo * width, hi * width), slice(lo, hi) if groups > 1 else slice(None))
            for lo, hi in zip(edges, edges[1:]) if hi > lo]


def mamba3(q, k, v, adt, dt, trap, angles, *, q_bias=None, k_bias=None, d=None, z=None, states=None,
           cu_seqlens=None, state_slots=None, path: str | None = None, chunk: int | None = None,
           workers: int | None = None) -> np.ndarray:
    """``y [B,S,H,P]`` of ABI.md §11 in the compute type of the inputs (and ``states``); ``states``: the four pools
    ``[angle_state, state, k_state, v_state]`` (each ``[entries, ...]``, f32 or f64), row ``r`` reading and
    writing entry ``state_slots[r]`` (else ``r``), updated in place; absent, every row starts from zeros. The
    chunked path splits the heads over ``workers`` threads (default: every core once the work is large)."""
    ct = np.result_type(q.dtype, adt.dtype, *(() if states is None else (s.dtype for s in states)))
    batch, seq, heads, p = v.shape
    name = pick_path("mamba3", path, seq if cu_seqlens is None else int(np.diff(cu_seqlens).max(initial=0)),
                     STEP_MAX, "chunked")
    groups = q.shape[2]
    units = groups if groups > 1 else heads
    parts = threads.parts_for("mamba3", v.size * q.shape[-1] if name == "chunked" else 0, 1, units, workers)
    y = np.zeros(v.shape, ct)
    zeros = [np.zeros((heads, angles.shape[-1]), ct), np.zeros((heads, p, q.shape[-1]), ct),
             np.zeros((heads, q.shape[-1]), ct), np.zeros((heads, p), ct)]
    optional = [None if a is None else np.asarray(a, ct) for a in (q_bias, k_bias, d)]
    for b, t, rows in row_blocks(batch, seq, cu_seqlens):
        entries = rows if state_slots is None else np.asarray(state_slots, np.intp)[rows]
        start = ([np.broadcast_to(z0, (len(rows),) + z0.shape).copy() for z0 in zeros] if states is None
                 else [rows_of(pool, entries, ct) for pool in states])
        angle = np.empty_like(start[0])

        def job(hs: slice, gs: slice, b=b, t=t, start=start, angle=angle) -> None:
            qk = [a[b, t][:, :, gs] for a in (q, k)]
            per_head = [a[b, t][:, :, hs] for a in (v, adt, dt, trap, angles)]
            qb, kb, dh = (None if a is None else a[hs] for a in optional)
            x = tokens(*qk, *per_head, qb, kb, start[0][:, hs], ct)
            block = recurrence(x, [s[:, hs] for s in start[1:]], name, chunk or CHUNK)
            zb = None if z is None else np.asarray(z[b, t][:, :, hs], ct)
            y[b, t, hs] = gate(block, x.v, dh, zb)
            angle[:, hs] = wrap_angle(x.theta[:, -1])

        threads.run_all([lambda hs=hs, gs=gs: job(hs, gs) for hs, gs in head_parts(heads, groups, parts)])
        if states is not None:
            for pool, final in zip(states, [angle] + start[1:]):
                if not np.may_share_memory(pool, final):
                    pool[entries] = final
    return y


def rows_of(pool: np.ndarray, entries: np.ndarray, ct: np.dtype) -> np.ndarray:
    """The pool entries a block of rows starts from, to advance in place: a view of the pool where they are
    consecutive and stored in the compute type, else a copy (written back by the caller)."""
    if pool.dtype == ct and len(entries) and np.array_equal(entries, np.arange(entries[0], entries[0] + len(entries))):
        return pool[entries[0]:entries[0] + len(entries)]
    return pool[entries].astype(ct)


def path_for(thunk: Thunk, *, path: str | None = None, chunk: int | None = None, workers: int | None = None) -> str:
    """Name the path ``mamba3`` runs ``thunk`` on: ``step``, ``chunked L=64``, with ``, N threads`` when split."""
    name = pick_path("mamba3", path, thunk["seq"], STEP_MAX, "chunked")
    if name == "step":
        return name
    units = thunk.get("groups", thunk["heads"])
    units = units if units > 1 else thunk["heads"]
    work = thunk["batch"] * thunk["seq"] * thunk["heads"] * thunk["head_dim"] * thunk["state_size"]
    parts = threads.parts_for("mamba3", work, 1, units, workers)
    return f"{name} L={chunk or CHUNK}" + (f", {parts} threads" if parts > 1 else "")


def inputs(t: Thunk, bound: Bound) -> tuple[list[np.ndarray], dict[str, Any]]:
    """A thunk's (completed) inputs as ``mamba3`` takes them: the seven tensors in their compute types, and the
    optional ones; the state pools as the arena's own views (f32 and f64 compute as they are stored)."""
    args = [bound.load(f) for f in ("q", "k", "v", "adt", "dt", "trap", "angles")]
    options: dict[str, Any] = {f: bound.load(f) for f in ("q_bias", "k_bias", "d", "z") if t[f] is not None}
    options.update({f: bound.view(f) for f in ("cu_seqlens", "state_slots") if t[f] is not None})
    if t["carry_state"]:
        options["states"] = [bound.view(f) for f in STATES]
    return args, options


def kernel(t: Thunk, arena: np.ndarray, *, path: str | None = None, chunk: int | None = None,
           workers: int | None = None) -> None:
    """``mamba3`` on a host arena: 16-bit storage computes in f32, the state pools are updated in place."""
    _arrays(t, arena, None, path, chunk, workers)


def _arrays(t: Thunk, arena: np.ndarray, by_field: Mapping[str, Region] | None, path: str | None,
            chunk: int | None, workers: int | None) -> None:
    """``kernel`` on the thunk's regions ``by_field`` where the caller laid them out (None: laid out here)."""
    bound = Bound(t, arena, by_field)
    args, options = inputs(t, bound)
    bound.store("dst", mamba3(*args, **options, path=path, chunk=chunk, workers=workers))


def _step_arguments(t: Thunk) -> compiled_step.Arguments:
    """``jit_mamba3.mamba3_step``'s arguments from a thunk's arena views."""
    present = {f: t[f] is not None for f in ("q_bias", "k_bias", "d", "z")}

    def arguments(bound: Bound) -> tuple:
        return (*(bound.view(f) for f in ("q", "k", "v", "adt", "dt", "trap", "angles")),
                *(compiled_step.view(bound, f, rank, present[f]) for f, rank in (("q_bias", 2), ("k_bias", 2),
                                                                                 ("d", 1), ("z", 4))),
                *(compiled_step.view(bound, f, rank, t["carry_state"]) for f, rank in zip(STATES, (3, 4, 3, 3))),
                *compiled_step.rows(t, bound), t["cu_seqlens"] is not None, bound.view("dst"))
    return arguments


def prepare(thunk: Thunk) -> Callable[..., bool | None]:
    """The thunk-only setup of ``mamba3``, once (``host_fallback.PREPARE``): the thunk completed and its regions
    laid out, and its compiled step bound (``compiled_step``: ``jit_mamba3.mamba3_step``), which runs the step path
    where it applies (every tensor f32; the step path runs on one thread). Returns ``run(arena, *, path, chunk,
    workers, given)`` (``given``: ``implementations.GIVEN``)."""
    t = complete(thunk)
    by_field = {r.field: r for r in regions(t)}
    compiled = compiled_step.CompiledStep.of(t, by_field, "mamba3_step", _step_arguments(t))
    units = t["groups"] if t["groups"] > 1 else t["heads"]  # as ``mamba3`` splits its heads

    def run(arena: np.ndarray, *, path: str | None = None, chunk: int | None = None,
            workers: int | None = None, given: Any = None) -> bool | None:
        # the step path runs on one thread unless workers are forced (which ``parts_for`` checks)
        taken = (compiled is not None and pick_path("mamba3", path, t["seq"], STEP_MAX, "chunked") == "step"
                 and (workers is None or threads.parts_for("mamba3", 0, 1, units, workers) == 1)
                 and compiled.run(arena, given))
        if taken or given is not None:  # arrays given in place of arena views: the compiled step only
            return taken
        _arrays(t, arena, by_field, path, chunk, workers)
        return None
    return run


KERNELS.add("mamba3", kernel)
PREPARE.add("mamba3", prepare)
GIVEN.add("mamba3")
PATHS.add("mamba3", path_for)
