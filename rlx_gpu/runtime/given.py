"""A host call plan's tensors read and written where the caller holds them (``call_plan.CallPlan`` on the host,
on a schedule of one host thunk whose kernel takes arrays in place of its arena views:
``Device.execute_given``): no copy into the arena and out of it for the large ones.

An input of at least ``GIVEN_BYTES`` that shares no arena byte with another input, given as a C-contiguous
array of its storage dtype (and without a stamp: a parameter's arena copy is what its stamp vouches for), is
handed to the kernel as it is. An output that
is an input's place updated in place (a carried state) comes back in the array the caller named for it
(``into``) when that is the input's own array (an in-place update the caller asked for), else in a new
array holding a copy of the input, which the kernel updates: one copy where the arena took two. Another
output of at least ``GIVEN_BYTES`` is written by the kernel into a new array (also where no input is handed
over, for a kernel that takes output arrays alone: ``host_fallback.GIVEN_OUTPUTS``, a training forward's
saved forward). The kernel checks what it is
given (dtype, layout, no array it writes sharing memory with another) and refuses the lot where anything
does not fit; the plan then copies those inputs in and runs as ever, so the results are the same bits
either way.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np

from host_fallback.implementations import GIVEN_OUTPUTS

from ..schedule.model import Schedule

#: The bytes from which an input or output is handed to the kernel where it lies rather than copied through
#: the arena (a smaller one costs less to copy than to check and place).
GIVEN_BYTES = 16 << 10


class Given(NamedTuple):
    """Per input, whether it may be handed over (large enough); per output, the index of the input whose
    place it is (updated in place), -1 for a large output of its own, None for one read from the arena, and
    its arena offset."""

    inputs: tuple[bool, ...]
    outputs: tuple[int | None, ...]
    offsets: tuple[int, ...]
    new_outputs: bool  # a large output of its own that a call hands over even with no input handed over


def given_layout(schedule: Schedule, inputs: Sequence[str], outputs: Sequence[str]) -> Given:
    """Which inputs and outputs of ``schedule`` a call may hand to its kernel where the caller holds them."""
    views = [schedule.tensors[name] for name in inputs]

    def apart(v: Any, but: int = -1) -> bool:  # sharing no byte with an input (but the one at ``but``)
        return not any(i != but and v.offset < w.offset + w.nbytes and w.offset < v.offset + v.nbytes
                       for i, w in enumerate(views))

    places = {(v.offset, v.nbytes): i for i, v in enumerate(views)}
    handed = []
    for name in outputs:
        v = schedule.tensors[name]
        source = places.get((v.offset, v.nbytes))
        handed.append(source if source is not None and apart(v, source) else
                      -1 if source is None and v.nbytes >= GIVEN_BYTES and apart(v) else None)
    alone = schedule.thunks[0].op in GIVEN_OUTPUTS  # the kernel takes output arrays alone (a saved forward's)
    return Given(tuple(v.nbytes >= GIVEN_BYTES and apart(v, i) for i, v in enumerate(views)), tuple(handed),
                 tuple(schedule.tensors[name].offset for name in outputs), alone and -1 in handed)


def handed_outputs(layout: Given, arena_views: Sequence[np.ndarray], given: dict[int, np.ndarray],
                   by_input: dict[int, np.ndarray], into: Sequence[np.ndarray | None] | None
                   ) -> list[np.ndarray | None]:
    """Each output's array where the kernel writes it in place of its arena view (``arena_views``; added to
    ``given`` by its offset), None for one read from the arena. ``by_input``: the inputs handed over, by
    index."""
    handed: list[np.ndarray | None] = []
    for j, source in enumerate(layout.outputs):
        if source is None or source >= 0 and source not in by_input:
            handed.append(None)
            continue
        if source >= 0:
            value = by_input[source]
            if into is None or into[j] is not value:  # the caller's input stays as it is: the kernel updates a copy
                value = value.copy()
        else:
            value = np.empty_like(arena_views[j])
        given[layout.offsets[j]] = value
        handed.append(value)
    return handed


def gathered(handed: Sequence[np.ndarray | None], arena_views: Sequence[np.ndarray],
             into: Sequence[np.ndarray | None] | None) -> list[np.ndarray]:
    """Every output after a run on handed arrays: its handed array (``handed_outputs``), else a copy of its
    arena view; written to its ``into`` array where one is named (converted to its dtype)."""
    out = []
    for j, (array, view) in enumerate(zip(handed, arena_views)):
        target = into[j] if into is not None else None
        if array is None:
            array = view.copy() if target is None else view
        if target is not None and target is not array:
            target[...] = array  # converted to its dtype, rounding to nearest even
        out.append(array if target is None else target)
    return out
