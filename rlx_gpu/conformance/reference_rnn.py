"""Float64 reference for lstm, gru and rnn, written straight from ABI.md §3 and §8 (no host_fallback code).

Deliberately plain: one batch row and one step at a time, gates in the ABI's order, every activation
as §8 writes it, sigmoid as 1/(1+e^-z). The ops' conformance shapes are declared at the end.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from .registry import declare_cases

GATES = {"lstm": 4, "gru": 3, "rnn": 1}
#: Activation slots per direction (lstm f g h, gru f g, rnn f).
SLOTS = {"lstm": 3, "gru": 2, "rnn": 1}
#: (``reserve``, ``reserve_bytes``: the saved forward changes no output a reference gives: implemented by all)
_EVERY_OP = ("seq_lens", "reverse", "clip", "activations", "reserve", "reserve_bytes")
#: op -> the version-2 fields (ABI.md §8) this reference implements: all of them.
V2_FIELDS = {"lstm": frozenset(_EVERY_OP + ("peepholes", "input_forget", "proj_size", "w_hr")),
             "gru": frozenset(_EVERY_OP + ("linear_before_reset",)), "rnn": frozenset(_EVERY_OP)}


def sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


#: ABI.md §8's activations, ``name -> f(x, alpha, beta)``.
ACTIVATIONS: dict[str, Callable[[np.ndarray, float, float], np.ndarray]] = {
    "sigmoid": lambda x, a, b: sigmoid(x),
    "tanh": lambda x, a, b: np.tanh(x),
    "relu": lambda x, a, b: np.maximum(x, 0.0),
    "affine": lambda x, a, b: a * x + b,
    "leaky_relu": lambda x, a, b: np.where(x >= 0, x, a * x),
    "thresholded_relu": lambda x, a, b: np.where(x > a, x, 0.0),
    "scaled_tanh": lambda x, a, b: a * np.tanh(b * x),
    "hard_sigmoid": lambda x, a, b: np.minimum(np.maximum(a * x + b, 0.0), 1.0),
    "elu": lambda x, a, b: np.where(x >= 0, x, a * (np.exp(np.minimum(x, 0.0)) - 1)),
    "softsign": lambda x, a, b: x / (1 + np.abs(x)),
    "softplus": lambda x, a, b: np.logaddexp(0.0, x),  # log(1 + e^x), exact where e^x overflows
}


def default_activations(op: str, dirs: int, relu: bool = False) -> list[tuple[str, float, float]]:
    """§8's defaults: sigmoid, tanh, tanh (lstm), sigmoid, tanh (gru), §3's ``act`` (rnn), per direction."""
    names = {"lstm": ("sigmoid", "tanh", "tanh"), "gru": ("sigmoid", "tanh"),
             "rnn": ("relu" if relu else "tanh",)}[op]
    return [(n, 0.0, 0.0) for _ in range(dirs) for n in names]


def _act(spec: Sequence[Any]) -> Callable[[np.ndarray], np.ndarray]:
    name, alpha, beta = spec
    fn = ACTIVATIONS[name]
    return lambda x: fn(x, float(alpha), float(beta))


def _cell(op: str, x_t, h, c, w_ih, w_hh, b, acts, clip: float, options: dict):
    """One step of one row: x_t [in], h [width], c [hidden] -> (h', c')."""
    H = w_hh.shape[0] // GATES[op]

    def clamp(z):
        return np.clip(z, -clip, clip) if clip else z

    if op == "lstm":
        f_act, g_act, h_act = acts
        z = w_ih @ x_t + w_hh @ h + b["bias"]
        z_i, z_f, z_g, z_o = (z[k * H: (k + 1) * H] for k in range(4))
        p = options.get("peepholes")
        if p is not None:  # order i, o, f; i and f see the previous cell, o the new one
            z_i, z_f = z_i + p[:H] * c, z_f + p[2 * H:] * c
        i = f_act(clamp(z_i))
        f = 1 - i if options.get("input_forget") else f_act(clamp(z_f))
        c = f * c + i * g_act(clamp(z_g))
        if p is not None:
            z_o = z_o + p[H: 2 * H] * c
        h = f_act(clamp(z_o)) * h_act(c)
        w_hr = options.get("w_hr")
        return (h if w_hr is None else w_hr @ h), c
    if op == "gru":
        f_act, g_act = acts
        a = w_ih @ x_t + b["b_ih"]
        r = f_act(clamp(a[:H] + w_hh[:H] @ h + b["b_hh"][:H]))
        z = f_act(clamp(a[H: 2 * H] + w_hh[H: 2 * H] @ h + b["b_hh"][H: 2 * H]))
        if options.get("linear_before_reset", True):
            n = g_act(clamp(a[2 * H:] + r * (w_hh[2 * H:] @ h + b["b_hh"][2 * H:])))
        else:
            n = g_act(clamp(a[2 * H:] + w_hh[2 * H:] @ (r * h) + b["b_hh"][2 * H:]))
        return (1 - z) * n + z * h, c
    (f_act,) = acts
    return f_act(clamp(w_ih @ x_t + w_hh @ h + b["bias"])), c


def reference(op: str, x: np.ndarray, w_ih: np.ndarray, w_hh: np.ndarray, biases: dict[str, np.ndarray], *,
              hidden: int, num_layers: int, bidirectional: bool, h0: np.ndarray | None = None,
              c0: np.ndarray | None = None, relu: bool = False, seq_lens: Sequence[int] | None = None,
              reverse: bool = False, clip: float = 0.0, activations: Sequence[Sequence[Any]] | None = None,
              linear_before_reset: bool = True, peepholes: np.ndarray | None = None, input_forget: bool = False,
              proj_size: int = 0, w_hr: np.ndarray | None = None):
    """Run the op in float64.

    ``x [B,S,I]``; ``w_ih`` flat in ABI packing; ``w_hh [L*D, G*H, W]`` (``W`` = ``proj_size`` or
    ``hidden``); ``biases`` maps ``bias`` (lstm, rnn) or ``b_ih``/``b_hh`` (gru) to ``[L*D, G*H]``;
    ``h0 [L*D, B, W]`` / ``c0 [L*D, B, H]`` or ``None`` for a zero initial state. The keywords after
    ``relu`` are ABI.md §8's fields (``peepholes [L*D, 3H]``, ``w_hr [L*D, P, H]``, ``seq_lens [B]``).
    Returns ``(dst [B,S,D*W], h_final [L*D,B,W], c_final [L*D,B,H] or None)``.
    """
    G, D, H = GATES[op], 2 if bidirectional else 1, hidden
    W = proj_size or H
    x = np.asarray(x, np.float64)
    B, S, I = x.shape
    lengths = [S] * B if seq_lens is None else [int(n) for n in np.ravel(seq_lens)]
    w_ih = np.asarray(w_ih, np.float64).ravel()
    w_hh = np.asarray(w_hh, np.float64)
    biases = {k: np.asarray(v, np.float64) for k, v in biases.items()}
    specs = default_activations(op, D, relu) if activations is None else list(activations)
    h_fin = np.zeros((num_layers * D, B, W)) if h0 is None else np.array(h0, np.float64)
    c_fin = np.zeros((num_layers * D, B, H)) if c0 is None else np.array(c0, np.float64)
    layer_in, offset = x, 0
    for layer in range(num_layers):
        in_l = I if layer == 0 else D * W
        out = np.zeros((B, S, D * W))
        for d in range(D):
            ld = layer * D + d
            w = w_ih[offset: offset + G * H * in_l].reshape(G * H, in_l)
            offset += G * H * in_l
            acts = [_act(s) for s in specs[d * SLOTS[op]: (d + 1) * SLOTS[op]]]
            options = {"linear_before_reset": linear_before_reset, "input_forget": input_forget,
                       "peepholes": None if peepholes is None else np.asarray(peepholes, np.float64)[ld],
                       "w_hr": None if w_hr is None else np.asarray(w_hr, np.float64)[ld]}
            b = {k: v[ld] for k, v in biases.items()}
            backwards = d == 1 or reverse
            for row, n in enumerate(lengths):
                h, c = h_fin[ld, row].copy(), c_fin[ld, row].copy()
                for t in (reversed(range(n)) if backwards else range(n)):
                    h, c = _cell(op, layer_in[row, t], h, c, w, w_hh[ld], b, acts, clip, options)
                    out[row, t, d * W: (d + 1) * W] = h
                h_fin[ld, row], c_fin[ld, row] = h, c
        layer_in = out
    return layer_in, h_fin, (c_fin if op == "lstm" else None)


def _recurrent(op: str, b: int, s: int, i: int, h: int, layers: int, bidir: bool, carry: bool, relu: bool = False) -> dict:
    params = dict(batch=b, seq=s, input_size=i, hidden=h, num_layers=layers, bidirectional=bidir, carry=carry)
    return dict(params, relu=relu) if op == "rnn" else params


NAN, INF = float("nan"), float("inf")
#: The params giving each op's small case a version-2 field they all have.
#: A saved forward (ABI.md §9.1) of 32 KiB: more than any of the three needs at its small shape in any dtype
#: (rlx_gpu.reserve_bytes: lstm's f64 16640 bytes); the footprint is what is given.
_RESERVE = {"reserve": True, "reserve_bytes": 1 << 15}
_PRESENT = {"seq_lens": {"seq_lens": [5, 2]}, "reverse": {"reverse": True, "bidirectional": False},
            "clip": {"clip": 0.5}, "reserve": _RESERVE, "reserve_bytes": _RESERVE}
# each op through both kernels (persistent: layers > 0 read their input from scratch); a decode step (seq 1,
# state carried) as the kernel choice of each target makes it; version 2 (ABI.md §8): every field of the op at
# once, seq 20 (past the host's decode path), a row that never runs and one that runs to the end; decode
# (seq 1) with a row of length 0. Causality: an Inf at a step; with lengths, a NaN inside row 0's length
# reaches its steps, one in its padding nothing.
declare_cases(
    "lstm", small=_recurrent("lstm", 2, 5, 3, 4, 2, True, True),
    thunks=[
        (_recurrent("lstm", 2, 5, 3, 4, 2, True, True), {"rnn_kernel": "persistent"}, False),
        (_recurrent("lstm", 2, 5, 3, 4, 2, True, True), {"rnn_kernel": "step"}, False),
        (_recurrent("lstm", 1, 1, 7, 20, 1, False, True), {}, False),
        (dict(_recurrent("lstm", 3, 20, 3, 5, 2, True, True), seq_lens=[20, 0, 7], peepholes=True,
              input_forget=True, clip=0.5, proj_size=3, w_hr=True,
              activations=[["hard_sigmoid", 0.2, 0.5], ["tanh", 0.0, 0.0], ["softsign", 0.0, 0.0]] * 2), {}, False),
        (dict(_recurrent("lstm", 2, 1, 7, 20, 1, False, True), seq_lens=[1, 0], clip=1.0), {}, False),
        (_recurrent("lstm", 3, 16, 24, 40, 2, True, True), {"rnn_kernel": "persistent"}, True),
    ],
    causal=[
        (_recurrent("lstm", 2, 5, 3, 4, 1, True, True), "x", 2, INF),
        (dict(_recurrent("lstm", 2, 5, 3, 4, 1, True, True), seq_lens=[4, 5]), "x", 2, NAN),
    ],
    present={**_PRESENT,
             "activations": {"activations": [["hard_sigmoid", 0.2, 0.5], ["elu", 1.0, 0.0], ["softsign", 0.0, 0.0]] * 2},
             "proj_size": {"proj_size": 3, "w_hr": True}, "w_hr": {"proj_size": 3, "w_hr": True}},
    refused=[({"seq_lens": [6, 2]}, "seq_lens", "past_seq")])
declare_cases(
    "gru", small=_recurrent("gru", 2, 5, 3, 4, 2, True, True), refused=[({"seq_lens": [3, -1]}, "seq_lens", "negative")],
    thunks=[
        (_recurrent("gru", 2, 4, 3, 5, 2, True, True), {"rnn_kernel": "persistent"}, False),
        (_recurrent("gru", 1, 3, 2, 6, 1, False, False), {"rnn_kernel": "step"}, False),
        (_recurrent("gru", 2, 1, 7, 20, 1, False, True), {}, False),
        (dict(_recurrent("gru", 3, 20, 3, 5, 2, True, True), seq_lens=[3, 20, 0], linear_before_reset=False,
              clip=0.5, activations=[["sigmoid", 0.0, 0.0], ["elu", 1.0, 0.0], ["hard_sigmoid", 0.2, 0.5],
                                     ["tanh", 0.0, 0.0]]), {}, False),
        (_recurrent("gru", 2, 12, 16, 33, 1, True, False), {"rnn_kernel": "step"}, True),
    ],
    causal=[
        (_recurrent("gru", 2, 5, 3, 4, 1, True, False), "x", 2, -INF),
        (dict(_recurrent("gru", 2, 5, 3, 4, 1, True, True), seq_lens=[2, 5]), "x", 3, NAN),
    ],
    present={**_PRESENT, "activations": {"activations": [["leaky_relu", 0.01, 0.0], ["scaled_tanh", 1.5, 0.7]] * 2},
             "linear_before_reset": {"linear_before_reset": False}})
declare_cases(
    "rnn", small=_recurrent("rnn", 2, 5, 3, 4, 2, True, True),
    thunks=[
        (_recurrent("rnn", 2, 4, 3, 5, 1, True, True, relu=True), {"rnn_kernel": "persistent"}, False),
        (_recurrent("rnn", 2, 4, 3, 5, 2, False, False), {"rnn_kernel": "step"}, False),
        (dict(_recurrent("rnn", 2, 20, 3, 5, 2, False, True), reverse=True, seq_lens=[20, 4],
              activations=[["scaled_tanh", 1.5, 0.7]]), {}, False),
    ],
    causal=[(_recurrent("rnn", 2, 5, 3, 4, 1, False, True, relu=True), "x", 2, INF)],
    present={**_PRESENT, "activations": {"activations": [["softplus", 0.0, 0.0], ["thresholded_relu", 0.1, 0.0]]}},
    refused=[({"seq_lens": [-5, 0]}, "seq_lens", "negative")])
