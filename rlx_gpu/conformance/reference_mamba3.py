"""Float64 references of ``mamba3`` and ``mamba3_backward`` (ABI.md §11), written from its six steps.

Deliberately plain and independent of ``host_fallback``: one sequence (a batch row, or a packed sequence of
``cu_seqlens``) at a time, one token at a time, every head at once, the state ``(θ, S, k̄, v̄)`` carried from
token to token exactly as §11 writes it. The backward is reverse-mode through the same loop, written by
hand: the forward's per-token values are kept, then the tokens are walked last to first, each step's
gradient handed to its inputs and to the state before it (§9: the carried states' gradients are read as the
final state's and become the initial state's; the reduction of θ mod 2π has derivative 1). Inputs are any
float arrays (rounded storage values as they are stored); results are float64.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from .reference_conv import sequences, sigmoid
from .registry import PACKED, SLOTS, Load, declare_cases, reference

#: The four carried states in the anchor's order (angle, ssm, k, v).
STATES = ("angle_state", "state", "k_state", "v_state")
#: The optional fields of §11 these references implement (all of them).
FIELDS = frozenset({"groups", "q_bias", "k_bias", "d", "z", "dt_dtype", "param_dtype", "carry_state", *STATES,
                    "state_dtype", "cu_seqlens", "num_seqs", "state_slots", "num_slots"})
OPTIONAL = ("q_bias", "k_bias", "d", "z")


def rotate(x: np.ndarray, theta: np.ndarray) -> np.ndarray:
    """§11 step 3's ``rot``: ``x [H,N]`` with each adjacent pair ``i < A`` turned by ``theta [H,A]``."""
    out = x.copy()
    a = theta.shape[-1]
    even, odd = x[:, 0:2 * a:2], x[:, 1:2 * a:2]
    c, s = np.cos(theta), np.sin(theta)
    out[:, 0:2 * a:2] = even * c - odd * s
    out[:, 1:2 * a:2] = even * s + odd * c
    return out


def _rotate_back(dx: np.ndarray, theta: np.ndarray) -> np.ndarray:
    """The gradient of ``rotate``'s input from its output's: the turn by ``-theta``."""
    return rotate(dx, -theta)


class _Inputs:
    """A thunk's tensors as float64 arrays, the optional ones at their neutral values."""

    def __init__(self, q, k, v, adt, dt, trap, angles, q_bias, k_bias, d, z):
        self.q, self.k, self.v = (np.asarray(a, np.float64) for a in (q, k, v))
        self.adt, self.dt, self.trap, self.angles = (np.asarray(a, np.float64) for a in (adt, dt, trap, angles))
        batch, seq, groups, n = self.q.shape
        heads, p = self.v.shape[2], self.v.shape[3]
        self.heads, self.p, self.n, self.a = heads, p, n, self.angles.shape[3]
        self.group = np.arange(heads) // (heads // groups)
        self.q_bias = np.zeros((heads, n)) if q_bias is None else np.asarray(q_bias, np.float64)
        self.k_bias = np.zeros((heads, n)) if k_bias is None else np.asarray(k_bias, np.float64)
        self.d = None if d is None else np.asarray(d, np.float64)
        self.z = None if z is None else np.asarray(z, np.float64)

    def zero_state(self) -> list[np.ndarray]:
        h = self.heads
        return [np.zeros((h, self.a)), np.zeros((h, self.p, self.n)), np.zeros((h, self.n)), np.zeros((h, self.p))]


def _step(x: _Inputs, b: int, t: int, theta, big_s, k_bar, v_bar) -> dict[str, np.ndarray]:
    """§11's six steps at token ``t`` of batch row ``b``: the new state and every intermediate value."""
    lam = sigmoid(x.trap[b, t])
    alpha = np.exp(x.adt[b, t])
    dt = x.dt[b, t]
    beta, gamma = (1 - lam) * dt * alpha, lam * dt
    theta = theta + np.pi * np.tanh(x.angles[b, t]) * dt[:, None]
    q_rot = rotate(x.q[b, t, x.group] + x.q_bias, theta)
    k_rot = rotate(x.k[b, t, x.group] + x.k_bias, theta)
    v = x.v[b, t]
    new_s = (alpha[:, None, None] * big_s + beta[:, None, None] * v_bar[:, :, None] * k_bar[:, None, :]
             + gamma[:, None, None] * v[:, :, None] * k_rot[:, None, :])
    y = np.einsum("hpn,hn->hp", new_s, q_rot)
    pre_gate = y if x.d is None else y + x.d[:, None] * v
    out = pre_gate if x.z is None else pre_gate * x.z[b, t] * sigmoid(x.z[b, t])
    return dict(lam=lam, alpha=alpha, beta=beta, gamma=gamma, theta=theta, q_rot=q_rot, k_rot=k_rot, old_s=big_s,
                k_bar=k_bar, v_bar=v_bar, new_s=new_s, pre_gate=pre_gate, out=out)


