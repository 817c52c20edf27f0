"""The conformance suite (``rlx_gpu.conformance``) on every device, one harness for all backends.

Every case of ``catalog.cases()`` runs on every device with guard bytes around every tensor, against a
float64 reference written from ABI.md and against ``host_fallback`` (NaN/Inf positions and NMSE bounds of
``configs/default.yaml``). Devices: ``RLX_TEST_DEVICES`` (comma-separated specs, e.g.
``host,opencl:0:0``); unset, the host and every available device but simulators (CUDA joins when its
backend reports a device). A device named there but absent fails every test, with the list of devices.
Kernel backends run at both targets: their own and the other one forced through ``RLX_TARGET`` (the gpu
kernel shapes on PoCL). A runtime rlx_gpu registers itself (Intel's OpenCL CPU runtime, a second compiler of
the same kernel text) runs, at both targets, the representative f32 quick cases: the cheapest case of every
kernel (its program builds take about two seconds each; every case would take many minutes; every
compile-time variant is built there by tests/devices/test_opencl_builds.py).
"""
from __future__ import annotations

import pytest

from host_fallback.abi import BACKWARD, OPS
from rlx_gpu.conformance import catalog, devices, runner
from rlx_gpu.conformance.references import REFERENCES
from rlx_gpu.runtime.config import default_config_path, load_config
from rlx_gpu.launches.limits import TARGETS
from rlx_gpu.runtime.registry import open_session, status
from support.conformance_devices import SPECS, is_second, opened

CONFIG = load_config(default_config_path())
CASES = catalog.cases()
#: The ops the catalog certifies: every op but a backward one (ABI.md §9) still without its float64 reference.
CERTIFIED = {op for op in OPS if op not in BACKWARD or op in REFERENCES}

DEVICES = [(spec, None) if spec.split(":")[0] == "host" else (spec, target) for spec in SPECS for target in TARGETS]
DEVICES = list(dict.fromkeys(DEVICES))
FULL = [d for d in DEVICES if not is_second(d[0])]
SECOND = [d for d in DEVICES if is_second(d[0])]


def _device_id(d):
    return d[0] if d[1] is None else f"{d[0]}@{d[1]}"


@pytest.fixture(scope="module", params=FULL, ids=_device_id)
def session(request):
    spec, target = request.param
    return devices.open_device(devices.find(spec), target)  # an absent device raises here: its tests fail


@pytest.fixture(scope="module")
def host():
    return open_session(status("host").devices[0])


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_case(session, host, case):
    outcome = runner.check(session, case, CONFIG, None if session.info.backend == "host" else host)
    if outcome.status == "skip":
        # every device kernel takes every version-2 field: a case falling back for one is a gap, not a skip
        assert "version-2 field" not in outcome.message, f"{session.info.spec} {case.id}: {outcome.message}"
        pytest.skip(outcome.message)
    assert outcome.status == "pass", f"{session.info.spec} {case.id}: {outcome.message}"


def _representative(spec: str, target: str) -> list:
    from rlx_gpu.conformance.representative import fewest_builds

    f32 = [c for c in catalog.cases(quick=True) if c.dtype == "f32"]
    # every kernel of every family once, each op on its families, for the fewest program builds: every
    # compile-time variant of the f32 programs is built on this implementation by
    # tests/devices/test_opencl_builds.py, so the cases here check what runs, not every variant's compile
    return [f32[i] for i in fewest_builds(spec, target, f32)]


SECOND_CASES = [(d, c) for d in SECOND for c in _representative(*d)]


@pytest.mark.parametrize("device, case", SECOND_CASES, ids=[f"{_device_id(d)}-{c.id}" for d, c in SECOND_CASES])
def test_representative_case_on_a_second_implementation(device, case, host):
    """The f32 quick cases that run every kernel of every family at each target, within the same bounds, on
    Intel's runtime."""
    outcome = runner.check(opened(*device), case, CONFIG, host)
    if outcome.status == "skip":
        assert "version-2 field" not in outcome.message, f"{device[0]} {case.id}: {outcome.message}"
        pytest.skip(outcome.message)
    assert outcome.status == "pass", f"{device[0]}@{device[1]} {case.id}: {outcome.message}"


