"""``rlx_gpu.reserve_bytes``: how many bytes a saved forward (ABI.md §9.1's ``reserve``) of a thunk needs."""
from __future__ import annotations

from typing import Any, Mapping

from host_fallback.abi import OPS, forward_op

from ..errors import ScheduleError


def reserve_bytes(fields: Mapping[str, Any]) -> int:
    """The least ``reserve_bytes`` of a thunk with these fields: its ``op`` (a forward op of ABI.md §9.1 or its
    backward op), ``dtype`` and shape fields (``batch``, ``seq``, ``hidden`` ...; the others are not read).
    A function of those alone: the same on every device, whatever the data.

    Raises
    ------
    ScheduleError
        For an op without a saved forward, or fields missing the shapes it needs.
    """
    op = fields.get("op")
    spec = OPS.get(forward_op(op)) if isinstance(op, str) else None
    if spec is None or spec.reserve_size is None:
        having = ", ".join(name for name, o in OPS.items() if o.reserve_size is not None and not o.forward)
        raise ScheduleError(f"reserve_bytes: op {op!r} has no saved forward (reserve); the ops with one: {having}")
    try:
        return spec.reserve_size({**fields, "op": spec.name})
    except KeyError as missing:
        raise ScheduleError(f"reserve_bytes: {spec.name} needs field {missing} (its shape fields and dtype)") from None