def _initial(pools, entry: int | None, x: _Inputs) -> list[np.ndarray]:
    return x.zero_state() if pools is None else [pool[entry].copy() for pool in pools]


def mamba3(q, k, v, adt, dt, trap, angles, *, q_bias=None, k_bias=None, d=None, z=None, states=None,
           cu_seqlens=None, state_slots=None):
    """``y [B,S,H,P]``, or ``(y, final pools)`` with ``states`` (the four pools ``angle_state, state, k_state,
    v_state`` the rows start from, each ``[entries, ...]``; entries no row names unchanged)."""
    x = _Inputs(q, k, v, adt, dt, trap, angles, q_bias, k_bias, d, z)
    pools = None if states is None else [np.array(s, np.float64) for s in states]
    y = np.zeros(x.v.shape)
    for b, r, tokens in sequences(x.q.shape[0], x.q.shape[1], cu_seqlens):
        entry = r if state_slots is None else int(state_slots[r])
        theta, big_s, k_bar, v_bar = _initial(pools, entry, x)
        for t in tokens:
            step = _step(x, b, t, theta, big_s, k_bar, v_bar)
            y[b, t] = step["out"]
            theta, big_s, k_bar, v_bar = step["theta"], step["new_s"], step["k_rot"], x.v[b, t]
        if pools is not None and len(tokens):
            theta = theta - 2 * np.pi * np.floor(theta / (2 * np.pi))
            for pool, value in zip(pools, (theta, big_s, k_bar, v_bar)):
                pool[entry] = value
    return y if pools is None else (y, pools)


def _step_back(x: _Inputs, b: int, t: int, st: dict, g: np.ndarray, grads: dict, carried: list) -> list:
    """Reverse of ``_step`` at token ``t``: ``g`` the output's gradient, ``carried`` the gradients of the state
    after the step ``[dθ, dS, dk̄, dv̄]``; accumulates into ``grads`` and returns those of the state before it."""
    d_theta, d_s, d_kbar, d_vbar = carried
    v, z = x.v[b, t], None if x.z is None else x.z[b, t]
    if z is not None:
        sz = sigmoid(z)
        grads["d_z"][b, t] = g * st["pre_gate"] * sz * (1 + z * (1 - sz))
        g = g * z * sz
    d_v = d_vbar.copy()  # step 6: v̄ ← v
    if x.d is not None:
        grads["d_d"] += np.sum(g * v, axis=1)
        d_v += g * x.d[:, None]
    d_s = d_s + g[:, :, None] * st["q_rot"][:, None, :]  # step 5: y = S q̃
    d_qrot = np.einsum("hpn,hp->hn", st["new_s"], g)
    d_krot = d_kbar + st["gamma"][:, None] * np.einsum("hpn,hp->hn", d_s, v)  # step 6 (k̄ ← k̃) and step 4
    d_v += st["gamma"][:, None] * np.einsum("hpn,hn->hp", d_s, st["k_rot"])
    d_alpha = np.einsum("hpn,hpn->h", d_s, st["old_s"])
    d_beta = np.einsum("hp,hpn,hn->h", st["v_bar"], d_s, st["k_bar"])
    d_gamma = np.einsum("hp,hpn,hn->h", v, d_s, st["k_rot"])
    prev_vbar = st["beta"][:, None] * np.einsum("hpn,hn->hp", d_s, st["k_bar"])
    prev_kbar = st["beta"][:, None] * np.einsum("hpn,hp->hn", d_s, st["v_bar"])
    prev_s = st["alpha"][:, None, None] * d_s
    a = x.a
    for d_rot, rot, name, bias in ((d_qrot, st["q_rot"], "q", "d_q_bias"), (d_krot, st["k_rot"], "k", "d_k_bias")):
        d_theta = d_theta + rot[:, 0:2 * a:2] * d_rot[:, 1:2 * a:2] - rot[:, 1:2 * a:2] * d_rot[:, 0:2 * a:2]
        d_in = _rotate_back(d_rot, st["theta"])
        np.add.at(grads[f"d_{name}"][b, t], x.group, d_in)
        grads[bias] += d_in
    lam, alpha, dt = st["lam"], st["alpha"], x.dt[b, t]
    tanh = np.tanh(x.angles[b, t])
    grads["d_angles"][b, t] = d_theta * np.pi * (1 - tanh ** 2) * dt[:, None]  # step 2
    d_alpha = d_alpha + d_beta * (1 - lam) * dt  # step 1
    grads["d_adt"][b, t] = d_alpha * alpha
    grads["d_dt"][b, t] = np.sum(d_theta * np.pi * tanh, axis=1) + d_beta * (1 - lam) * alpha + d_gamma * lam
    grads["d_trap"][b, t] = (d_gamma * dt - d_beta * dt * alpha) * lam * (1 - lam)
    grads["d_v"][b, t] = d_v
    return [d_theta, prev_s, prev_kbar, prev_vbar]


