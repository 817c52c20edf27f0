"""Backend modules: host (NumPy), opencl (pyopencl), cuda (CuPy); each is imported only when asked for.

``MODULES`` is the one list of backends. Each module describes itself (``base.Backend``: its name, its
device-spec grammar, its kernel dialect's prelude, the environment variable that picks its device), so
adding a backend is its module plus one entry here (and, for a kernel dialect, its prelude folder).
Importing a backend module never needs its API package: that is needed only to probe or open a device.
"""
from __future__ import annotations

import importlib
from functools import lru_cache
from types import ModuleType

from ..errors import DeviceError
from .base import BackendUnavailable

#: backend name -> the module that implements it, in the order ``rlx-gpu devices`` lists them
MODULES: dict[str, str] = {"host": "rlx_gpu.backends.host", "opencl": "rlx_gpu.backends.opencl",
                           "cuda": "rlx_gpu.backends.cuda"}


@lru_cache(maxsize=None)
def backend_module(name: str) -> ModuleType:
    """Import a backend by name; a module that cannot be imported raises ``BackendUnavailable`` with the reason."""
    if name not in MODULES:
        raise DeviceError(f"unknown backend {name!r}; known: {', '.join(MODULES)}")
    try:
        return importlib.import_module(MODULES[name])
    except ModuleNotFoundError as err:
        if err.name == MODULES[name]:
            raise BackendUnavailable(f"{name}: this release has no {name} backend module ({MODULES[name]})") from err
        extra = "cuda13" if name == "cuda" else name
        raise BackendUnavailable(f"{name}: importing {MODULES[name]} needs module {err.name!r}, which is not "
                                 f'installed (in a checkout: pip install -e ".[{extra}]")') from err


def spec_form(name: str) -> str:
    """The device-spec grammar of backend ``name``: ``opencl[:platform[:device]]``."""
    indices = backend_module(name).SPEC_INDICES
    return name + "".join(f"[:{part}" for part in indices) + "]" * len(indices)
