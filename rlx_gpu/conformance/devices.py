"""Which devices a conformance run covers: named ones (an unknown name is an error listing every
device), or by default every available device of every backend except simulators.

The pytest suite reads the same list from ``RLX_TEST_DEVICES`` (comma-separated specs).
"""
from __future__ import annotations

import os
from typing import Iterable

from ..backends.base import DeviceInfo, Session
from ..errors import DeviceError
from ..launches.limits import TARGET_ENV, TARGETS
from ..runtime.registry import backend_module, discover, open_session, status

ENV = "RLX_TEST_DEVICES"


def every_device() -> list[DeviceInfo]:
    return [info for st in discover() if st.available for info in st.devices]


def listing() -> str:
    """Every backend's devices, or why it has none: the text an unknown device's error shows."""
    lines = []
    for st in discover():
        if st.available:
            lines += [f"  {info.spec:<14} {info.name}" for info in st.devices]
        else:
            lines.append(f"  {st.name:<14} unavailable: {st.reason}")
    return "\n".join(lines)


def default_devices() -> list[DeviceInfo]:
    """The host and every available device that is not a simulator (Oclgrind runs only when named)."""
    return [info for info in every_device() if not info.details.get("simulator")]


def find(spec: str) -> DeviceInfo:
    """The device ``spec`` names exactly (``opencl`` alone: that backend's first device)."""
    spec = spec.strip()
    name = spec.split(":", 1)[0]
    st = status(name) if name in {s.name for s in discover()} else None
    if st is not None and st.available:
        if ":" not in spec:
            return st.devices[0]
        for info in st.devices:
            if info.spec == spec:
                return info
    raise DeviceError(f"no device {spec!r} here; the devices are:\n{listing()}")


def resolve(specs: Iterable[str] | None) -> list[DeviceInfo]:
    """The devices ``specs`` name, in order and without repeats (none named: :func:`default_devices`)."""
    specs = [s for s in (specs or []) if s.strip()]
    if not specs:
        return default_devices()
    found: list[DeviceInfo] = []
    for spec in specs:
        info = find(spec)
        if info not in found:
            found.append(info)
    return found


def open_device(info: DeviceInfo, target: str | None = None) -> Session:
    """A session on ``info``; ``target`` (``cpu`` or ``gpu``) forces the kernel shapes of a device backend
    (through ``RLX_TARGET``, e.g. the gpu kernels on PoCL) in a session of its own."""
    if target is None:
        return open_session(info)
    if target not in TARGETS:
        raise DeviceError(f"target {target!r} is not one of {', '.join(TARGETS)}")
    if info.backend == "host":
        raise DeviceError("the host has no kernel targets; --target applies to opencl and cuda devices")
    before = os.environ.get(TARGET_ENV)
    os.environ[TARGET_ENV] = target
    try:
        session = backend_module(info.backend).open(info)
    finally:
        if before is None:
            del os.environ[TARGET_ENV]
        else:
            os.environ[TARGET_ENV] = before
    return session
