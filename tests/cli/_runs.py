"""Helpers: write runs through a real Tracker, and a dump whose unpickling writes a file."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import anyio
import pytest

import trajtrack
from trajtrack.cli import main


def write_run(dest: str, dumps: Mapping[str, Any]) -> None:
    """Dump each object under its name, in order, through a real tracker (records included)."""

    async def go() -> None:
        async with trajtrack.Tracker(dest, workers=1) as tracker:
            for name, obj in dumps.items():
                await (await tracker.dump(obj, name))  # commit in order: dump order is stable

    anyio.run(go)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``main(argv)`` with stdout/stderr captured."""
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any]:
    code, out, _ = run_cli(capsys, *argv, "--json")
    return code, json.loads(out)


class WritesMarker:
    """Unpickling this object creates the marker (a directory): what a malicious dump does."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.marker,))
