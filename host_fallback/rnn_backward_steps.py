"""The recurrences of ``rnn_backward`` per op (lstm, gru, rnn): a layer-direction's forward again, keeping
what the reverse pass reads, and its steps back through time, returning the per-step gradients (the compiled
lstm's through ``lstm_sequence``)."""
from __future__ import annotations

from typing import Mapping

import numpy as np

from . import gemm, lstm_sequence, rnn_backward_gates
from .rnn_backward_cell import _Cell

Array = np.ndarray


# --- the recurrences: forward keeps what the reverse pass reads; reverse returns the per-step gradients
# Arrays are time-major [seq, batch, features]; ``order`` is the direction's walk, ``valid[t]`` [batch, 1]
# (``valid`` None: every step of every row); ``xp`` is the input projection plus bias, which a forward
# may keep and overwrite. ``into`` (a saved forward's slots by name: ``rnn_reserve.slots``; None: none) holds
# the arrays a forward keeps where it has them, so a forward writing a reserve copies nothing.


def _array(into: Mapping[str, Array] | None, name: str, shape: tuple[int, ...], dtype, fill=None) -> Array:
    """A kept array: ``into[name]`` where there is one (``fill`` written over it), else a new one."""
    if into is not None and name in into:
        out = into[name]
        if fill is not None:
            out[...] = fill
        return out
    return np.empty(shape, dtype) if fill is None else np.full(shape, fill, dtype)


def _lstm_leading_gates(cell: _Cell, u: Array, y: Array, m: Array | None) -> None:
    """i, f (``1 - i`` with ``input_forget``) and g of a step's pre-activations ``u`` into ``y``, or of a chunk's
    steps at once (a leading step axis); ``m`` the clip's mask."""
    H, first = u.shape[-1] // 4, 1 if cell.input_forget else 2  # the gates of activation slot 0 that lead
    cell.gate_into(0, u[..., : first * H], y[..., : first * H], None if m is None else m[..., : first * H])
    if cell.input_forget:
        np.subtract(1, y[..., :H], out=y[..., H: 2 * H])
    cell.gate_into(1, u[..., 2 * H: 3 * H], y[..., 2 * H: 3 * H], None if m is None else m[..., 2 * H: 3 * H])


def _lstm_output_gate(cell: _Cell, u: Array, y: Array, m: Array | None) -> None:
    """o, as ``_lstm_leading_gates`` (after the new cell's peephole, where there is one)."""
    H = u.shape[-1] // 4
    cell.gate_into(0, u[..., 3 * H:], y[..., 3 * H:], None if m is None else m[..., 3 * H:])


def _lstm_forward(cell: _Cell, xp: Array, w: Mapping[str, Array], h: Array, c: Array, valid: Array | None, order,
                  into: Mapping[str, Array] | None = None):
    S, B, _ = xp.shape
    H = c.shape[1]
    peep, w_hr = w.get("peepholes"), w.get("w_hr")
    keep = {k: _array(into, k, (S, B, n), xp.dtype) for k, n in
            (("h_prev", h.shape[1]), ("c_prev", H), ("c_new", H), ("hc", H), ("raw", H)) if k != "raw" or w_hr is not None}
    # the projection's buffer becomes the pre-activations' (each step adds W_hh·h to its row), and also the
    # gates' where those are activated in place (h's slot reads c', not the gates)
    keep["u"] = xp
    keep["y"] = _array(into, "y", xp.shape, xp.dtype) if cell.keeps_pre_activations(2) else xp
    step, w_t = np.empty((B, 4 * H), xp.dtype), _transposed(w["w_hh"])
    keep["mask"] = _array(into, "mask", (S, B, 4 * H), bool, True) if cell.clip else None
    out = np.zeros((S, B, h.shape[1]), xp.dtype)
    # o⊙h(c') is kept for the projection's gradient; without one (and every step valid) it is the step's output
    direct = w_hr is None and valid is None
    scratch = np.empty((B, H), xp.dtype) if w_hr is None and valid is not None else None
    for t in order:
        keep["h_prev"][t], keep["c_prev"][t] = h, c
        u, y, c_new, hc = keep["u"][t], keep["y"][t], keep["c_new"][t], keep["hc"][t]
        raw = keep["raw"][t] if w_hr is not None else out[t] if direct else scratch
        np.matmul(h, w_t, out=step)
        u += step
        if peep is not None:
            u[:, :H] += peep[:H] * c
            u[:, H: 2 * H] += peep[2 * H:] * c
        m = keep["mask"][t] if cell.clip else None
        _lstm_leading_gates(cell, u, y, m)
        _lstm_cell(y, c, c_new)
        if peep is not None:
            u[:, 3 * H:] += peep[H: 2 * H] * c_new
        _lstm_output_gate(cell, u, y, m)
        cell.acts[2].into(c_new, hc)
        np.multiply(y[:, 3 * H:], hc, out=raw)
        h_new = raw @ w_hr.T if w_hr is not None else raw
        v = None if valid is None else valid[t]
        h, c = _where(v, h_new, h), _where(v, c_new, c)
        if not direct:
            out[t] = _where(v, h_new, 0)
    return out, (h, c), keep


