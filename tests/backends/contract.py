"""The storage contract: every backend passes the same tests.

A backend's test module subclasses :class:`StorageContract` and provides a ``storage`` fixture
that yields a prepared, empty :class:`trajtrack.backends.Storage`, and a ``plant`` fixture
(:data:`Plant`) that puts a file into it without going through it.
"""

from __future__ import annotations

import zlib
from collections.abc import Awaitable, Callable

import anyio
import pytest

from trajtrack import DumpExistsError, StorageNotFoundError
from trajtrack.backends import Storage, WriteResult
from trajtrack.layouts.names import (
    WriterIdentity,
    is_internal_path,
    parse_temp_path,
    temp_path_for,
)
from trajtrack.tracker._payloads import BytesPayload


class _Exploding:
    """A payload that writes some bytes, then fails (a serializer crashing mid-write)."""

    nbytes = 10

    def write_to(self, out: object) -> None:
        out.write(b"partial")  # type: ignore[attr-defined]
        raise RuntimeError("serializer exploded")


Plant = Callable[[str, bytes], Awaitable[None]]
"""``await plant(path, data)``: put bytes at *path* behind the storage's back (as a crashed
writer, or a person copying files in, would)."""


class StorageContract:
    async def test_write_then_read(self, storage: Storage) -> None:
        data = b"hello trajectories"
        result = await storage.write_atomic("a/b/c.pth", BytesPayload(data), overwrite=True)
        assert result.size == len(data)
        assert result.checksum == crc32_of(data)
        assert await storage.read("a/b/c.pth") == data

    async def test_list_is_recursive_and_relative(self, storage: Storage) -> None:
        for path, data in {"x.pth": b"1", "d/y.pth": b"22", "d/e/z.pth": b"333"}.items():
            await storage.write_atomic(path, BytesPayload(data), overwrite=True)
        listed = {info.path: info.size for info in await storage.list()}
        assert listed == {"x.pth": 1, "d/y.pth": 2, "d/e/z.pth": 3}
        below = {info.path for info in await storage.list("d")}
        assert below == {"d/y.pth", "d/e/z.pth"}

    async def test_stat(self, storage: Storage) -> None:
        await storage.write_atomic("s.pth", BytesPayload(b"12345"), overwrite=True)
        info = await storage.stat("s.pth")
        assert info is not None
        assert info.size == 5
        assert await storage.stat("missing.pth") is None

    async def test_overwrite_replaces(self, storage: Storage) -> None:
        await storage.write_atomic("o.pth", BytesPayload(b"old"), overwrite=True)
        await storage.write_atomic("o.pth", BytesPayload(b"newer"), overwrite=True)
        assert await storage.read("o.pth") == b"newer"

    async def test_no_overwrite_refuses_and_keeps_the_old_file(self, storage: Storage) -> None:
        await storage.write_atomic("k.pth", BytesPayload(b"first"), overwrite=False)
        with pytest.raises(DumpExistsError):
            await storage.write_atomic("k.pth", BytesPayload(b"second"), overwrite=False)
        assert await storage.read("k.pth") == b"first"
        assert [i.path for i in await storage.list()] == ["k.pth"]  # no temp file left

    async def test_read_missing(self, storage: Storage) -> None:
        with pytest.raises(StorageNotFoundError):
            await storage.read("nope.pth")
        with pytest.raises(FileNotFoundError):  # also a built-in FileNotFoundError
            await storage.read("nope.pth")

    async def test_delete(self, storage: Storage) -> None:
        await storage.write_atomic("del.pth", BytesPayload(b"x"), overwrite=True)
        await storage.delete("del.pth")
        assert await storage.stat("del.pth") is None
        await storage.delete("del.pth")  # missing: not an error

    async def test_failed_write_leaves_nothing(self, storage: Storage) -> None:
        with pytest.raises(RuntimeError, match="exploded"):
            await storage.write_atomic("f/boom.pth", _Exploding(), overwrite=True)
        assert await storage.stat("f/boom.pth") is None
        assert [i.path for i in await storage.list()] == []

    async def test_temp_files_are_listed_hidden_and_parseable(
        self, storage: Storage, plant: Plant
    ) -> None:
        # What a writer killed between creating its temporary file and the rename leaves
        # behind: list() must show it (the sweep finds it there), recognisable as internal
        # and as that writer's, while the dumps beside it are not.
        dead = WriterIdentity("somehost", 4242, 0, 0, 1)
        temp = temp_path_for("t/dump.pth", dead)
        await plant(temp, b"partial")
        await storage.write_atomic("t/other.pth", BytesPayload(b"x"), overwrite=True)
        listed = {info.path for info in await storage.list()}
        assert listed == {temp, "t/other.pth"}
        assert temp.startswith("t/.dump.pth")
        assert is_internal_path(temp)
        assert parse_temp_path(temp) == ("somehost", 4242)
        assert not is_internal_path("t/other.pth")
        assert parse_temp_path("t/other.pth") is None

    async def test_write_many_reports_each_item_on_its_own(self, storage: Storage) -> None:
        items = [
            ("m/a.pth", BytesPayload(b"aa")),
            ("m/boom.pth", _Exploding()),
            ("m/b.pth", BytesPayload(b"bbb")),
        ]
        seen: list[tuple[int, object]] = []
        outcomes = await storage.write_atomic_many(
            items, overwrite=True, done=lambda i, outcome: seen.append((i, outcome))
        )
        assert [type(o).__name__ for o in outcomes] == [
            "WriteResult",
            "RuntimeError",
            "WriteResult",
        ]
        assert outcomes[0] == WriteResult(2, crc32_of(b"aa"))
        assert outcomes[2] == WriteResult(3, crc32_of(b"bbb"))
        assert sorted(seen, key=lambda pair: pair[0]) == list(enumerate(outcomes))
        assert {i.path for i in await storage.list("m")} == {"m/a.pth", "m/b.pth"}
        refused = await storage.write_atomic_many(
            [("m/a.pth", BytesPayload(b"x"))], overwrite=False
        )
        assert isinstance(refused[0], DumpExistsError)
        assert await storage.read("m/a.pth") == b"aa"

    async def test_ranged_reads(self, storage: Storage) -> None:
        data = bytes(range(256)) * 4096  # 1 MiB
        await storage.write_atomic("r/blob.bin", BytesPayload(data), overwrite=True)
        for offset, length in [(0, 10), (1000, 4096), (len(data) - 7, 7), (12345, 0), (5, 300000)]:
            assert (
                await storage.read_range("r/blob.bin", offset, length)
                == data[offset : offset + length]
            ), (offset, length)
        assert await storage.read_range("r/blob.bin", len(data) - 3, 100) == data[-3:]
        assert await storage.read_range("r/blob.bin", len(data), 10) == b""
        with pytest.raises(StorageNotFoundError):
            await storage.read_range("r/missing.bin", 0, 10)
        with pytest.raises(ValueError, match="offset"):
            await storage.read_range("r/blob.bin", -1, 10)

    async def test_large_payload(self, storage: Storage) -> None:
        data = bytes(range(256)) * (5 * 4096)  # 5 MiB
        result = await storage.write_atomic("big.pth", BytesPayload(data), overwrite=True)
        assert result.size == len(data)
        assert await storage.read("big.pth") == data

    async def test_concurrent_writes(self, storage: Storage) -> None:
        async def write(i: int) -> None:
            await storage.write_atomic(f"c/{i}.pth", BytesPayload(b"%d" % i), overwrite=True)

        async with anyio.create_task_group() as group:
            for i in range(20):
                group.start_soon(write, i)
        listed = {info.path for info in await storage.list("c")}
        assert listed == {f"c/{i}.pth" for i in range(20)}
        assert await storage.read("c/7.pth") == b"7"

    async def test_prepare_is_idempotent(self, storage: Storage) -> None:
        await storage.prepare()
        await storage.write_atomic("p.pth", BytesPayload(b"ok"), overwrite=True)
        await storage.prepare()
        assert await storage.read("p.pth") == b"ok"


def crc32_of(data: bytes) -> str:
    """The record's checksum format, computed with zlib itself (not the library's helper)."""
    return f"crc32:{zlib.crc32(data):08x}"
