"""The shards layout (tracker/_shards.py): packing, sealing, commits, failures, names."""

from __future__ import annotations

import errno
import io
import pickle
import tarfile
import threading
import zlib
from pathlib import Path
from typing import Any, BinaryIO

import anyio
import pytest
import torch

from trajtrack import (
    ConfigurationError,
    DumpExistsError,
    QueueFullError,
    SerializationError,
    StorageError,
    StorageUnavailableError,
    Tracker,
)
from trajtrack.backends.memory import MemoryStorage
from trajtrack.layouts.shards import SHARDS_DIR, is_shard_path
from trajtrack.tracker import _shard_spool as shard_spool, _shards as shards_module

SHARDS = Path(SHARDS_DIR)


def tiny(i: int) -> dict[str, Any]:
    return {"i": i, "x": torch.full((64,), float(i))}


def pickled(obj: Any, out: BinaryIO) -> None:
    """A deterministic serializer: the same object gives the same bytes in any layout.

    (Pickling a tensor itself is not: torch keys its storage by memory address.)
    """
    out.write(pickle.dumps({k: v.tolist() if torch.is_tensor(v) else v for k, v in obj.items()}))


def shards_of(dest: Path) -> list[Path]:
    return sorted((dest / SHARDS).glob("*.tar"))


def _names(data: bytes) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        return archive.getnames()


async def _until(condition: Any) -> None:
    with anyio.fail_after(30):  # a hang guard, not a timing
        while not condition():  # noqa: ASYNC110  (a condition of another thread's progress)
            await anyio.sleep(0.01)


def members(shard: Path) -> dict[str, bytes]:
    with tarfile.open(shard) as archive:
        return {m.name: archive.extractfile(m).read() for m in archive if m.isreg()}  # type: ignore[union-attr]


async def test_dumps_are_members_named_and_filled_as_the_files_layout_would(
    tmp_path: Path,
) -> None:
    objects = {f"step{i // 4}/sample{i % 4}": tiny(i) for i in range(12)}
    async with Tracker(tmp_path / "files", serializer=pickled) as files:
        for name, obj in objects.items():
            await files.dump(obj, name)
    async with Tracker(tmp_path / "shards", serializer=pickled, layout="shards") as sharded:
        handles = [await sharded.dump(obj, name) for name, obj in objects.items()]
        await sharded.flush(timeout=30)
        records = [await h for h in handles]
    (shard,) = shards_of(tmp_path / "shards")
    packed = members(shard)
    assert list(packed) == [f"{name}.pth" for name in objects]  # dump order, files' names
    for name in objects:
        assert packed[f"{name}.pth"] == (tmp_path / "files" / f"{name}.pth").read_bytes()
    raw = shard.read_bytes()
    for record in records:  # the record locates each member's bytes exactly
        assert record.shard == f"{SHARDS_DIR}/{shard.name}"
        assert record.offset is not None and record.offset % 512 == 0
        data = raw[record.offset : record.offset + record.size]
        assert data == packed[record.path]
        assert record.checksum == f"crc32:{zlib.crc32(data):08x}"
    extracted = tmp_path / "x"
    with tarfile.open(shard) as archive:
        archive.extractall(extracted, filter="data")
    assert sorted(p.relative_to(extracted).as_posix() for p in extracted.rglob("*.pth")) == sorted(
        f"{name}.pth" for name in objects
    )


async def test_a_shard_is_sealed_by_size(tmp_path: Path) -> None:
    async with Tracker(tmp_path, layout="shards", shard_max_bytes=8_000, shard_max_age=600) as t:
        for i in range(30):
            await t.dump(tiny(i), f"d{i}")
        await t.flush(timeout=30)
    shards = shards_of(tmp_path)
    assert len(shards) >= 3
    assert sum(len(members(s)) for s in shards) == 30
    for shard in shards[:-1]:  # sealed once full: at most one member past the limit
        assert shard.stat().st_size < 8_000 + 4_096


async def test_a_shard_is_sealed_by_age_without_a_flush(tmp_path: Path) -> None:
    async with Tracker(tmp_path, layout="shards", shard_max_age=0.2) as tracker:
        handle = await tracker.dump(tiny(1), "old")
        with anyio.fail_after(30):  # a hang guard only: the age seal commits it
            record = await handle
        assert record.shard is not None
        assert len(shards_of(tmp_path)) == 1


