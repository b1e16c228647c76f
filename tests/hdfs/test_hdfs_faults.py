"""Faults injected into the real cluster: nothing lost, clear errors, no retry storms.

Each test leaves the cluster healthy (``restore()`` in ``finally``), so the session's single
cluster can be shared; they run last in this directory (file name order) and on their own.
"""

from __future__ import annotations

import io
from collections.abc import AsyncIterator, Callable

import anyio
import anyio.to_thread
import pytest
import torch

from _support.hdfs_cluster import HdfsCluster
from trajtrack import (
    RetryPolicy,
    StoragePermissionError,
    StorageUnavailableError,
    Tracker,
)
from trajtrack.backends import open_storage

pytestmark = pytest.mark.hdfs

# Short backoffs so a test notices recovery quickly; a deadline far above any restart here.
RIDE_OUT = RetryPolicy(initial_backoff=0.2, max_backoff=1.0, deadline=150.0)


@pytest.fixture
async def cluster(hdfs_cluster: HdfsCluster) -> AsyncIterator[HdfsCluster]:
    try:
        yield hdfs_cluster
    finally:
        await anyio.to_thread.run_sync(hdfs_cluster.restore)


def _payload(i: int) -> dict[str, object]:
    return {"i": i, "x": torch.full((4096,), float(i))}


async def _until(condition: Callable[[], bool], timeout: float) -> None:
    # Polls the tracker's counters: they have no event to wait on.
    with anyio.fail_after(timeout):
        while not condition():  # noqa: ASYNC110
            await anyio.sleep(0.05)


async def _check_all_committed(url: str, count: int) -> None:
    storage = open_storage(url)
    for i in range(count):
        data = await storage.read(f"s/{i}.pth")
        loaded = torch.load(io.BytesIO(data), weights_only=True)
        assert loaded["i"] == i
        assert torch.equal(loaded["x"], torch.full((4096,), float(i)))
    await storage.aclose()


async def _stream_through_fault(
    url: str, fault: Callable[[], None], recover: Callable[[], None]
) -> int:
    """Dump before, during and after a fault; return the retries it took."""
    async with Tracker(url, workers=4, retry=RIDE_OUT) as tracker:
        for i in range(5):
            await tracker.dump(_payload(i), f"s/{i}")
        await tracker.flush(timeout=60)
        await anyio.to_thread.run_sync(fault)
        for i in range(5, 15):
            await tracker.dump(_payload(i), f"s/{i}")
        # The fault is really seen (the dumps are failing and being retried) before recovery.
        await _until(lambda: tracker.statistics().retries >= 3, 60)
        await anyio.to_thread.run_sync(recover)
        for i in range(15, 20):
            await tracker.dump(_payload(i), f"s/{i}")
        await tracker.flush(timeout=180)
        stats = tracker.statistics()
    assert stats.failed == 0
    assert stats.committed == 20
    await _check_all_committed(url, 20)
    return stats.retries


async def test_datanode_killed_and_restarted(cluster: HdfsCluster, hdfs_url: str) -> None:
    retries = await _stream_through_fault(hdfs_url, cluster.kill_datanode, cluster.start_datanode)
    assert retries >= 3


async def test_namenode_restarted_through_safe_mode(cluster: HdfsCluster, hdfs_url: str) -> None:
    retries = await _stream_through_fault(hdfs_url, cluster.kill_namenode, cluster.start_namenode)
    assert retries >= 3


async def test_admin_safe_mode_is_ridden_out(cluster: HdfsCluster, hdfs_url: str) -> None:
    retries = await _stream_through_fault(
        hdfs_url, lambda: cluster.safemode("enter"), lambda: cluster.safemode("leave")
    )
    assert retries >= 3


async def test_namenode_down_past_the_deadline(cluster: HdfsCluster, hdfs_url: str) -> None:
    short = RetryPolicy(initial_backoff=0.1, max_backoff=0.5, deadline=3.0)
    async with Tracker(hdfs_url, retry=short, exit_timeout=60) as tracker:
        await anyio.to_thread.run_sync(cluster.kill_namenode)
        handle = await tracker.dump(_payload(0), "down/0")
        with pytest.raises(StorageUnavailableError, match="retry deadline") as caught:
            await handle
        assert "connection failed" in str(caught.value)
        with pytest.raises(StorageUnavailableError):
            await tracker.flush(timeout=30)  # the failure is reported once, then cleared
        await anyio.to_thread.run_sync(cluster.restore)
        later = await tracker.dump(_payload(1), "down/1")
        assert (await later).size > 0
        await tracker.flush(timeout=60)
    storage = open_storage(hdfs_url)
    assert await storage.stat("down/0.pth") is None
    assert await storage.stat("down/1.pth") is not None
    await storage.aclose()


async def test_unreachable_at_start_is_a_clear_error(cluster: HdfsCluster, hdfs_url: str) -> None:
    await anyio.to_thread.run_sync(cluster.kill_namenode)
    tracker = Tracker(hdfs_url, storage_options={"prepare_timeout": 2.0})
    with pytest.raises(StorageUnavailableError, match="unreachable"):
        await tracker.start()


async def test_permission_denied_fails_fast(
    hdfs_cluster: HdfsCluster, hdfs_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    owner = open_storage(hdfs_url)
    await owner.prepare()  # owned by the superuser, 755
    monkeypatch.setenv("HADOOP_USER_NAME", "intruder")
    async with Tracker(hdfs_url, retry=RIDE_OUT, record=False) as tracker:
        handles = [await tracker.dump(_payload(i), f"p/{i}") for i in range(3)]
        for handle in handles:
            with pytest.raises(StoragePermissionError) as caught:
                await handle
            assert caught.value.remote_exception == "AccessControlException"
        stats = tracker.statistics()
        with pytest.raises(StoragePermissionError):
            await tracker.flush(timeout=10)
    assert stats.retries == 0
    assert stats.failed == 3
    assert await owner.list() == []
    await owner.aclose()
