"""README's Python blocks run as written (those that need no HDFS cluster and no Ray).

Each block runs in a fresh interpreter in an empty folder, with tracking off (a user's first
try) and, for blocks that dump, on into a local folder; a block that names HDFS or Ray is
left to the suites that have them (tests/hdfs, tests/ray).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_NEEDS = ("webhdfs://", "hdfs://", "trajtrack.ray", "import ray")


def _blocks() -> list[tuple[int, str]]:
    text = README.read_text()
    found = [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in _BLOCK.finditer(text)]
    return [(line, code) for line, code in found if not _needs_a_cluster(code)]


def _needs_a_cluster(code: str) -> bool:
    # A comment naming an hdfs:// destination as an example does not make a block need HDFS.
    lines = [line.split("#", 1)[0] for line in code.splitlines()]
    return any(needle in line for line in lines for needle in _NEEDS)


def _run(code: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TRAJTRACK_", "VERL_"))}
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env={**clean, "PYTHONWARNINGS": "ignore", **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_readme_has_the_blocks_this_test_runs() -> None:
    blocks = [code for _, code in _blocks()]
    assert len(blocks) >= 3  # the sync drop-in, many writers, the rollout layer
    assert any("dump_data(" in code and "get_tracker().flush" in code for code in blocks)


@pytest.mark.parametrize(
    ("line", "code"), _blocks(), ids=lambda v: f"line{v}" if isinstance(v, int) else ""
)
def test_a_readme_block_runs_as_written_with_tracking_off(
    tmp_path: Path, line: int, code: str
) -> None:
    done = _run(code, tmp_path)
    assert done.returncode == 0, f"README.md line {line}:\n{code}\n{done.stderr}"
    assert list(tmp_path.iterdir()) == []  # tracking off: nothing written


def test_the_sync_drop_in_dumps_when_tracking_is_on(tmp_path: Path) -> None:
    (code,) = [c for _, c in _blocks() if "dump_data(" in c and "get_tracker().flush" in c]
    dest = tmp_path / "run42"
    done = _run(code, tmp_path, VERL_ENABLE_TRACKER="1", VERL_TRACKER_HDFS_DIR=str(dest))
    assert done.returncode == 0, done.stderr
    for step in range(3):
        dumped = torch.load(dest / f"step{step}" / "obs.pth", weights_only=True)
        assert sorted(dumped) == ["actions", "obs"] and dumped["obs"].shape == (4, 8)
