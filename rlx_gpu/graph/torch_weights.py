"""Pack the parameters of a ``torch.nn.LSTM`` / ``GRU`` / ``RNN`` into the weight streams of ABI.md §3.

For people bringing PyTorch weights: the result feeds ``Graph.lstm/gru/rnn`` or a schedule's tensors.
Works on any object with torch's module attributes; torch itself is never imported here.
"""
from __future__ import annotations

from typing import Any

import numpy as np


#: torch.nn.RNN's ``nonlinearity`` choices.
NONLINEARITIES = ("tanh", "relu")


class PackedStream(np.ndarray):
    """A weight stream packed from a module: an array that remembers the module's activation.

    ``nonlinearity`` is an RNN's ``"tanh"`` or ``"relu"`` (None for LSTM and GRU), so ``Graph.rnn``
    runs the activation the weights were trained with, given the arrays or ``Graph.weight`` tensors of them.
    """

    nonlinearity: str | None = None

    def __array_finalize__(self, obj: Any) -> None:
        self.nonlinearity = getattr(obj, "nonlinearity", None)


def _stream(values: np.ndarray, nonlinearity: str | None) -> PackedStream:
    out = np.asarray(values).view(PackedStream)
    out.nonlinearity = nonlinearity
    return out


def pack_recurrent(module: Any) -> dict[str, PackedStream]:
    """``{"w_ih", "w_hh", "bias"}`` (LSTM, RNN: ``b_ih + b_hh`` merged) or ``{"w_ih", "w_hh", "b_ih", "b_hh"}`` (GRU).

    Gate orders already agree with the ABI (i, f, g, o and r, z, n); layer-direction blocks are laid out
    ``ld = layer*dirs + dir``. A module built with ``bias=False`` gets zero biases. The arrays of an RNN
    carry its ``nonlinearity`` (:class:`PackedStream`).
    """
    kind = type(module).__name__
    if kind not in ("LSTM", "GRU", "RNN"):
        raise TypeError(f"expected torch.nn.LSTM, GRU or RNN, got {kind}")
    nonlinearity = getattr(module, "nonlinearity", None) if kind == "RNN" else None
    if nonlinearity is not None and nonlinearity not in NONLINEARITIES:
        raise ValueError(f"RNN nonlinearity {nonlinearity!r} has no ABI counterpart; expected one of "
                         f"{', '.join(NONLINEARITIES)}")
    if getattr(module, "proj_size", 0):
        raise ValueError("LSTM projections (proj_size > 0) have no ABI counterpart")
    dirs = 2 if module.bidirectional else 1
    names = [f"l{layer}{'_reverse' if d else ''}" for layer in range(module.num_layers) for d in range(dirs)]
    params = {k: v.detach().cpu().numpy() for k, v in module.named_parameters()}
    w_hh = np.stack([params[f"weight_hh_{n}"] for n in names])
    zeros = np.zeros(w_hh.shape[:2], dtype=w_hh.dtype)
    b_ih = np.stack([params.get(f"bias_ih_{n}", zeros[0]) for n in names])
    b_hh = np.stack([params.get(f"bias_hh_{n}", zeros[0]) for n in names])
    out = {"w_ih": np.concatenate([params[f"weight_ih_{n}"].ravel() for n in names]), "w_hh": w_hh}
    if kind == "GRU":
        out.update(b_ih=b_ih, b_hh=b_hh)
    else:
        out["bias"] = b_ih + b_hh
    return {name: _stream(values, nonlinearity) for name, values in out.items()}
