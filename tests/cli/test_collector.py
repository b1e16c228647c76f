"""The CLI's garbage collection: off while a command runs, cycles still collected on a timer,
everything put back after."""

from __future__ import annotations

import argparse
import gc
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import pytest

import trajtrack.cli.ls as ls_command
from trajtrack.cli import main
from trajtrack.cli._collector import collected_every


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


def _collector_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "trajtrack-gc"]


def test_the_collector_is_off_inside_and_cycles_are_still_freed() -> None:
    assert gc.isenabled()
    with collected_every(0.01):
        assert not gc.isenabled()
        assert gc.get_freeze_count() > 0  # what was alive before is left out of collections
        cycle = weakref.ref(_Node())  # garbage at once, but only a collection frees it
        deadline = time.monotonic() + 5.0
        while cycle() is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cycle() is None
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert not _collector_threads()


def test_a_collector_off_before_stays_off_after() -> None:
    gc.disable()
    try:
        with collected_every(0.01):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_put_back_when_the_command_raises() -> None:
    with pytest.raises(RuntimeError), collected_every(0.01):
        raise RuntimeError("boom")
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert not _collector_threads()


def test_a_command_runs_with_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []

    async def handler(args: argparse.Namespace, streams: Any) -> int:
        seen.append((gc.isenabled(), len(_collector_threads())))
        return 0

    monkeypatch.setattr(ls_command, "run", handler)
    assert main(["ls", str(tmp_path)]) == 0
    assert seen == [(False, 1)]
    assert gc.isenabled()
