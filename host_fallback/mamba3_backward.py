"""The host kernel of ``mamba3_backward`` (ABI.md §9, §11): the gradients of every input of ``mamba3`` and, with a
carried state, of the four initial states.

The forward's state-free parts are recomputed for every token at once (``mamba3.tokens``). The recurrence is
reversed by one of two walks, each giving the per-token gradients of ``q̃``, ``k̃``, ``v`` and of the weights
``adt``, ``β' = (1−λ)·dt``, ``γ = λ·dt`` (``Gradients``):

- a long block whose inputs are all finite reverses the forward's chunked path (``through_ssd``): mamba2's SSD
  backward (``mamba2_backward.ssd_backward``) on the inputs ``(γ_s + β'_{s+1})·v_s``, keys ``k̃``, queries ``q̃``
  and decays ``adt``, then the chain rule through those inputs, the trapezoid's boundary term and the
  diagonal's correction;
- a short block, or one holding a NaN or an Inf (whose gradients must land where the step recurrence puts
  them), walks the tokens last to first a chunk at a time (``Reverse``): the chunk's states recomputed token
  by token from the forward's chunk starts, the reverse of §11's steps 4-6 handing each token's output
  gradient to ``S``, ``q̃``, ``k̃``, ``v`` and ``α, β, γ``, and the state's gradient back to the token before
  (compiled for f32 where Numba is installed).

Steps 1-3 are then reversed for every token at once: the rotations undone, the angle's gradient summed from the
last token back (the reduction mod 2π has derivative 1), the weights' gradients to ``adt, dt, trap``. Every row
and head runs at once; the summation order is fixed, so every run gives the same bytes.
"""
from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import numpy as np

from . import jit
from .bound import Bound
from .chunked import floor_log_decays, sum_from_end
from .implementations import KERNELS
from .mamba2_backward import ssd_backward
from .mamba3 import (CHUNK, STATES, STEP_MAX, Tokens, inputs, recurrence, rotate, row_blocks, run_step, sigmoid,
                     tokens)
from .ssm import MAMBA2_STEP_MAX

Thunk = Mapping[str, Any]
#: The seven inputs every call has, and the optional ones, in field order.
INPUTS = ("q", "k", "v", "adt", "dt", "trap", "angles")
OPTIONAL = ("q_bias", "k_bias", "d", "z")


def _part(x: Tokens, lo: int, hi: int) -> Tokens:
    return Tokens(*(getattr(x, f)[:, lo:hi] for f in Tokens.__dataclass_fields__))


def forward_again(x: Tokens, state: list[np.ndarray], chunk: int) -> tuple[list[list[np.ndarray]], np.ndarray]:
    """``[S, k̄, v̄]`` entering each chunk of ``chunk`` tokens (copies), and the outputs before ``d`` and ``z``, by
    the forward's chunked path from ``state`` (advanced in place)."""
    starts, y, seq = [], np.empty(x.v.shape, x.v.dtype), x.v.shape[1]
    for lo in range(0, seq, chunk):
        starts.append([s.copy() for s in state])
        y[:, lo:lo + chunk] = recurrence(_part(x, lo, lo + chunk), state, "chunked", chunk)
    return starts, y


