"""Case 3, fork: a process forks while its global tracker is busy uploading.

The parent (a child process of the test) streams 300 dumps through ``dump_data`` from a thread
and forks when a quarter are queued, with ``os.fork`` (the forked child flushes and closes its
own tracker) and with the multiprocessing ``fork`` start method (the child does not flush: the
multiprocessing finalizer drains it). The forked child must dump its own data with a fresh
tracker (no inherited queue, loop thread or locks: it would deadlock or lose them otherwise),
and the parent's dumps must be written exactly once, by the parent.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from ._payloads import KIB, check_file
from ._proc import child_env, final_files, records, run_child

PARENT = 300
CHILD = 40


@pytest.mark.parametrize("method", ["os", "multiprocessing"])
def test_fork_with_a_busy_global_tracker(tmp_path: Path, method: str) -> None:
    dest = tmp_path / "run"
    env = child_env(TRAJTRACK_ENABLE="1", TRAJTRACK_DIR=f"slowfile://{dest}")
    proc = run_child("fork", "os" if method == "os" else "mp", PARENT, CHILD, env=env)
    assert proc.proc.returncode == 0, proc.stderr
    result = next(line for line in proc.stdout if line.startswith("RESULT"))

    outcome = json.loads(result.removeprefix("RESULT"))
    assert outcome["busy_at_fork"] > 0  # the tracker really had a backlog when it forked
    assert outcome["child_exit"] == 0, proc.stderr
    child_pid = outcome["child_pid"]

    files = final_files(dest)
    parent_names = {f"parent/d{i}" for i in range(PARENT)}
    child_names = {f"child{child_pid}/d{i}" for i in range(CHILD)}
    assert set(files) == parent_names | child_names
    for name, path in files.items():
        check_file(path, name, KIB, 64 * KIB)

    written = records(dest)
    by_name = Counter(r.name for r in written)
    assert all(by_name[name] == 1 for name in parent_names | child_names), by_name.most_common(3)
    assert set(by_name) == parent_names | child_names
    writers = {r.name: r.pid for r in written}
    assert {writers[name] for name in child_names} == {child_pid}
    assert child_pid not in {writers[name] for name in parent_names}
