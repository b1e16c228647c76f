"""The storage contract against a fake WebHDFS server: the backend's logic, without Java.

The real cluster runs the same contract in tests/hdfs/test_hdfs_contract.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import anyio.to_thread
import pytest
from hdfs import InsecureClient

from _support.fake_webhdfs import fake_webhdfs
from trajtrack.backends import Storage, open_storage
from trajtrack.backends.webhdfs import WebHdfsStorage

from .contract import Plant, StorageContract


@pytest.fixture
def webhdfs_base() -> Iterator[str]:
    with fake_webhdfs() as base:
        yield base


class TestFakeWebHdfsContract(StorageContract):
    @pytest.fixture
    async def storage(self, webhdfs_base: str) -> AsyncIterator[Storage]:
        storage = open_storage(f"{webhdfs_base}/user/test/run", user="test", timeout=(5, 30))
        await storage.prepare()
        yield storage
        await storage.aclose()

    @pytest.fixture
    def plant(self, storage: WebHdfsStorage) -> Plant:
        # Straight into the server's namespace, past the backend (a crashed writer's file).
        client = InsecureClient(storage.namenodes[0], user="test")

        async def put(path: str, data: bytes) -> None:
            target = f"{storage.root}/{path}"
            await anyio.to_thread.run_sync(lambda: client.write(target, data=data, overwrite=True))

        return put
