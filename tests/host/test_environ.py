"""host_fallback.environ: a reader follows os.environ's writes and deletions at every call, in the value's own
characters."""
from __future__ import annotations

import os

from host_fallback import environ

NAME = "RLX_TEST_ENVIRON_READER"


def test_a_reader_sees_each_change_of_the_variable(monkeypatch):
    monkeypatch.delenv(NAME, raising=False)
    read = environ.reader(NAME)
    assert read() is None
    monkeypatch.setenv(NAME, "opencl:1:0")
    assert read() == "opencl:1:0" == os.environ[NAME]
    monkeypatch.setenv(NAME, "héllo ✓")
    assert read() == "héllo ✓"
    monkeypatch.delenv(NAME)
    assert read() is None


def test_the_dictionary_answers_as_os_environ_does(monkeypatch):
    monkeypatch.setenv(NAME, "1")
    assert environ.ENVIRON.get(environ.key(NAME)) in ("1", b"1")
    monkeypatch.delenv(NAME)
    assert environ.ENVIRON.get(environ.key(NAME)) is None
