"""Session hooks: the long checks of ``background`` start once the tests are collected."""
from __future__ import annotations

import background


def pytest_collection_finish(session):
    background.start({item.nodeid for item in session.items})


def pytest_sessionfinish(session, exitstatus):
    background.stop_all()
