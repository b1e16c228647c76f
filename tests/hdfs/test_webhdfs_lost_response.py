"""A RENAME that took effect on the NameNode but whose answer was lost, on the real cluster.

Under ``on_exists="error"`` the publishing RENAME is a plain one. When its answer is lost
(connection reset, read timeout) the tracker retries the write, and the retry's RENAME finds
the final name taken by the write's own first attempt: that must end committed, while a final
name holding anyone else's bytes is still refused. The cluster cannot lose an answer on cue,
so HdfsCLI's RENAME is wrapped: it does the real RENAME, then raises ``ConnectionError``.
"""

from __future__ import annotations

import io
import zlib
from collections.abc import Callable

import pytest
import requests
import torch
from hdfs import InsecureClient
from hdfs.client import Client

from _support.hdfs_cluster import HdfsCluster
from trajtrack import DumpExistsError, RetryPolicy, Tracker
from trajtrack.backends import open_storage
from trajtrack.backends._protocol import BytesPayload

pytestmark = pytest.mark.hdfs

FAST = RetryPolicy(initial_backoff=0.05, max_backoff=0.2, deadline=60.0)
NAME = "step1/obs"


def _path_of(url: str) -> str:
    return "/" + url.split("://", 1)[1].split("/", 1)[1]


def _client(cluster: HdfsCluster) -> InsecureClient:
    """A client of the test's own, independent of the backend's."""
    return InsecureClient(f"http://127.0.0.1:{cluster.http_port}", user=cluster.superuser)


def _read(cluster: HdfsCluster, hdfs_path: str) -> bytes:
    with _client(cluster).read(hdfs_path) as reader:
        return reader.read()  # type: ignore[no-any-return]


def _files(cluster: HdfsCluster, root: str) -> list[str]:
    """Every file under *root*, relative to it."""
    found = []
    for directory, _dirs, names in _client(cluster).walk(root):
        found += [f"{directory}/{name}"[len(root) + 1 :] for name in names]
    return sorted(found)


def _assert_no_temp_files(cluster: HdfsCluster, root: str) -> None:
    files = _files(cluster, root)
    assert f"{NAME}.pth" in files
    assert [f for f in files if ".tmp~" in f] == [], files


def _lose_first_answer(
    monkeypatch: pytest.MonkeyPatch,
    final: str,
    instead: Callable[[str], None] | None = None,
) -> list[str]:
    """The first plain RENAME to *final* is done (or *instead(temp)* runs), then its answer
    is lost; returns the temp paths whose RENAME answer was lost."""
    real = Client._rename
    lost: list[str] = []

    def rename(client: Client, hdfs_path: str, **params: object) -> object:
        if lost or params.get("destination") != final or "renameoptions" in params:
            return real(client, hdfs_path, **params)
        lost.append(hdfs_path)
        if instead is None:
            real(client, hdfs_path, **params)
        else:
            instead(hdfs_path)
        raise requests.exceptions.ConnectionError("connection reset by peer (injected)")

    monkeypatch.setattr(Client, "_rename", rename)
    return lost


async def test_lost_rename_answer_ends_committed(
    hdfs_cluster: HdfsCluster, hdfs_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _path_of(hdfs_url)
    lost = _lose_first_answer(monkeypatch, f"{root}/{NAME}.pth")
    obj = {"obs": torch.randn(64, 32), "ids": torch.arange(1000, dtype=torch.int64)}
    async with Tracker(hdfs_url, on_exists="error", retry=FAST) as tracker:
        record = await (await tracker.dump(obj, NAME))
        await tracker.flush(timeout=60)
        stats = tracker.statistics()
    assert len(lost) == 1  # the fault happened: the first RENAME's answer was lost
    assert (stats.committed, stats.failed) == (1, 0)
    assert stats.retries >= 1
    data = _read(hdfs_cluster, f"{root}/{NAME}.pth")
    assert record.path == f"{NAME}.pth"
    assert record.size == len(data)
    assert record.checksum == f"crc32:{zlib.crc32(data):08x}"
    loaded = torch.load(io.BytesIO(data), weights_only=True)
    assert loaded.keys() == obj.keys()
    assert all(torch.equal(loaded[k], obj[k]) for k in obj)
    _assert_no_temp_files(hdfs_cluster, root)


@pytest.mark.parametrize("when", ["before-the-dump", "between-attempts-same-length"])
async def test_someone_elses_file_is_still_refused(
    hdfs_cluster: HdfsCluster, hdfs_url: str, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    root = _path_of(hdfs_url)
    final = f"{root}/{NAME}.pth"
    theirs: list[bytes] = []
    client = _client(hdfs_cluster)

    def write_theirs(data: bytes) -> None:
        client.write(final, data=data, overwrite=False)
        theirs.append(data)

    def take_the_name(temp: str) -> None:
        # Another writer takes the name between the attempts: our length, other bytes.
        with client.read(temp) as reader:
            ours = bytearray(reader.read())
        ours[len(ours) // 2] ^= 0xFF
        write_theirs(bytes(ours))

    if when == "before-the-dump":
        write_theirs(b"someone else's dump, not ours")
        lost = _lose_first_answer(monkeypatch, final)  # the RENAME answered false: lost
    else:
        lost = _lose_first_answer(monkeypatch, final, instead=take_the_name)
    async with Tracker(hdfs_url, on_exists="error", retry=FAST) as tracker:
        handle = await tracker.dump({"obs": torch.randn(64, 32)}, NAME)
        with pytest.raises(DumpExistsError, match="exists"):
            await handle
        with pytest.raises(DumpExistsError):
            await tracker.flush(timeout=60)
        stats = tracker.statistics()
    assert len(lost) == 1
    assert stats.retries >= 1  # the retry, not the first attempt, met their file
    assert (stats.committed, stats.failed) == (0, 1)
    assert _read(hdfs_cluster, final) == theirs[0]
    _assert_no_temp_files(hdfs_cluster, root)


async def test_identical_file_without_a_lost_answer_is_refused(
    hdfs_cluster: HdfsCluster, hdfs_url: str
) -> None:
    # With no RENAME of this write unanswered, the file cannot be its own: the policy holds
    # even for the very same bytes.
    root = _path_of(hdfs_url)
    data = b"the same bytes, written by another writer"
    _client(hdfs_cluster).write(f"{root}/{NAME}.pth", data=data)
    storage = open_storage(hdfs_url)
    try:
        with pytest.raises(DumpExistsError):
            await storage.write_atomic(f"{NAME}.pth", BytesPayload(data), overwrite=False)
    finally:
        await storage.aclose()
    assert _read(hdfs_cluster, f"{root}/{NAME}.pth") == data
    _assert_no_temp_files(hdfs_cluster, root)
