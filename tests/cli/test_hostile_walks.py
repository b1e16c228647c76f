"""Issue 32: hostile objects through ``show`` and ``diff`` -- every walk is bounded.

A 1.3 KB list DAG of shared references (2**60 paths through 61 lists), a 5,000-deep list and a
1 KB stride-0 tensor claiming 2**34 elements, each built here, saved with ``torch.save`` into a
run directory (unrecorded dumps, which the reader lists) and run through the CLI: each ends
with an answer, never a hang, a ``RecursionError`` or gigabytes allocated.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ._runs import run_cli, run_json


def _dag(levels: int, leaf: object) -> list[Any]:
    node: list[Any] = [leaf]
    for _ in range(levels):
        node = [node, node]
    return node


def _deep(levels: int, leaf: list[Any]) -> list[Any]:
    node = leaf
    for _ in range(levels):
        node = [node]
    return node


@pytest.fixture
def hostile(tmp_path: Path) -> tuple[str, str]:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)  # only to pickle the deep list here
    try:
        torch.save({"dag": _dag(60, 1)}, a / "dag.pth")
        torch.save({"dag": _dag(60, 2)}, b / "dag.pth")
        torch.save(_deep(5000, []), a / "deep.pth")
        torch.save(_deep(5000, [1]), b / "deep.pth")
    finally:
        sys.setrecursionlimit(limit)
    torch.save({"t": torch.zeros(1).expand(2**34)}, a / "wide.pth")
    torch.save({"t": torch.ones(1).expand(2**34)}, b / "wide.pth")
    assert (a / "dag.pth").stat().st_size < 2048 and (a / "wide.pth").stat().st_size < 2048
    return str(a), str(b)


def test_diff_answers_every_hostile_pair(
    hostile: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = hostile
    code, report = run_json(capsys, "diff", a, b)
    assert code == 2
    dumps = {d["name"]: d for d in report["dumps"]}
    # The DAG: one difference, where the shared leaf is first reached.
    assert dumps["dag"]["status"] == "different"
    (difference,) = dumps["dag"]["differences"]
    assert difference["path"] == "['dag']" + "[0]" * 61
    # Too deep and too wide: typed errors, not a traceback, and not divergences.
    assert dumps["deep"]["status"] == "error"
    assert "nested deeper than 64 levels" in dumps["deep"]["error"]
    assert dumps["wide"]["status"] == "error"
    assert "17179869184 elements over a storage of 4 bytes" in dumps["wide"]["error"]
    assert report["first_divergence"] == "dag"


def test_show_describes_every_hostile_dump(
    hostile: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    a, _ = hostile
    code, out, _ = run_cli(capsys, "show", a, "dag")
    assert code == 0
    assert "(the same object as ['dag'][0])" in out  # the second reference, not walked again
    assert len(out.splitlines()) < 100
    code, out, _ = run_cli(capsys, "show", a, "deep")
    assert code == 0 and out.rstrip().endswith("list [[[[...]]]]")
    code, out, _ = run_cli(capsys, "show", a, "wide")
    assert code == 0
    assert "Tensor float32 [17179869184] cpu (statistics not computed:" in out
    code, report = run_json(capsys, "show", a, "wide")
    (tensor,) = report["structure"]["children"]
    assert "min" not in tensor and tensor["note"].startswith("statistics not computed")
