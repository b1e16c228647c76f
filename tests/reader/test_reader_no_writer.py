"""A reader starts no writer machinery (#34 item 2): opening and loading a local run maps no
staging arena, starts no writer process, and the reader imports nothing from the tracker."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from trajtrack import SyncTracker

_PROBE = textwrap.dedent(
    """
    import sys, threading
    from trajtrack.reader import SyncRun
    with SyncRun(sys.argv[1]) as run:
        loaded = run.load("x")
        maps = open("/proc/self/maps").read()
        print("arena", "trajtrack-staging" in maps)
        print("value", loaded["a"].tolist())
    import multiprocessing
    print("children", len(multiprocessing.active_children()))
    """
)


def test_opening_a_local_run_maps_no_arena_and_starts_no_writer(tmp_path: Path) -> None:
    tracker = SyncTracker(str(tmp_path / "run"))
    tracker.dump({"a": torch.ones(2)}, "x")
    tracker.close()
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert done.stdout.split("\n")[:3] == ["arena False", "value [1.0, 1.0]", "children 0"]


def test_the_reader_modules_import_nothing_from_the_tracker() -> None:
    reader = Path(__file__).resolve().parents[2] / "src" / "trajtrack" / "reader"
    for module in reader.glob("*.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            assert not any(n.startswith("trajtrack.tracker") for n in names), module.name
