"""Float64 reference for lstm, gru and rnn, written straight from ABI.md §3 (no host_fallback code).

Deliberately plain: one batch-major step at a time, gates in the ABI's order, sigmoid as 1/(1+e^-z).
"""
from __future__ import annotations

import numpy as np

GATES = {"lstm": 4, "gru": 3, "rnn": 1}


def sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


def _cell(op: str, relu: bool, x_t, h, c, w_ih, w_hh, biases):
    """One step for one layer-direction: x_t [B, in], h/c [B, H] -> (h', c')."""
    H = h.shape[1]
    if op == "lstm":
        z = x_t @ w_ih.T + h @ w_hh.T + biases["bias"]
        i, f, g, o = (z[:, k * H: (k + 1) * H] for k in range(4))
        i, f, g, o = sigmoid(i), sigmoid(f), np.tanh(g), sigmoid(o)
        c = f * c + i * g
        return o * np.tanh(c), c
    if op == "gru":
        a = x_t @ w_ih.T + biases["b_ih"]
        b = h @ w_hh.T + biases["b_hh"]
        r = sigmoid(a[:, :H] + b[:, :H])
        z = sigmoid(a[:, H: 2 * H] + b[:, H: 2 * H])
        n = np.tanh(a[:, 2 * H:] + r * b[:, 2 * H:])
        return (1 - z) * n + z * h, c
    pre = x_t @ w_ih.T + h @ w_hh.T + biases["bias"]
    return (np.maximum(pre, 0.0) if relu else np.tanh(pre)), c


def reference(op: str, x: np.ndarray, w_ih: np.ndarray, w_hh: np.ndarray, biases: dict[str, np.ndarray], *,
              hidden: int, num_layers: int, bidirectional: bool, h0: np.ndarray | None = None,
              c0: np.ndarray | None = None, relu: bool = False):
    """Run the op in float64.

    ``x [B,S,I]``; ``w_ih`` flat in ABI packing; ``w_hh [L*D, G*H, H]``; ``biases`` maps ``bias``
    (lstm, rnn) or ``b_ih``/``b_hh`` (gru) to ``[L*D, G*H]``; ``h0``/``c0 [L*D, B, H]`` or ``None``
    for a zero initial state. Returns ``(dst [B,S,D*H], h_final [L*D,B,H], c_final or None)``.
    """
    G, D, H = GATES[op], 2 if bidirectional else 1, hidden
    x = np.asarray(x, np.float64)
    B, S, I = x.shape
    w_ih = np.asarray(w_ih, np.float64).ravel()
    w_hh = np.asarray(w_hh, np.float64)
    biases = {k: np.asarray(v, np.float64) for k, v in biases.items()}
    zeros = np.zeros((num_layers * D, B, H))
    h_init = zeros if h0 is None else np.asarray(h0, np.float64)
    c_init = zeros if c0 is None else np.asarray(c0, np.float64)
    h_fin, c_fin = np.zeros_like(zeros), np.zeros_like(zeros)
    layer_in, offset = x, 0
    for layer in range(num_layers):
        in_l = I if layer == 0 else D * H
        out = np.zeros((B, S, D * H))
        for d in range(D):
            ld = layer * D + d
            w = w_ih[offset: offset + G * H * in_l].reshape(G * H, in_l)
            offset += G * H * in_l
            b = {k: v[ld] for k, v in biases.items()}
            h, c = h_init[ld].copy(), c_init[ld].copy()
            for t in (range(S) if d == 0 else reversed(range(S))):
                h, c = _cell(op, relu, layer_in[:, t], h, c, w, w_hh[ld], b)
                out[:, t, d * H: (d + 1) * H] = h
            h_fin[ld], c_fin[ld] = h, c
        layer_in = out
    return layer_in, h_fin, (c_fin if op == "lstm" else None)