def mamba3_backward(q, k, v, adt, dt, trap, angles, d_dst, *, q_bias=None, k_bias=None, d=None, z=None,
                    states=None, d_states=None, cu_seqlens=None, state_slots=None) -> dict[str, np.ndarray]:
    """The gradients of every floating-point input (``d_q_bias d_k_bias d_d d_z`` with their inputs) and, with
    ``states``, the four pools of ``d_states`` (the final states' gradients) with each named entry replaced by
    its initial state's."""
    x = _Inputs(q, k, v, adt, dt, trap, angles, q_bias, k_bias, d, z)
    d_dst = np.asarray(d_dst, np.float64)
    pools = None if states is None else [np.asarray(s, np.float64) for s in states]
    d_pools = None if states is None else [np.array(s, np.float64) for s in d_states]
    grads = {f"d_{f}": np.zeros(getattr(x, f).shape) for f in ("q", "k", "v", "adt", "dt", "trap", "angles")}
    grads.update(d_q_bias=np.zeros(x.q_bias.shape), d_k_bias=np.zeros(x.k_bias.shape), d_d=np.zeros(x.heads),
                 d_z=np.zeros(x.v.shape))
    for b, r, tokens in sequences(x.q.shape[0], x.q.shape[1], cu_seqlens):
        entry = r if state_slots is None else int(state_slots[r])
        state = _initial(pools, entry, x)
        steps = []
        for t in tokens:
            steps.append(_step(x, b, t, *state))
            state = [steps[-1]["theta"], steps[-1]["new_s"], steps[-1]["k_rot"], x.v[b, t]]
        carried = x.zero_state() if d_pools is None else [pool[entry].copy() for pool in d_pools]
        for t, st in zip(reversed(tokens), reversed(steps)):
            carried = _step_back(x, b, t, st, d_dst[b, t], grads, carried)
        if d_pools is not None:
            for pool, value in zip(d_pools, carried):
                pool[entry] = value
    out = {f: grads[f] for f in ("d_q", "d_k", "d_v", "d_adt", "d_dt", "d_trap", "d_angles")}
    out.update({f"d_{f}": grads[f"d_{f}"] for f, given in zip(OPTIONAL, (q_bias, k_bias, d, z)) if given is not None})
    if d_pools is not None:
        out.update({f"d_{f}": pool for f, pool in zip(STATES, d_pools)})
    return out


def _fields(t: Mapping[str, Any], load: Load) -> dict[str, Any]:
    """The optional §11 fields of thunk ``t`` (completed) as the functions above take them."""
    out: dict[str, Any] = {f: load(f) for f in OPTIONAL + ("cu_seqlens", "state_slots") if t[f] is not None}
    if t["carry_state"]:
        out["states"] = [load(f) for f in STATES]
    return out


def _inputs(load: Load) -> list[np.ndarray]:
    return [load(f) for f in ("q", "k", "v", "adt", "dt", "trap", "angles")]


