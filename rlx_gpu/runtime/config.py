"""The YAML configuration: device choice, backend priority, fallback policy, overrides, the CUDA backend's
TF32 switch, tolerances."""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml
from host_fallback.abi import DTYPES, OPS
from host_fallback.scan import STRATEGIES as RECOMPUTE

from .. import backends
from ..errors import ConfigError, DeviceError
from ..paths import data_dir
from ..schedule.yaml_reader import yaml_message

POLICIES = ("allow", "warn", "forbid")
KEYS = ("device", "priority", "fallback", "overrides", "scan", "cuda", "tolerances")
TOLERANCE_KEYS = ("thunk", "schedule", *OPS)


@dataclass(frozen=True)
class Config:
    """What ``configs/default.yaml`` (or ``RLX_CONFIG``) says; ``source`` names the file it came from."""

    device: str = "auto"
    priority: tuple[str, ...] = ("cuda", "opencl", "host")
    fallback: str = "warn"
    overrides: Mapping[str, str] = field(default_factory=dict)
    recompute: str = "segment"
    tf32: bool = False  # cuda.tf32: f32 gemms and chunk products may round operands to TF32 (registry.open_session)
    tolerances: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    source: str = "<defaults>"

    def override_for(self, op: str, dtype: str) -> str | None:
        """The backend an override pins ``op`` (in ``dtype``) to, if any; ``op:dtype`` wins over ``op``."""
        return self.overrides.get(f"{op}:{dtype}", self.overrides.get(op))

    def tolerance(self, what: str, dtype: str) -> float:
        """NMSE bound in ``dtype``: ``what`` is an op (one thunk; else the ``thunk`` entry) or ``schedule``."""
        for key in (what, "thunk"):
            bound = (self.tolerances.get(key) or {}).get(dtype)
            if bound is not None:
                return float(bound)
        raise ConfigError(f"config {self.source}: no tolerance for {what!r} in {dtype}; add it under tolerances "
                          f"(see {default_config_path()})")


def backend_names() -> tuple[str, ...]:
    """Every backend a config may name (``rlx_gpu.backends.MODULES``)."""
    return tuple(backends.MODULES)


def spec_forms() -> str:
    """The device-spec forms, each backend's as its module declares it (``host | opencl[:platform[:device]]
    | ... | auto``)."""
    return " | ".join([*(backends.spec_form(name) for name in backends.MODULES), "auto"])


def check_spec(spec: str) -> str:
    """``spec`` stripped, when it has one of the forms of :func:`spec_forms`; else a ``DeviceError`` saying so.

    Only the form is checked: whether the device exists is ``resolve``'s question.
    """
    name, *indices = str(spec).strip().split(":")
    if name == "auto":
        most = 0
    elif name in backends.MODULES:
        most = len(backends.backend_module(name).SPEC_INDICES)
    else:
        most = -1  # not a backend: no form fits
    if len(indices) > most or not all(i.isdigit() for i in indices):
        raise DeviceError(f"device {spec!r} is not a device spec; expected {spec_forms()} "
                          f"(`rlx-gpu devices` lists the devices here)")
    return str(spec).strip()


def default_config_path() -> Path:
    return data_dir("configs") / "default.yaml"


def _one_of(path: Path, key: str, value: Any, known: tuple[str, ...], what: str) -> str:
    """``value`` when it is in ``known``; else a ``ConfigError`` naming the file, the key and the choices."""
    if value in known:
        return str(value)
    near = difflib.get_close_matches(str(value), known, n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    raise ConfigError(f"config {path}: {key}: {value!r} is not {what}{hint}; expected one of {', '.join(known)}")


def _mapping(path: Path, key: str, value: Any) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"config {path}: {key}: expected a mapping, got {type(value).__name__} {value!r}")
    return value


def _device(path: Path, value: Any) -> str:
    try:
        return check_spec(str(value))
    except DeviceError as err:
        raise ConfigError(f"config {path}: device: {err}") from err


def _priority(path: Path, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"config {path}: priority: expected a list of backends ({', '.join(backend_names())}), "
                          f"got {value!r}")
    return tuple(_one_of(path, "priority", name, backend_names(), "a backend") for name in value)


