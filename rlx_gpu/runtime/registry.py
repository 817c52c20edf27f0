"""Backend discovery (lazy imports), backend status, device selection and one session per device."""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

from ..backends import MODULES, backend_module
from ..backends.base import BackendUnavailable, DeviceInfo, Session
from ..errors import DeviceError
from .config import Config, check_spec


@dataclass(frozen=True)
class BackendStatus:
    """Whether a backend can run here: its devices, or the reason it cannot."""

    name: str
    devices: tuple[DeviceInfo, ...]
    reason: str | None  # None when available
    #: devices the backend found but cannot run on (``details["unusable"]`` says why), listed, never chosen
    refused: tuple[DeviceInfo, ...] = ()

    @property
    def available(self) -> bool:
        return self.reason is None and bool(self.devices)


@lru_cache(maxsize=None)
def status(name: str) -> BackendStatus:
    """Probe one backend once per process."""
    try:
        devices = tuple(backend_module(name).probe())
    except BackendUnavailable as err:
        return BackendStatus(name, (), str(err))
    except Exception as err:  # a broken driver must not hide the other backends
        return BackendStatus(name, (), f"{name}: probing failed: {type(err).__name__}: {err}")
    usable = tuple(d for d in devices if "unusable" not in d.details)
    refused = tuple(d for d in devices if "unusable" in d.details)
    if usable:
        return BackendStatus(name, usable, None, refused)
    reason = "; ".join(f"{d.spec} {d.name}: {d.details['unusable']}" for d in refused)
    return BackendStatus(name, (), f"{name}: {reason or 'no device found'}", refused)


def discover() -> list[BackendStatus]:
    """Every known backend with its devices or the reason it is unavailable."""
    return [status(name) for name in MODULES]


def _device_env(name: str) -> str | None:
    """The value of backend ``name``'s device variable (``DEVICE_ENV``), if it declares one and it is set."""
    try:
        variable = backend_module(name).DEVICE_ENV
    except BackendUnavailable:
        return None
    return os.environ.get(variable) if variable else None


def device_variables() -> tuple[str, ...]:
    """The environment variables that choose the default device: ``RLX_DEVICE``, each available
    backend's own device variable, and ``RLX_CONFIG`` (whose ``device`` comes last)."""
    own = []
    for name in MODULES:
        try:
            own.append(backend_module(name).DEVICE_ENV)
        except BackendUnavailable:
            continue
    return ("RLX_DEVICE", *(v for v in own if v), "RLX_CONFIG")


def resolve(spec: str | None, config: Config) -> DeviceInfo:
    """Turn a device spec (``host | opencl[:p[:d]] | cuda[:n] | auto``) into a device (see :func:`choose`)."""
    return choose(spec, config)[0]


def choose(spec: str | None, config: Config) -> tuple[DeviceInfo, str]:
    """The device a spec names, and why it is the one: what chose the spec and, for ``auto``, how auto chose.

    Without ``spec``: ``RLX_DEVICE``, else a backend's own device variable (``PYOPENCL_CTX``: an OpenCL
    device, as pyopencl reads it), else the config's ``device``. A bare backend name also takes its
    device from that variable when it is set. A named device runs whatever its type; ``auto`` is :func:`_auto`.
    """
    chosen_by = "the device argument" if spec else "RLX_DEVICE"
    spec = spec or os.environ.get("RLX_DEVICE")
    if not spec:
        spec = next((name for name in MODULES if _device_env(name) is not None), None)
        if spec:
            chosen_by = backend_module(spec).DEVICE_ENV
    if not spec:
        chosen_by = f"device: in the config {config.source}"
    spec = check_spec(spec or config.device or "auto")
    why = f"{spec}, named by {chosen_by}"
    if spec in MODULES and (value := _device_env(spec)) is not None:
        why += f"; {backend_module(spec).DEVICE_ENV}={value} picks which"
        spec = backend_module(spec).device_from_env(value, status(spec).devices)
    if spec == "auto":
        info, how = _auto(config, chosen_by)
        return info, f"auto ({chosen_by}) takes {how}"
    name = spec.split(":", 1)[0]
    st = status(name)
    for info in st.refused:
        if ":" in spec and _names(spec, info):
            raise DeviceError(f"device {spec!r} (chosen by {chosen_by}) is {info.name}, which cannot run here: "
                              f"{info.details['unusable']}")
    if not st.available:
        raise DeviceError(f"device {spec!r} (chosen by {chosen_by}) is unavailable: {st.reason}")
    if ":" not in spec:
        return st.devices[0], why
    for info in st.devices:
        if _names(spec, info):
            return info, why
    raise DeviceError(f"device {spec!r} (chosen by {chosen_by}) not found; {name} has {', '.join(d.spec for d in st.devices)}")


