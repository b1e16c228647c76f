from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from trajtrack.backends import Storage, open_storage
from trajtrack.backends.memory import MemoryStorage

from .contract import Plant, StorageContract


class TestMemoryContract(StorageContract):
    @pytest.fixture
    async def storage(self) -> AsyncIterator[Storage]:
        storage = open_storage("memory://contract/run")
        assert isinstance(storage, MemoryStorage)
        await storage.prepare()
        yield storage
        await storage.aclose()

    @pytest.fixture
    def plant(self, storage: MemoryStorage) -> Plant:
        async def put(path: str, data: bytes) -> None:
            storage.put_raw(path, data)

        return put


async def test_stores_are_shared_by_name() -> None:
    from trajtrack.tracker._payloads import BytesPayload

    writer = MemoryStorage("memory://shared/run1")
    reader = MemoryStorage("memory://shared/run1")
    other = MemoryStorage("memory://shared/run2")
    await writer.write_atomic("a.pth", BytesPayload(b"x"), overwrite=True)
    assert await reader.read("a.pth") == b"x"
    assert await other.list() == []
