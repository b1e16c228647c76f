"""Case 2, exit paths: nothing pending is lost at exit, and no storage can stop a process exiting.

Each scenario runs in a child process (``_child.py``), because what is tested is the process
ending: the interpreter's exit, ``SIGTERM``, ``sys.exit`` inside ``async with Tracker``.
``slowfile://`` is the local backend with 10 ms per write, so that dumps are still pending when
the process starts to exit; ``hang://<n>`` is the memory backend that answers *n* writes and
then never answers again (a storage that hangs).
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from ._payloads import KIB, check_file
from ._proc import Child, child_env, final_files, records, run_child

SMALL = 16 * KIB


def _shim_env(dest: str, **extra: str) -> dict[str, str]:
    return child_env(TRAJTRACK_ENABLE="1", TRAJTRACK_DIR=dest, **extra)


def _assert_all_written(root: Path, prefix: str, count: int) -> None:
    files = final_files(root)
    expected = {f"{prefix}/d{i}" for i in range(count)}
    assert set(files) == expected, f"missing: {sorted(expected - set(files))[:5]}"
    for name, path in files.items():
        check_file(path, name, KIB, SMALL)
    recorded = [r.name for r in records(root)]
    assert sorted(recorded) == sorted(expected)  # each recorded exactly once


def test_normal_exit_writes_500_pending_dumps(tmp_path: Path) -> None:
    dest = tmp_path / "run"
    child = Child("exit_pending", 500, env=_shim_env(f"slowfile://{dest}"))
    result = child.result()
    assert child.finish() == 0, child.stderr
    assert result["pending_at_return"] > 0  # 500 x 10 ms / 4 workers: most still pending
    _assert_all_written(dest, "exit", 500)


def test_sigterm_drains_within_the_budget_then_exits(tmp_path: Path) -> None:
    dest = tmp_path / "run"
    env = _shim_env(f"slowfile://{dest}", TRAJTRACK_HANDLE_SIGTERM="1", TRAJTRACK_EXIT_TIMEOUT="60")
    child = Child("sigterm", 300, env=env)
    pending = int(child.wait_line("READY"))
    child.signal(signal.SIGTERM)
    assert child.finish() == 128 + signal.SIGTERM, child.stderr
    assert pending > 0
    _assert_all_written(dest, "term", 300)


def test_sigterm_is_left_alone_when_disabled(tmp_path: Path) -> None:
    # TRAJTRACK_HANDLE_SIGTERM=0: the default action (immediate death) stays; nothing hangs.
    env = _shim_env(
        f"slowfile://{tmp_path / 'run'}", TRAJTRACK_HANDLE_SIGTERM="0", TRAJTRACK_EXIT_TIMEOUT="60"
    )
    child = Child("sigterm", 50, env=env)
    child.wait_line("READY")
    child.signal(signal.SIGTERM)
    assert child.finish() == -signal.SIGTERM


@pytest.mark.parametrize("answered", [0, 3])
def test_hanging_storage_cannot_stop_the_exit(answered: int) -> None:
    # answered=3: some dumps commit first, so the final record write hangs too (that used to
    # hang the exit forever: fail_after cannot interrupt a blocked worker thread).
    env = _shim_env(f"hang://{answered}", TRAJTRACK_EXIT_TIMEOUT="2")
    child = Child("hang", 10, env=env)
    child.wait_line("READY")
    assert child.finish(timeout=60) == 0, child.stderr  # the budget is 2 s: 60 s means hung
    match = re.search(r"(\d+) dumps were not written", child.stderr)
    assert match, child.stderr
    assert int(match.group(1)) == 10 - answered


@pytest.mark.parametrize("how", ["exit", "raise"])
def test_leaving_async_with_by_exit_or_exception_drains(tmp_path: Path, how: str) -> None:
    dest = tmp_path / "run"
    child = run_child("scoped", dest, 200, how)
    if how == "exit":
        assert child.proc.returncode == 7, child.stderr
    else:
        assert child.proc.returncode == 1
        assert "the training loop crashed" in child.stderr
    pending = int(next(line for line in child.stdout if line.startswith("READY")).split()[1])
    assert pending > 0
    _assert_all_written(dest, "scoped", 200)
