"""The float64 references, registered against their ops by name by the modules that write them.

A reference takes the (completed) thunk and ``load(field)`` (a tensor of the laid-out arena as the
float64 values stored there) and returns ``{field: float64 array}`` for every tensor the op writes.
Beside it, the module declares the op's hand-picked conformance shapes (``cases``): its small case, its
thunk cases, causality cases, the params giving it each version-2 field, and bad integer tensors the run
must refuse; the catalog makes its cases from these and the op's definition alone. ``references`` imports
every ``reference_*`` module of this package, so a new op's reference module is all it takes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from host_fallback.registry import Registry

Load = Callable[[str], np.ndarray]
Reference = Callable[[Mapping[str, Any], Load], dict[str, np.ndarray]]

REFERENCES: Registry[Reference] = Registry("float64 reference")
#: op -> the version-2 fields (ABI.md §8) its float64 reference implements; the catalog makes "present"
#: cases of these only (``catalog.optional_field_cases``), and tests/conformance/test_conformance.py names the rest.
V2_FIELDS: dict[str, frozenset[str]] = {}


def register(ops: str | Iterable[str], reference: Reference,
             v2_fields: Mapping[str, frozenset[str]] | None = None) -> Reference:
    """Register ``reference`` for each op of ``ops``, with the version-2 fields it implements (``v2_fields``:
    op -> fields, read for these ops only)."""
    names = (ops,) if isinstance(ops, str) else tuple(ops)
    REFERENCES.add(names, reference)
    V2_FIELDS.update({op: v2_fields[op] for op in names if v2_fields and op in v2_fields})
    return reference


def reference(*ops: str, v2_fields: Mapping[str, frozenset[str]] | None = None) -> Callable[[Reference], Reference]:
    """``register`` as a decorator: ``@reference("lstm", "gru", v2_fields=...)``."""
    return lambda fn: register(ops, fn, v2_fields)


#: A thunk case: (params, run options, whether only the full run has it: ``large``).
ThunkCase = tuple[dict[str, Any], dict[str, Any], bool]
#: A causality case: (params, the input field poisoned, the step, the value: NaN or ±Inf), which must reach
#: batch row 0's outputs from that step on and nothing else.
CausalCase = tuple[dict[str, Any], str, int, float]
#: A run-time data case: (params, the integer tensor, a label for its bad values), which the run must refuse.
RefusedCase = tuple[dict[str, Any], str, str]


@dataclass(frozen=True)
class OpCases:
    """The hand-picked conformance shapes of one op (see ``cases``)."""

    small: Mapping[str, Any] | None
    thunks: tuple[ThunkCase, ...] = ()
    causal: tuple[CausalCase, ...] = ()
    present: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    refused: tuple[RefusedCase, ...] = ()


CASES: Registry[OpCases] = Registry("conformance cases")

#: The params a case adds to carry a state, to pass it through slots, or to pack three sequences (one empty)
#: into the small cases' seq 7: pieces of ``present`` and ``refused`` entries.
CARRIED = {"carry_state": True, "state": True}
SLOTS = {"state_slots": [2, 0], "num_slots": 3}
PACKED = {"batch": 1, "cu_seqlens": [0, 3, 3, 7], "num_seqs": 3}


def declare_cases(op: str, small: Mapping[str, Any] | None = None, thunks: Iterable[ThunkCase] = (),
          causal: Iterable[CausalCase] = (), present: Mapping[str, Mapping[str, Any]] | None = None,
          refused: Iterable[RefusedCase] = ()) -> None:
    """Declare ``op``'s conformance shapes, each in every dtype (thunks, causal cases: f32 and bf16):

    - ``small``: the params of its one small case (``cases.SMALL``), which ``present`` entries vary; a
      backward op's is its forward's;
    - ``thunks``: its hand-picked thunk cases;
    - ``causal``: one NaN or Inf that must reach exactly the outputs the recurrence says (compared with the
      float64 reference and the host);
    - ``present``: version-2 field -> the params that give the small case the field, with what it needs beside
      it (a field not named is a flag or a tensor: ``True``; a backward op's follow from its forward's);
    - ``refused``: integer tensors outside their rule (ABI.md §8).
    """
    CASES.add(op, OpCases(None if small is None else dict(small), tuple(thunks), tuple(causal), dict(present or {}),
                          tuple(refused)))
