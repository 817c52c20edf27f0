"""Launch geometry and argument lists, computed once per op for every device dialect.

``plan(thunk, limits, **options)`` turns one thunk into the ordered kernel launches that run it
(each naming its program family, kernel, dtype, sizes and arguments, where buffers are the
``ARENA`` / ``SCRATCH`` placeholders); ``unsupported(thunk, limits)`` gives the reason a device
cannot run a thunk, or ``None``. Backends only translate these into their API calls.
"""
from __future__ import annotations

from host_fallback.abi import used

from . import body, gdn, rnn, rnn_backward, ssm, ssm_backward
from .core import ARENA, SCRATCH, Buf, Launch, LaunchPlan, Thunk
from .limits import DeviceLimits

_FAMILIES = (body, rnn, rnn_backward, ssm, gdn, ssm_backward)
PLANNERS = {op: fn for module in _FAMILIES for op, fn in module.PLANNERS.items()}
_UNSUPPORTED = {op: module.unsupported for module in _FAMILIES for op in module.PLANNERS}
#: op -> the version-2 fields (ABI.md §8) its device kernels implement; a thunk using another runs on the host
V2_FIELDS = {op: getattr(module, "V2_FIELDS", frozenset()) for module in _FAMILIES for op in module.PLANNERS}


def unsupported(thunk: Thunk, limits: DeviceLimits) -> str | None:
    """``None`` when kernels exist for ``thunk`` within ``limits``, else the reason (whether the device
    offers f64 is the device session's question: it names the feature the device lacks)."""
    op = thunk["op"]
    if op not in PLANNERS:
        return f"no device kernel for op {op!r}"
    missing = [name for name in used(thunk) if name not in V2_FIELDS[op]]
    if missing:
        return f"no device kernel of {op} takes the version-2 field(s) {', '.join(missing)} yet"
    return _UNSUPPORTED[op](thunk, limits)


def plan(thunk: Thunk, limits: DeviceLimits, **options: object) -> LaunchPlan:
    """The launches that run ``thunk`` (``options``: ``rnn_kernel="auto"|"persistent"|"step"``; at the gpu
    target ``ssm_kernel="auto"|"lanes"|"chunked"`` for selective_scan, mamba2 and gated_delta_net)."""
    return PLANNERS[thunk["op"]](thunk, limits, **options)


__all__ = ["ARENA", "SCRATCH", "Buf", "Launch", "LaunchPlan", "DeviceLimits", "plan", "unsupported", "PLANNERS"]
