"""The Ray adapter with the shards layout: dumps from Ray tasks packed into tar shards.

The actor's tracker takes its layout from the environment of the process that creates it
(``TRAJTRACK_LAYOUT``, ``TRAJTRACK_SHARD_MAX_AGE``) or from ``get_trajectory_tracker``'s
tracker options. A dump is acknowledged once the actor has *admitted* it; in the shards layout
it is committed only when its shard is sealed, here by ``flush`` (the age limit is an hour).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import trajtrack
from trajtrack.cli import main as trajtrack_cli
from trajtrack.layouts.shards import SHARDS_DIR
from trajtrack.reader import SyncRun

RAY_TIMEOUT = 90  # seconds for any single wait on the cluster
NEVER_BY_AGE = "3600"  # seconds: no shard is sealed by age while a test runs

pytestmark = pytest.mark.ray


def _assert_same(stored: Any, expected: Any) -> None:
    """Equal by type, keys and values; tensors by dtype, shape and ``torch.equal``."""
    assert type(stored) is type(expected), (type(stored), type(expected))
    if isinstance(expected, torch.Tensor):
        assert stored.dtype == expected.dtype and stored.shape == expected.shape
        assert torch.equal(stored, expected)
    elif isinstance(expected, dict):
        assert list(stored) == list(expected)
        for key, value in expected.items():
            _assert_same(stored[key], value)
    else:
        assert stored == expected


def _shards(dest: Path) -> list[Path]:
    return sorted((dest / SHARDS_DIR).glob("*.tar"))


def _write_files_run(dest: Path, dumps: dict[str, Any]) -> None:
    async def write() -> None:
        async with trajtrack.Tracker(dest, layout="files") as tracker:
            for name, obj in dumps.items():
                await tracker.dump(obj, name)

    anyio.run(write)


def _check_sharded_run(dest: Path, expected: dict[str, Any]) -> list[trajtrack.DumpInfo]:
    """Every expected dump is listed in a shard, none as a file, and loads back as sent."""
    assert _shards(dest)
    assert [p for p in dest.rglob("*.pth") if ".trajtrack" not in p.parts] == []
    with SyncRun(dest) as run:
        listing = run.list()
        assert sorted(info.name for info in listing) == sorted(expected)
        for info in listing:
            assert info.shard is not None and info.shard.startswith(f"{SHARDS_DIR}/")
            _assert_same(run.load(info), expected[info.name])
    return listing


def test_dumps_from_ray_tasks_land_in_shards_that_flush_commits(
    ray_cluster: Any,
    tracker_env: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    import ray
    from _ray_tasks import dump_shard_payloads, shard_payloads

    import trajtrack.ray as tr

    # Only this process, which creates the actor, says "shards": the tasks' workers do not.
    monkeypatch.setenv("TRAJTRACK_LAYOUT", "shards")
    monkeypatch.setenv("TRAJTRACK_SHARD_MAX_AGE", NEVER_BY_AGE)
    actor = tr.get_trajectory_tracker()
    ray.get(actor.ready.remote(), timeout=RAY_TIMEOUT)
    task = ray.remote(max_calls=1)(dump_shard_payloads).options(
        runtime_env={"env_vars": tracker_env["env"]}
    )
    waits = [True, False, True, False]  # acknowledged, pipelined, ...
    pids = ray.get([task.remote(i, wait) for i, wait in enumerate(waits)], timeout=RAY_TIMEOUT * 2)
    expected = {name: obj for i in range(len(waits)) for name, obj in shard_payloads(i).items()}

    # Every task has returned, so the actor has admitted every dump; none is committed yet:
    # an acknowledgement means "admitted", and the open shard waits for its seal.
    dest: Path = tracker_env["dest"]
    stats = ray.get(actor.statistics.remote(), timeout=RAY_TIMEOUT)
    assert (stats.enqueued, stats.committed, stats.failed) == (len(expected), 0, 0)
    assert _shards(dest) == []

    tr.flush(timeout=RAY_TIMEOUT)  # seals the open shard and commits it

    stats = ray.get(actor.statistics.remote(), timeout=RAY_TIMEOUT)
    assert (stats.committed, stats.failed) == (len(expected), 0)
    listing = _check_sharded_run(dest, expected)
    for info in listing:  # the record names the task's process, not the actor's
        assert info.pid == pids[int(info.name.split("/")[0].removeprefix("task"))]

    files = tmp_path / "files"
    _write_files_run(files, expected)
    assert trajtrack_cli(["diff", str(dest), str(files)]) == 0


def test_layout_shards_as_a_tracker_option_of_get_trajectory_tracker(
    ray_cluster: Any, tracker_env: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray
    from _ray_tasks import shard_payloads

    import trajtrack.ray as tr

    monkeypatch.delenv("TRAJTRACK_LAYOUT", raising=False)
    monkeypatch.delenv("TRAJTRACK_SHARD_MAX_AGE", raising=False)
    actor = tr.get_trajectory_tracker(layout="shards", shard_max_age=float(NEVER_BY_AGE))
    expected = shard_payloads(7)
    for index, (name, obj) in enumerate(expected.items()):
        tr.dump_data(obj, name, wait=index % 2 == 0)
    tr.wait_for_own_dumps(timeout=RAY_TIMEOUT)

    dest: Path = tracker_env["dest"]
    stats = ray.get(actor.statistics.remote(), timeout=RAY_TIMEOUT)
    assert (stats.enqueued, stats.committed) == (len(expected), 0)
    assert _shards(dest) == []

    tr.flush(timeout=RAY_TIMEOUT)

    _check_sharded_run(dest, expected)