async def test_flush_commits_everything_so_far_and_close_the_rest(tmp_path: Path) -> None:
    tracker = Tracker(tmp_path, layout="shards", shard_max_age=600)
    await tracker.start()
    first = [await tracker.dump(tiny(i), f"a{i}") for i in range(5)]
    assert not any(h.done() for h in first)  # in the open shard: not committed yet
    await tracker.flush(timeout=30)
    assert all(h.done() and h.exception() is None for h in first)
    later = [await tracker.dump(tiny(i), f"b{i}") for i in range(5)]
    await tracker.aclose(timeout=30)
    assert all(h.done() and h.exception() is None for h in later)
    assert len(shards_of(tmp_path)) == 2


async def test_a_dump_larger_than_a_shard_gets_one_of_its_own(tmp_path: Path) -> None:
    async with Tracker(tmp_path, layout="shards", shard_max_bytes=50_000) as tracker:
        small = await tracker.dump(tiny(0), "small")
        big = await tracker.dump({"x": torch.zeros(100_000)}, "big")
        await tracker.flush(timeout=30)
        small_record, big_record = await small, await big
    assert small_record.shard != big_record.shard
    assert list(members(tmp_path / big_record.shard)) == ["big.pth"]  # type: ignore[operator]
    assert (
        torch.load(io.BytesIO(members(tmp_path / big_record.shard)["big.pth"]))["x"].numel()
        == 100_000
    )  # type: ignore[operator]


class _ShardWrites:
    """A fault on shard commits: block until released, or fail the first *n* with *error*."""

    def __init__(self, fail: int = 0) -> None:
        self.fail = fail
        self.release = threading.Event()
        self.release.set()
        self.entered = threading.Event()

    def __call__(self, operation: str, path: str) -> None:
        if operation != "write" or not is_shard_path(path):
            return
        self.entered.set()
        self.release.wait(timeout=60)
        if self.fail > 0:
            self.fail -= 1
            raise StorageUnavailableError("the DataNode went away")


def _memory(fault: Any, **options: Any) -> Tracker:
    storage = MemoryStorage("memory://shards/run", fault=fault)
    return Tracker("memory://shards/run", storage=storage, layout="shards", **options)


async def test_a_handle_resolves_only_once_its_shard_is_committed() -> None:
    fault = _ShardWrites()
    fault.release.clear()
    async with _memory(fault, shard_max_age=600) as tracker:
        handle = await tracker.dump(tiny(0), "waits")
        flushing = anyio.Event()

        async def flush() -> None:
            await tracker.flush(timeout=30)
            flushing.set()

        async with anyio.create_task_group() as group:
            group.start_soon(flush)
            await anyio.to_thread.run_sync(fault.entered.wait, 30)
            assert not handle.done()  # spooled and sealed, but not yet committed
            fault.release.set()
        assert flushing.is_set()
        assert (await handle).shard is not None


async def test_a_failed_commit_is_retried_with_the_spooled_shard() -> None:
    fault = _ShardWrites(fail=2)
    async with _memory(fault) as tracker:
        handles = [await tracker.dump(tiny(i), f"r{i}") for i in range(3)]
        await tracker.flush(timeout=60)
        records = [await h for h in handles]
        stats = tracker.statistics()
    assert stats.retries == 2
    assert len({r.shard for r in records}) == 1
    shard = MemoryStorage("memory://shards/run")
    data = await shard.read(records[0].shard)  # type: ignore[arg-type]
    assert [r.path for r in records] == _names(data)


def _picky(obj: Any, out: BinaryIO) -> None:
    if obj.get("bad"):
        raise TypeError("this one cannot be serialized")
    torch.save(obj, out)


async def test_a_dump_that_fails_to_serialize_fails_alone() -> None:
    async with _memory(None, serializer=_picky) as tracker:
        before = await tracker.dump(tiny(0), "before")
        bad = await tracker.dump({"bad": True}, "bad")
        after = await tracker.dump(tiny(2), "after")
        with pytest.raises(SerializationError):
            await tracker.flush(timeout=30)
        with pytest.raises(SerializationError, match="cannot be serialized"):
            await bad
        first, last = await before, await after
    assert first.shard == last.shard  # the failed member left no trace in the shard
    data = await MemoryStorage("memory://shards/run").read(first.shard)  # type: ignore[arg-type]
    assert _names(data) == ["before.pth", "after.pth"]
    assert last.offset is not None
    assert torch.load(io.BytesIO(data[last.offset : last.offset + last.size]))["i"] == 2


async def test_a_shard_in_the_making_counts_against_the_byte_budget() -> None:
    async with _memory(None, shard_max_age=600, max_pending_bytes=20_000, full_policy="raise") as t:
        for i in range(5):
            await t.dump(tiny(i), f"p{i}")
        # Taken off the queue first, then laid out once the shard's spool exists (a thread
        # hop later): their item slots are freed then, not when the queue empties.
        await _until(lambda: t.statistics().queued_items == 0 == t.statistics().pending_items)
        stats = t.statistics()
        assert stats.pending_items == 0  # in the spool: their item slots are free
        assert stats.pending_bytes > 0  # their bytes count until the shard is committed
        with pytest.raises(QueueFullError):
            for i in range(100):
                await t.dump(tiny(i), f"q{i}")
        await t.flush(timeout=30)
        assert t.statistics().pending_bytes == 0


