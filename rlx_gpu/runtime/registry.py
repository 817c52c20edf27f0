"""Backend discovery (lazy imports), backend status, device selection and one session per device."""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from functools import lru_cache
from types import ModuleType

from ..backends.base import BackendUnavailable, DeviceInfo, Session
from ..errors import DeviceError
from .config import BACKENDS, Config, check_spec

BACKEND_MODULES = {name: f"rlx_gpu.backends.{name}" for name in BACKENDS}


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
        extra = "cuda12" if name == "cuda" else name
        raise BackendUnavailable(f"{name}: module {err.name!r} is not installed "
                                 f'(in a checkout: pip install -e ".[{extra}]")') from err


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


def _pyopencl_ctx(opencl: BackendStatus) -> str | None:
    """The OpenCL device ``PYOPENCL_CTX`` picks (``p``, ``p:d``, or platform/device name fragments)."""
    answer = os.environ.get("PYOPENCL_CTX")
    if answer is None:
        return None
    parts = [p.strip() for p in answer.split(":")]
    if all(p.isdigit() for p in parts if p):
        return ":".join(["opencl", *[p for p in parts if p]][:3])
    for info in opencl.devices:
        name, platform = info.name.lower(), str(info.details.get("platform", "")).lower()
        if parts[0].lower() in platform and (len(parts) < 2 or parts[1].lower() in name):
            return info.spec
    raise DeviceError(f"PYOPENCL_CTX={answer!r} names no OpenCL device; "
                      f"opencl has {', '.join(d.spec + ' ' + d.name for d in opencl.devices) or 'none'}")


def resolve(spec: str | None, config: Config) -> DeviceInfo:
    """Turn ``host | opencl[:p[:d]] | cuda[:n] | auto`` into a device.

    Without ``spec``: ``RLX_DEVICE``, else ``PYOPENCL_CTX`` (an OpenCL device, as pyopencl reads it),
    else the config's ``device``. A plain ``opencl`` also takes its platform and device from ``PYOPENCL_CTX``.
    """
    chosen_by = "the device argument" if spec else "RLX_DEVICE"
    spec = spec or os.environ.get("RLX_DEVICE")
    if not spec and os.environ.get("PYOPENCL_CTX") is not None:
        spec, chosen_by = "opencl", "PYOPENCL_CTX"
    if not spec:
        chosen_by = f"device: in the config {config.source}"
    spec = check_spec(spec or config.device or "auto")
    if spec == "opencl" and os.environ.get("PYOPENCL_CTX") is not None:
        spec = _pyopencl_ctx(status("opencl")) or spec
    if spec == "auto":
        for name in config.priority:
            st = status(name)
            if st.available:
                return st.devices[0]
        raise DeviceError(f"auto (chosen by {chosen_by}): no backend of {list(config.priority)} is available")
    name = spec.split(":", 1)[0]
    st = status(name)
    if not st.available:
        raise DeviceError(f"device {spec!r} (chosen by {chosen_by}) is unavailable: {st.reason}")
    if ":" not in spec:
        return st.devices[0]
    for info in st.devices:
        if info.spec == spec or info.spec.startswith(spec + ":"):
            return info
    raise DeviceError(f"device {spec!r} (chosen by {chosen_by}) not found; {name} has {', '.join(d.spec for d in st.devices)}")


@lru_cache(maxsize=None)
def open_session(info: DeviceInfo) -> Session:
    """One session per device per process, so compiled kernels are reused across runs."""
    return backend_module(info.backend).open(info)
