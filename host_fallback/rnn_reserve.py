"""The recurrent ops' saved forward on the host (ABI.md §9.1): a reserve as NumPy views, which a training
forward keeps its per-step arrays in and the backward reads instead of running the forward again.

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

from .abi.reserve import Slot
from .abi.rnn import ACTIVATION_SLOTS, recurrent_dims
from .arena import view
from .rnn_backward_cell import _Cell

Array = np.ndarray


def _views(reserve: Array, slots_of: Sequence[Slot]) -> dict[tuple[str, int], Array]:
    """Every slot of ``slots_of`` (``abi.rnn.reserve_slots``, worked out once a thunk) by ``(name, index)``: views
    of ``reserve``, the reserve's bytes (the arena's, or the caller's array: ``bound.given_views``)."""
    return {(s.name, s.index): view(reserve, s.offset, s.dtype, s.shape) for s in slots_of}


def _pre_activations_read(t: Mapping[str, Any], cell: _Cell) -> bool:
    return cell.keeps_pre_activations(min(ACTIVATION_SLOTS[t["op"]], 2))


def projection_slot(t: Mapping[str, Any], cell: _Cell) -> str:
    """The slot a layer-direction's input projection is computed into: the forward's steps turn it into the
    pre-activations ``u`` where those are kept, else into the gates ``y`` (activated in place)."""
    return "u" if _pre_activations_read(t, cell) else "y"


def slots(t: Mapping[str, Any], reserve: Array, slots_of: Sequence[Slot]
          ) -> tuple[list[dict[str, Array]], list[Array]]:
    """``(per layer-direction its arrays by name, every layer's output but the top one's)``: views of the
    ``reserve`` (its bytes) of the completed forward thunk ``t`` laid out as ``slots_of`` (``reserve_slots``), the masks
    as booleans."""
    _, dirs = recurrent_dims(t)
    v = _views(reserve, slots_of)
    per_ld: list[dict[str, Array]] = [{} for _ in range(t["num_layers"] * dirs)]
    for (name, index), values in v.items():
        if name != "out":
            per_ld[index][name] = values.view(bool) if name == "mask" else values
    return per_ld, [v["out", layer] for layer in range(t["num_layers"] - 1)]


def save(t: Mapping[str, Any], reserve: tuple[list[dict[str, Array]], list[Array]], cells: Sequence[_Cell],
         kept: Sequence[Mapping[str, Array]]) -> None:
    """Copy what each layer-direction ``kept`` (``rnn_backward_steps``' forward, by layer-direction) into the
    ``reserve`` (``slots``) where the forward did not keep it there already: what the backward reads. (The
    forward pass writes the layers' outputs there itself.)"""
    _, dirs = recurrent_dims(t)
    per_ld = reserve[0]
    for ld, keep in enumerate(kept):
        dest = per_ld[ld]
        for name, values in keep.items():
            read = name != "u" or _pre_activations_read(t, cells[ld % dirs])
            if values is not None and read and values is not dest[name]:
                dest[name][...] = values


def load(t: Mapping[str, Any], reserve: Array, slots_of: Sequence[Slot], cells: Sequence[_Cell]
         ) -> tuple[list[Array], list[dict]]:
    """``(inputs above layer 0, kept by layer-direction)`` as ``save`` wrote them: views of the ``reserve`` (as
    ``slots``), which the reverse pass only reads."""
    _, dirs = recurrent_dims(t)
    per_ld, outs = slots(t, reserve, slots_of)
    kept = []
    for ld, saved in enumerate(per_ld):
        keep = dict(saved)
        if not _pre_activations_read(t, cells[ld % dirs]):
            keep["u"] = keep["y"]
        if not cells[ld % dirs].clip:
            keep["mask"] = None
        kept.append(keep)
    return outs, kept
