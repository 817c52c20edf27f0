"""NumPy kernels for every op of the rlx-thunks ABI, run on a bare ``numpy.uint8`` arena.

Importable without ``rlx_gpu``: a runtime whose device lacks an op calls
``host_fallback.execute(thunk, arena)`` with the thunk as a mapping of its ABI fields
(``thunk["op"]``, ``thunk["dtype"]``, ``thunk["x"]`` ...). Nested scan bodies are mappings with
``arena_bytes``, ``init`` and ``thunks``. The thunk is trusted: validate it first
(``rlx_gpu.load_schedule`` does).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from . import body, gdn, rnn, scan, ssm
from .layout import Region, regions

Kernel = Callable[..., None]

KERNELS: dict[str, Kernel] = {**rnn.KERNELS, **ssm.KERNELS, **gdn.KERNELS, **body.KERNELS, **scan.KERNELS}


def execute(thunk: Mapping[str, Any], arena: np.ndarray, **options: Any) -> None:
    """Run one thunk on a host arena in place.

    ``options`` reach the kernels that take them: ``recompute="segment" | "treeverse"`` for the
    scan family.
    """
    if arena.dtype != np.uint8 or arena.ndim != 1:
        raise TypeError(f"arena must be a 1-D numpy.uint8 array, got {arena.dtype} with shape {arena.shape}")
    check_bounds(thunk, arena.size)
    KERNELS[thunk["op"]](thunk, arena, **options)


def check_bounds(thunk: Mapping[str, Any], arena_bytes: int) -> None:
    """The one check a runtime calling in directly still gets: a known op, and no byte outside the arena."""
    if thunk["op"] not in KERNELS:
        raise ValueError(f"host_fallback has no kernel for op {thunk['op']!r}; it has {sorted(KERNELS)}")
    for r in regions(thunk):
        if r.offset < 0 or r.offset + r.nbytes > arena_bytes:
            raise ValueError(f"{thunk['op']} thunk, field {r.field!r}: bytes [{r.offset}, {r.offset + r.nbytes}) "
                             f"fall outside the arena of {arena_bytes} bytes; validate it with rlx_gpu.load_schedule")


PATHS: dict[str, Callable[..., str]] = {"selective_scan": ssm.path_for, "mamba2": ssm.path_for,
                                        "gated_delta_net": gdn.path_for}


def path_for(thunk: Mapping[str, Any], **options: Any) -> str | None:
    """The algorithm the host runs ``thunk`` with (``chunked L=64``, ``step`` ...), for ops that choose one."""
    chooser = PATHS.get(thunk["op"])
    return chooser(thunk, **options) if chooser else None


__all__ = ["execute", "check_bounds", "path_for", "regions", "Region", "KERNELS"]
