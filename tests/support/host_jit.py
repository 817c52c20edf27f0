"""What the tests of a compiled host kernel share: both paths of a thunk, a count of the kernels' calls, and the
gradients a backward thunk writes."""
from __future__ import annotations

from types import ModuleType
from typing import Iterable

import numpy as np
import pytest

import host_fallback
from host_fallback import jit
from support.gradient_check import read


@pytest.fixture(params=[True, False], ids=["numba", "numpy"])
def compiled(request, monkeypatch):
    """Each path: the compiled kernels, and NumPy's (``RLX_HOST_JIT=0``)."""
    if not request.param:
        monkeypatch.setenv(jit.ENV, "0")
    return request.param


def count_calls(monkeypatch, module: ModuleType, names: Iterable[str]) -> dict[str, int]:
    """A count of each kernel ``names`` of ``module`` is called, kept current while the kernels still run."""
    counted = dict.fromkeys(names, 0)
    for name in counted:
        def spy(*args, name=name, real=getattr(module, name)):
            counted[name] += 1
            real(*args)
        monkeypatch.setattr(module, name, spy)
    return counted


def gradients(thunk: dict, arena: np.ndarray, **options) -> dict[str, np.ndarray]:
    """The gradients (``d_*`` fields but the given ``d_dst``) a backward thunk writes, run on a copy of ``arena``."""
    out = arena.copy()
    host_fallback.execute(thunk, out, **options)
    return {f: v for f, v in read(thunk, out).items() if f.startswith("d_") and f != "d_dst"}
