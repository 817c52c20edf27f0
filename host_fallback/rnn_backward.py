"""Host kernels for ``lstm_backward``, ``gru_backward`` and ``rnn_backward`` (ABI.md §9).

A backward thunk recomputes its forward (ABI.md §3 and §8: every layer and direction, sequence
lengths, reverse, clip, activations, both GRU forms, peepholes, coupled input-forget gates and
projections), keeping what the reverse pass needs per step: the pre-activations, the gate values,
the state entering each step and, for an lstm, the new cell. Then backpropagation through time,
top layer first, each direction walking its steps in the opposite order:

- A step computes only what depends on the step before it: the gradients of the gate
  pre-activations, and from them the gradients of the state entering the step (one GEMM by
  ``W_hh``). Everything else is a GEMM over the whole sequence afterwards, with the ``seq*batch``
  rows of the saved gradients as the long dimension: ``d_w_ih``, ``d_w_hh``, ``d_w_hr``, the layer
  input's gradient (the layer below's output gradient, or ``d_x``), and the bias and peephole sums.
- A row past its length (``seq_lens``) takes no step: its state passes through unchanged, so its
  gradient does too, and its output (written as 0) passes none back.
- Where an activation or a clamp has a kink, the gradient is the derivative of the branch the
  forward takes there (ABI.md §9): ``relu`` and ``thresholded_relu`` 0 at the kink, ``leaky_relu``
  and ``elu`` 1, and ``clip`` and ``hard_sigmoid`` pass the gradient at their bounds.

A small f32-inside lstm that ``lstm_sequence`` covers runs each layer-direction's forward and its steps back
through time as one compiled call each (``_compiled_lstm_forward``, ``_compiled_lstm_reverse``: the same
recurrence, with the GEMMs over the whole sequence still NumPy's), where NumPy's ~40 array passes a step
were the time (B=8 S=24 H=32, 2 layers: the thunk 2.5 ms to 0.4).

16-bit storage computes in f32 (every gradient sum included), f64 in f64; only the outputs are
rounded on store. The order of every sum is fixed, so a thunk gives the same bytes on every run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from . import lstm_sequence, threads
from .arena import COMPUTE
from .fields import ACTIVATION_SLOTS, complete
from .implementations import KERNELS, PREPARE
from .layout import Bound, Region, forward_thunk, layer_input_sizes, output_width, recurrent_dims, regions

Array = np.ndarray


# --- activations: the function and its derivative, from the (clipped) pre-activation u and the value y
def _sigmoid(u: Array) -> Array:
    with np.errstate(over="ignore"):  # exp(-u) = inf for very negative u gives σ = 0, as it should
        return 1.0 / (1.0 + np.exp(-u))


def _elu(u: Array, a: float) -> Array:
    return np.where(u >= 0, u, a * np.expm1(np.minimum(u, 0)))


def _hard_sigmoid(u: Array, a: float, b: float) -> Array:
    return np.clip(a * u + b, 0, 1)


_FUNCTIONS: dict[str, Callable[[Array, float, float], Array]] = {
    "sigmoid": lambda u, a, b: _sigmoid(u),
    "tanh": lambda u, a, b: np.tanh(u),
    "relu": lambda u, a, b: np.maximum(u, 0),
    "affine": lambda u, a, b: a * u + b,
    "leaky_relu": lambda u, a, b: np.where(u >= 0, u, a * u),
    "thresholded_relu": lambda u, a, b: np.where(u > a, u, 0),
    "scaled_tanh": lambda u, a, b: a * np.tanh(b * u),
    "hard_sigmoid": _hard_sigmoid,
    "elu": lambda u, a, b: _elu(u, a),
    "softsign": lambda u, a, b: u / (1 + np.abs(u)),
    "softplus": lambda u, a, b: np.logaddexp(0, u),
}
_DERIVATIVES: dict[str, Callable[[Array, Array, float, float], Array]] = {
    "sigmoid": lambda u, y, a, b: y * (1 - y),
    "tanh": lambda u, y, a, b: 1 - y * y,
    "relu": lambda u, y, a, b: (u > 0).astype(u.dtype),
    "affine": lambda u, y, a, b: np.full_like(u, a),
    "leaky_relu": lambda u, y, a, b: np.where(u >= 0, 1, a).astype(u.dtype),
    "thresholded_relu": lambda u, y, a, b: (u > a).astype(u.dtype),
    "scaled_tanh": lambda u, y, a, b: a * b * (1 - np.tanh(b * u) ** 2),
    "hard_sigmoid": lambda u, y, a, b: np.where((a * u + b >= 0) & (a * u + b <= 1), a, 0).astype(u.dtype),
    "elu": lambda u, y, a, b: np.where(u >= 0, 1, y + a).astype(u.dtype),
    "softsign": lambda u, y, a, b: 1 / (1 + np.abs(u)) ** 2,
    "softplus": lambda u, y, a, b: _sigmoid(u),
}


@dataclass(frozen=True)
class _Activation:
    name: str
    alpha: float
    beta: float

    def __call__(self, u: Array) -> Array:
        return _FUNCTIONS[self.name](u, self.alpha, self.beta).astype(u.dtype, copy=False)

    def slope(self, u: Array, y: Array) -> Array:
        return _DERIVATIVES[self.name](u, y, self.alpha, self.beta).astype(u.dtype, copy=False)

    def into(self, u: Array, out: Array) -> None:
        """``out = self(u)``; sigmoid and tanh without a temporary (``out`` may be ``u``)."""
        if self.name == "sigmoid":
            np.negative(u, out=out)
            with np.errstate(over="ignore"):  # exp(-u) = inf gives σ = 0, as it should
                np.exp(out, out=out)
            out += 1
            np.reciprocal(out, out=out)
        elif self.name == "tanh":
            np.tanh(u, out=out)
        else:
            out[...] = self(u)


@dataclass(frozen=True)
class _Cell:
    """What one layer-direction's steps need besides the tensors: its activations and the op's flags."""

    acts: tuple[_Activation, ...]  # this direction's slots: lstm f g h, gru f g, rnn f
    clip: float
    linear_before_reset: bool
    input_forget: bool

    def keeps_pre_activations(self, slots: int) -> bool:
        """Whether the reverse pass reads the gates' pre-activations: a clip's mask needs them, and so does
        the slope of any activation of the first ``slots`` slots but sigmoid and tanh (whose slopes follow
        from their values). Otherwise a gate is activated in place and only its value is kept."""
        return bool(self.clip) or any(a.name not in ("sigmoid", "tanh") for a in self.acts[:slots])

    def clipped(self, u: Array) -> tuple[Array, Array | None]:
        """``(u clamped to [-clip, clip], where the clamp passes the gradient)``; ``None``: no clip."""
        if not self.clip:
            return u, None
        return np.clip(u, -self.clip, self.clip), np.abs(u) <= self.clip

    def gate(self, slot: int, u: Array) -> tuple[Array, Array, Array | None]:
        """``(activation slot applied to the clipped u, the clipped u, the clamp's mask)``."""
        uc, mask = self.clipped(u)
        return self.acts[slot](uc), uc, mask

    def gate_into(self, slot: int, u: Array, out: Array, mask: Array | None) -> None:
        """Clip ``u`` in place (its gradient mask into ``mask``), then ``out = activation slot(u)``."""
        if self.clip:
            np.less_equal(np.abs(u), self.clip, out=mask)
            np.clip(u, -self.clip, self.clip, out=u)
        self.acts[slot].into(u, out)

    def grad_into(self, slot: int, dy: Array, uc: Array, y: Array, mask: Array | None, out: Array) -> None:
        """``out`` = the gradient of a gate pre-activation from its value's gradient ``dy`` (``grad``)."""
        np.multiply(dy, self.acts[slot].slope(uc, y), out=out)
        if mask is not None:
            out *= mask

    def grad(self, slot: int, dy: Array, uc: Array, y: Array, mask: Array | None) -> Array:
        """The gradient of a gate pre-activation from its value's gradient ``dy``."""
        out = dy * self.acts[slot].slope(uc, y)
        return out if mask is None else out * mask


# --- the recurrences: forward keeps what the reverse pass reads; reverse returns the per-step gradients
# Arrays are time-major [seq, batch, features]; ``order`` is the direction's walk, ``valid[t]`` [batch, 1]
# (``valid`` None: every step of every row); ``xp`` is the input projection plus bias, which a forward
# may keep and overwrite.


def _lstm_forward(cell: _Cell, xp: Array, w: Mapping[str, Array], h: Array, c: Array, valid: Array | None, order):
    S, B, _ = xp.shape
    H = c.shape[1]
    peep, w_hr = w.get("peepholes"), w.get("w_hr")
    keep = {k: np.empty((S, B, n), xp.dtype) for k, n in
            (("h_prev", h.shape[1]), ("c_prev", H), ("c_new", H), ("hc", H), ("raw", H)) if k != "raw" or w_hr is not None}
    # the projection's buffer becomes the pre-activations' (each step adds W_hh·h to its row), and also the
    # gates' where those are activated in place (h's slot reads c', not the gates)
    keep["u"] = xp
    keep["y"] = np.empty_like(xp) if cell.keeps_pre_activations(2) else xp
    step = np.empty((B, 4 * H), xp.dtype)
    keep["mask"] = np.ones((S, B, 4 * H), bool) if cell.clip else None
    out = np.zeros((S, B, h.shape[1]), xp.dtype)
    # o⊙h(c') is kept for the projection's gradient; without one (and every step valid) it is the step's output
    direct = w_hr is None and valid is None
    scratch = np.empty((B, H), xp.dtype) if w_hr is None and valid is not None else None
    first = 1 if cell.input_forget else 2  # the gates of activation slot 0 that lead: i (and f)
    for t in order:
        keep["h_prev"][t], keep["c_prev"][t] = h, c
        u, y, c_new, hc = keep["u"][t], keep["y"][t], keep["c_new"][t], keep["hc"][t]
        raw = keep["raw"][t] if w_hr is not None else out[t] if direct else scratch
        np.matmul(h, w["w_hh"].T, out=step)
        u += step
        if peep is not None:
            u[:, :H] += peep[:H] * c
            u[:, H: 2 * H] += peep[2 * H:] * c
        m = keep["mask"][t] if cell.clip else None
        cell.gate_into(0, u[:, : first * H], y[:, : first * H], None if m is None else m[:, : first * H])
        if cell.input_forget:
            np.subtract(1, y[:, :H], out=y[:, H: 2 * H])
        cell.gate_into(1, u[:, 2 * H: 3 * H], y[:, 2 * H: 3 * H], None if m is None else m[:, 2 * H: 3 * H])
        np.multiply(y[:, H: 2 * H], c, out=c_new)
        c_new += y[:, :H] * y[:, 2 * H: 3 * H]
        if peep is not None:
            u[:, 3 * H:] += peep[H: 2 * H] * c_new
        cell.gate_into(0, u[:, 3 * H:], y[:, 3 * H:], None if m is None else m[:, 3 * H:])
        cell.acts[2].into(c_new, hc)
        np.multiply(y[:, 3 * H:], hc, out=raw)
        h_new = raw @ w_hr.T if w_hr is not None else raw
        v = None if valid is None else valid[t]
        h, c = _where(v, h_new, h), _where(v, c_new, c)
        if not direct:
            out[t] = _where(v, h_new, 0)
    return out, (h, c), keep


def _lstm_reverse(cell: _Cell, keep, w: Mapping[str, Array], dy: Array, dh: Array, dc: Array, valid: Array | None,
                  order):
    S, B, _ = dy.shape
    H = dc.shape[1]
    peep, w_hr = w.get("peepholes"), w.get("w_hr")
    dz_all = np.zeros((S, B, 4 * H), dy.dtype)
    dh_out = np.zeros_like(dy) if w_hr is not None else None
    for t in order:
        v = None if valid is None else valid[t]
        dh_in = dh + _where(v, dy[t], 0)
        u, y, m = keep["u"][t], keep["y"][t], keep["mask"][t] if cell.clip else None
        gi, gf, gg, go = (y[:, k * H: (k + 1) * H] for k in range(4))
        dz = dz_all[t]
        dzi, dzf, dzg, dzo = (dz[:, k * H: (k + 1) * H] for k in range(4))

        def part(k: int) -> Array | None:
            return None if m is None else m[:, k * H: (k + 1) * H]
        draw = dh_in @ w_hr if w_hr is not None else dh_in
        hc, c_prev = keep["hc"][t], keep["c_prev"][t]
        cell.grad_into(0, draw * hc, u[:, 3 * H:], go, part(3), dzo)
        dcn = draw * go
        dcn *= cell.acts[2].slope(keep["c_new"][t], hc)
        dcn += dc
        if peep is not None:
            dcn += dzo * peep[H: 2 * H]
        dgi = dcn * gg
        dgf = dcn * c_prev
        if cell.input_forget:
            dgi -= dgf
        else:
            cell.grad_into(0, dgf, u[:, H: 2 * H], gf, part(1), dzf)
        cell.grad_into(0, dgi, u[:, :H], gi, part(0), dzi)
        cell.grad_into(1, dcn * gi, u[:, 2 * H: 3 * H], gg, part(2), dzg)
        dc_prev = dcn * gf
        if peep is not None:
            dc_prev += dzi * peep[:H]
            dc_prev += dzf * peep[2 * H:]
        if v is not None:  # a row past its length takes no step: no gradient reaches its gates
            dz[...] = np.where(v, dz, 0)
        if dh_out is not None:
            dh_out[t] = _where(v, dh_in, 0)
        dh, dc = _where(v, dz @ w["w_hh"], dh), _where(v, dc_prev, dc)
    grads = {"w_hh": _sum_outer(dz_all, keep["h_prev"])}
    if peep is not None:
        dzi, dzf, dzo = dz_all[..., :H], dz_all[..., H: 2 * H], dz_all[..., 3 * H:]
        grads["peepholes"] = np.concatenate([_sum(dzi * keep["c_prev"]), _sum(dzo * keep["c_new"]),
                                             _sum(dzf * keep["c_prev"])])
    if w_hr is not None:
        grads["w_hr"] = _sum_outer(dh_out, keep["raw"])
    return dz_all, {"bias": _sum(dz_all)}, grads, (dh, dc)


def _gru_forward(cell: _Cell, xp: Array, w: Mapping[str, Array], h: Array, c: None, valid: Array, order):
    S, B, _ = xp.shape
    H = h.shape[1]
    w_hh, b_hh, lbr = w["w_hh"], w["b_hh"], cell.linear_before_reset
    keep = {k: np.zeros((S, B, H), xp.dtype) for k in ("h_prev", "hn")}
    keep["u"] = xp  # each step adds the hidden side to its row of the projection (see _lstm_forward)
    keep["y"] = np.zeros_like(xp) if cell.keeps_pre_activations(2) else xp
    keep["mask"] = np.ones((S, B, 3 * H), bool) if cell.clip else None
    hidden = np.empty((B, 3 * H if lbr else 2 * H), xp.dtype)
    out = np.zeros((S, B, H), xp.dtype)
    for t in order:
        u, y, m = xp[t], keep["y"][t], keep["mask"][t] if cell.clip else None
        np.matmul(h, (w_hh if lbr else w_hh[: 2 * H]).T, out=hidden)
        hidden += b_hh if lbr else b_hh[: 2 * H]
        u[:, : 2 * H] += hidden[:, : 2 * H]
        cell.gate_into(0, u[:, : 2 * H], y[:, : 2 * H], None if m is None else m[:, : 2 * H])
        r, z = y[:, :H], y[:, H: 2 * H]
        if lbr:
            hn = hidden[:, 2 * H:]
            u[:, 2 * H:] += r * hn
        else:
            hn = r * h  # the n block's hidden-side operand: W_hn·(r⊙h)
            u[:, 2 * H:] += hn @ w_hh[2 * H:].T
            u[:, 2 * H:] += b_hh[2 * H:]
        cell.gate_into(1, u[:, 2 * H:], y[:, 2 * H:], None if m is None else m[:, 2 * H:])
        n = y[:, 2 * H:]
        h_new = (1 - z) * n + z * h
        keep["h_prev"][t], keep["hn"][t] = h, hn
        v = None if valid is None else valid[t]
        h = _where(v, h_new, h)
        out[t] = _where(v, h_new, 0)
    return out, (h, None), keep


def _gru_reverse(cell: _Cell, keep, w: Mapping[str, Array], dy: Array, dh: Array, dc: None, valid: Array, order):
    S, B, _ = dy.shape
    H = dh.shape[1]
    w_hh = w["w_hh"]
    d_in = np.zeros((S, B, 3 * H), dy.dtype)  # input side: W_ih·x + b_ih
    d_hid = np.zeros((S, B, 3 * H), dy.dtype)  # hidden side: W_hh·h + b_hh (n block: W_hn·(r⊙h) without lbr)
    for t in order:
        v = None if valid is None else valid[t]
        dh_in = dh + _where(v, dy[t], 0)
        u, y, m = keep["u"][t], keep["y"][t], keep["mask"][t] if cell.clip else None
        r, z, n = y[:, :H], y[:, H: 2 * H], y[:, 2 * H:]
        h_prev, hn = keep["h_prev"][t], keep["hn"][t]
        dpn = cell.grad(1, dh_in * (1 - z), u[:, 2 * H:], n, None if m is None else m[:, 2 * H:])
        dh_prev = dh_in * z
        if cell.linear_before_reset:
            dhn, dr = dpn * r, dpn * hn
        else:
            dq = dpn @ w_hh[2 * H:]
            dhn, dr = dpn, dq * h_prev
            dh_prev = dh_prev + dq * r
        drz = cell.grad(0, np.concatenate([dr, dh_in * (h_prev - n)], axis=1), u[:, : 2 * H], y[:, : 2 * H],
                        None if m is None else m[:, : 2 * H])
        da = _where(v, np.concatenate([drz, dpn], axis=1), 0)
        dhid = _where(v, np.concatenate([drz, dhn], axis=1), 0)
        d_in[t], d_hid[t] = da, dhid
        if cell.linear_before_reset:
            dh_prev = dh_prev + dhid @ w_hh
        else:
            dh_prev = dh_prev + dhid[:, : 2 * H] @ w_hh[: 2 * H]
        dh = _where(v, dh_prev, dh)
    if cell.linear_before_reset:
        d_w_hh = _sum_outer(d_hid, keep["h_prev"])
    else:
        d_w_hh = np.concatenate([_sum_outer(d_hid[..., : 2 * H], keep["h_prev"]),
                                 _sum_outer(d_hid[..., 2 * H:], keep["hn"])])
    return d_in, {"b_ih": _sum(d_in), "b_hh": _sum(d_hid)}, {"w_hh": d_w_hh}, (dh, None)


def _rnn_forward(cell: _Cell, xp: Array, w: Mapping[str, Array], h: Array, c: None, valid: Array, order):
    S, B, _ = xp.shape
    H = h.shape[1]
    keep = {"h_prev": np.zeros((S, B, H), xp.dtype), "u": xp}  # the projection's rows (see _lstm_forward)
    keep["y"] = np.zeros_like(xp) if cell.keeps_pre_activations(1) else xp
    keep["mask"] = np.ones((S, B, H), bool) if cell.clip else None
    hidden = np.empty((B, H), xp.dtype)
    out = np.zeros((S, B, H), xp.dtype)
    for t in order:
        u, y = xp[t], keep["y"][t]
        np.matmul(h, w["w_hh"].T, out=hidden)
        u += hidden
        cell.gate_into(0, u, y, keep["mask"][t] if cell.clip else None)
        keep["h_prev"][t] = h
        v = None if valid is None else valid[t]
        h = _where(v, y, h)
        out[t] = _where(v, y, 0)
    return out, (h, None), keep


def _rnn_reverse(cell: _Cell, keep, w: Mapping[str, Array], dy: Array, dh: Array, dc: None, valid: Array, order):
    dz_all = np.zeros_like(keep["u"])
    for t in order:
        v = None if valid is None else valid[t]
        m = keep["mask"][t] if cell.clip else None
        dz = _where(v, cell.grad(0, dh + _where(v, dy[t], 0), keep["u"][t], keep["y"][t], m), 0)
        dz_all[t] = dz
        dh = _where(v, dz @ w["w_hh"], dh)
    return dz_all, {"bias": _sum(dz_all)}, {"w_hh": _sum_outer(dz_all, keep["h_prev"])}, (dh, None)


def _compiled_lstm_forward(cell: _Cell, xp: Array, w: Mapping[str, Array], h: Array, c: Array,
                           valid: Array | None, order: range):
    """``_lstm_forward`` where ``lstm_sequence`` applies, in one Numba call; it keeps what
    ``_compiled_lstm_reverse`` reads."""
    S, B, _ = xp.shape
    keep = {k: np.empty((S, B, c.shape[1]), xp.dtype) for k in ("h_prev", "c_prev", "hc")}
    keep["y"] = xp  # the gates, activated in place
    out = np.empty_like(keep["hc"])
    h, c = h.copy(), c.copy()
    lstm_sequence.forward(xp, w["w_hh"], h, c, _lengths(valid), order.step < 0, out,
                          (keep["h_prev"], keep["c_prev"], keep["hc"]))
    return out, (h, c), keep


def _compiled_lstm_reverse(cell: _Cell, keep, w: Mapping[str, Array], dy: Array, dh: Array, dc: Array,
                           valid: Array | None, order: range):
    """``_lstm_reverse`` of ``_compiled_lstm_forward``'s steps, in one Numba call."""
    dz_all = np.empty_like(keep["y"])
    dh, dc = dh.copy(), dc.copy()
    # ``order`` walks the forward's steps from the end: backwards where the forward walked forwards
    lstm_sequence.backward(keep["y"], keep["hc"], keep["c_prev"], w["w_hh"], dy, dh, dc, _lengths(valid),
                           order.step > 0, dz_all)
    return dz_all, {"bias": _sum(dz_all)}, {"w_hh": _sum_outer(dz_all, keep["h_prev"])}, (dh, dc)


def _lengths(valid: Array | None) -> Array:
    """Each row's valid steps from ``valid`` ``[seq, batch, 1]`` (``None``: all), as ``lstm_sequence`` takes them."""
    return lstm_sequence.lengths(None if valid is None else np.count_nonzero(valid[:, :, 0], axis=0))


_FORWARD = {"lstm": _lstm_forward, "gru": _gru_forward, "rnn": _rnn_forward}
_REVERSE = {"lstm": _lstm_reverse, "gru": _gru_reverse, "rnn": _rnn_reverse}


def _where(valid: Array | None, new: Array, old: Array | float) -> Array:
    """``new`` where ``valid`` (``None``: everywhere), else ``old``."""
    return new if valid is None else np.where(valid, new, old)


def _sum(a: Array) -> Array:
    """Sum over the time and batch axes of ``[seq, batch, n]``."""
    return a.reshape(-1, a.shape[-1]).sum(axis=0)


def _sum_outer(d: Array, operand: Array) -> Array:
    """``Σ_{t,b} d[t,b] ⊗ operand[t,b]``: one GEMM over the ``seq*batch`` rows."""
    return d.reshape(-1, d.shape[-1]).T @ operand.reshape(-1, operand.shape[-1])


# --- the thunk ---------------------------------------------------------------------------------------
def _each_direction(jobs: list[Callable[[], None]]) -> None:
    """Run a layer's directions, each with a one-thread BLAS: two at once on two threads where there are
    two cores, else one after the other. A step's GEMMs are small (``batch`` rows): a second BLAS
    thread mostly waits on the first, and on a busy machine it waits for a core (lstm B32 I=H=256
    S128 while the machine ran other work: 25 ms a step's W_hh GEMM with two threads, 1.4 ms with one)."""
    if len(jobs) > 1 and threads.cores() >= 2:
        threads.run_all(jobs)
        return
    with threads.single_threaded_blas():
        for job in jobs:
            job()


def _valid(t: Mapping[str, Any], b: Bound) -> Array | None:
    """``[seq, batch, 1]``: whether step ``t`` of row ``b`` is one of its ``seq_lens`` valid steps; ``None``
    without ``seq_lens`` (every step is)."""
    if t["seq_lens"] is None:
        return None
    return np.arange(t["seq"])[:, None, None] < b.view("seq_lens").astype(np.int64)[None, :, None]


def _cell(t: Mapping[str, Any], direction: int) -> _Cell:
    """Direction ``direction``'s activations and flags of the forward thunk ``t``."""
    slots = ACTIVATION_SLOTS[t["op"]]
    acts = tuple(_Activation(name, float(a), float(b))
                 for name, a, b in t["activations"][direction * slots: (direction + 1) * slots])
    return _Cell(acts, float(t["clip"]), bool(t.get("linear_before_reset", True)), bool(t.get("input_forget", False)))


def prepare(thunk: Mapping[str, Any]) -> Callable[[np.ndarray], None]:
    """The thunk-only setup once (``host_fallback.PREPARE``): the completed fields and the regions, which a
    small thunk's run would otherwise spend a tenth of its time on (lstm B=8 S=24 H=32, 2 layers)."""
    t = complete(thunk)
    by_field = {r.field: r for r in regions(t)}
    return lambda arena: _backward(t, arena, by_field)


def _run(thunk: Mapping[str, Any], arena: np.ndarray) -> None:
    """Run one lstm/gru/rnn backward thunk in place."""
    prepare(thunk)(arena)


def _backward(t: Mapping[str, Any], arena: np.ndarray, by_field: Mapping[str, Region]) -> None:
    fwd = forward_thunk(t)
    op = fwd["op"]
    gates, dirs = recurrent_dims(fwd)
    b = Bound(t, arena, by_field)
    S, B, H, width, dt = t["seq"], t["batch"], t["hidden"], output_width(fwd), COMPUTE[t["dtype"]]
    valid = _valid(t, b)
    biases = ("bias",) if op != "gru" else ("b_ih", "b_hh")
    w_ih = b.load("w_ih")
    d_w_ih = np.zeros_like(w_ih)
    grads: dict[str, Array] = {f: np.zeros(b.regions[f].shape, dt) for f in ("w_hh",) + biases}
    for f in ("peepholes", "w_hr"):
        if t.get(f) is not None:
            grads[f] = np.zeros(b.regions[f].shape, dt)
    states = ("h0", "c0") if op == "lstm" else ("h0",)
    if t["carry"]:
        init = {f: b.load(f) for f in states}
        d_final = {f: b.load(f"d_{f}") for f in states}
        d_init = {f: np.zeros_like(init[f]) for f in states}
    cells = [_cell(fwd, dr) for dr in range(dirs)]  # a direction's activations and flags, alike in every layer
    compiled = lstm_sequence.applies(fwd)
    forwards = _compiled_lstm_forward if compiled else _FORWARD[op]
    reverses = _compiled_lstm_reverse if compiled else _REVERSE[op]
    spans, offset = [], 0
    for in_l in layer_input_sizes(fwd):
        size = gates * H * in_l
        spans.append([(offset + k * size, offset + (k + 1) * size, in_l) for k in range(dirs)])
        offset += dirs * size

    def weights(ld: int) -> dict[str, Array]:
        out = {"w_hh": b.load("w_hh", ld)}
        if op == "gru":
            out["b_hh"] = b.load("b_hh", ld)
        for f in ("peepholes", "w_hr"):
            if t.get(f) is not None:
                out[f] = b.load(f, ld)
        return out

    def walk(dr: int) -> range:
        backwards = dr == 1 or t["reverse"]
        return range(S - 1, -1, -1) if backwards else range(S)

    # forward, bottom up: every layer's input and what each direction keeps
    x = np.ascontiguousarray(b.load("x").transpose(1, 0, 2))
    inputs, kept = [x], []
    for layer, layer_spans in enumerate(spans):
        outs: list[Array] = [None] * dirs
        layer_kept: list[dict] = [None] * dirs

        def forward(dr: int, lo: int, hi: int, in_l: int, layer: int = layer) -> None:
            ld = layer * dirs + dr
            w = w_ih[lo:hi].reshape(gates * H, in_l)
            xp = (inputs[-1].reshape(S * B, in_l) @ w.T).reshape(S, B, gates * H)
            xp += b.load(biases[0], ld)
            h = init["h0"][ld] if t["carry"] else np.zeros((B, width), dt)
            c = (init["c0"][ld] if t["carry"] else np.zeros((B, H), dt)) if op == "lstm" else None
            outs[dr], _, layer_kept[dr] = forwards(cells[dr], xp, weights(ld), h, c, valid, walk(dr))

        _each_direction([lambda dr=dr, span=span: forward(dr, *span) for dr, span in enumerate(layer_spans)])
        if layer + 1 < len(spans):  # the next layer's input (the top layer's output is dst: not needed here)
            inputs.append(np.concatenate(outs, axis=2))
        kept.append(layer_kept)

    # reverse, top down: d_y is the gradient of the layer's output, then of its input
    d_y = _where(valid, b.load("d_dst").transpose(1, 0, 2), 0)
    for layer in reversed(range(len(spans))):
        d_ins: list[Array] = [None] * dirs

        def reverse(dr: int, lo: int, hi: int, in_l: int, layer: int = layer) -> None:
            ld = layer * dirs + dr
            dh = d_final["h0"][ld] if t["carry"] else np.zeros((B, width), dt)
            dc = (d_final["c0"][ld] if t["carry"] else np.zeros((B, H), dt)) if op == "lstm" else None
            d_pre, d_bias, d_w, (dh, dc) = reverses(cells[dr], kept[layer][dr], weights(ld),
                                                    d_y[..., dr * width: (dr + 1) * width], dh, dc, valid,
                                                    walk(dr)[::-1])
            d_w_ih[lo:hi] = _sum_outer(d_pre, inputs[layer]).reshape(-1)
            d_ins[dr] = (d_pre.reshape(S * B, -1) @ w_ih[lo:hi].reshape(gates * H, in_l)).reshape(S, B, in_l)
            for f, g in {**d_bias, **d_w}.items():
                grads[f][ld] = g
            if t["carry"]:
                d_init["h0"][ld] = dh
                if dc is not None:
                    d_init["c0"][ld] = dc

        _each_direction([lambda dr=dr, span=span: reverse(dr, *span) for dr, span in enumerate(spans[layer])])
        kept[layer] = []  # the layer's saved steps are no longer needed
        d_in = d_ins[0]
        if dirs == 2:
            d_in += d_ins[1]  # in direction order: the same bytes every run
        d_y = _where(valid, d_in, 0) if layer else d_in
    b.store("d_x", d_y.transpose(1, 0, 2))
    b.store("d_w_ih", d_w_ih)
    for f, g in grads.items():
        b.store(f"d_{f}", g)
    if t["carry"]:
        for f in states:
            b.store(f"d_{f}", d_init[f])


KERNELS.add(("lstm_backward", "gru_backward", "rnn_backward"), _run)
PREPARE.add(("lstm_backward", "gru_backward", "rnn_backward"), prepare)