def _lstm_cell(y: Array, c: Array, c_new: Array) -> None:
    """``c_new = f⊙c + i⊙g`` from a step's gates ``y``."""
    H = c.shape[-1]
    np.multiply(y[:, H: 2 * H], c, out=c_new)
    c_new += y[:, :H] * y[:, 2 * H: 3 * H]


def _lstm_chunk(cell: _Cell, xp: Array, w: Mapping[str, Array], h_prev: Array, c: Array, valid: Array | None,
                order) -> dict:
    """What ``_lstm_forward`` keeps over a chunk whose every step's entering state ``h_prev`` is known, without
    peepholes (whose gates read the cell): the gates of its steps at once, then the cell step by step from its
    entering value ``c`` (``order``: the walk), then ``h(c')`` at once; in one compiled pass where
    ``rnn_backward_gates`` applies."""
    xp += _times(h_prev, w["w_hh"].T)
    keep = rnn_backward_gates.lstm(cell, xp, c, _lengths(valid), order.step < 0)
    if keep is not None:
        keep.update(h_prev=h_prev, u=xp, y=xp, mask=None)
    else:
        keep = {k: np.empty((*xp.shape[:2], c.shape[-1]), xp.dtype) for k in ("c_prev", "c_new", "hc")}
        keep.update(h_prev=h_prev, u=xp, y=np.empty_like(xp) if cell.keeps_pre_activations(2) else xp,
                    mask=np.ones(xp.shape, bool) if cell.clip else None)
        _lstm_leading_gates(cell, xp, keep["y"], keep["mask"])
        _lstm_output_gate(cell, xp, keep["y"], keep["mask"])
        for t in order:
            keep["c_prev"][t] = c
            _lstm_cell(keep["y"][t], c, keep["c_new"][t])
            c = _where(None if valid is None else valid[t], keep["c_new"][t], c)
        cell.acts[2].into(keep["c_new"], keep["hc"])
    if w.get("w_hr") is not None:
        keep["raw"] = keep["y"][..., 3 * c.shape[-1]:] * keep["hc"]
    return keep


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


def _gru_keep(cell: _Cell, xp: Array, h_shape: tuple[int, ...], into: Mapping[str, Array] | None) -> dict:
    """The arrays a gru's steps keep (``h_shape``: the entering states'): the projection's buffer becomes the
    pre-activations ``u`` (each step adds the hidden side to its row, see ``_lstm_forward``)."""
    keep = {k: _array(into, k, h_shape, xp.dtype) for k in ("h_prev", "hn")}  # every step writes its row
    keep["u"] = xp
    keep["y"] = _array(into, "y", xp.shape, xp.dtype) if cell.keeps_pre_activations(2) else xp
    keep["mask"] = _array(into, "mask", xp.shape, bool, True) if cell.clip else None
    return keep


