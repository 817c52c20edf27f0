"""Placement: the backend each thunk runs on and why — top-level thunks and, recursively, the body
thunks of every scan the device drives, under the same rules (config overrides, device support,
fallback policy). Decided once, before anything runs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import host_fallback

from host_fallback.abi import SCAN_OPS, footprint

from ..backends.base import Session
from ..errors import DeviceError, FallbackForbidden
from ..schedule.model import Schedule, Thunk
from .config import Config

#: The body schedules of each scan op, in the order placement lists them.
BODIES = {"scan": ("body",), "scan_backward": ("body_vjp", "forward_body"),
          "scan_backward_xs": ("body_vjp", "forward_body")}


@dataclass(frozen=True)
class Assignment:
    """Where one thunk runs and why.

    ``path`` locates it: ``("thunk 3",)`` at the top level, ``("thunk 3", "body thunk 1")`` inside the
    body of scan 3. ``copied_bytes`` is what one execution moves when it runs on the host while the
    schedule runs on a device (its read footprint in, its write footprint back), else 0.
    """

    index: int
    op: str
    dtype: str
    backend: str
    reason: str
    path: tuple[str, ...] = ()
    copied_bytes: int = 0
    thunk: Thunk | None = field(default=None, repr=False, compare=False)

    @property
    def where(self) -> str:
        return " › ".join(self.path) or f"thunk {self.index}"

    @property
    def nested(self) -> bool:
        return len(self.path) > 1


def assign(thunk: Thunk, session: Session, config: Config, path: tuple[str, ...] = ()) -> Assignment:
    """Choose the backend for one thunk: an override, else the device, else the host under the policy."""
    device = session.info.backend
    path = path or (f"thunk {thunk.index}",)
    where = f"{' › '.join(path)} ({thunk.op}, {thunk.dtype})"
    pinned = config.override_for(thunk.op, thunk.dtype)
    if pinned and pinned != device:
        if pinned != "host":
            raise DeviceError(f"{where}: override pins it to {pinned!r}, but a schedule runs on one device "
                              f"({device}) plus the host")
        why = f"override {thunk.op}:{thunk.dtype} -> host in {config.source}"
        if config.fallback == "forbid":
            raise FallbackForbidden(f"{where}: {why}, but the fallback policy is 'forbid' (remove the override "
                                    f"or set fallback: allow or warn in {config.source})")
        return _on_host(thunk, path, f"fallback{_host_path(thunk)}: {why}")
    why_not = session.unsupported(thunk)
    if why_not is None:
        how = "override" if pinned else "supported"
        host_path = _host_path(thunk) if device == "host" else ""
        return Assignment(thunk.index, thunk.op, thunk.dtype, device, f"{how} on {session.info.spec}{host_path}", path,
                          thunk=thunk)
    if thunk.op not in host_fallback.KERNELS:
        on_host = "" if device == "host" else f", and host_fallback has no {thunk.op} kernel"
        raise DeviceError(f"{where}: no backend runs it yet ({session.info.spec}: {why_not}{on_host}); leave the "
                          "op out of the schedule")
    if config.fallback == "forbid":
        raise FallbackForbidden(f"{where} cannot run on {session.info.spec}: {why_not}; the fallback policy is "
                                f"'forbid' (set fallback: allow or warn in {config.source})")
    return _on_host(thunk, path, f"fallback{_host_path(thunk)}: {why_not}")


def _on_host(thunk: Thunk, path: tuple[str, ...], reason: str) -> Assignment:
    reads, writes = footprint(thunk)
    copied = sum(r.nbytes for r in reads) + sum(r.nbytes for r in writes)
    return Assignment(thunk.index, thunk.op, thunk.dtype, "host", reason, path, copied, thunk)


def _host_path(thunk: Thunk) -> str:
    """`` (algorithm)`` the host runs ``thunk`` with, for ops that choose one; else empty."""
    path = host_fallback.path_for(thunk)
    return f" ({path})" if path else ""


def _walk(thunks: tuple[Thunk, ...], session: Session, config: Config, outer: tuple[str, ...],
          label: str) -> Iterator[Assignment]:
    for thunk in thunks:
        path = outer + (f"{label}thunk {thunk.index}",)
        chosen = assign(thunk, session, config, path)
        yield chosen
        if chosen.backend == session.info.backend != "host" and thunk.op in SCAN_OPS:
            for body in BODIES[thunk.op]:  # the device drives this scan: place its body thunks too
                if thunk[body] is not None:  # a null forward_body: every step saved, nothing to recompute
                    yield from _walk(thunk[body].thunks, session, config, path, f"{body} ")


def place(schedule: Schedule, session: Session, config: Config) -> list[Assignment]:
    """Every thunk's assignment, depth first: each top-level thunk, then (for a scan the device drives)
    its body thunks. Nothing runs; ``FallbackForbidden`` or ``DeviceError`` is raised here."""
    return list(_walk(schedule.thunks, session, config, (), ""))
