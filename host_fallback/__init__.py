"""NumPy kernels for every op of the rlx-thunks ABI, run on a bare ``numpy.uint8`` arena.

Importable without ``rlx_gpu``: a runtime whose device lacks an op calls
``host_fallback.execute(thunk, arena)`` with the thunk as a mapping of its ABI fields
(``thunk["op"]``, ``thunk["dtype"]``, ``thunk["x"]`` ...). Nested scan bodies are mappings with
``arena_bytes``, ``init`` and ``thunks``. The thunk is trusted: validate it first
(``rlx_gpu.load_schedule`` does).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping

import numpy as np

from .abi import Region, complete, regions, runtime_data
from .arena import view
from .implementations import GIVEN, KERNELS, PATHS, PREPARE, WORKING, Kernel
from .registry import import_all

# every module registers its kernels against their ops on import (``implementations``): importing them all
# finds them. The ``jit_*`` modules compile Numba code when imported: ``jit`` loads them when a kernel first asks.
import_all(__name__, skip="jit_")


def _keywords(kernel: Kernel) -> frozenset[str]:
    return frozenset(p.name for p in inspect.signature(kernel).parameters.values() if p.kind is p.KEYWORD_ONLY)


def _passes_all(kernel: Kernel) -> bool:
    return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(kernel).parameters.values())


#: Every option some kernel declares (its keyword-only parameters).
OPTIONS = frozenset().union(*(_keywords(kernel) for kernel in KERNELS.values()))
#: op -> the options its kernel takes: all of them for the scans, which hand them to their body thunks.
ACCEPTS: dict[str, frozenset[str]] = {op: OPTIONS if _passes_all(k) else _keywords(k) for op, k in KERNELS.items()}


def keywords_for(op: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The ``options`` that ``op``'s kernel takes; an option no kernel takes raises ``TypeError``."""
    unknown = set(options) - OPTIONS
    if unknown:
        raise TypeError(f"unknown host option(s) {sorted(unknown)}; the host kernels take {sorted(OPTIONS)}")
    accepts = ACCEPTS[op]
    return {k: v for k, v in options.items() if k in accepts}


def bound_kernel(thunk: Mapping[str, Any], options: Mapping[str, Any]) -> Callable[[np.ndarray], None]:
    """``thunk``'s kernel with the ``options`` it takes bound and its thunk-only setup (``PREPARE``) done
    once: call it with an arena, as often as needed. No bounds check: the thunk is trusted (validated).

    This is the one place a host thunk is dispatched to its kernel; the host backend and the scan
    driver's body runs both come through it. ``kernel(arena, given)`` (``implementations.GIVEN``) runs it
    on the given arrays in place of those arena views where it can and says whether it did (False:
    nothing ran).
    """
    keywords = keywords_for(thunk["op"], options)
    fields = complete(thunk)  # a plain dict: a kernel reads its fields dozens of times a call (decode: ~20 µs)
    prepare = PREPARE.get(thunk["op"])
    if prepare is not None:
        prepared, takes_given = prepare(fields), thunk["op"] in GIVEN

        def run_prepared(arena: np.ndarray, given: Mapping[int, np.ndarray] | None = None) -> bool | None:
            if given is not None:  # the compiled step alone runs on given arrays: no NumPy pass to quiet
                return takes_given and prepared(arena, given=given, **keywords)
            with np.errstate(all="ignore"):  # NaN and inf are data: they propagate without a RuntimeWarning
                prepared(arena, **keywords)
            return None
        return run_prepared
    kernel = KERNELS[thunk["op"]]

    def run(arena: np.ndarray, given: Mapping[int, np.ndarray] | None = None) -> bool | None:
        if given is not None:
            return False
        with np.errstate(all="ignore"):
            kernel(fields, arena, **keywords)
        return None
    return run


def working_bytes(thunk: Mapping[str, Any]) -> int:
    """A lower bound of the bytes ``thunk``'s kernel allocates besides the arena (0 where none is known):
    a runtime refuses a thunk this exceeds its memory before ``bound_kernel`` prepares anything."""
    bound = WORKING.get(thunk["op"])
    return bound(thunk) if bound else 0


def execute(thunk: Mapping[str, Any], arena: np.ndarray, **options: Any) -> None:
    """Run one thunk on a host arena in place.

    ``options`` reach the kernels that take them (``OPTIONS`` lists every one): ``recompute``
    (``"segment" | "treeverse"``) for the scan family, ``path``, ``chunk`` and ``workers`` for the
    state-space ops, ``parallel_directions`` for the recurrences. An unknown option raises ``TypeError``;
    an integer tensor outside ABI.md §8's rules raises ``runtime_data.DataError`` before anything is written.
    Non-finite values propagate silently: the kernels run under ``numpy.errstate(all="ignore")``.
    """
    if arena.dtype != np.uint8 or arena.ndim != 1:
        raise TypeError(f"arena must be a 1-D numpy.uint8 array, got {arena.dtype} with shape {arena.shape}")
    check_bounds(thunk, arena.size)
    fields = complete(thunk)
    runtime_data.check(fields, lambda r: view(arena, r.offset, r.dtype, r.shape))
    with np.errstate(all="ignore"):  # as in bound_kernel
        KERNELS[thunk["op"]](fields, arena, **keywords_for(thunk["op"], options))


def check_bounds(thunk: Mapping[str, Any], arena_bytes: int) -> None:
    """The one check a runtime calling in directly still gets: a known op, and no byte outside the arena."""
    if thunk["op"] not in KERNELS:
        raise ValueError(f"host_fallback has no kernel for op {thunk['op']!r}; it has {sorted(KERNELS)}")
    for r in regions(thunk):
        if r.offset < 0 or r.offset + r.nbytes > arena_bytes:
            raise ValueError(f"{thunk['op']} thunk, field {r.field!r}: bytes [{r.offset}, {r.offset + r.nbytes}) "
                             f"fall outside the arena of {arena_bytes} bytes; validate it with rlx_gpu.load_schedule")


def path_for(thunk: Mapping[str, Any], **options: Any) -> str | None:
    """The algorithm the host runs ``thunk`` with (``chunked L=64``, ``step`` ...), for ops that choose one."""
    chooser = PATHS.get(thunk["op"])
    return chooser(thunk, **keywords_for(thunk["op"], options)) if chooser else None


__all__ = ["execute", "bound_kernel", "check_bounds", "keywords_for", "path_for", "regions", "Region", "KERNELS",
           "OPTIONS", "working_bytes"]
