"""The float64 references, registered against their ops by name by the modules that write them.

A reference takes the (completed) thunk and ``load(field)`` (a tensor of the laid-out arena as the
float64 values stored there) and returns ``{field: float64 array}`` for every tensor the op writes.
``references`` imports every ``reference_*`` module of this package, so a new op's reference module is
all it takes.
"""
from __future__ import annotations

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