def test_the_second_implementation_s_cases_run_every_kernel_of_every_family_and_every_op_at_each_target():
    """What the representative cases on Intel's runtime still cover, planned here from the cases themselves: every
    kernel of every family, each op on each family it launches, every scan op, one combined-field case per op."""
    from host_fallback.abi import SCAN_OPS
    from rlx_gpu import launches
    from rlx_gpu.runtime.options import RunOptions

    f32 = [c for c in catalog.cases(quick=True) if c.dtype == "f32"]
    for device in SECOND:
        limits = opened(*device).limits

        def covered(cases):
            out = set()
            for case in cases:
                if case.op in SCAN_OPS or case.combined:
                    out.add((case.op, "scan" if case.op in SCAN_OPS else "combined"))
                elif case.op in launches.PLANNERS:
                    plan = launches.plan(runner.lay_out(case).thunk, limits,
                                         **RunOptions.build(**case.options).planner_keywords)
                    out |= {k for i in plan.launches if not i.empty for k in ((i.family, i.kernel), (case.op, i.family))}
            return out

        chosen = [c for d, c in SECOND_CASES if d == device]
        assert covered(chosen) == covered(f32), device
        assert len({c.op for c in chosen if c.combined}) == len([c for c in chosen if c.combined]), device
        assert len(chosen) < len(f32) / 4, f"{device}: {len(chosen)} of {len(f32)} cases"


def test_every_op_and_dtype_has_cases():
    from host_fallback.abi import DTYPES, OPS

    covered = {(c.op, c.dtype) for c in CASES}
    assert covered == {(op, dt) for op in OPS for dt in DTYPES if op in CERTIFIED}
    assert {c.id for c in CASES}.__len__() == len(CASES)  # ids are unique


def test_every_optional_field_of_the_op_table_has_a_case_with_it_and_one_without():
    """Walks the op table: each optional field (nullable, used only under a flag, or of version 2) of
    each op is run present and absent, and the laid-out thunk really has it or lacks it."""
    from host_fallback.abi import OPS, used

    optional = [(op, f) for op, spec in OPS.items() if op in CERTIFIED for f in spec.optional_fields]
    assert {(op, f.name) for op, f in optional} >= {("lstm", "c0"), ("gated_delta_net", "state"),
                                                    ("scan_backward", "forward_body")}
    for op, f in optional:
        for present in (True, False):
            found = [c for c in CASES if c.op == op and c.has(f) == present and not c.refused]
            assert found, f"no conformance case of {op} {'with' if present else 'without'} {f.name}"
            thunk = runner.lay_out(found[0]).thunk
            if f.version > 1:
                assert (f.name in used(thunk)) == present, found[0].id
            elif f.nullable:
                assert (thunk[f.name] is not None) == present, found[0].id
            else:
                assert (f.name in {r.field for r in runner.lay_out(found[0]).regions}) == present, found[0].id


def test_a_backward_scan_without_forward_body_is_placed_on_every_device(session):
    """A null ``forward_body`` (every step saved) has no body thunks to place; the device drives the scan."""
    from rlx_gpu.conformance.cases import schedule_of
    from rlx_gpu.runtime.executor import Device

    case = next(c for c in CASES if c.op == "scan_backward_xs" and c.params.get("forward_body") is False)
    laid = runner.lay_out(case)
    assert laid.thunk["forward_body"] is None
    placed = Device(session, CONFIG).place(schedule_of(laid.thunk, laid.arena.size))
    assert placed[0].backend == session.info.backend
    nested = {a.path[1].split(" ")[0] for a in placed[1:]}  # a device walks the bodies; the host runs them whole
    assert nested == (set() if session.info.backend == "host" else {"body_vjp"})