def _names(spec: str, info: DeviceInfo) -> bool:
    """Whether ``spec`` (``opencl:1`` or ``opencl:1:0``) names ``info``: its whole spec or a leading part."""
    return info.spec == spec or info.spec.startswith(spec + ":")


def _auto(config: Config, chosen_by: str) -> tuple[DeviceInfo, str]:
    """``auto``: in the order of ``config.priority``, the host or a backend's first GPU or accelerator; with
    how it chose.

    A backend's CPU devices (an OpenCL CPU device such as PoCL, a simulator) run most ops slower than the host
    does on the same CPU (an lstm decode step 2.8 ms on PoCL, 0.96 ms on the host), so auto passes them over;
    they run when named. Only a priority that leaves out the host falls back to one of them.
    """
    order = ", ".join(config.priority)
    passed: list[DeviceInfo] = []
    for name in config.priority:
        st = status(name)
        devices = st.devices if st.available else ()
        if name == "host" and devices:
            return devices[0], f"the host: no GPU or accelerator comes before it in the priority {order}" + \
                _passed_over(passed)
        faster = [info for info in devices if not info.cpu]
        if faster:
            return faster[0], f"{faster[0].spec}, the first GPU or accelerator in the priority {order}"
        passed += devices
    if passed:
        return passed[0], f"{passed[0].spec}: no GPU or accelerator, and the priority {order} leaves out the host"
    raise DeviceError(f"auto (chosen by {chosen_by}): no backend of {list(config.priority)} is available")


def _passed_over(cpus: list[DeviceInfo]) -> str:
    """Why auto took the host over the CPU devices ``cpus``, and how to name one (empty without any)."""
    if not cpus:
        return ""
    backends = " and ".join(dict.fromkeys(info.backend for info in cpus))
    listed = ", ".join(f"{info.spec} ({info.name})" for info in cpus)
    which = f"the only {backends} device, {listed}, runs" if len(cpus) == 1 else f"the {backends} devices {listed} run"
    name = cpus[0].backend if len(cpus) == 1 else cpus[0].spec
    return (f"; {which} on the CPU, where the host runs most ops faster; name {'it' if len(cpus) == 1 else 'one'} "
            f"to use it: --device {name} or RLX_DEVICE={name}")


def open_session(info: DeviceInfo, tf32: bool = False) -> Session:
    """The session of ``info``: one per device per process, so compiled kernels are reused across runs, and a
    second on a CUDA device for ``tf32`` (the config's ``cuda.tf32``: f32 gemms and chunk products may round
    their operands to TF32; other backends have no such setting and ignore it). The cache is keyed by the setting
    in force, ``RLX_CUDA_TF32`` over the config's (``cuda.tf32_asked``), so a session never answers for the other."""
    if info.backend != "cuda":
        return sessions(info, False)
    return sessions(info, backend_module("cuda").tf32_asked(bool(tf32)))


@lru_cache(maxsize=None)
def sessions(info: DeviceInfo, tf32: bool) -> Session:
    """The cache behind :func:`open_session`, keyed by the device and its one setting (``cache_clear`` empties it)."""
    module = backend_module(info.backend)
    return module.open(info, tf32=True) if tf32 else module.open(info)
