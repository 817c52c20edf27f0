"""The saved forward (ABI.md §9.1) across devices, for the device tests of the ops that have one: a thunk run on a
device session or on the host, a forward run into an arena lengthened to hold its ``dst``, a reserve copied from
one arena into another, gradients compared relative to their largest magnitude, a schedule with a short reserve,
and a script run under Oclgrind."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

import host_fallback
import rlx_gpu
from host_fallback.abi import complete, regions
from rlx_gpu import launches
from rlx_gpu.conformance.cases import SMALL, lay_out, schedule_of

from .gradient_check import read

ROOT = Path(__file__).resolve().parents[2]


def run_on(session, thunk: dict, arena: np.ndarray, **options) -> np.ndarray:
    """``arena`` after ``thunk``: on the device ``session`` (which must have kernels for it), or on the host."""
    if session is None:
        out = arena.copy()
        host_fallback.execute(thunk, out)
        return out
    assert launches.unsupported(complete(thunk), session.limits) is None
    on_device = session.upload(arena)
    session.launch(thunk, on_device, **options)
    return session.read(on_device, 0, arena.size)


def forward_on(session, forward: dict, arena: np.ndarray, **options) -> np.ndarray:
    """The arena, lengthened to hold ``forward``'s dst, after ``forward`` (``run_on``)."""
    dst = next(r for r in regions(forward) if r.field == "dst")
    longer = np.zeros(dst.offset + dst.nbytes, np.uint8)
    longer[:arena.size] = arena
    return run_on(session, forward, longer, **options)


def gradients_of(thunk: dict, arena: np.ndarray) -> dict[str, np.ndarray]:
    """The backward ``thunk``'s gradients in ``arena`` (float64, by field)."""
    return {f: v for f, v in read(thunk, arena).items() if f.startswith("d_") and f != "d_dst"}


def with_reserve(thunk: dict, arena: np.ndarray, written: np.ndarray) -> np.ndarray:
    """A copy of ``arena`` whose reserve (``thunk``'s) holds the bytes of ``written`` there."""
    start, end = thunk["reserve"], thunk["reserve"] + thunk["reserve_bytes"]
    out = arena.copy()
    out[start:end] = written[start:end]
    return out


def assert_close(got: dict, expected: dict, tol: float, what: str) -> None:
    """Every gradient of ``got`` within ``tol`` of the largest magnitude of ``expected``'s."""
    assert set(got) == set(expected)
    for name in expected:
        scale = np.abs(expected[name]).max() + 1e-30
        np.testing.assert_allclose(got[name], expected[name], rtol=0, atol=tol * scale, err_msg=f"{what}: {name}")


def _schedule_with_reserve(op: str, short: int = 0) -> dict:
    """A schedule of ``op`` (the catalog's small shape) with a reserve ``short`` bytes below the minimum."""
    need = rlx_gpu.reserve_bytes({"op": op, "dtype": "f32", **SMALL[op]})
    thunk, nbytes = lay_out(op, "f32", {"reserve": True, "reserve_bytes": need - short, **SMALL[op]})
    return schedule_of(thunk, nbytes)


def runs_a_reserve_and_refuses_a_short_one(spec: str, op: str) -> None:
    """The device ``spec`` places a schedule of ``op`` with a reserve on itself, and refuses one with a short
    reserve naming the minimum."""
    device = rlx_gpu.get_device(spec)
    assert {a.backend for a in device.place(_schedule_with_reserve(op))} == {"opencl"}
    need = rlx_gpu.reserve_bytes({"op": op, "dtype": "f32", **SMALL[op]})
    with pytest.raises(rlx_gpu.ScheduleError, match=rf"field 'reserve_bytes': expected at least {need} bytes"):
        device.run(_schedule_with_reserve(op, short=16))


def under_oclgrind(script: str) -> tuple[int, list[str], str]:
    """``script`` run by Python under Oclgrind (tools/oclgrind_check.py): exit code, diagnostics, output."""
    spec = importlib.util.spec_from_file_location("oclgrind_check", ROOT / "tools" / "oclgrind_check.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool.run_under_oclgrind([sys.executable, "-c", script], {})
