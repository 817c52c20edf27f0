"""The YAML configuration: device choice, backend priority, fallback policy, overrides, tolerances."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from ..errors import RlxError
from ..paths import data_dir

POLICIES = ("allow", "warn", "forbid")
RECOMPUTE = ("segment", "treeverse")


@dataclass(frozen=True)
class Config:
    """What ``configs/default.yaml`` (or ``RLX_CONFIG``) says; ``source`` names the file it came from."""

    device: str = "auto"
    priority: tuple[str, ...] = ("cuda", "opencl", "host")
    fallback: str = "warn"
    overrides: Mapping[str, str] = field(default_factory=dict)
    recompute: str = "segment"
    tolerances: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    source: str = "<defaults>"

    def override_for(self, op: str, dtype: str) -> str | None:
        """The backend an override pins ``op`` (in ``dtype``) to, if any; ``op:dtype`` wins over ``op``."""
        return self.overrides.get(f"{op}:{dtype}", self.overrides.get(op))

    def tolerance(self, op: str, dtype: str) -> float:
        """NMSE bound for ``op`` in ``dtype`` against the float64 reference."""
        return float(self.tolerances.get(op, {}).get(dtype, self.tolerances.get("default", {}).get(dtype, 1e-7)))


def default_config_path() -> Path:
    return data_dir("configs") / "default.yaml"


def load_config(path: str | os.PathLike | None = None) -> Config:
    """Read ``path``, else ``$RLX_CONFIG``, else the bundled default; unknown keys and values are errors."""
    path = Path(path or os.environ.get("RLX_CONFIG") or default_config_path())
    try:
        data: Any = yaml.safe_load(path.read_text()) or {}
    except OSError as err:
        raise RlxError(f"cannot read config {path}: {err.strerror}") from err
    known = {"device", "priority", "fallback", "overrides", "scan", "tolerances"}
    if not isinstance(data, dict) or set(data) - known:
        raise RlxError(f"config {path}: unknown keys {sorted(set(data) - known)}; known: {sorted(known)}")
    fallback = data.get("fallback", Config.fallback)
    if fallback not in POLICIES:
        raise RlxError(f"config {path}: fallback {fallback!r} is not one of {', '.join(POLICIES)}")
    recompute = (data.get("scan") or {}).get("recompute", Config.recompute)
    if recompute not in RECOMPUTE:
        raise RlxError(f"config {path}: scan.recompute {recompute!r} is not one of {', '.join(RECOMPUTE)}")
    return Config(
        device=str(data.get("device", Config.device)),
        priority=tuple(data.get("priority", Config.priority)),
        fallback=fallback,
        overrides=dict(data.get("overrides") or {}),
        recompute=recompute,
        tolerances=dict(data.get("tolerances") or {}),
        source=str(path),
    )
