"""The storage contract against the real cluster, plus WebHDFS specifics seen only there."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from hdfs import InsecureClient

from _support.hdfs_cluster import HdfsCluster
from backends.contract import Plant, StorageContract
from trajtrack import ConfigurationError, StorageError, StoragePermissionError
from trajtrack._exceptions import StorageUnavailableError
from trajtrack.backends import Storage, _webhdfs_io as webhdfs_io, open_storage
from trajtrack.backends.webhdfs import WebHdfsStorage
from trajtrack.tracker._payloads import BytesPayload, FilePayload

pytestmark = pytest.mark.hdfs


class TestWebHdfsContract(StorageContract):
    @pytest.fixture
    async def storage(self, hdfs_url: str) -> AsyncIterator[Storage]:
        storage = open_storage(hdfs_url, timeout=(5, 60))
        await storage.prepare()
        yield storage
        await storage.aclose()

    @pytest.fixture
    def plant(self, storage: WebHdfsStorage, hdfs_cluster: HdfsCluster) -> Plant:
        client = InsecureClient(
            f"http://127.0.0.1:{hdfs_cluster.http_port}", user=hdfs_cluster.superuser
        )

        async def put(path: str, data: bytes) -> None:
            target = f"{storage.root}/{path}"
            await anyio.to_thread.run_sync(lambda: client.write(target, data=data, overwrite=True))

        return put


async def test_hdfs_url_resolved_through_the_cluster_configuration(
    hdfs_cluster: HdfsCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HADOOP_CONF_DIR", str(hdfs_cluster.conf_dir))
    # open_storage reads the Hadoop configuration files: in a thread, as the tracker does
    url = f"{hdfs_cluster.hdfs_url}/tests/resolved"
    storage = await anyio.to_thread.run_sync(open_storage, url)
    assert isinstance(storage, WebHdfsStorage)
    assert storage.namenodes == (f"http://127.0.0.1:{hdfs_cluster.http_port}",)
    await storage.prepare()
    await storage.write_atomic("r.pth", BytesPayload(b"via hdfs://"), overwrite=True)
    assert await storage.read("r.pth") == b"via hdfs://"
    await storage.aclose()


async def test_destination_that_is_a_file(hdfs_url: str) -> None:
    parent = open_storage(hdfs_url)
    await parent.prepare()
    await parent.write_atomic("afile", BytesPayload(b"x"), overwrite=True)
    with pytest.raises(ConfigurationError, match="not a directory"):
        await open_storage(f"{hdfs_url}/afile").prepare()
    await parent.aclose()


async def test_overwrite_onto_a_directory_fails_and_cleans_up(hdfs_url: str) -> None:
    storage = open_storage(hdfs_url)
    await storage.prepare()
    await storage.write_atomic("d/inner.pth", BytesPayload(b"x"), overwrite=True)
    with pytest.raises(StorageError, match="directories") as caught:
        await storage.write_atomic("d", BytesPayload(b"y"), overwrite=True)
    assert not caught.value.retryable
    assert [info.path for info in await storage.list()] == ["d/inner.pth"]
    await storage.aclose()


async def test_user_without_access_is_refused_at_once(
    hdfs_cluster: HdfsCluster, hdfs_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    owner = open_storage(hdfs_url)
    await owner.prepare()  # created by the superuser, mode 755
    monkeypatch.setenv("HADOOP_USER_NAME", "intruder")
    intruder = open_storage(hdfs_url)
    await intruder.prepare()  # the directory exists: reading its status is allowed
    with pytest.raises(StoragePermissionError) as caught:
        await intruder.write_atomic("x.pth", BytesPayload(b"x"), overwrite=True)
    assert caught.value.remote_exception == "AccessControlException"
    assert "intruder" in str(caught.value)
    with pytest.raises(StoragePermissionError):
        await open_storage(f"{hdfs_url}/sub", user="intruder").prepare()
    assert await owner.list() == []
    await owner.aclose()


async def test_a_file_payload_is_uploaded_from_its_own_file_and_again_after_release(
    hdfs_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A shard's spool (or a large dump's) is a local file already: the backend reads it
    # instead of copying it into a spool of its own, and a retry reads it again even once
    # the payload has let go of its name.
    data = os.urandom(3 << 20)
    spool = tmp_path / "spool"
    spool.write_bytes(data + b"not part of the payload")
    payload = FilePayload(str(spool), len(data), checksum="c0ffee00")

    def no_copy(*args: object, **kwargs: object) -> None:
        raise AssertionError("the payload was copied into a spool of the backend's")

    monkeypatch.setattr(webhdfs_io.tempfile, "TemporaryFile", no_copy)
    storage = open_storage(hdfs_url, timeout=(5, 60))
    await storage.prepare()
    real_publish = WebHdfsStorage._publish
    failures = [StorageUnavailableError("the NameNode went away (test)")]

    def publish_failing_once(self: WebHdfsStorage, *args: Any) -> None:
        if failures:
            raise failures.pop()
        real_publish(self, *args)

    monkeypatch.setattr(WebHdfsStorage, "_publish", publish_failing_once)
    with pytest.raises(StorageUnavailableError):
        await storage.write_atomic("big.pth", payload, overwrite=True)
    await anyio.to_thread.run_sync(payload.release)  # its name goes; the file stays open
    assert not await anyio.Path(spool).exists()
    result = await storage.write_atomic("big.pth", payload, overwrite=True)
    assert (result.size, result.checksum) == (len(data), "c0ffee00")
    assert await storage.read("big.pth") == data
    await storage.aclose()
