"""Assemble one device program: defines + dialect prelude + shared text + one op family.

The family text in ``kernels/`` is the same for every dialect (DESIGN.md principle 1); only the
prelude differs. The defines select the dtype, the target's tuning constants (``launches.limits``)
and a launch's compile-time constants. ``program_for(dialect, launch, limits)`` is the one way a
backend gets the program of a launch; the program's digest keys every compile cache.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path

from host_fallback.abi import DTYPES
from host_fallback.arena import COMPUTE, STORAGE

from ..launches import families, shared_texts
from ..launches.activation_codes import activation_defines
from ..launches.body import fn_defines
from ..launches.core import Launch
from ..launches.limits import TARGETS, TUNING, DeviceLimits, variants
from ..paths import data_dir
from . import backend_module

#: Every program family: the ones the registered planners launch (``launches.families``); ``cast`` builds one
#: program per (dtype, source dtype)
FAMILIES = families()

#: The C type holding each NumPy storage or compute type (16-bit floats are stored as their raw bits).
_C_TYPE = {"float32": "float", "float64": "double", "float16": "ushort", "bfloat16": "ushort"}

#: dtype -> (macro suffix, storage C type, compute C type), from host_fallback.arena's STORAGE and COMPUTE
C_TYPES: dict[str, tuple[str, str, str]] = {
    dt: (dt.upper(), _C_TYPE[STORAGE[dt].name], _C_TYPE[COMPUTE[dt].name]) for dt in COMPUTE
}


@dataclass(frozen=True)
class Program:
    """One compilable program: its source text and the identity used by compile caches."""

    dialect: str
    family: str
    dtype: str
    src_dtype: str | None
    source: str
    target: str = "cpu"
    defines: tuple[tuple[str, int], ...] = ()

    @cached_property
    def digest(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()

    @property
    def label(self) -> str:
        cast = f" (cast from {self.src_dtype})" if self.src_dtype else ""
        extra = "".join(f" {name}={value}" for name, value in self.defines)
        return f"{self.dialect} program {self.family}/{self.dtype}{cast} [{self.target}{extra}]"


@lru_cache(maxsize=None)
def _text(path: Path) -> str:
    return path.read_text()


def prelude_path(dialect: str) -> Path:
    """The prelude of ``dialect``, as the backend module of that name declares it (``PRELUDE``)."""
    prelude = backend_module(dialect).PRELUDE
    if prelude is None:
        raise ValueError(f"backend {dialect!r} compiles no kernels: its module declares no PRELUDE")
    folder, name = prelude
    return data_dir(folder) / name


def defines(dtype: str, src_dtype: str | None = None, target: str = "cpu",
            extra: tuple[tuple[str, int], ...] = ()) -> str:
    """The ``#define`` block: storage, compute type and LOAD/STORE for ``dtype``, the target's tuning
    constants and ``RLX_TARGET_CPU`` / ``RLX_TARGET_GPU``, the body's function codes and the recurrent
    activation codes (``launches.activation_codes``), then a launch's own constants ``extra``."""
    suffix, storage, compute = C_TYPES[dtype]
    lines = [f"#define RLX_DT {suffix}", f"#define RLX_STORE_T {storage}"]
    need_fp64 = dtype == "f64" or src_dtype == "f64"
    lines.append(f"#define RLX_REAL {compute}")
    if src_dtype is not None:
        lines.append(f"#define RLX_SRC_DT {C_TYPES[src_dtype][0]}")
    if need_fp64:
        lines.append("#define RLX_NEED_FP64 1")
    lines.append(f"#define RLX_TARGET_{target.upper()} 1")
    tuning = TUNING[target]
    clash = [name for name, _ in extra if name in tuning]
    if clash:
        raise ValueError(f"launch defines {clash} would redefine {target} tuning constants; rename them")
    named = [*tuning.items(), *fn_defines().items(), *activation_defines().items(), *extra]
    lines += [f"#define {name} {value}" for name, value in named]
    return "\n".join(lines) + "\n"


@lru_cache(maxsize=None)  # backends ask once per launch: the text and its digest are built once
def program(dialect: str, family: str, dtype: str, src_dtype: str | None = None, target: str = "cpu",
            extra: tuple[tuple[str, int], ...] = ()) -> Program:
    """Full source of ``family`` for ``dtype`` in ``dialect`` at ``target`` (``src_dtype`` adds the cast
    kernel, ``extra`` a launch's compile-time constants)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}; expected one of {FAMILIES}")
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; expected one of {TARGETS}")
    kernels = data_dir("kernels")  # the family's text after those it shares with others (its planner names them)
    source = "".join(
        [
            f"/* rlx_gpu {family} kernels, dtype {dtype} */\n",
            defines(dtype, src_dtype, target, extra),
            _text(prelude_path(dialect)),
            _text(kernels / "common.cl"),
            *(_text(kernels / name) for name in shared_texts(family)),
            _text(kernels / f"{family}.cl"),
        ]
    )
    return Program(dialect, family, dtype, src_dtype, source, target, tuple(extra))


def program_for(dialect: str, launch: Launch, limits: DeviceLimits) -> Program:
    """The program that holds ``launch``'s kernel, in ``dialect``, for a device with ``limits``."""
    if launch.target != limits.target:
        raise ValueError(f"launch {launch.kernel} was planned for the {launch.target} target but the device "
                         f"runs {limits.target} kernels; plan it with this device's limits")
    return program(dialect, launch.family, launch.dtype, launch.src_dtype, launch.target, launch.defines)


def every_program(dialect: str, target: str = "cpu", dtypes: tuple[str, ...] | None = None) -> list[Program]:
    """Every program the backends build at ``target`` in ``dialect``: each family for each dtype (of ``dtypes``,
    default all) and compile-time variant, and the cast family for each (dtype, source dtype)."""
    chosen = DTYPES if dtypes is None else dtypes
    out = [program(dialect, fam, dt, None, target, defs)
           for fam in FAMILIES if fam != "cast" for dt in chosen for defs in variants(fam, target)]
    out += [program(dialect, "cast", dt, src, target) for dt in chosen for src in DTYPES]
    return out


def cache_key(device_key: object, prog: Program, options: tuple[str, ...]) -> tuple[object, str, tuple[str, ...]]:
    """Compile-cache identity: the same source and options on the same device compile once."""
    return (device_key, prog.digest, tuple(options))