@reference("mamba3", v2_fields={"mamba3": FIELDS})
def forward(t: Mapping[str, Any], load: Load) -> dict[str, np.ndarray]:
    """``{field: float64}`` of every tensor a ``mamba3`` thunk ``t`` (completed) writes."""
    result = mamba3(*_inputs(load), **_fields(t, load))
    if t["carry_state"]:
        return {"dst": result[0], **dict(zip(STATES, result[1]))}
    return {"dst": result}


_GRADIENTS = frozenset(f"d_{f}" for f in OPTIONAL + STATES)


@reference("mamba3_backward", v2_fields={"mamba3_backward": FIELDS | _GRADIENTS})
def backward(t: Mapping[str, Any], load: Load) -> dict[str, np.ndarray]:
    """``{field: float64}`` of every tensor a ``mamba3_backward`` thunk ``t`` (completed) writes."""
    extra = {"d_states": [load(f"d_{f}") for f in STATES]} if t["carry_state"] else {}
    return mamba3_backward(*_inputs(load), load("d_dst"), **_fields(t, load), **extra)


def _mamba3(b: int, s: int, heads: int, p: int, n: int, angles: int, carry_state: bool = False, **v2: Any) -> dict:
    """A mamba3 case; ``carry_state`` places its four states (a backward op's case adds their gradients)."""
    return dict(batch=b, seq=s, heads=heads, head_dim=p, state_size=n, num_angles=angles,
                **(_CARRIED if carry_state else {}), **v2)


_CARRIED = {"carry_state": True, **dict.fromkeys(STATES, True)}
_GRADIENTS_OF_STATES = {f"d_{f}": True for f in STATES}
_EVERY = dict(groups=2, q_bias=True, k_bias=True, d=True, z=True)
NAN = float("nan")

# an odd num_angles = N/2; a single angle with q/k shared by two heads each; every field at once over packed
# sequences (one empty, one starting inside the second chunk of 64) through slots; a decode step into slots;
# three chunks (the last partial) carried; the backward likewise. A NaN reaches its own row from its step on and
# no other packed sequence.
declare_cases("mamba3", small=dict(batch=2, seq=7, heads=2, head_dim=3, state_size=6, num_angles=2), thunks=[
    (_mamba3(2, 5, 2, 3, 6, 3), {}, False),
    (_mamba3(2, 9, 4, 3, 8, 1, groups=2), {}, False),
    (_mamba3(1, 150, 4, 3, 8, 2, True, cu_seqlens=[0, 20, 20, 100, 150], state_slots=[3, 0, 4, 1], num_slots=5,
             **_EVERY), {}, False),
    (_mamba3(3, 1, 2, 4, 6, 3, True, state_slots=[2, 0, 4], num_slots=5, d=True, z=True), {}, False),
    (_mamba3(2, 150, 2, 5, 10, 4, True, d=True), {}, False),
], causal=[
    (_mamba3(2, 9, 2, 3, 6, 2), "v", 5, NAN),
    (_mamba3(1, 80, 2, 3, 6, 2, cu_seqlens=[0, 30, 68, 80]), "q", 40, NAN),
], present={
    **dict.fromkeys(("carry_state",) + STATES, _CARRIED), "groups": {"groups": 1}, "dt_dtype": {"dt_dtype": "f32"},
    "param_dtype": {"param_dtype": "f32"}, "state_dtype": {**_CARRIED, "state_dtype": "f64"}, "cu_seqlens": PACKED,
    "num_seqs": PACKED, "state_slots": {**_CARRIED, **SLOTS}, "num_slots": {**_CARRIED, **SLOTS}})
declare_cases("mamba3_backward", thunks=[
    (_mamba3(2, 5, 2, 3, 6, 3), {}, False),
    (_mamba3(1, 40, 4, 3, 8, 2, True, cu_seqlens=[0, 15, 15, 40], state_slots=[1, 2, 0], num_slots=3, **_EVERY,
             **_GRADIENTS_OF_STATES, d_q_bias=True, d_k_bias=True, d_d=True, d_z=True), {}, False),
    (_mamba3(2, 1, 2, 4, 6, 1, True, state_slots=[1, 0], num_slots=2, **_GRADIENTS_OF_STATES), {}, False),
    (_mamba3(1, 150, 2, 4, 8, 4, True, **_GRADIENTS_OF_STATES), {}, False),
])