def _gru_gates(cell: _Cell, u: Array, y: Array, m: Array | None, h: Array, hidden: Array, w: Mapping[str, Array]):
    """The gates of a step, or of a chunk's steps at once (a leading step axis) given each one's entering state
    ``h``, and the n block's hidden-side operand (returned): ``u`` holds the input projection and becomes the pre-activations,
    ``y`` the gates; ``hidden`` is ``h·W_hh^T`` (its r, z rows only without ``linear_before_reset``)."""
    w_hh, b_hh, lbr = w["w_hh"], w["b_hh"], cell.linear_before_reset
    H = h.shape[-1]
    hidden += b_hh if lbr else b_hh[: 2 * H]
    u[..., : 2 * H] += hidden[..., : 2 * H]
    cell.gate_into(0, u[..., : 2 * H], y[..., : 2 * H], None if m is None else m[..., : 2 * H])
    r = y[..., :H]
    if lbr:
        hn = hidden[..., 2 * H:]
        u[..., 2 * H:] += r * hn
    else:
        hn = r * h  # the n block's hidden-side operand: W_hn·(r⊙h)
        u[..., 2 * H:] += _times(hn, w_hh[2 * H:].T)
        u[..., 2 * H:] += b_hh[2 * H:]
    cell.gate_into(1, u[..., 2 * H:], y[..., 2 * H:], None if m is None else m[..., 2 * H:])
    return hn


def _gru_forward(cell: _Cell, xp: Array, w: Mapping[str, Array], h: Array, c: None, valid: Array, order,
                 into: Mapping[str, Array] | None = None):
    S, B, _ = xp.shape
    H = h.shape[1]
    keep = _gru_keep(cell, xp, (S, B, H), into)
    w_t = _transposed(w["w_hh"] if cell.linear_before_reset else w["w_hh"][: 2 * H])
    hidden = np.empty((B, w_t.shape[1]), xp.dtype)
    out = np.zeros((S, B, H), xp.dtype)
    for t in order:
        np.matmul(h, w_t, out=hidden)
        y = keep["y"][t]
        keep["hn"][t] = _gru_gates(cell, xp[t], y, keep["mask"][t] if cell.clip else None, h, hidden, w)
        z, n = y[:, H: 2 * H], y[:, 2 * H:]
        h_new = (1 - z) * n + z * h
        keep["h_prev"][t] = h
        v = None if valid is None else valid[t]
        h = _where(v, h_new, h)
        out[t] = _where(v, h_new, 0)
    return out, (h, None), keep


def _gru_chunk(cell: _Cell, xp: Array, w: Mapping[str, Array], h_prev: Array, *_) -> dict:
    """What ``_gru_forward`` keeps over a chunk whose every step's entering state ``h_prev [n, batch, H]`` is
    known (the layer's output, one step over): its steps at once, no recurrence."""
    keep = _gru_keep(cell, xp, h_prev.shape, None)
    w_h = w["w_hh"] if cell.linear_before_reset else w["w_hh"][: 2 * h_prev.shape[-1]]
    keep["h_prev"] = h_prev
    hidden = _times(h_prev, w_h.T)
    if rnn_backward_gates.gru(cell, xp, hidden, w["b_hh"]):  # one compiled pass
        keep["hn"] = hidden[..., 2 * h_prev.shape[-1]:]
    else:
        keep["hn"] = _gru_gates(cell, xp, keep["y"], keep["mask"], h_prev, hidden, w)
    return keep


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


def _rnn_keep(cell: _Cell, xp: Array, into: Mapping[str, Array] | None) -> dict:
    """The arrays an rnn's steps keep: the projection's rows become the pre-activations (see ``_lstm_forward``)."""
    keep = {"h_prev": _array(into, "h_prev", xp.shape, xp.dtype), "u": xp}
    keep["y"] = _array(into, "y", xp.shape, xp.dtype) if cell.keeps_pre_activations(1) else xp
    keep["mask"] = _array(into, "mask", xp.shape, bool, True) if cell.clip else None
    return keep


