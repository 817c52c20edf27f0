"""Backend discovery (lazy imports), device selection, and the per-thunk choice with its reason."""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from functools import lru_cache
from types import ModuleType
from typing import Any

import host_fallback

from .abi import Schedule, Thunk
from .backends.base import BackendUnavailable, DeviceInfo, Session
from .config import Config, load_config
from .errors import DeviceError, FallbackForbidden

BACKEND_MODULES = {"host": "rlx_gpu.backends.host", "opencl": "rlx_gpu.backends.opencl",
                   "cuda": "rlx_gpu.backends.cuda"}


@dataclass(frozen=True)
class BackendStatus:
    """Whether a backend can run here: its devices, or the reason it cannot."""

    name: str
    devices: tuple[DeviceInfo, ...]
    reason: str | None  # None when available

    @property
    def available(self) -> bool:
        return self.reason is None and bool(self.devices)


@lru_cache(maxsize=None)
def backend_module(name: str) -> ModuleType:
    """Import a backend by name; a missing package raises ``BackendUnavailable`` with the reason."""
    if name not in BACKEND_MODULES:
        raise DeviceError(f"unknown backend {name!r}; known: {', '.join(BACKEND_MODULES)}")
    try:
        return importlib.import_module(BACKEND_MODULES[name])
    except ModuleNotFoundError as err:
        if err.name == BACKEND_MODULES[name]:
            raise BackendUnavailable(f"{name}: this release has no {name} backend module yet") from err
        raise BackendUnavailable(f"{name}: module {err.name!r} is not installed "
                                 f"(pip install 'rlx_gpu[{'cuda12' if name == 'cuda' else name}]')") from err


@lru_cache(maxsize=None)
def status(name: str) -> BackendStatus:
    """Probe one backend once per process."""
    try:
        devices = tuple(backend_module(name).probe())
    except BackendUnavailable as err:
        return BackendStatus(name, (), str(err))
    except Exception as err:  # a broken driver must not hide the other backends
        return BackendStatus(name, (), f"{name}: probing failed: {type(err).__name__}: {err}")
    return BackendStatus(name, devices, None if devices else f"{name}: no device found")


def discover() -> list[BackendStatus]:
    """Every known backend with its devices or the reason it is unavailable."""
    return [status(name) for name in BACKEND_MODULES]


def resolve(spec: str | None, config: Config) -> DeviceInfo:
    """Turn ``host | opencl[:p[:d]] | cuda[:n] | auto`` (or RLX_DEVICE, or the config) into a device."""
    spec = (spec or os.environ.get("RLX_DEVICE") or config.device or "auto").strip()
    if spec == "auto":
        for name in config.priority:
            st = status(name)
            if st.available:
                return st.devices[0]
        raise DeviceError(f"auto: no backend of {list(config.priority)} is available")
    name = spec.split(":", 1)[0]
    st = status(name)
    if not st.available:
        raise DeviceError(f"device {spec!r} is unavailable: {st.reason}")
    if ":" not in spec:
        return st.devices[0]
    for info in st.devices:
        if info.spec == spec or info.spec.startswith(spec + ":"):
            return info
    raise DeviceError(f"device {spec!r} not found; {name} has {', '.join(d.spec for d in st.devices)}")


@lru_cache(maxsize=None)
def open_session(info: DeviceInfo) -> Session:
    """One session per device per process, so compiled kernels are reused across runs."""
    return backend_module(info.backend).open(info)


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


def plan(schedule: Schedule, session: Session, config: Config) -> list[Assignment]:
    """The assignment of every top-level thunk; nothing runs."""
    return [assign(t, session, config) for t in schedule.thunks]


def get_device(spec: str | None = None, config: Config | str | None = None) -> Any:
    """Open a device by spec (``None``: ``RLX_DEVICE``, then the config's ``device``)."""
    from .executor import Device

    cfg = config if isinstance(config, Config) else load_config(config)
    return Device(open_session(resolve(spec, cfg)), cfg)
