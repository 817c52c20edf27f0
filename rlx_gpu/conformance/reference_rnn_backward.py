"""Float64 reference of lstm_backward, gru_backward and rnn_backward (ABI.md §9), written from the
forward's formulas of ABI.md §3 and §8 (no host_fallback code, no finite differences).

Deliberately plain: the forward one batch-major step at a time in the ABI's gate order, every
intermediate kept per step, then the chain rule back through the steps in reverse, every weight
gradient summed step by step. The derivative at a kink is the one of the branch the forward's
formula takes there (ABI.md §9).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from .reference_rnn import _recurrent
from .registry import declare_cases, register

Load = Callable[[str], np.ndarray]
Fn = Callable[[np.ndarray, float, float], np.ndarray]


def _sigmoid(u: np.ndarray) -> np.ndarray:
    return 0.5 * (1 + np.tanh(0.5 * u))


#: name -> (the function, its derivative), both of the pre-activation u and the entry's alpha, beta
ACTIVATIONS: dict[str, tuple[Fn, Fn]] = {
    "sigmoid": (lambda u, a, b: _sigmoid(u), lambda u, a, b: _sigmoid(u) * (1 - _sigmoid(u))),
    "tanh": (lambda u, a, b: np.tanh(u), lambda u, a, b: 1 - np.tanh(u) ** 2),
    "relu": (lambda u, a, b: np.where(u > 0, u, 0.0), lambda u, a, b: np.where(u > 0, 1.0, 0.0)),
    "affine": (lambda u, a, b: a * u + b, lambda u, a, b: np.full_like(u, a)),
    "leaky_relu": (lambda u, a, b: np.where(u >= 0, u, a * u), lambda u, a, b: np.where(u >= 0, 1.0, a)),
    "thresholded_relu": (lambda u, a, b: np.where(u > a, u, 0.0), lambda u, a, b: np.where(u > a, 1.0, 0.0)),
    "scaled_tanh": (lambda u, a, b: a * np.tanh(b * u), lambda u, a, b: a * b * (1 - np.tanh(b * u) ** 2)),
    "hard_sigmoid": (lambda u, a, b: np.minimum(np.maximum(a * u + b, 0), 1),
                     lambda u, a, b: np.where((a * u + b >= 0) & (a * u + b <= 1), a, 0.0)),
    "elu": (lambda u, a, b: np.where(u >= 0, u, a * (np.exp(np.minimum(u, 0)) - 1)),
            lambda u, a, b: np.where(u >= 0, 1.0, a * np.exp(np.minimum(u, 0)))),
    "softsign": (lambda u, a, b: u / (1 + np.abs(u)), lambda u, a, b: 1 / (1 + np.abs(u)) ** 2),
    "softplus": (lambda u, a, b: np.log1p(np.exp(-np.abs(u))) + np.maximum(u, 0), lambda u, a, b: _sigmoid(u)),
}

#: The §8 fields of lstm/gru/rnn this reference implements (all of them), by backward op.
#: A saved forward (``reserve``) changes no gradient: the reference recomputes its forward either way.
V2_FIELDS: dict[str, frozenset[str]] = {
    "lstm_backward": frozenset({"seq_lens", "reverse", "clip", "activations", "peepholes", "input_forget",
                                "proj_size", "w_hr", "d_peepholes", "d_w_hr", "reserve", "reserve_bytes"}),
    "gru_backward": frozenset({"seq_lens", "reverse", "clip", "activations", "linear_before_reset", "reserve",
                               "reserve_bytes"}),
    "rnn_backward": frozenset({"seq_lens", "reverse", "clip", "activations", "reserve", "reserve_bytes"}),
}


class _Gate:
    """One activation slot with the clip: ``value(u)`` and ``back(u, d)`` (the gradient reaching u)."""

    def __init__(self, entry, clip: float):
        self.entry = entry
        name, self.alpha, self.beta = entry[0], float(entry[1]), float(entry[2])
        self.fn, self.slope = ACTIVATIONS[name]
        self.clip = clip

    def _clipped(self, u: np.ndarray) -> np.ndarray:
        return np.minimum(np.maximum(u, -self.clip), self.clip) if self.clip else u

    def value(self, u: np.ndarray) -> np.ndarray:
        return self.fn(self._clipped(u), self.alpha, self.beta)

    def back(self, u: np.ndarray, d: np.ndarray) -> np.ndarray:
        out = d * self.slope(self._clipped(u), self.alpha, self.beta)
        return out * (np.abs(u) <= self.clip) if self.clip else out


# Each op has a forward over one layer-direction (``order``: its walk), which returns what every step kept
# and its output sequence [S, B, W] (0 past a row's length), and a reverse pass over the kept steps, which
# returns the gradients of the layer input, of the weights, and of the initial state.
def _lstm_forward(t, p, gates, x, h, c, valid, order):
    f_act, g_act, h_act = gates
    H = t["hidden"]
    h_act = _Gate(h_act.entry, 0.0)  # the cell state itself is not clipped
    steps, out = {}, np.zeros(x.shape[:2] + (h.shape[1],))
    for s in order:
        z = x[s] @ p["w_ih"].T + h @ p["w_hh"].T + p["bias"]
        zi, zf, zg, zo = z[:, :H], z[:, H: 2 * H], z[:, 2 * H: 3 * H], z[:, 3 * H:]
        if p.get("peepholes") is not None:
            zi = zi + p["peepholes"][:H] * c
            zf = zf + p["peepholes"][2 * H:] * c
        i = f_act.value(zi)
        f = 1 - i if t["input_forget"] else f_act.value(zf)
        g = g_act.value(zg)
        c_new = f * c + i * g
        if p.get("peepholes") is not None:
            zo = zo + p["peepholes"][H: 2 * H] * c_new
        o = f_act.value(zo)
        m = o * h_act.value(c_new)
        h_new = m @ p["w_hr"].T if p.get("w_hr") is not None else m
        steps[s] = dict(x=x[s], h=h, c=c, zi=zi, zf=zf, zg=zg, zo=zo, i=i, f=f, g=g, o=o, c_new=c_new, m=m)
        v = valid[s][:, None]
        h, c = np.where(v, h_new, h), np.where(v, c_new, c)
        out[s] = np.where(v, h_new, 0.0)
    return steps, out


def _lstm_reverse(t, p, gates, steps, d_out, dh, dc, valid, order):
    f_act, g_act, h_act = gates
    H = t["hidden"]
    h_act = _Gate(h_act.entry, 0.0)
    grads = {k: np.zeros_like(v) for k, v in p.items()}
    d_x = np.zeros(d_out.shape[:2] + (p["w_ih"].shape[1],))
    for s in reversed(list(order)):
        k, v = steps[s], valid[s][:, None]
        dh_new = dh + np.where(v, d_out[s], 0.0)
        if p.get("w_hr") is not None:
            grads["w_hr"] += np.where(v, dh_new, 0.0).T @ k["m"]
            dm = dh_new @ p["w_hr"]
        else:
            dm = dh_new
        do = dm * h_act.value(k["c_new"])
        dcn = dc + dm * k["o"] * h_act.back(k["c_new"], np.ones_like(dm))
        dzo = f_act.back(k["zo"], do)
        if p.get("peepholes") is not None:
            dcn = dcn + dzo * p["peepholes"][H: 2 * H]
        di, df, dg = dcn * k["g"], dcn * k["c"], dcn * k["i"]
        dc_prev = dcn * k["f"]
        if t["input_forget"]:
            di, dzf = di - df, np.zeros_like(df)
        else:
            dzf = f_act.back(k["zf"], df)
        dzi, dzg = f_act.back(k["zi"], di), g_act.back(k["zg"], dg)
        if p.get("peepholes") is not None:
            dc_prev = dc_prev + dzi * p["peepholes"][:H] + dzf * p["peepholes"][2 * H:]
        dz = np.where(v, np.concatenate([dzi, dzf, dzg, dzo], axis=1), 0.0)
        if p.get("peepholes") is not None:
            dzi, dzf, dzo = dz[:, :H], dz[:, H: 2 * H], dz[:, 3 * H:]
            grads["peepholes"] += np.concatenate([(dzi * k["c"]).sum(0), (dzo * k["c_new"]).sum(0),
                                                  (dzf * k["c"]).sum(0)])
        grads["w_ih"] += dz.T @ k["x"]
        grads["w_hh"] += dz.T @ k["h"]
        grads["bias"] += dz.sum(0)
        d_x[s] = dz @ p["w_ih"]
        dh = np.where(v, dz @ p["w_hh"], dh)
        dc = np.where(v, dc_prev, dc)
    return d_x, grads, dh, dc


def _gru_forward(t, p, gates, x, h, c, valid, order):
    f_act, g_act = gates
    H = t["hidden"]
    lbr = t["linear_before_reset"]
    w_hr_z, w_hn = p["w_hh"][: 2 * H], p["w_hh"][2 * H:]
    steps, out = {}, np.zeros(x.shape[:2] + (H,))
    for s in order:
        a = x[s] @ p["w_ih"].T + p["b_ih"]
        hh_rz = h @ w_hr_z.T + p["b_hh"][: 2 * H]
        zr, zz = a[:, :H] + hh_rz[:, :H], a[:, H: 2 * H] + hh_rz[:, H:]
        r, z = f_act.value(zr), f_act.value(zz)
        if lbr:
            hn = h @ w_hn.T + p["b_hh"][2 * H:]
            zn = a[:, 2 * H:] + r * hn
        else:
            hn = None
            zn = a[:, 2 * H:] + (r * h) @ w_hn.T + p["b_hh"][2 * H:]
        n = g_act.value(zn)
        steps[s] = dict(x=x[s], h=h, zr=zr, zz=zz, zn=zn, r=r, z=z, n=n, hn=hn)
        v = valid[s][:, None]
        h_new = (1 - z) * n + z * h
        h = np.where(v, h_new, h)
        out[s] = np.where(v, h_new, 0.0)
    return steps, out


def _gru_reverse(t, p, gates, steps, d_out, dh, dc, valid, order):
    f_act, g_act = gates
    H = t["hidden"]
    lbr = t["linear_before_reset"]
    w_hr_z, w_hn = p["w_hh"][: 2 * H], p["w_hh"][2 * H:]
    grads = {k: np.zeros_like(p[k]) for k in ("w_ih", "w_hh", "b_ih", "b_hh")}
    d_x = np.zeros(d_out.shape[:2] + (p["w_ih"].shape[1],))
    for s in reversed(list(order)):
        k, v = steps[s], valid[s][:, None]
        dh_new = dh + np.where(v, d_out[s], 0.0)
        dzn = np.where(v, g_act.back(k["zn"], dh_new * (1 - k["z"])), 0.0)
        dzz = np.where(v, f_act.back(k["zz"], dh_new * (k["h"] - k["n"])), 0.0)
        dh_prev = dh_new * k["z"]
        if lbr:
            dr = dzn * k["hn"]
            d_hn = dzn * k["r"]
            grads["w_hh"][2 * H:] += d_hn.T @ k["h"]
            grads["b_hh"][2 * H:] += d_hn.sum(0)
            dh_prev = dh_prev + d_hn @ w_hn
        else:
            d_rh = dzn @ w_hn
            dr = d_rh * k["h"]
            grads["w_hh"][2 * H:] += dzn.T @ (k["r"] * k["h"])
            grads["b_hh"][2 * H:] += dzn.sum(0)
            dh_prev = dh_prev + d_rh * k["r"]
        dzr = np.where(v, f_act.back(k["zr"], dr), 0.0)
        d_rz = np.concatenate([dzr, dzz], axis=1)
        grads["w_hh"][: 2 * H] += d_rz.T @ k["h"]
        grads["b_hh"][: 2 * H] += d_rz.sum(0)
        da = np.concatenate([dzr, dzz, dzn], axis=1)
        grads["w_ih"] += da.T @ k["x"]
        grads["b_ih"] += da.sum(0)
        d_x[s] = da @ p["w_ih"]
        dh = np.where(v, dh_prev + d_rz @ w_hr_z, dh)
    return d_x, grads, dh, None


def _rnn_forward(t, p, gates, x, h, c, valid, order):
    (act,) = gates
    steps, out = {}, np.zeros(x.shape[:2] + (h.shape[1],))
    for s in order:
        z = x[s] @ p["w_ih"].T + h @ p["w_hh"].T + p["bias"]
        steps[s] = dict(x=x[s], h=h, z=z)
        v = valid[s][:, None]
        h = np.where(v, act.value(z), h)
        out[s] = np.where(v, act.value(z), 0.0)
    return steps, out


def _rnn_reverse(t, p, gates, steps, d_out, dh, dc, valid, order):
    (act,) = gates
    grads = {k: np.zeros_like(p[k]) for k in ("w_ih", "w_hh", "bias")}
    d_x = np.zeros(d_out.shape[:2] + (p["w_ih"].shape[1],))
    for s in reversed(list(order)):
        k, v = steps[s], valid[s][:, None]
        dz = np.where(v, act.back(k["z"], dh + np.where(v, d_out[s], 0.0)), 0.0)
        grads["w_ih"] += dz.T @ k["x"]
        grads["w_hh"] += dz.T @ k["h"]
        grads["bias"] += dz.sum(0)
        d_x[s] = dz @ p["w_ih"]
        dh = np.where(v, dz @ p["w_hh"], dh)
    return d_x, grads, dh, None


_FORWARD = {"lstm": _lstm_forward, "gru": _gru_forward, "rnn": _rnn_forward}
_REVERSE = {"lstm": _lstm_reverse, "gru": _gru_reverse, "rnn": _rnn_reverse}
_SLOTS = {"lstm": 3, "gru": 2, "rnn": 1}


def _gates(t: Mapping[str, Any], op: str, direction: int) -> list[_Gate]:
    """Direction ``direction``'s activation slots, each with the thunk's clip."""
    slots = _SLOTS[op]
    return [_Gate(entry, float(t["clip"])) for entry in t["activations"][direction * slots: (direction + 1) * slots]]


def backward(t: Mapping[str, Any], load: Load) -> dict[str, np.ndarray]:
    """The gradients of an lstm/gru/rnn backward thunk ``t`` (completed), its tensors through ``load``."""
    op = t["op"].removesuffix("_backward")
    L, D, H, B, S = t["num_layers"], 2 if t["bidirectional"] else 1, t["hidden"], t["batch"], t["seq"]
    G, W = {"lstm": 4, "gru": 3, "rnn": 1}[op], t.get("proj_size") or t["hidden"]
    lens = np.full(B, S) if t["seq_lens"] is None else np.array([int(n) for n in load("seq_lens")])
    valid = np.arange(S)[:, None] < lens[None, :]  # [S, B]
    biases = ("b_ih", "b_hh") if op == "gru" else ("bias",)
    w_ih, w_hh = load("w_ih").ravel(), load("w_hh")
    extra = {f: load(f) for f in ("peepholes", "w_hr") if t.get(f) is not None}
    states = ("h0", "c0") if op == "lstm" else ("h0",)
    init = {f: load(f) if t["carry"] else np.zeros((L * D, B, H if f == "c0" else W)) for f in states}
    d_final = {f: load(f"d_{f}") if t["carry"] else np.zeros_like(init[f]) for f in states}
    out = {"d_w_ih": np.zeros_like(w_ih), "d_w_hh": np.zeros_like(w_hh)}
    out.update({f"d_{f}": np.zeros_like(load(f)) for f in biases + tuple(extra)})
    out.update({f"d_{f}": np.zeros_like(init[f]) for f in states})

    def walk(d: int) -> range:
        return range(S - 1, -1, -1) if d == 1 or t["reverse"] else range(S)

    # the forward, bottom up, keeping every step; then the gradients, top down
    x, kept, offset = load("x").transpose(1, 0, 2), [], 0
    for layer in range(L):
        in_l, outs = x.shape[2], []
        for d in range(D):
            ld = layer * D + d
            p = {"w_ih": w_ih[offset: offset + G * H * in_l].reshape(G * H, in_l), "w_hh": w_hh[ld],
                 **{f: load(f)[ld] for f in biases}, **{f: v[ld] for f, v in extra.items()}}
            steps, y = _FORWARD[op](t, p, _gates(t, op, d), x, init["h0"][ld],
                                    init["c0"][ld] if op == "lstm" else None, valid, walk(d))
            kept.append((ld, offset, p, steps))
            offset += G * H * in_l
            outs.append(y)
        x = np.concatenate(outs, axis=2)
    d_y = np.where(valid[..., None], load("d_dst").transpose(1, 0, 2), 0.0)
    for layer in reversed(range(L)):
        d_in = 0.0
        for d in range(D):
            ld, start, p, steps = kept[layer * D + d]
            dc = d_final["c0"][ld] if op == "lstm" else None
            d_x, grads, dh, dc = _REVERSE[op](t, p, _gates(t, op, d), steps, d_y[..., d * W: (d + 1) * W],
                                              d_final["h0"][ld], dc, valid, walk(d))
            d_in = d_in + d_x
            out["d_w_ih"][start: start + p["w_ih"].size] = grads.pop("w_ih").ravel()
            for f, g in grads.items():
                out[f"d_{f}"][ld] = g
            out["d_h0"][ld] = dh
            if op == "lstm":
                out["d_c0"][ld] = dc
        d_y = np.where(valid[..., None], d_in, 0.0)
    out["d_x"] = d_y.transpose(1, 0, 2)
    if not t["carry"]:
        for f in states:
            del out[f"d_{f}"]
    return out


register(V2_FIELDS.keys(), backward, V2_FIELDS)

# layers and directions, with and without the carried state's gradient; a NaN gradient at one step reaches only
# that row's earlier steps' inputs (and every weight gradient, which sums over rows and steps)
declare_cases("lstm_backward", thunks=[(_recurrent("lstm", 2, 4, 3, 5, 2, True, True), {}, False),
                                       (_recurrent("lstm", 3, 16, 24, 40, 2, True, True), {}, True)],
              causal=[(_recurrent("lstm", 2, 5, 3, 4, 1, False, True), "d_dst", 2, float("nan"))])
# gates that keep the update a convex blend (z in [0, 1]): leaky_relu driving r and z compounds over the steps
# past what a 16-bit thunk's f32 holds, and the backward multiplies those values again
declare_cases("gru_backward", thunks=[(_recurrent("gru", 2, 4, 3, 5, 2, True, False), {}, False)],
              causal=[(_recurrent("gru", 2, 5, 3, 4, 2, False, False), "d_dst", 2, float("nan"))],
              present={"activations": {"activations": [["hard_sigmoid", 0.2, 0.5], ["leaky_relu", 0.01, 0.0]] * 2}})
declare_cases("rnn_backward", thunks=[(_recurrent("rnn", 2, 4, 3, 5, 1, False, True, relu=True), {}, False)],
              causal=[(_recurrent("rnn", 2, 5, 3, 4, 1, False, True), "d_dst", 2, float("nan"))])