def _rnn_forward(cell: _Cell, xp: Array, w: Mapping[str, Array], h: Array, c: None, valid: Array, order,
                 into: Mapping[str, Array] | None = None):
    S, B, H = xp.shape
    keep = _rnn_keep(cell, xp, into)
    hidden, w_t = np.empty((B, H), xp.dtype), _transposed(w["w_hh"])
    out = np.zeros((S, B, H), xp.dtype)
    for t in order:
        u, y = xp[t], keep["y"][t]
        np.matmul(h, w_t, out=hidden)
        u += hidden
        cell.gate_into(0, u, y, keep["mask"][t] if cell.clip else None)
        keep["h_prev"][t] = h
        v = None if valid is None else valid[t]
        h = _where(v, y, h)
        out[t] = _where(v, y, 0)
    return out, (h, None), keep


def _rnn_chunk(cell: _Cell, xp: Array, w: Mapping[str, Array], h_prev: Array, *_) -> dict:
    """``_gru_chunk`` for an rnn."""
    keep = _rnn_keep(cell, xp, {"h_prev": h_prev})
    xp += _times(h_prev, w["w_hh"].T)
    cell.gate_into(0, xp, keep["y"], keep["mask"])
    return keep


def _rnn_from_output(cell: _Cell, h_prev: Array, out: Array) -> dict | None:
    """What ``_rnn_forward`` keeps over a chunk, read off the layer's output ``out`` (its steps, the direction's
    columns) where the reverse pass needs no pre-activation (``_Cell.keeps_pre_activations``): the output is the
    gate's value (0 past a row's length, where the reverse pass takes no step), so no GEMM runs. None otherwise."""
    if cell.keeps_pre_activations(1):
        return None
    return {"h_prev": h_prev, "u": out, "y": out, "mask": None}


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
                           valid: Array | None, order: range, into: Mapping[str, Array] | None = None):
    """``_lstm_forward`` where ``lstm_sequence`` applies, in one Numba call; it keeps what
    ``_compiled_lstm_reverse`` reads."""
    S, B, _ = xp.shape
    keep = {k: _array(into, k, (S, B, c.shape[1]), xp.dtype) for k in ("h_prev", "c_prev", "hc")}
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
#: What a chunk's forward keeps, given every step's entering state ``h_prev`` (``(cell, xp, w, h_prev, c, valid,
#: order)``, ``c`` the cell entering the chunk): the gates of every step at once (an lstm's with peepholes read the
#: cell: not here), and no recurrence but an lstm's cell.
_CHUNK = {"lstm": _lstm_chunk, "gru": _gru_chunk, "rnn": _rnn_chunk}
#: What a chunk's forward keeps, read off the layer's output without a GEMM where it can be (``(cell, h_prev, out)``;
#: None where it cannot).
_FROM_OUTPUT = {"rnn": _rnn_from_output}
_REVERSE = {"lstm": _lstm_reverse, "gru": _gru_reverse, "rnn": _rnn_reverse}


def _where(valid: Array | None, new: Array, old: Array | float) -> Array:
    """``new`` where ``valid`` (``None``: everywhere), else ``old``."""
    return new if valid is None else np.where(valid, new, old)


def _sum(a: Array) -> Array:
    """Sum over the time and batch axes of ``[seq, batch, n]``."""
    return a.reshape(-1, a.shape[-1]).sum(axis=0)


def _times(a: Array, m: Array) -> Array:
    """``a [..., k]`` times ``m [k, n]`` as one GEMM over all of ``a``'s rows (NumPy's matmul would run one small
    product per leading index; ``gemm`` says whose)."""
    return gemm.times(a.reshape(-1, a.shape[-1]), m).reshape(*a.shape[:-1], m.shape[1])


def _transposed(w: Array) -> Array:
    """``w^T`` laid out C-contiguous, for a step's ``h · w^T``: OpenBLAS runs that GEMM (batch 32, H=256) about 30%
    faster than on the transposed view (lstm 285 -> 210 µs, gru 236 -> 164, rnn 82 -> 58, one thread)."""
    return np.ascontiguousarray(w.T)


def _sum_outer(d: Array, operand: Array) -> Array:
    """``Σ_{t,b} d[t,b] ⊗ operand[t,b]``: one GEMM over the ``seq*batch`` rows."""
    return gemm.times(d.reshape(-1, d.shape[-1]).T, operand.reshape(-1, operand.shape[-1]))
