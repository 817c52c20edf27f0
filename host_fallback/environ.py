"""Environment variables read on every call at a dictionary lookup's cost: the host kernels' switches
(``RLX_HOST_JIT``, ``RLX_HOST_JIT_WIDTH``: ``jit``; ``RLX_HOST_GEMM``: ``gemm``) and the variables that choose the
torch bridge's default device are read at each call, so that a process changing them between calls is obeyed, and a
decode step reads them several times. ``os.environ.get`` encodes the name in Python frames and, for an unset one,
raises and catches a KeyError: 0.6 µs a read, 2 after a kernel swept the cache; its own dictionary answers in 0.03."""
from __future__ import annotations

import os
from typing import Any, Callable, Mapping

#: os.environ's own dictionary where it has one (POSIX: bytes -> bytes, what ``os.environ.get`` reads after
#: encoding the name; ``os.environ``'s writes go to it), else os.environ itself.
ENVIRON: Mapping[Any, Any] = getattr(os.environ, "_data", os.environ)


def key(name: str) -> Any:
    """``name`` as a key of ``ENVIRON``."""
    return os.fsencode(name) if ENVIRON is not os.environ and os.name == "posix" else name


def reader(name: str) -> Callable[[], str | None]:
    """``read()``: the value of the variable ``name`` now, None where it is unset."""
    get, at = ENVIRON.get, key(name)
    if ENVIRON is os.environ:
        return lambda: get(at)

    def read() -> str | None:
        value = get(at)
        return None if value is None else os.fsdecode(value)
    return read
