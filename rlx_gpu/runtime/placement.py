"""Placement: the backend each thunk of a schedule runs on, and why (an override, support, or fallback)."""
from __future__ import annotations

from dataclasses import dataclass

import host_fallback

from ..backends.base import Session
from ..errors import DeviceError, FallbackForbidden
from ..schedule.model import Schedule, Thunk
from .config import Config


@dataclass(frozen=True)
class Assignment:
    """Where one thunk runs and why."""

    index: int
    op: str
    dtype: str
    backend: str
    reason: str


def assign(thunk: Thunk, session: Session, config: Config) -> Assignment:
    """Choose the backend for one thunk: an override, else the device, else the host under the policy."""
    device = session.info.backend
    pinned = config.override_for(thunk.op, thunk.dtype)
    if pinned and pinned != device:
        if pinned != "host":
            raise DeviceError(f"thunk {thunk.index} ({thunk.op}): override pins it to {pinned!r}, but a schedule "
                              f"runs on one device ({device}) plus the host")
        return Assignment(thunk.index, thunk.op, thunk.dtype, "host",
                          f"fallback{_host_path(thunk)}: override {thunk.op}:{thunk.dtype} -> host in {config.source}")
    why_not = session.unsupported(thunk)
    if why_not is None:
        how = "override" if pinned else "supported"
        path = _host_path(thunk) if device == "host" else ""
        return Assignment(thunk.index, thunk.op, thunk.dtype, device, f"{how} on {session.info.spec}{path}")
    if config.fallback == "forbid":
        raise FallbackForbidden(f"thunk {thunk.index} ({thunk.op}, {thunk.dtype}) cannot run on "
                                f"{session.info.spec}: {why_not}; the fallback policy is 'forbid' "
                                f"(set fallback: allow or warn in {config.source})")
    return Assignment(thunk.index, thunk.op, thunk.dtype, "host", f"fallback{_host_path(thunk)}: {why_not}")


def _host_path(thunk: Thunk) -> str:
    """`` (algorithm)`` the host runs ``thunk`` with, for ops that choose one; else empty."""
    path = host_fallback.path_for(thunk)
    return f" ({path})" if path else ""


def place(schedule: Schedule, session: Session, config: Config) -> list[Assignment]:
    """The assignment of every top-level thunk; nothing runs."""
    return [assign(t, session, config) for t in schedule.thunks]
