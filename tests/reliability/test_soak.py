"""Case 4, soak: ``benchmarks/soak.py`` in a fresh process (so its RSS is the run's own).

The short form runs in CI; ``--long`` runs the issue's numbers (20,000 dumps of 1 KB-8 MB from
32 tasks with random flushes). The script checks everything itself (commit, record, RSS, pending
bytes, fd and thread growth) and exits non-zero on a failure; the test also reads its report.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ._proc import child_env

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def _soak(tmp_path: Path, timeout: float, *args: str) -> dict[str, object]:
    out = tmp_path / "soak.json"
    done = subprocess.run(
        [sys.executable, str(SOAK), "--dest", str(tmp_path / "run"), "--json", str(out), *args],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert out.exists(), done.stderr[-3000:]
    report: dict[str, object] = json.loads(out.read_text())
    assert done.returncode == 0, report["errors"]
    return report


def test_soak_short_form(tmp_path: Path) -> None:
    report = _soak(
        tmp_path,
        240,
        "--dumps",
        "1500",
        "--max-size",
        "1MiB",
        "--budget",
        "16MiB",
        "--flush-probability",
        "0.01",
    )
    assert report["committed"] == report["verified"] == 1500
    assert report["errors"] == []
    assert report["flushes"] > 0
    assert int(report["max_rss"]) <= int(report["rss_limit"])  # type: ignore[call-overload]
    assert not list((tmp_path / "run").rglob("*.pth"))  # all verified (and removed)


@pytest.mark.slow
@pytest.mark.timeout(3700)
def test_soak_long_form(tmp_path: Path) -> None:
    report = _soak(tmp_path, 3600)
    assert report["committed"] == report["verified"] == 20_000
