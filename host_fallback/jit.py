"""Host kernels compiled by Numba (the ``jit`` extra), used where it is installed.

One kernel so far: everything of an lstm step but its GEMM (``lstm_pointwise``), one pass over the
step's gates. NumPy runs that part as about fifteen whole-block passes (``rnn._lstm_loop``): at B=32
H=256 they take 105-167 µs of a 650-900 µs step, the compiled pass 55-85 µs, which takes the host lstm
prefill from a median 1.28x torch's oneDNN kernel to 1.12x (``python benchmarks/rnn.py``, which times
both beside torch). NumPy's loop stays the path without Numba and everywhere the pass does not apply;
the tests run both against the same float64 recurrences.

``RLX_HOST_JIT=0`` keeps the NumPy loops where Numba is installed. The kernels are compiled for one
signature each, eagerly when ``jit_kernels`` is first imported (under Python's import lock: once, whatever
the threads),
and cached on disk by Numba (``__pycache__`` beside it, else Numba's user cache or ``NUMBA_CACHE_DIR``):
a process pays the compile once per machine, a few seconds; a later one loads them in well under one.
"""
from __future__ import annotations

import os
from functools import cache
from types import ModuleType
from typing import Callable

#: The environment variable that turns the compiled kernels off (``0``, ``off``, ``false`` or ``no``).
ENV = "RLX_HOST_JIT"

def enabled() -> bool:
    """Whether ``RLX_HOST_JIT`` allows the compiled kernels (read on every call)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "false", "no")


@cache
def _kernels() -> ModuleType | None:
    """``jit_kernels``, or None without Numba (Python's import lock compiles it once across threads)."""
    try:
        from . import jit_kernels
    except ImportError:  # no Numba (or no llvmlite): the NumPy loops
        return None
    return jit_kernels


def kernel(name: str) -> Callable | None:
    """The compiled kernel ``name``, or ``None`` without Numba or with ``RLX_HOST_JIT=0``.

    ``lstm_pointwise(g, proj, col, bias, c, out, out_col, n, clip_ifo, clip_g, g_scale, coupled)``, float32,
    every array C-contiguous: ``g [4H, n]`` is ``W_hh·h`` in the internal gate order ``i f o g``
    (``rnn._ORDER``), the rows of i f o at ``-z`` (``activations.stored_scale``) and those of g at ``-2z``
    (``g_scale`` 1) or at ``z`` (``g_scale`` -2); columns ``col..col+n`` of ``proj`` are the step's input
    projection and ``bias [4H]`` the input-side bias, at the same scales; ``c [H, >=n]`` is the cell,
    updated in place; ``o·tanh(c)`` goes to columns ``out_col..out_col+n`` of ``out``'s first ``H`` rows.
    ``clip_ifo``, ``clip_g``: ``clip`` at the scale of each gate's rows, inf for none; ``coupled``:
    ``input_forget``.
    """
    if not enabled():
        return None
    module = _kernels()
    return None if module is None else getattr(module, name)
