"""Cubins built once: in memory per process, on disk across processes.

The CUDA backend loads cubins for the device's exact ``sm_XY`` (never PTX: a driver older than the
NVRTC that wrote PTX rejects it). A cubin is identified by (architecture, program source digest,
compile options, NVRTC version); the disk copy lives in ``$RLX_CACHE_DIR`` or
``~/.cache/rlx_gpu/cubin`` and is written atomically (a temporary file renamed into place), so
concurrent processes never read half a file. An unreadable cache entry is rebuilt, never trusted.
Beside each cubin the cache keeps the PTX it was assembled from (``<name>.ptx``), whose ``.entry`` list
names the kernels the module holds and the parameters each takes, and ptxas's ``-v`` report
(``<name>.log``: registers, stack and spills per kernel).
"""
from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .atomic_files import write_atomically
from .programs import Program

CACHE_ENV = "RLX_CACHE_DIR"
MAGIC = b"\x7fELF"  # a cubin is an ELF image; anything else in the cache is a damaged entry


@dataclass(frozen=True)
class CudaBuild:
    """One NVRTC compile for an ``sm_XX`` architecture: the cubin, its PTX and the log with ptxas's report."""

    cubin: bytes
    ptx: str
    log: str


#: builds a program for an architecture (``backends.nvrtc.build``)
Compile = Callable[[Program, str], CudaBuild]


def cache_dir() -> Path:
    """``$RLX_CACHE_DIR`` when set, else ``~/.cache/rlx_gpu/cubin``."""
    override = os.environ.get(CACHE_ENV)
    return Path(override) if override else Path.home() / ".cache" / "rlx_gpu" / "cubin"


def nvrtc_version() -> str:
    """The NVRTC library's version, ``major.minor`` (part of every cubin's identity)."""
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"nvrtcVersion failed: {err}")
    return f"{major}.{minor}"


class CubinCache:
    """``get(program)`` returns the cubin of ``program`` for ``arch``, compiling at most once per key.

    Parameters
    ----------
    arch : str
        ``sm_XY`` of the device.
    options : tuple of str
        The compile options ``compile`` uses (part of the key: a change of options rebuilds).
    compile : callable
        ``(program, arch) -> CudaBuild``; raises ``KernelBuildError`` on failure.
    version : str
        The compiler's version (part of the key).
    directory : Path or None
        The disk cache; ``None`` keeps cubins in memory only.
    """

    def __init__(self, arch: str, options: tuple[str, ...], compile: Compile, version: str,
                 directory: Path | None = None):
        self.arch, self.options, self.compile, self.version = arch, tuple(options), compile, version
        self.directory = directory
        self._memory: dict[str, CudaBuild] = {}
        self._lock = threading.Lock()
        self.compiled = 0  # programs this cache compiled (not read back), for reports and tests

    def key(self, prog: Program) -> str:
        ident = "\0".join((self.arch, prog.digest, *self.options, "nvrtc " + self.version))
        return hashlib.sha256(ident.encode()).hexdigest()

    def path(self, prog: Program) -> Path | None:
        return None if self.directory is None else self.directory / f"{prog.family}-{prog.dtype}-{self.key(prog)[:32]}.cubin"

    def get(self, prog: Program) -> bytes:
        """The cubin of ``prog``."""
        return self.built(prog).cubin

    def ptx(self, prog: Program) -> str:
        """The PTX the cubin of ``prog`` was assembled from."""
        return self.built(prog).ptx

    def built(self, prog: Program) -> CudaBuild:
        """The build of ``prog``, from memory, the disk or a compile."""
        key = self.key(prog)
        with self._lock:
            built = self._memory.get(key)
        if built is not None:
            return built
        # compiled outside the lock, so programs build in parallel; a race builds one twice, harmlessly
        built = self._read(prog)
        if built is None:
            built = self.compile(prog, self.arch)
            self._write(prog, built)
            with self._lock:
                self.compiled += 1
        with self._lock:
            return self._memory.setdefault(key, built)

    def _read(self, prog: Program) -> CudaBuild | None:
        path = self.path(prog)
        if path is None:
            return None
        try:
            built = CudaBuild(path.read_bytes(), path.with_suffix(".ptx").read_text(),
                              path.with_suffix(".log").read_text())
        except (OSError, UnicodeDecodeError):
            return None
        return built if built.cubin.startswith(MAGIC) and ".target" in built.ptx else None

    def _write(self, prog: Program, built: CudaBuild) -> None:
        path = self.path(prog)
        if path is None:
            return
        try:
            # the cubin last: a reader finding it finds its PTX and report too
            for target, data in ((path.with_suffix(".ptx"), built.ptx.encode()),
                                 (path.with_suffix(".log"), built.log.encode()), (path, built.cubin)):
                write_atomically(target, data)
        except OSError:
            pass  # a read-only or full cache costs a rebuild next time, never a failure now
