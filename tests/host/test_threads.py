"""Thread safety: one Device shared by 8 threads, each running lstm, gated_delta_net, mamba2 and
scan_backward_xs 200 times with a 10 µs switch interval; every result must be bit-identical to a
serial run. A device session serialises runs (its lock); the host is re-entrant."""
from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

import rlx_gpu
from rlx_gpu.conformance.cases import lay_out, schedule_of
from rlx_gpu.runtime.registry import status

OPS = ("lstm", "gated_delta_net", "mamba2", "scan_backward_xs")
THREADS, RUNS = 8, 200


def _problems() -> list[tuple[rlx_gpu.Schedule, np.ndarray]]:
    rng = np.random.default_rng(0)
    problems = []
    for op in OPS:
        thunk, nbytes = lay_out(op, "f32")
        sched = rlx_gpu.load_schedule(schedule_of(thunk, nbytes))
        arena = rng.uniform(-0.5, 0.5, nbytes // 4).astype(np.float32).view(np.uint8)
        problems.append((sched, arena))
    return problems


def _devices() -> list:
    specs = ["host"] + (["opencl"] if status("opencl").available else [])
    return [pytest.param(spec, id=spec) for spec in specs]


@pytest.fixture
def fast_switching():
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


@pytest.mark.parametrize("spec", _devices())
def test_threads_sharing_a_device_get_the_serial_results(spec, fast_switching):
    device = rlx_gpu.get_device(spec, rlx_gpu.Config(fallback="forbid"))
    problems = _problems()
    serial = [device.run(sched, arena) for sched, arena in problems]
    mismatches: list[str] = []
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for i in range(RUNS):
                which = (i + k) % len(problems)
                sched, arena = problems[which]
                got = device.run(sched, arena)
                if not np.array_equal(got, serial[which]):
                    mismatches.append(f"thread {k} run {i} ({OPS[which]})")
        except BaseException as err:  # surfaced below with the thread that raised it
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert not mismatches, f"{len(mismatches)} of {THREADS * RUNS} runs differ: {mismatches[:5]}"
