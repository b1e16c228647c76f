"""The per-dump environment reader sees exactly what ``os.environ`` holds, at once."""

from __future__ import annotations

import os

import pytest

from trajtrack._environ import _RAW, getenv


def test_it_reads_the_mapping_os_environ_writes() -> None:
    assert _RAW is not None  # CPython on Linux: the fast path is the one under test
    assert getenv("PATH") == os.environ["PATH"]


def test_values_set_changed_and_removed_are_seen_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    name = "TRAJTRACK_TEST_ENVIRON"
    assert getenv(name) is None
    monkeypatch.setenv(name, "1")
    assert getenv(name) == "1"
    os.environ[name] = "two"
    assert getenv(name) == "two"
    monkeypatch.setenv(name, "ünï\udcff")  # non-ASCII and an undecodable byte round-trip
    assert getenv(name) == os.environ[name] == "ünï\udcff"
    monkeypatch.delenv(name)
    assert getenv(name) is None
    os.environ.update({name: "3"})
    assert getenv(name) == "3"
    os.environ.pop(name)
    assert getenv(name) is None


def test_every_variable_of_the_process_agrees() -> None:
    for name, value in os.environ.items():
        assert getenv(name) == value, name