class Reverse:
    """The reverse walk over a block of rows: ``d_s, d_kbar, d_vbar`` the gradients of the state after the
    token being undone; per-token gradients of ``q̃, k̃, v`` and of ``α, β, γ`` collected for every token."""

    def __init__(self, x: Tokens, d_final: list[np.ndarray]):
        self.x = x
        self.d_s, self.d_kbar, self.d_vbar = (np.array(a, x.v.dtype) for a in d_final)
        self.d_qrot, self.d_krot, self.d_v = (np.zeros_like(a) for a in (x.q_rot, x.k_rot, x.v))
        self.d_alpha, self.d_beta, self.d_gamma = (np.zeros_like(x.alpha) for _ in range(3))
        self.unused = np.empty(x.v.shape, x.v.dtype)  # the recomputed outputs, not read
        self.compiled = jit.kernel("mamba3_state_step_back") if x.v.dtype == np.float32 else None

    def chunk(self, lo: int, hi: int, start: list[np.ndarray], g: np.ndarray) -> None:
        """Undo tokens ``hi-1 .. lo`` from the state ``start`` entering token ``lo``; ``g [R,T,H,P]`` the gradient
        of the outputs before ``d`` and ``z``."""
        x = self.x
        state = [s.copy() for s in start]
        history = np.empty((hi - lo + 1,) + start[0].shape, start[0].dtype)  # S before each token, then after the last
        history[0] = start[0]
        run_step(x, lo, hi, state, self.unused, history[1:])
        for t in range(hi - 1, lo - 1, -1):
            k_bar, v_bar = (start[1], start[2]) if t == lo else (x.k_rot[:, t - 1], x.v[:, t - 1])
            token = self._compiled if self.compiled is not None else self._token
            token(t, history[t - lo], history[t - lo + 1], k_bar, v_bar, g[:, t])

    def _compiled(self, t: int, old_s, new_s, k_bar, v_bar, g) -> None:
        """``_token`` in one compiled pass (f32)."""
        x = self.x
        flat = [np.ascontiguousarray(a) for a in (x.q_rot[:, t], x.k_rot[:, t], k_bar, x.v[:, t], v_bar, g,
                                                  x.alpha[:, t], x.beta[:, t], x.gamma[:, t])]
        outs = [np.empty_like(a) for a in (flat[0], flat[0], flat[3], flat[6], flat[6], flat[6])]
        self.compiled(self.d_s, old_s, new_s, *flat, self.d_kbar, self.d_vbar, *outs)
        for target, value in zip((self.d_qrot, self.d_krot, self.d_v, self.d_alpha, self.d_beta, self.d_gamma), outs):
            target[:, t] = value

    def _token(self, t: int, old_s, new_s, k_bar, v_bar, g) -> None:
        """The reverse of steps 4-6 at token ``t`` (``old_s``/``new_s``: S before and after it)."""
        x = self.x
        v, k_rot = x.v[:, t], x.k_rot[:, t]
        d_s = self.d_s + g[..., :, None] * x.q_rot[:, t, ..., None, :]  # y = S q̃
        self.d_qrot[:, t] = np.matmul(g[..., None, :], new_s)[..., 0, :]
        d_sv = np.matmul(d_s, k_rot[..., :, None])[..., 0]  # [R,H,P]: dS k̃
        d_sk = np.matmul(v[..., None, :], d_s)[..., 0, :]  # [R,H,N]: vᵀ dS
        gamma, beta = x.gamma[:, t, :, None], x.beta[:, t, :, None]
        self.d_krot[:, t] = self.d_kbar + gamma * d_sk  # k̄ ← k̃, and S's γ·v⊗k̃
        self.d_v[:, t] = self.d_vbar + gamma * d_sv
        self.d_alpha[:, t] = np.einsum("rhpn,rhpn->rh", d_s, old_s)
        d_skbar = np.matmul(d_s, k_bar[..., :, None])[..., 0]  # [R,H,P]: dS k̄
        self.d_beta[:, t] = np.einsum("rhp,rhp->rh", v_bar, d_skbar)
        self.d_gamma[:, t] = np.einsum("rhp,rhp->rh", v, d_sv)
        self.d_vbar = beta * d_skbar
        self.d_kbar = beta * np.matmul(v_bar[..., None, :], d_s)[..., 0, :]
        self.d_s = x.alpha[:, t, :, None, None] * d_s


def _angle_turns(rot: np.ndarray, d_rot: np.ndarray, a: int) -> np.ndarray:
    """The gradient of the angles a rotation turned by, from the rotated vectors and their gradients."""
    return rot[..., 0:2 * a:2] * d_rot[..., 1:2 * a:2] - rot[..., 1:2 * a:2] * d_rot[..., 0:2 * a:2]


class Gradients(NamedTuple):
    """A block's per-token gradients, from either walk: of ``q̃, k̃`` ``[R,T,H,N]``, of ``v`` (the recurrence's
    part) ``[R,T,H,P]``, of ``adt``, ``β' = (1−λ)·dt`` and ``γ = λ·dt`` ``[R,T,H]``, and of the initial
    ``[S, k̄, v̄]``."""

    d_qrot: np.ndarray
    d_krot: np.ndarray
    d_v: np.ndarray
    d_adt: np.ndarray
    d_bprime: np.ndarray
    d_gamma: np.ndarray
    d_initial: list[np.ndarray]


def from_steps(x: Tokens, rev: Reverse) -> Gradients:
    """The step walk's gradients as ``Gradients``: ``β = β'·α`` and ``α = exp(adt)`` pass on ``β``'s."""
    return Gradients(rev.d_qrot, rev.d_krot, rev.d_v, (rev.d_alpha + rev.d_beta * x.bprime) * x.alpha,
                     rev.d_beta * x.alpha, rev.d_gamma, [rev.d_s, rev.d_kbar, rev.d_vbar])


