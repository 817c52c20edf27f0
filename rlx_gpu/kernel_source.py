"""Assemble one device program: dialect prelude + shared text + one op family + dtype defines.

The family text in ``kernels/`` is the same for every dialect (DESIGN.md principle 1); only the
prelude differs. ``program(dialect, family, dtype)`` returns the full source, and its hash keys
the compile caches of every backend.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from .launches.limits import CONSTANTS
from .paths import data_dir

FAMILIES = ("rnn", "ssm", "gdn", "body")
PRELUDES = {"opencl": data_dir("kernels_opencl") / "prelude.cl", "cuda": data_dir("kernels_cuda") / "prelude.cuh"}

#: dtype -> (macro suffix, storage C type, compute C type)
C_TYPES: dict[str, tuple[str, str, str]] = {
    "f32": ("F32", "float", "float"),
    "f16": ("F16", "ushort", "float"),
    "bf16": ("BF16", "ushort", "float"),
    "f64": ("F64", "double", "double"),
}


@dataclass(frozen=True)
class Program:
    """One compilable program: its source text and the identity used by compile caches."""

    dialect: str
    family: str
    dtype: str
    src_dtype: str | None
    source: str

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()

    @property
    def label(self) -> str:
        cast = f" (cast from {self.src_dtype})" if self.src_dtype else ""
        return f"{self.dialect} program {self.family}/{self.dtype}{cast}"


@lru_cache(maxsize=None)
def _text(path: Path) -> str:
    return path.read_text()


def defines(dtype: str, src_dtype: str | None = None) -> str:
    """The ``#define`` block that selects storage, compute type and LOAD/STORE for ``dtype``."""
    suffix, storage, compute = C_TYPES[dtype]
    lines = [f"#define RLX_DT {suffix}", f"#define RLX_STORE_T {storage}"]
    need_fp64 = dtype == "f64" or src_dtype == "f64"
    lines.append(f"#define RLX_REAL {compute}")
    if src_dtype is not None:
        lines.append(f"#define RLX_SRC_DT {C_TYPES[src_dtype][0]}")
    if need_fp64:
        lines.append("#define RLX_NEED_FP64 1")
    lines += [f"#define {name} {value}" for name, value in CONSTANTS.items()]
    return "\n".join(lines) + "\n"


def program(dialect: str, family: str, dtype: str, src_dtype: str | None = None,
            extra: tuple[tuple[str, int], ...] = ()) -> Program:
    """Full source of ``family`` for ``dtype`` in ``dialect`` (``src_dtype`` adds the cast kernel)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}; expected one of {FAMILIES}")
    kernels = data_dir("kernels")
    source = "".join(
        [
            f"/* rlx_gpu {family} kernels, dtype {dtype} */\n",
            defines(dtype, src_dtype),
            "".join(f"#define {name} {value}\n" for name, value in extra),
            _text(PRELUDES[dialect]),
            _text(kernels / "common.cl"),
            _text(kernels / f"{family}.cl"),
        ]
    )
    return Program(dialect, family, dtype, src_dtype, source)


def cache_key(device_key: object, prog: Program, options: tuple[str, ...]) -> tuple[object, str, tuple[str, ...]]:
    """Compile-cache identity: the same source and options on the same device compile once."""
    return (device_key, prog.digest, tuple(options))