def _overrides(path: Path, value: Any) -> dict[str, str]:
    """``op`` or ``op:dtype`` -> backend, each part checked against the op table, dtypes and backends."""
    out = {}
    for key, backend in _mapping(path, "overrides", value).items():
        op, _, dtype = str(key).partition(":")
        _one_of(path, f"overrides[{key!r}]", op, tuple(OPS), "an op")
        if dtype:
            _one_of(path, f"overrides[{key!r}]", dtype, DTYPES, "a dtype")
        out[str(key)] = _one_of(path, f"overrides[{key!r}]", backend, backend_names(), "a backend")
    return out


def _flag(path: Path, key: str, value: Any) -> bool:
    """``value`` when it is a YAML boolean (true or false); else a ``ConfigError`` naming the file and the key."""
    if isinstance(value, bool):
        return value
    raise ConfigError(f"config {path}: {key}: expected true or false, got {type(value).__name__} {value!r}")


def _tolerances(path: Path, given: Any) -> dict[str, dict[str, float]]:
    """The bundled table of ``configs/default.yaml`` with the entries of ``path`` on top."""
    base = {} if path == default_config_path() else load_config(default_config_path()).tolerances
    table = {key: dict(bounds) for key, bounds in base.items()}
    for key, bounds in _mapping(path, "tolerances", given).items():
        _one_of(path, "tolerances", key, TOLERANCE_KEYS, "thunk, schedule or an op")
        for dtype, bound in _mapping(path, f"tolerances.{key}", bounds).items():
            _one_of(path, f"tolerances.{key}", dtype, DTYPES, "a dtype")
            if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not bound >= 0:
                raise ConfigError(f"config {path}: tolerances.{key}.{dtype}: expected an NMSE bound >= 0, "
                                  f"got {bound!r}{_yaml11_hint(bound)}")
            table.setdefault(key, {})[dtype] = float(bound)
    return table


def _yaml11_hint(value: Any) -> str:
    """Why a number arrived as a string: YAML 1.1 (PyYAML) reads ``1e-20`` as text, wanting ``1.0e-20``."""
    if not isinstance(value, str):
        return ""
    try:
        float(value)
    except ValueError:
        return ""
    return (f", a string: YAML 1.1 reads a float only with a dot and a signed exponent; "
            f"write {value.strip()} as {_yaml11_float(value)}")


def _yaml11_float(text: str) -> str:
    """``1e-20`` → ``1.0e-20``, ``5E3`` → ``5.0e+3``: the spelling YAML 1.1 reads as a float."""
    mantissa, _, exponent = text.strip().lower().partition("e")
    if "." not in mantissa:
        mantissa += ".0"
    if exponent and exponent[0] not in "+-":
        exponent = "+" + exponent
    return mantissa + ("e" + exponent if exponent else "")


def load_config(path: str | os.PathLike | None = None) -> Config:
    """Read ``path``, else ``$RLX_CONFIG``, else the bundled default, over the defaults' tolerances.

    Every key and value is checked (devices, backends, ops, dtypes); a mistake raises ``ConfigError``.
    """
    path = Path(path or os.environ.get("RLX_CONFIG") or default_config_path())
    try:
        data: Any = yaml.safe_load(path.read_text()) or {}
    except OSError as err:
        raise ConfigError(f"cannot read config {path}: {err.strerror}") from err
    except yaml.YAMLError as err:
        raise ConfigError(f"config {path}: not YAML: {yaml_message(err)}") from err
    if not isinstance(data, dict):
        raise ConfigError(f"config {path}: expected a mapping of {', '.join(KEYS)}, got {type(data).__name__}")
    for key in data:
        _one_of(path, "top level", key, KEYS, "a config key")
    scan = _mapping(path, "scan", data.get("scan"))
    for key in scan:
        _one_of(path, "scan", key, ("recompute",), "a scan option")
    cuda = _mapping(path, "cuda", data.get("cuda"))
    for key in cuda:
        _one_of(path, "cuda", key, ("tf32",), "a cuda option")
    return Config(
        device=_device(path, data.get("device", Config.device)),
        priority=_priority(path, data.get("priority", list(Config.priority))),
        fallback=_one_of(path, "fallback", data.get("fallback", Config.fallback), POLICIES, "a fallback policy"),
        overrides=_overrides(path, data.get("overrides")),
        recompute=_one_of(path, "scan.recompute", scan.get("recompute", Config.recompute), RECOMPUTE,
                          "a recompute strategy"),
        tf32=_flag(path, "cuda.tf32", cuda.get("tf32", Config.tf32)),
        tolerances=_tolerances(path, data.get("tolerances")),
        source=str(path),
    )