async def test_on_exists_error_refuses_names_this_tracker_or_the_record_has(
    tmp_path: Path,
) -> None:
    async with Tracker(tmp_path, layout="shards", on_exists="error") as tracker:
        await tracker.dump(tiny(0), "once")
        again = await tracker.dump(tiny(1), "once")
        with anyio.fail_after(30), pytest.raises(DumpExistsError):
            await again
        with pytest.raises(DumpExistsError):
            await tracker.flush(timeout=30)
    async with Tracker(tmp_path, layout="shards", on_exists="error") as later:
        refused = await later.dump(tiny(2), "once")
        fresh = await later.dump(tiny(3), "fresh")
        with anyio.fail_after(30), pytest.raises(DumpExistsError):
            await refused
        with pytest.raises(DumpExistsError):
            await later.flush(timeout=30)
        assert (await fresh).path == "fresh.pth"


class _FullDisk:
    """The spool's ``writev`` loop: once ``fail`` is set, the next write stops half-way with
    ENOSPC (a full disk)."""

    fail = threading.Event()

    def __init__(self, real: Any) -> None:
        self._real = real

    def __call__(self, fd: int, pieces: list[Any]) -> None:
        if self.fail.is_set():
            self.fail.clear()
            self._real(fd, pieces[: max(1, len(pieces) // 2)])
            raise OSError(errno.ENOSPC, "No space left on device")
        self._real(fd, pieces)


@pytest.fixture
def full_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """A spool write that fails half-way (in the worker thread that writes it)."""
    monkeypatch.setattr(shard_spool, "_write_all", _FullDisk(shard_spool._write_all))


async def test_a_spool_write_that_fails_fails_its_dumps_and_leaves_no_trace(
    monkeypatch: pytest.MonkeyPatch, full_disk: None, tmp_path: Path
) -> None:
    monkeypatch.setattr(shards_module, "WRITE_AT", 1)  # each batch written at once
    # A local destination: the spool file itself is renamed into place, whole.
    async with Tracker(tmp_path / "run", layout="shards", shard_max_age=600) as tracker:
        before = await tracker.dump(tiny(0), "before")
        await _until(lambda: tracker.statistics().pending_items == 0)  # in the spool
        _FullDisk.fail.set()
        lost = [tracker.dump_nowait(tiny(i), f"lost{i}") for i in range(10)]  # one batch
        for handle in lost:
            with anyio.fail_after(30), pytest.raises(StorageError, match="no space left"):
                await handle
        after = await tracker.dump(tiny(9), "after")
        with pytest.raises(StorageError):
            await tracker.flush(timeout=30)
        first, last = await before, await after
        stats = tracker.statistics()
        assert (stats.pending_items, stats.pending_bytes, stats.failed) == (0, 0, 10)
    assert first.shard == last.shard  # the failed batch left no trace in the shard
    assert first.shard is not None and last.offset is not None
    data = await anyio.Path(tmp_path / "run" / first.shard).read_bytes()
    assert _names(data) == ["before.pth", "after.pth"]
    assert torch.load(io.BytesIO(data[last.offset : last.offset + last.size]))["i"] == 9
    end = last.offset + -(-last.size // 512) * 512
    assert data[end:] == bytes(1024)  # the end of the archive, and nothing after it


def test_layout_options_are_checked() -> None:
    with pytest.raises(ConfigurationError, match="layout"):
        Tracker("memory://x", layout="zip")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="shard_max_bytes"):
        Tracker("memory://x", layout="shards", shard_max_bytes=0)
    with pytest.raises(ConfigurationError, match="shard_max_age"):
        Tracker("memory://x", layout="shards", shard_max_age=0)


async def test_dumps_laid_out_but_not_written_fail_when_their_seal_cannot_write_them(
    full_disk: None,
) -> None:
    async with _memory(None, shard_max_age=600) as tracker:
        waiting = [await tracker.dump(tiny(i), f"w{i}") for i in range(5)]  # under WRITE_AT
        await _until(lambda: tracker.statistics().pending_items == 0)
        _FullDisk.fail.set()  # the seal's write of them fails
        with pytest.raises(StorageError, match="no space left"):
            await tracker.flush(timeout=30)
        for handle in waiting:
            with pytest.raises(StorageError):
                await handle
        assert tracker.state.value == "running"  # the tracker goes on
        later = await tracker.dump(tiny(7), "later")
        await tracker.flush(timeout=30)
        record = await later
    data = await MemoryStorage("memory://shards/run").read(record.shard)  # type: ignore[arg-type]
    assert _names(data) == ["later.pth"]


class _FailingEnd:
    """A spool whose end-of-archive write fails."""

    def __init__(self, file: BinaryIO) -> None:
        self._file = file

    def write(self, data: bytes) -> int:
        if bytes(data) == bytes(len(data)) and len(data) == 1024:  # END_OF_ARCHIVE
            raise OSError(errno.EIO, "Input/output error")
        return self._file.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)


async def test_a_shard_whose_end_cannot_be_written_fails_its_dumps_not_the_tracker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = shards_module.create_spool
    monkeypatch.setattr(shards_module, "create_spool", lambda path: _FailingEnd(real(path)))
    async with _memory(None, shard_max_age=600) as tracker:
        handle = await tracker.dump(tiny(0), "lost")
        with pytest.raises(StorageError, match="Input/output error"):
            await tracker.flush(timeout=30)
        with pytest.raises(StorageError):
            await handle
        assert tracker.state.value == "running"
        assert tracker.statistics().failed == 1
    listed = await MemoryStorage("memory://shards/run").list("")
    assert [f.path for f in listed if is_shard_path(f.path)] == []  # nothing committed


async def test_laid_out_members_are_written_before_a_member_a_thread_appends(
    tmp_path: Path,
) -> None:
    odd = {"s": {1, 2, 3}}  # not plain data: serialized and appended by a thread
    async with Tracker(tmp_path, layout="shards", shard_max_age=600) as tracker:
        handles = [
            tracker.dump_nowait(tiny(0), "a"),
            await tracker.dump(odd, "b"),
            tracker.dump_nowait(tiny(2), "c"),
        ]
        await tracker.flush(timeout=30)
        records = [await h for h in handles]
    assert len({r.shard for r in records}) == 1
    (shard,) = shards_of(tmp_path)
    assert _names(shard.read_bytes()) == ["a.pth", "b.pth", "c.pth"]
    data = shard.read_bytes()
    loaded = [
        torch.load(io.BytesIO(data[r.offset : r.offset + r.size]), weights_only=False)  # type: ignore[operator]
        for r in records
    ]
    assert loaded[0]["i"] == 0 and loaded[1] == odd and loaded[2]["i"] == 2


async def test_a_member_that_needs_no_padding_is_written(tmp_path: Path) -> None:
    # Ready bytes whose size is a multiple of 512 (a tar block) end with an empty padding
    # piece; the spool's write used to retry that empty piece forever.
    data = bytes(range(256)) * 4  # 1,024 bytes
    async with Tracker(tmp_path, layout="shards") as tracker:
        handle = await tracker.dump_serialized(data, "exact")
        with anyio.fail_after(30):  # a hang guard, not a timing
            await tracker.flush()
        record = await handle
    (shard,) = shards_of(tmp_path)
    assert members(shard) == {"exact.pth": data}
    assert record.checksum == f"crc32:{zlib.crc32(data):08x}"


async def test_large_ready_bytes_are_checksummed_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ready bytes (the Ray adapter's) up to a shard's size join the open shard; their CRC-32
    # over many megabytes on the loop would stall it. Small ones stay on the loop's route.
    loop_thread = threading.get_ident()
    on_loop: list[int] = []
    real_crc32 = zlib.crc32

    def watched(data: Any, value: int = 0) -> int:
        if threading.get_ident() == loop_thread:
            on_loop.append(memoryview(data).nbytes)
        return real_crc32(data, value)

    monkeypatch.setattr(zlib, "crc32", watched)
    big = bytes(range(256)) * (12 << 12)  # 12 MiB
    small = b"s" * 1000
    async with Tracker(tmp_path, layout="shards", shard_max_bytes=64 << 20) as tracker:
        handles = [
            await tracker.dump_serialized(small, "small"),
            await tracker.dump_serialized(big, "big"),
        ]
        with anyio.fail_after(60):  # a hang guard, not a timing
            await tracker.flush()
        records = [await h for h in handles]
    assert max(on_loop, default=0) <= 1 << 20
    assert len({r.shard for r in records}) == 1  # both in the open shard, in dump order
    (shard,) = shards_of(tmp_path)
    assert members(shard) == {"small.pth": small, "big.pth": big}
    assert [r.checksum for r in records] == [
        f"crc32:{real_crc32(small):08x}",
        f"crc32:{real_crc32(big):08x}",
    ]
