"""Pack the parameters of a ``torch.nn.LSTM`` / ``GRU`` / ``RNN`` into the weight streams of ABI.md §3
(and §8's ``w_hr`` of an LSTM with ``proj_size``), and a ``PackedSequence`` into a padded batch with
its lengths (§8's ``seq_lens``).

For people bringing PyTorch weights and batches: the results feed ``Graph.lstm/gru/rnn`` or a
schedule's tensors. Works on any object with torch's attributes; torch itself is never imported here.
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


def layer_directions(num_layers: int, bidirectional: bool) -> list[str]:
    """torch's parameter-name suffixes (``l0``, ``l0_reverse``, ``l1``, ...) in the ABI's layer-direction
    order ``ld = layer*dirs + dir``."""
    dirs = 2 if bidirectional else 1
    return [f"l{layer}{'_reverse' if d else ''}" for layer in range(num_layers) for d in range(dirs)]


def pack_recurrent(module: Any) -> dict[str, PackedStream]:
    """``{"w_ih", "w_hh", "bias"}`` (LSTM, RNN: ``b_ih + b_hh`` merged) or ``{"w_ih", "w_hh", "b_ih", "b_hh"}`` (GRU),
    plus ``"w_hr" [layers*dirs, proj_size, hidden]`` for an LSTM with ``proj_size`` (pass
    ``proj_size=module.proj_size`` to ``Graph.lstm`` beside it).

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
    names = layer_directions(module.num_layers, module.bidirectional)
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
    if getattr(module, "proj_size", 0):
        out["w_hr"] = np.stack([params[f"weight_hr_{n}"] for n in names])
    return {name: _stream(values, nonlinearity) for name, values in out.items()}


def unpack_sequence(packed: Any) -> tuple[np.ndarray, np.ndarray]:
    """A ``torch.nn.utils.rnn.PackedSequence`` (sorted or not) as ``(x [batch, seq, features], lengths)``:
    the batch in its original row order, zero past each row's length, and ``lengths`` as int32, the
    ``seq_lens`` of ABI.md §8 (``seq`` is the longest length)."""
    data = np.asarray(packed.data.detach().cpu().numpy())
    running = np.asarray(packed.batch_sizes.cpu().numpy(), np.int64)  # rows still running at each step
    sorted_rows = (np.arange(running[0]) if packed.sorted_indices is None
                   else np.asarray(packed.sorted_indices.cpu().numpy()))
    batch, seq = int(running[0]), running.size
    x = np.zeros((batch, seq, *data.shape[1:]), data.dtype)
    start = 0
    for t, n in enumerate(running.tolist()):
        x[sorted_rows[:n], t] = data[start: start + n]
        start += n
    lengths = np.zeros(batch, np.int32)
    lengths[sorted_rows] = np.count_nonzero(np.arange(batch)[:, None] < running[None, :], axis=1)
    return x, lengths
