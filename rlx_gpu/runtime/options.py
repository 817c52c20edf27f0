"""The typed run options, where docs/python.md names them (Resident arenas); they are defined beside the
backends they steer (:mod:`rlx_gpu.backends.options`), since a backend never imports the runtime."""
from __future__ import annotations

from ..backends.options import RunOptions

__all__ = ["RunOptions"]