def _steps_back(x: Tokens, grads: Gradients, d_theta_final: np.ndarray, angles, groups: int, out: dict, b,
                t) -> np.ndarray:
    """The reverse of steps 1-3 for every token of a block at once; returns the initial angle's gradient."""
    a = x.theta.shape[-1]
    local = _angle_turns(x.q_rot, grads.d_qrot, a) + _angle_turns(x.k_rot, grads.d_krot, a)
    d_theta = sum_from_end(local, 1) + d_theta_final[:, None]
    heads = x.v.shape[2]
    for name, d_rot in (("q", grads.d_qrot), ("k", grads.d_krot)):
        d_in = rotate(d_rot, x.theta, -1)
        out[f"d_{name}"][b, t] = d_in.reshape(d_in.shape[:2] + (groups, heads // groups, -1)).sum(axis=3)
        if f"d_{name}_bias" in out:
            out[f"d_{name}_bias"] += d_in.sum(axis=(0, 1))
    tanh = np.tanh(angles)
    out["d_angles"][b, t] = d_theta * np.pi * (1 - tanh ** 2) * x.dt[..., None]
    lam, dt = x.lam, x.dt
    out["d_adt"][b, t] = grads.d_adt
    out["d_dt"][b, t] = np.sum(d_theta * np.pi * tanh, axis=-1) + grads.d_bprime * (1 - lam) + grads.d_gamma * lam
    out["d_trap"][b, t] = (grads.d_gamma - grads.d_bprime) * dt * lam * (1 - lam)
    out["d_v"][b, t] += grads.d_v
    return d_theta[:, 0]


def through_ssd(x: Tokens, start: list[np.ndarray], finals: list[np.ndarray], g: np.ndarray,
                length: int) -> tuple[np.ndarray, Gradients]:
    """The reverse of the chunked path (``mamba3.run_chunks``: mamba2's SSD on inputs ``w·v``, keys ``k̃``, queries
    ``q̃``, decays ``adt``, from ``S + β'_0·v̄⊗k̄``, less ``β'_{t+1}·(q̃_t·k̃_t)·v_t``) by mamba2's SSD backward
    (``mamba2_backward.ssd_backward``), then the chain rule through those pieces for every token at once.
    ``start``/``finals``: ``[S, k̄, v̄]`` and their final gradients; ``g``: the outputs' gradient before the gate.
    Returns the outputs before ``d`` and the gate, and the gradients."""
    big_s, k_bar, v_bar = start
    first = x.bprime[:, 0, :, None]
    entering = big_s + first[..., None] * (v_bar[..., :, None] * k_bar[..., None, :])
    weight = x.gamma.copy()
    weight[:, :-1] += x.bprime[:, 1:]
    path = "step" if x.v.shape[1] <= MAMBA2_STEP_MAX else "chunked"
    y, du, d_adt, db, dc, d_entering = ssd_backward(path, floor_log_decays(x.adt), x.v * weight[..., None], x.k_rot,
                                                    x.q_rot, entering, g, finals[0], length, True)
    after = np.zeros_like(x.gamma)  # β'_{t+1}: the diagonal's excess
    after[:, :-1] = x.bprime[:, 1:]
    same = np.einsum("rthn,rthn->rth", x.q_rot, x.k_rot)
    y -= (after * same)[..., None] * x.v
    g_v = np.einsum("rthp,rthp->rth", g, x.v)
    d_v = weight[..., None] * du - (after * same)[..., None] * g
    d_same = -after * g_v
    d_qrot, d_krot = dc + d_same[..., None] * x.k_rot, db + d_same[..., None] * x.q_rot
    d_weight = np.einsum("rthp,rthp->rth", du, x.v)
    d_bprime = np.zeros_like(x.gamma)
    d_bprime[:, 1:] = d_weight[:, :-1] - (same * g_v)[:, :-1]
    d_bprime[:, 0] += np.einsum("rhp,rhpn,rhn->rh", v_bar, d_entering, k_bar)
    d_vbar = first * np.einsum("rhpn,rhn->rhp", d_entering, k_bar)
    d_kbar = first * np.einsum("rhpn,rhp->rhn", d_entering, v_bar)
    d_krot[:, -1] += finals[1]
    d_v[:, -1] += finals[2]
    return y, Gradients(d_qrot, d_krot, d_v, d_adt, d_bprime, d_weight, [d_entering, d_kbar, d_vbar])


def _finite(*arrays: np.ndarray) -> bool:
    return all(np.isfinite(np.sum(a)) for a in arrays)


def _block(x: Tokens, start: list[np.ndarray], finals: list[np.ndarray], d_out: np.ndarray, d, z, length: int,
           out: dict, b, t) -> Gradients:
    """A block's gradients: the skip and gate reversed (``d_z``, ``d_d``, ``d_v``'s skip part), then the
    recurrence by the chunked path's reverse (``through_ssd``) where the block is long and finite, else by the
    step walk (``Reverse``, chunk by chunk from the forward's chunk starts)."""
    g = d_out
    if z is not None:
        sig = sigmoid(z)
        g = d_out * (z * sig)
    if d is not None:
        out["d_d"] += np.einsum("rthp,rthp->h", g, x.v)
        out["d_v"][b, t] += g * d[:, None]
    if x.v.shape[1] > STEP_MAX and _finite(x.adt, x.dt, x.lam, x.q_rot, x.k_rot, x.v, g, *start[1:], *finals):
        pre, grads = through_ssd(x, start[1:], finals[1:], g, length)
    else:
        starts, pre = forward_again(x, [s.copy() for s in start[1:]], length)
        rev = Reverse(x, finals[1:])
        for index in range(len(starts) - 1, -1, -1):
            lo = index * length
            rev.chunk(lo, min(lo + length, x.v.shape[1]), starts[index], g)
        grads = from_steps(x, rev)
    if z is not None:
        if d is not None:
            pre += d[:, None] * x.v
        out["d_z"][b, t] = d_out * pre * sig * (1 + z * (1 - sig))
    return grads


def mamba3_backward(q, k, v, adt, dt, trap, angles, d_dst, *, q_bias=None, k_bias=None, d=None, z=None, states=None,
                    d_states=None, cu_seqlens=None, state_slots=None, chunk: int | None = None) -> dict[str, np.ndarray]:
    """The gradients ``d_q d_k d_v d_adt d_dt d_trap d_angles`` (and ``d_q_bias d_k_bias d_d d_z`` with their
    inputs) in the compute type; with ``states`` (the four initial pools, read only), ``d_states`` (the four
    pools of the final states' gradients) has each named entry replaced by its initial state's, in place."""
    ct = np.result_type(q.dtype, adt.dtype, *(() if states is None else (s.dtype for s in states)))
    batch, seq, heads, p = v.shape
    n, a = q.shape[-1], angles.shape[-1]
    given = dict(zip(OPTIONAL, (q_bias, k_bias, d, z)))
    out = {f"d_{f}": np.zeros(arr.shape, ct) for f, arr in zip(INPUTS, (q, k, v, adt, dt, trap, angles))}
    out.update({f"d_{f}": np.zeros(arr.shape, ct) for f, arr in given.items() if arr is not None})
    d_param = None if d is None else np.asarray(d, ct)
    zeros = [np.zeros(shape, ct) for shape in ((heads, a), (heads, p, n), (heads, n), (heads, p))]
    for b, t, rows in row_blocks(batch, seq, cu_seqlens):
        entries = rows if state_slots is None else np.asarray(state_slots, np.intp)[rows]
        start = ([np.broadcast_to(z0, (len(rows),) + z0.shape).copy() for z0 in zeros] if states is None
                 else [pool[entries].astype(ct) for pool in states])
        finals = ([np.broadcast_to(z0, (len(rows),) + z0.shape).copy() for z0 in zeros] if d_states is None
                  else [pool[entries].astype(ct) for pool in d_states])
        x = tokens(*(arr[b, t] for arr in (q, k, v, adt, dt, trap, angles)), q_bias, k_bias, start[0], ct)
        zb = None if z is None else np.asarray(z[b, t], ct)
        grads = _block(x, start, finals, np.asarray(d_dst[b, t], ct), d_param, zb, chunk or CHUNK, out, b, t)
        d_theta0 = _steps_back(x, grads, finals[0], np.asarray(angles[b, t], ct), q.shape[2], out, b, t)
        if d_states is not None:
            for pool, value in zip(d_states, [d_theta0, *grads.d_initial]):
                pool[entries] = value
    return out


def kernel(t: Thunk, arena: np.ndarray, *, chunk: int | None = None) -> None:
    """``mamba3_backward`` on a host arena: 16-bit storage computes in f32; the four state-gradient pools are
    updated in place (they are f32 or f64, stored as they compute)."""
    bound = Bound(t, arena)
    args, options = inputs(t, bound)
    if t["carry_state"]:
        options["d_states"] = [bound.view(f"d_{f}") for f in STATES]
    grads = mamba3_backward(*args, bound.load("d_dst"), **options, chunk=chunk)
    for field, values in grads.items():
        bound.store(field, values)


KERNELS.add("mamba3_backward", kernel)
