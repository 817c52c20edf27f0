"""Session hooks: the long checks of ``background`` start once the tests are collected, or before the collection
when the whole suite runs (the tests that wait for them run last), and the run ends with one JSON line per device
and kernel target of the conformance cases it ran (CI's log shows what each OpenCL implementation passed at each
target)."""
from __future__ import annotations

import collections
import gc
import json

import pytest

from support import background

#: (device id as the conformance tests name it, e.g. ``opencl:1:0@gpu``) -> outcome -> count
_CONFORMANCE: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
_CONFORMANCE_TESTS = ("tests/conformance/test_conformance.py::test_case[",
                      "tests/conformance/test_conformance.py::test_representative_case_on_a_second_implementation[")


@pytest.fixture
def collect_only_new_objects():
    """A ``gc.collect()`` in the test walks only the objects made since it began: the older ones (late in a run,
    millions: torch's, every earlier test's, the built programs; a full collection of them took two to three
    seconds) are frozen (``gc.freeze``), counted as live until the test ends. What a test checks is that the
    objects it made and dropped are collected, and none of those is frozen."""
    gc.freeze()
    yield
    gc.unfreeze()


def pytest_sessionstart(session):
    if background.whole_suite(session.config):
        background.start_all()


def pytest_collection_modifyitems(session, config, items):
    items[:] = background.waiting_last(items)


def pytest_collection_finish(session):
    selected = {item.nodeid for item in session.items}
    background.only(selected)
    background.start(selected)


def pytest_runtest_logreport(report):
    if not report.nodeid.startswith(_CONFORMANCE_TESTS):
        return
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        device = report.nodeid.split("[", 1)[1].split("-", 1)[0]
        _CONFORMANCE[device][report.outcome] += 1


def pytest_terminal_summary(terminalreporter):
    if not _CONFORMANCE:
        return
    from rlx_gpu.conformance import devices

    terminalreporter.section("conformance cases per device and kernel target")
    for device, counts in _CONFORMANCE.items():
        spec, _, target = device.partition("@")
        try:
            name = devices.find(spec).name
        except Exception as err:  # an absent device: its tests failed and say why
            name = f"absent ({type(err).__name__})"
        terminalreporter.write_line(json.dumps({"device": spec, "name": name, "target": target or None,
                                                **{k: counts[k] for k in ("passed", "failed", "skipped")}}))


def pytest_sessionfinish(session, exitstatus):
    background.stop_all()
