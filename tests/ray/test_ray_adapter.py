"""trajtrack.ray against a real local Ray cluster (see conftest.py), plus its import rules."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import anyio.to_thread
import pytest
import torch

RAY_TIMEOUT = 90  # seconds for any single wait on the cluster


def _load(path: Path) -> Any:
    return torch.load(path, weights_only=True)


# --------------------------------------------------------------------------- imports


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_import_trajtrack_does_not_import_ray() -> None:
    done = _python(
        """
        import sys, trajtrack
        trajtrack.dump_data  # the sync shim is per process and needs no Ray
        print("ray" in sys.modules)
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_import_without_ray_gives_the_install_hint() -> None:
    done = _python(
        """
        import sys

        class NoRay:
            def find_spec(self, name, path=None, target=None):
                if name == "ray" or name.startswith("ray."):
                    raise ImportError(f"No module named {name!r}", name=name)
                return None

        sys.meta_path.insert(0, NoRay())
        import trajtrack
        try:
            import trajtrack.ray
        except trajtrack.MissingDependencyError as exc:
            print(type(exc).__name__, "|", exc)
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("MissingDependencyError |")
    assert "pip install 'trajtrack[ray]'" in done.stdout


# --------------------------------------------------------------------------- on the cluster


@pytest.mark.ray
def test_disabled_dump_data_is_a_noop(ray_cluster: Any, tracker_env: dict[str, Any]) -> None:
    import ray

    import trajtrack.ray as tr

    os.environ.pop("VERL_ENABLE_TRACKER")
    assert tr.dump_data({"x": torch.ones(2)}, "never") is None
    with pytest.raises(ValueError, match="Failed to look up actor"):
        ray.get_actor(tracker_env["name"], namespace=tr.DEFAULT_NAMESPACE)


@pytest.mark.ray
def test_ten_tasks_in_different_workers_dump_then_flush(
    ray_cluster: Any, tracker_env: dict[str, Any]
) -> None:
    import ray
    from _ray_tasks import dump_one, payload

    import trajtrack.ray as tr

    # Create the actor first with a template that puts the *writer's* pid into the names.
    actor = tr.get_trajectory_tracker(name_template="{name}.pid{pid}")
    info = ray.get(actor.ready.remote(), timeout=RAY_TIMEOUT)
    # max_calls=1: each task runs in a worker process of its own.
    task = ray.remote(max_calls=1)(dump_one).options(runtime_env={"env_vars": tracker_env["env"]})
    pids = ray.get([task.remote(i) for i in range(10)], timeout=RAY_TIMEOUT * 2)
    assert len(set(pids)) == 10
    assert info["pid"] not in pids

    tr.flush(timeout=RAY_TIMEOUT)

    dest = tracker_env["dest"]
    for i, pid in enumerate(pids):
        stored = _load(dest / f"process_{i}_obs.pid{pid}.pth")
        expected = payload(i)
        assert stored["step"] == expected["step"]
        assert torch.equal(stored["obs"], expected["obs"])
    stats = ray.get(actor.statistics.remote(), timeout=RAY_TIMEOUT)
    assert stats.committed == 10 and stats.failed == 0 and stats.pending_items == 0
    channel = ray.get(actor.channel_statistics.remote(), timeout=RAY_TIMEOUT)
    assert channel["dumps"] == 10 and channel["connections"] == 10  # the direct channel


@pytest.mark.ray
def test_a_second_driver_finds_the_actor_by_name(
    ray_cluster: Any, tracker_env: dict[str, Any]
) -> None:
    import ray

    import trajtrack.ray as tr

    tr.dump_data({"x": torch.arange(4)}, "first")
    tr.flush(timeout=RAY_TIMEOUT)
    mine = ray.get(tr.get_trajectory_tracker().ready.remote(), timeout=RAY_TIMEOUT)

    theirs = json.loads(ray_cluster.driver("lookup", tracker_env["name"]))

    assert theirs == {"token": mine["token"], "committed": 1}


@pytest.mark.ray
def test_a_dump_just_before_the_creating_driver_leaves_still_lands(
    ray_cluster: Any, tmp_path: Path, actor_name: str
) -> None:
    import ray

    import trajtrack.ray as tr

    dest = tmp_path / "late"
    out = ray_cluster.driver("dump-and-leave", str(dest), actor_name, "8")
    created_by_them = json.loads(out)["token"]

    # That driver is gone; the detached actor is not, and it still writes what it was given.
    actor = tr.get_trajectory_tracker(name=actor_name)
    assert ray.get(actor.ready.remote(), timeout=RAY_TIMEOUT)["token"] == created_by_them
    ray.get(actor.flush.remote(RAY_TIMEOUT), timeout=RAY_TIMEOUT)
    for i in range(8):
        assert torch.equal(_load(dest / "late" / f"{i}.pth")["late"], torch.full((1 << 18,), i))


@pytest.mark.ray
def test_a_failing_storage_surfaces_through_flush(
    ray_cluster: Any, tracker_env: dict[str, Any]
) -> None:
    import ray

    import trajtrack
    import trajtrack.ray as tr

    dest: Path = tracker_env["dest"]
    tr.dump_data({"ok": torch.ones(1)}, "ok")  # creates the actor and the directory
    tr.flush(timeout=RAY_TIMEOUT)
    (dest / "blocker").write_bytes(b"a file where a directory must go")

    tr.dump_data({"x": torch.ones(3)}, "blocker/x")  # admitted; the write fails later

    with pytest.raises(trajtrack.StorageError) as failure:
        tr.flush(timeout=RAY_TIMEOUT)
    assert "blocker" in str(failure.value)
    # Reported once; the tracker keeps working.
    tr.dump_data({"y": torch.zeros(2)}, "after")
    tr.flush(timeout=RAY_TIMEOUT)
    assert torch.equal(_load(dest / "after.pth")["y"], torch.zeros(2))
    stats = ray.get(tr.get_trajectory_tracker().statistics.remote(), timeout=RAY_TIMEOUT)
    assert (stats.committed, stats.failed) == (2, 1)


@pytest.mark.ray
def test_the_snapshot_is_taken_before_dump_data_returns(
    ray_cluster: Any, tracker_env: dict[str, Any]
) -> None:
    import trajtrack.ray as tr

    obs = torch.zeros(8)
    tr.dump_data({"obs": obs}, "snap", wait=False)
    obs += 1  # the caller mutates right away
    tr.dump_data({"obs": obs}, "snap2")
    tr.flush(timeout=RAY_TIMEOUT)
    assert torch.equal(_load(tracker_env["dest"] / "snap.pth")["obs"], torch.zeros(8))
    assert torch.equal(_load(tracker_env["dest"] / "snap2.pth")["obs"], torch.ones(8))


@pytest.mark.ray
def test_pipelined_mode_bounds_what_is_in_flight(
    ray_cluster: Any, tracker_env: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import trajtrack.ray as tr

    monkeypatch.setenv("TRAJTRACK_RAY_PIPELINED", "1")
    monkeypatch.setenv("TRAJTRACK_RAY_MAX_IN_FLIGHT", "3")
    seen = []
    for i in range(30):
        tr.dump_data({"i": torch.tensor([i])}, f"pipe/{i}")
        seen.append(tr.own_dumps_in_flight())
    assert max(seen) <= 3

    tr.wait_for_own_dumps(timeout=RAY_TIMEOUT)
    assert tr.own_dumps_in_flight() == 0
    tr.flush(timeout=RAY_TIMEOUT)
    for i in range(30):
        assert _load(tracker_env["dest"] / "pipe" / f"{i}.pth")["i"].item() == i


@pytest.mark.ray
def test_pipelined_errors_surface_in_wait_for_own_dumps(
    ray_cluster: Any, tracker_env: dict[str, Any]
) -> None:
    import trajtrack
    import trajtrack.ray as tr

    # A template that makes one name too long only once rendered (in the actor).
    tr.get_trajectory_tracker(name_template="{name}" + "x" * 200)
    tr.dump_data({"x": 1}, "ok", wait=False)  # rendered: 202 bytes, fits
    tr.dump_data({"x": 2}, "m" * 60, wait=False)  # rendered: 260 bytes, over HDFS's 255

    with pytest.raises(trajtrack.InvalidNameError):
        tr.wait_for_own_dumps(timeout=RAY_TIMEOUT)
    tr.wait_for_own_dumps(timeout=RAY_TIMEOUT)  # reported once
    tr.flush(timeout=RAY_TIMEOUT)
    assert (tracker_env["dest"] / ("ok" + "x" * 200 + ".pth")).exists()


@pytest.mark.ray
def test_bad_names_are_rejected_in_the_caller(
    ray_cluster: Any, tracker_env: dict[str, Any]
) -> None:
    import ray

    import trajtrack
    import trajtrack.ray as tr

    with pytest.raises(trajtrack.InvalidNameError):
        tr.dump_data({"x": 1}, "../escape")
    # Nothing was sent: the actor was not even created.
    with pytest.raises(ValueError, match="Failed to look up actor"):
        ray.get_actor(tracker_env["name"], namespace=tr.DEFAULT_NAMESPACE)


@pytest.mark.ray
def test_a_gone_actor_is_replaced_on_the_next_dump(
    ray_cluster: Any, tracker_env: dict[str, Any]
) -> None:
    import ray
    from _ray_tasks import wait_until_gone

    import trajtrack.ray as tr

    tr.dump_data({"x": torch.ones(1)}, "before")
    first = ray.get(tr.get_trajectory_tracker().ready.remote(), timeout=RAY_TIMEOUT)["token"]
    tr.shutdown(timeout=RAY_TIMEOUT)  # drains: the dump is written
    assert (tracker_env["dest"] / "before.pth").exists()

    tr.dump_data({"x": torch.ones(1)}, "after")  # the cached handle is stale: looked up anew
    tr.flush(timeout=RAY_TIMEOUT)
    second = ray.get(tr.get_trajectory_tracker().ready.remote(), timeout=RAY_TIMEOUT)["token"]
    assert second != first
    assert (tracker_env["dest"] / "after.pth").exists()

    # The actor dies behind the cached handle's back: the next dump finds a new one. (ray.kill
    # only asks for the kill; wait until the process is gone, or the channel still reaches it.)
    pid = ray.get(tr.get_trajectory_tracker().ready.remote(), timeout=RAY_TIMEOUT)["pid"]
    ray.kill(tr.get_trajectory_tracker())
    wait_until_gone(pid)
    tr.dump_data({"x": torch.ones(1)}, "third")
    tr.flush(timeout=RAY_TIMEOUT)
    assert (tracker_env["dest"] / "third.pth").exists()


@pytest.mark.ray
async def test_the_driver_can_await_the_actor(
    ray_cluster: Any, tracker_env: dict[str, Any]
) -> None:
    import trajtrack.ray as tr

    # The blocking calls (a Ray lookup, a dump's round trip) in a thread, as a driver's event
    # loop must; then awaiting the actor's methods, which is what this test is about.
    actor = await anyio.to_thread.run_sync(tr.get_trajectory_tracker)
    await anyio.to_thread.run_sync(tr.dump_data, {"x": torch.ones(1)}, "awaited")
    await actor.flush.remote(RAY_TIMEOUT)
    stats = await actor.statistics.remote()
    assert stats.committed == 1
