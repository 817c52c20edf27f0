"""OpenCL program binaries kept on disk, so that a process builds from source only what no earlier process built.

Intel's OpenCL CPU runtime takes seconds to build a program (14 s for the ssm family on a loaded machine) and keeps
nothing across processes, Oclgrind one to four seconds, PoCL (whose own kernel cache keeps its compiles) half a
second; loading a binary and building it takes a tenth of a second on each. An entry is the binary
``clGetProgramInfo(CL_PROGRAM_BINARIES)`` gives after a build from source, beside that build's log, whose
diagnostics a load warns of again, as the build did. It is keyed by the device (platform, device name, device and
driver versions, and the host's processor: a CPU device's binary is machine code for it), the build options and the
program's source text, so a change to any of them builds again; PoCL keeps none here (``keeps_own_builds``).
Entries live in ``$RLX_OPENCL_CACHE_DIR``, else
``~/.cache/rlx_gpu/opencl``; the log is written before the binary, each whole (``atomic_files``), so a process
finding a binary finds its log, and processes building at once at worst build a program twice. A failed build is
never kept; an entry that cannot be read, or whose binary the driver refuses, is built from source again.
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
from pathlib import Path

from .atomic_files import write_atomically
from .programs import Program

CACHE_ENV = "RLX_OPENCL_CACHE_DIR"


def cache_dir() -> Path:
    """``$RLX_OPENCL_CACHE_DIR`` when set, else ``~/.cache/rlx_gpu/opencl``."""
    override = os.environ.get(CACHE_ENV)
    return Path(override) if override else Path.home() / ".cache" / "rlx_gpu" / "opencl"


def keeps_own_builds(platform_name: str) -> bool:
    """Whether the platform caches its builds itself, so that this cache would only cost: PoCL keeps its compiles
    across processes, and asking it for a program's binary compiles every kernel of the program into it (3.1 s
    for the gdn_backward family against a 0.8 s build from source)."""
    return platform_name.startswith("Portable Computing Language")


@functools.lru_cache(maxsize=None)
def host_processor() -> str:
    """The host's processor as the kernel reports it (model and instruction-set flags), else as Python knows it."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    named = [line for line in lines if line.split(":")[0].strip() in ("model name", "flags", "Features")]
    return "\n".join(dict.fromkeys(named)) or f"{platform.machine()} {platform.processor()}"


class BinaryCache:
    """``read(program)`` finds the binary and build log a build of ``program`` left, ``write`` keeps them.

    Parameters
    ----------
    device : tuple of str
        What identifies the device's compiler: platform, device name, device and driver versions.
    options : tuple of str
        The build options (part of the key).
    directory : Path or None
        The disk cache; ``None`` keeps nothing.
    """

    def __init__(self, device: tuple[str, ...], options: tuple[str, ...], directory: Path | None):
        self.identity = "\0".join((*device, host_processor(), *options))
        self.directory = directory
        self.loaded = 0  # binaries read back and accepted by the driver, for reports and tests

    def path(self, program: Program) -> Path | None:
        if self.directory is None:
            return None
        key = hashlib.sha256(f"{self.identity}\0{program.digest}".encode()).hexdigest()
        return self.directory / f"{program.family}-{program.dtype}-{key[:32]}.clbin"

    def read(self, program: Program) -> tuple[bytes, str] | None:
        """The binary and build log kept for ``program``, or ``None``."""
        path = self.path(program)
        if path is None:
            return None
        try:
            binary, log = path.read_bytes(), path.with_suffix(".log").read_text()
        except (OSError, UnicodeDecodeError):
            return None
        return (binary, log) if binary else None

    def write(self, program: Program, binary: bytes, log: str) -> None:
        """Keep the ``binary`` a build of ``program`` gave, and its ``log``; a cache that cannot be written costs a
        build next time, never a failure now."""
        path = self.path(program)
        if path is None or not binary:
            return
        try:
            write_atomically(path.with_suffix(".log"), log.encode())
            write_atomically(path, binary)
        except OSError:
            pass
