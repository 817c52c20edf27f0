"""The recurrent ops' saved forward on the host (ABI.md §9.1): a reserve as NumPy views, what a training
forward copies into it and what the backward reads from it instead of running the forward again.

The layout is the ABI's (``abi.rnn.reserve_slots``, docs/abi.md): per layer-direction what the reverse pass of
``rnn_backward_steps`` reads (the gates ``y``, the pre-activations ``u``, the state entering each step ...),
then the layers' outputs (the next layer's input, for ``d_w_ih``), then the clip's masks. ``u`` is written
only where the reverse pass reads it (``_Cell.keeps_pre_activations``: a clip or an activation other than
sigmoid/tanh; else the gates were activated in place and ``u`` is ``y``), the masks only with a clip, an
lstm's ``c_new`` only with peepholes or an ``h`` activation other than tanh (a small lstm's whole-sequence
kernel, which takes neither, keeps none).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from .abi.rnn import ACTIVATION_SLOTS, recurrent_dims, reserve_slots
from .arena import view
from .rnn_backward_cell import _Cell

Array = np.ndarray


def _views(t: Mapping[str, Any], arena: np.ndarray) -> dict[tuple[str, int], Array]:
    """Every slot of the reserve of the completed forward thunk ``t``, by ``(name, index)``."""
    base = t["reserve"]
    return {(s.name, s.index): view(arena, base + s.offset, s.dtype, s.shape) for s in reserve_slots(t)}


def _pre_activations_read(t: Mapping[str, Any], cell: _Cell) -> bool:
    return cell.keeps_pre_activations(min(ACTIVATION_SLOTS[t["op"]], 2))


def save(t: Mapping[str, Any], arena: np.ndarray, cells: Sequence[_Cell], inputs: Sequence[Array],
         kept: Sequence[Sequence[Mapping[str, Array]]]) -> None:
    """Copy what each layer-direction ``kept`` (``rnn_backward_steps``' forward) and every layer's input
    but the first (``inputs[1:]``, the outputs of the layers below the top) into the reserve."""
    _, dirs = recurrent_dims(t)
    v = _views(t, arena)
    for layer, per_direction in enumerate(kept):
        for dr, keep in enumerate(per_direction):
            ld = layer * dirs + dr
            for name, values in keep.items():
                if name == "mask":
                    if values is not None:
                        v["mask", ld][...] = values
                elif name != "u" or _pre_activations_read(t, cells[dr]):
                    v[name, ld][...] = values
    for layer, values in enumerate(inputs[1:]):
        v["out", layer][...] = values


def load(t: Mapping[str, Any], arena: np.ndarray, cells: Sequence[_Cell]) -> tuple[list[Array], list[list[dict]]]:
    """``(inputs above layer 0, kept)`` as ``save`` wrote them: views of the reserve, which the reverse pass
    only reads."""
    _, dirs = recurrent_dims(t)
    v = _views(t, arena)
    names = {name for name, _ in v if name not in ("out", "mask")}
    kept = []
    for layer in range(t["num_layers"]):
        per_direction = []
        for dr in range(dirs):
            ld = layer * dirs + dr
            keep = {name: v[name, ld] for name in names}
            if not _pre_activations_read(t, cells[dr]):
                keep["u"] = keep["y"]
            keep["mask"] = v["mask", ld].view(bool) if cells[dr].clip else None
            per_direction.append(keep)
        kept.append(per_direction)
    return [v["out", layer] for layer in range(t["num_layers"] - 1)], kept
