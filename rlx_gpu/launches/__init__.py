"""Launch geometry and argument lists, computed once per op for every device dialect.

``plan(thunk, limits, **options)`` turns one thunk into the ordered kernel launches that run it
(each naming its program family, kernel, dtype, sizes and arguments, where buffers are the
``ARENA`` / ``SCRATCH`` placeholders); ``unsupported(thunk, limits)`` gives the reason a device
cannot run a thunk, or ``None``. Backends only translate these into their API calls.
"""
from __future__ import annotations

from host_fallback.abi import SCAN_OPS, used
from host_fallback.registry import import_all

from .core import ARENA, SCRATCH, Buf, Launch, LaunchPlan, Thunk
from .limits import DeviceLimits
from .registry import PLANNERS, DeviceOp, families, shared_texts

import_all(__name__)  # each planner module registers its ops (``registry.register``) on import
PLANNERS.exempt(SCAN_OPS, "the scan driver runs it on every device, each body thunk planned as its own op")


def unsupported(thunk: Thunk, limits: DeviceLimits) -> str | None:
    """``None`` when kernels exist for ``thunk`` within ``limits``, else the reason (whether the device
    offers f64 is the device session's question: it names the feature the device lacks)."""
    op = thunk["op"]
    device_op = PLANNERS.get(op)
    if device_op is None:
        return f"no device kernel for op {op!r}"
    if thunk.get("reserve") is not None and "reserve" not in device_op.v2_fields:  # ABI.md §9.1, issue 36
        return f"no device kernel of {op} writes or reads a saved forward (reserve) yet; the host does"
    missing = [name for name in used(thunk) if name not in device_op.v2_fields]
    if missing:
        return f"no device kernel of {op} takes the version-2 field(s) {', '.join(missing)} yet"
    return device_op.unsupported(thunk, limits)


def plan(thunk: Thunk, limits: DeviceLimits, **options: object) -> LaunchPlan:
    """The launches that run ``thunk`` (``options``: ``rnn_kernel="auto"|"persistent"|"step"``;
    ``ssm_kernel="auto"|"lanes"|"chunked"`` for the ops with a chunked and a step form, at the targets their
    planner modules name)."""
    return PLANNERS[thunk["op"]].plan(thunk, limits, **options)


__all__ = ["ARENA", "SCRATCH", "Buf", "Launch", "LaunchPlan", "DeviceLimits", "DeviceOp", "plan", "unsupported",
           "PLANNERS", "families", "shared_texts"]
