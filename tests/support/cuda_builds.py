"""The test session's NVRTC builds: each program compiled once per machine and shared by every test that
builds, reads or loads a cubin (the budget, signature and flush checks, the CuPy double, the backend's cache).

NVRTC with ptxas is the suite's longest work (about a second a program, a few hundred programs over both
targets and both architectures). The builds go through the CUDA backend's own cache
(``backends.cubin_cache``: keyed by architecture, the program's source digest, the compile options and
the NVRTC version, so a change to a kernel's text, an option or the compiler rebuilds exactly what it
touches) in a directory kept across sessions, as PoCL keeps its kernel cache:
``$RLX_TEST_CACHE_DIR``, else ``~/.cache/rlx_gpu/test-cubin``. Point it at an empty directory for a
run that compiles everything.
"""
from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TEST_CACHE_ENV = "RLX_TEST_CACHE_DIR"


def directory() -> Path:
    """Where the session's cubins live (``$RLX_TEST_CACHE_DIR``, else ``~/.cache/rlx_gpu/test-cubin``)."""
    override = os.environ.get(TEST_CACHE_ENV)
    return Path(override) if override else Path.home() / ".cache" / "rlx_gpu" / "test-cubin"


@functools.lru_cache(maxsize=None)
def cache(arch: str | None = None):
    """The session's :class:`~rlx_gpu.backends.cubin_cache.CubinCache` for ``arch`` (default the backend's
    sm_90) on :func:`directory`, with the backend's options and compiler."""
    from rlx_gpu.backends import nvrtc
    from rlx_gpu.backends.cubin_cache import CubinCache, nvrtc_version

    return CubinCache(arch or nvrtc.CUBIN_ARCH, nvrtc.OPTIONS, nvrtc.build, nvrtc_version(), directory())


def build(prog, arch: str | None = None):
    """The build of ``prog`` for ``arch`` (default sm_90): cubin, PTX, ptxas's ``-v`` report."""
    return cache(arch).built(prog)


@functools.lru_cache(maxsize=None)
def gpu_cubins() -> tuple[bytes, ...]:
    """The cubin of every gpu-target program, in ``nvrtc.programs("gpu")`` order (two at a time)."""
    from rlx_gpu.backends import nvrtc

    with ThreadPoolExecutor(2) as pool:
        return tuple(pool.map(cache().get, nvrtc.programs("gpu")))
