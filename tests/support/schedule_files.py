"""Small schedules for the tests that run a whole schedule: one thunk written to a file for the CLI, and an
f32 chain reading ``x`` at offset 0 and writing ``w``."""
from __future__ import annotations

import json
from pathlib import Path

from rlx_gpu.conformance.cases import schedule_of


def write_one_thunk(path: Path, thunk: dict, arena_bytes: int) -> Path:
    """``thunk`` as a one-thunk schedule file at ``path`` (for the CLI commands), returned."""
    path.write_text(json.dumps(schedule_of(thunk, arena_bytes)))
    return path


def f32_chain(n: int, arena_bytes: int, w_offset: int, thunks: list[dict]) -> dict:
    """A schedule dict of ``thunks``: input ``x`` (``n`` f32 at offset 0), output ``w`` (``n`` f32 at
    ``w_offset``)."""
    return {
        "abi": "rlx-thunks/1", "arena_bytes": arena_bytes,
        "tensors": {"x": {"offset": 0, "dtype": "f32", "shape": [n]},
                    "w": {"offset": w_offset, "dtype": "f32", "shape": [n]}},
        "inputs": ["x"], "outputs": ["w"],
        "thunks": thunks,
    }
