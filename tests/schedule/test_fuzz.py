"""A short seeded fuzz profile of the schedule border (the long runs are ``tools/fuzz.py``).

Every damaged schedule must be refused with a ScheduleError/DeviceError/RunError or run cleanly:
nothing written outside its write footprint, the caller's arena untouched. The checker itself is
shown to catch a device that breaks either promise. The profile runs on the host in this process and
on every OpenCL implementation here (``background.OPENCL_IMPLEMENTATIONS``) through ``tools/fuzz.py``, beside
the other tests (child processes: a crash of the device is a finding, not the end of the test run).
"""
from __future__ import annotations

import collections

import pytest

from support import background
import host_fallback
import rlx_gpu
from rlx_gpu.conformance.fuzz import Case, check_case, make_case, make_data_case
from rlx_gpu.conformance.cases import FEEDS, lay_out, schedule_of
from rlx_gpu.runtime.config import Config
from host_fallback.abi import OPS

PROFILE = range(1500)


@pytest.fixture(scope="module")
def host():
    return rlx_gpu.get_device("host", Config(fallback="allow"))


def test_seeded_profile_on_the_host(host):
    outcomes: collections.Counter = collections.Counter()
    ran_ops: set[str] = set()
    problems = []
    for seed in PROFILE:
        case = make_case(seed)
        outcome, problem = check_case(case, host)
        outcomes[outcome] += 1
        if outcome == "ran":
            ran_ops.add(case.op)
        if problem is not None:
            problems.append(f"seed {seed} ({', '.join(case.mutations)}): {problem}")
    assert not problems, "\n".join(problems[:10])
    runnable = set(OPS) & set(host_fallback.KERNELS)  # an op with no kernel anywhere is refused (DeviceError)
    assert ran_ops == runnable, f"no clean run of {sorted(runnable - ran_ops)}"
    assert outcomes["refused"] > len(PROFILE) // 2 and outcomes["ran"] > len(PROFILE) // 10, outcomes


def test_damaged_run_time_data_and_knobs_on_the_host(host):
    """The data cases alone: every form (top level, late, each body feed) both refused and run cleanly."""
    outcomes: collections.Counter = collections.Counter()
    problems = []
    for seed in range(300):
        case = make_data_case(seed)
        outcome, problem = check_case(case, host)
        outcomes[case.mutations[-1], outcome] += 1
        if problem is not None:
            problems.append(f"seed {seed} ({', '.join(case.mutations)}): {problem}")
    assert not problems, "\n".join(problems[:10])
    for form in ("top", "late") + FEEDS:
        assert outcomes[form, "refused"] and outcomes[form, "ran"], (form, outcomes)


@pytest.mark.parametrize("spec", background.OPENCL_IMPLEMENTATIONS)
def test_the_profile_on_opencl(spec):
    done = background.result(f"fuzz-{spec}")  # tools/fuzz.py, started with the session beside the other tests
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert f"{background.FUZZ_OPENCL_CASES} schedules, 0 bad" in done.stdout, done.stdout[-2000:]


def test_cases_are_reproducible():
    assert [make_case(s).mutations for s in range(50)] == [make_case(s).mutations for s in range(50)]


class _Scribbler:
    """A device that runs on the host and then writes one byte past the last write region,
    or into the caller's arena."""

    def __init__(self, host, into_caller: bool):
        self.host, self.into_caller = host, into_caller

    def run(self, schedule, arena):
        out = self.host.run(schedule, arena)
        target = arena if self.into_caller else out
        target[-1] ^= 0xFF
        return out


@pytest.mark.parametrize("into_caller,expected", [(False, "1 bytes written outside the write footprint"),
                                                   (True, "the caller's arena changed")])
def test_the_checker_catches_a_device_that_scribbles(host, into_caller, expected):
    thunk, arena_bytes = lay_out("unary", "f32", guard=16)
    case = Case(0, "unary", schedule_of(thunk, arena_bytes), ())
    assert check_case(case, host) == ("ran", None)
    outcome, problem = check_case(case, _Scribbler(host, into_caller))
    assert outcome == "ran" and problem is not None and problem.startswith(expected)

