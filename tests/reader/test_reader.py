"""The reader API: listing from records (merged over writers), fallback, loading, iteration."""

from __future__ import annotations

import asyncio
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

import trajtrack
from _support.expect import assert_same
from trajtrack import DumpLoadError, StorageNotFoundError, UnsafeLoadError
from trajtrack.backends import FileInfo, register_backend
from trajtrack.backends.memory import MemoryStorage
from trajtrack.layouts.records import RECORDS_PREFIX, DumpRecord, encode_segment
from trajtrack.reader import SyncRun, open_run
from trajtrack.rollout import RolloutBatch, RolloutSample


class Evil:
    def __reduce__(self) -> tuple[object, ...]:
        return (print, ("owned",))


async def test_list_merges_writers_latest_wins(tmp_path: Path) -> None:
    dest = str(tmp_path)
    async with trajtrack.Tracker(dest) as first:
        await (await first.dump(torch.zeros(2), "shared"))
        await (await first.dump(torch.zeros(1), "only_first"))
    async with trajtrack.Tracker(dest) as second:
        await (await second.dump(torch.ones(3), "shared"))
    async with open_run(dest) as run:
        dumps = {d.name: d for d in await run.list()}
        assert set(dumps) == {"shared", "only_first"}
        assert dumps["shared"].writer != dumps["only_first"].writer
        assert dumps["shared"].size == (tmp_path / "shared.pth").stat().st_size
        assert torch.equal(await run.load("shared"), torch.ones(3))
        assert (await run.scan()).segments == 2


async def test_unrecorded_files_and_temp_files(tmp_path: Path) -> None:
    async with trajtrack.Tracker(str(tmp_path)) as tracker:
        await (await tracker.dump({"a": 1}, "step0/a"))
    torch.save({"b": 2}, tmp_path / "step0" / "b.pth")
    (tmp_path / "step0" / ".b.pth.tmp~host~1~abcd").write_bytes(b"x")
    async with open_run(str(tmp_path)) as run:
        dumps = {d.name: d for d in await run.list()}
        assert set(dumps) == {"step0/a", "step0/b"}
        assert dumps["step0/a"].recorded and not dumps["step0/b"].recorded
        assert dumps["step0/b"].checksum is None
        assert await run.load("step0/b") == {"b": 2}
        assert [d.name for d in await run.list("*/b")] == ["step0/b"]


class _NoTimes(MemoryStorage):
    """A storage that lists no modification times (some object stores)."""

    async def list(self, prefix: str = "") -> list[FileInfo]:
        return [FileInfo(f.path, f.size) for f in await super().list(prefix)]


@pytest.mark.parametrize("untimed", [False, True])
async def test_dumps_are_listed_in_dump_order_time_then_name(untimed: bool) -> None:
    # Records out of order, two sharing a time; an unrecorded file without a time goes last.
    records = [
        DumpRecord(name, f"{name}.pth", 1, "crc32:00000000", "h", 1, 0, "w", time)
        for name, time in [("c", 2.0), ("b", 1.0), ("a", 2.0), ("z", 0.5)]
    ]
    storage = _NoTimes("memory://order/run")
    storage.put_raw(f"{RECORDS_PREFIX}/w-000000.jsonl", encode_segment(records))
    for record in records:
        storage.put_raw(record.path, b"x")
    if untimed:
        storage.put_raw("unrecorded.pth", b"y")
    async with open_run("memory://order/run", storage=storage) as run:
        dumps = await run.list()
    assert [d.name for d in dumps] == ["z", "b", "a", "c"] + (["unrecorded"] if untimed else [])
    assert dumps[-1].time is None if untimed else dumps[-1].recorded
    with pytest.raises(AttributeError):
        dumps[0].size = 5  # type: ignore[misc]  # a listing's entries are immutable
    assert dumps[0]._replace(size=5).size == 5 and dumps[0].size == 1


async def test_memory_url_iteration_and_read_bytes() -> None:
    async with trajtrack.Tracker("memory://reader/run") as tracker:
        for i in range(3):
            await (await tracker.dump({"i": torch.tensor(i)}, f"d{i}"))
    async with open_run("memory://reader/run") as run:
        seen = [(info.name, int(obj["i"])) async for info, obj in run]
        assert seen == [("d0", 0), ("d1", 1), ("d2", 2)]
        data = await run.read_bytes("d1")
        info = await run.info("d1")
        assert len(data) == info.size
        assert crc32_of(data) == info.checksum


async def test_rollout_types_load_safely(tmp_path: Path) -> None:
    sample = RolloutSample(
        full_batch=RolloutBatch(
            {"responses": torch.tensor([[1, 2]])},
            {"uid": np.array(["u"], dtype=object)},
            {"k": np.float64(1.5)},
        ),
        sample_id="s",
    )
    async with trajtrack.Tracker(str(tmp_path)) as tracker:
        await (await tracker.dump(sample, "sample"))
    async with open_run(str(tmp_path)) as run:
        assert_same(await run.load("sample"), sample)


async def test_unsafe_and_corrupt_dumps(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    torch.save({"x": Evil()}, tmp_path / "evil.pth")
    (tmp_path / "junk.pth").write_bytes(b"\x00garbage")
    async with open_run(str(tmp_path)) as run:
        with pytest.raises(UnsafeLoadError, match=r"builtins\.print"):
            await run.load("evil")
        with pytest.raises(DumpLoadError):
            await run.load("junk")
        with pytest.raises(StorageNotFoundError):
            await run.load("absent")
        assert await run.load("evil", unsafe=True) == {"x": None}
    assert "unsafe=True" in caplog.text


async def test_corrupt_record_lines_are_skipped_and_counted() -> None:
    async with trajtrack.Tracker("memory://rec/run") as tracker:
        await (await tracker.dump(1, "one"))
    MemoryStorage("memory://rec/run").put_raw(".trajtrack/records/zz-000001.jsonl", b"{not json\n")
    async with open_run("memory://rec/run") as run:
        listing = await run.scan()
        assert [d.name for d in listing.dumps] == ["one"]
        assert listing.bad_record_lines == 1


def test_sync_run(tmp_path: Path) -> None:
    torch.save(torch.arange(3), tmp_path / "x.pth")
    with SyncRun(str(tmp_path)) as run:
        assert [d.name for d in run.list()] == ["x"]
        assert torch.equal(run.load("x"), torch.arange(3))
        assert [name for name, _ in ((i.name, o) for i, o in run)] == ["x"]


async def test_the_storage_is_opened_off_the_event_loop() -> None:
    # Opening may read Hadoop configuration files: never on the loop (like the tracker).
    seen: list[bool] = []

    def factory(url: str, **_options: object) -> MemoryStorage:
        try:
            asyncio.get_running_loop()
            seen.append(True)  # called on the event loop's thread
        except RuntimeError:
            seen.append(False)
        return MemoryStorage("memory://" + url.partition("://")[2])

    register_backend("probe", factory)
    run = open_run("probe://offloop/run")
    assert seen == []  # nothing opened before it is used
    async with run:
        await run.list()
    async with open_run("probe://offloop/run") as again:
        await again.list()
    assert seen == [False, False]


def crc32_of(data: bytes) -> str:
    """The record's checksum format, computed with zlib itself (not the library's helper)."""
    return f"crc32:{zlib.crc32(data):08x}"


@pytest.mark.parametrize("layout", ["files", "shards"])
async def test_listing_parses_and_merges_off_the_event_loop(
    tmp_path: Path, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Tens of microseconds a dump: seconds of a big run that must not stall the caller's loop.
    import threading

    from trajtrack.reader import _record_set

    async with trajtrack.Tracker(tmp_path, layout=layout) as tracker:  # type: ignore[arg-type]
        for i in range(5):
            await tracker.dump({"x": torch.zeros(3)}, f"d{i}")
    (tmp_path / "unrecorded.pth").write_bytes(b"a file no record describes")
    threads: dict[str, set[int]] = {"decode": set(), "merge": set()}
    decode, recorded = _record_set.decode_segment_parts, _record_set.RecordSet.dumps

    def watched_decode(data: bytes) -> object:
        threads["decode"].add(threading.get_ident())
        return decode(data)

    def watched_merge(*args: object) -> object:
        threads["merge"].add(threading.get_ident())
        return recorded(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(_record_set, "decode_segment_parts", watched_decode)
    monkeypatch.setattr(_record_set.RecordSet, "dumps", watched_merge)
    async with open_run(tmp_path) as run:
        dumps = await run.list()
    assert sorted(d.name for d in dumps) == ["d0", "d1", "d2", "d3", "d4", "unrecorded"]
    loop = threading.get_ident()
    assert threads["decode"] and loop not in threads["decode"]
    assert threads["merge"] and loop not in threads["merge"]


async def test_a_local_listing_takes_recorded_sizes_from_the_record_it_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A local run's segments are read before it is listed, so that recorded files need no
    # lstat. A segment read first that the listing then does not find (gone, or behind a
    # link it never enters) vouches for nothing: the run is listed again, sizes looked at.
    from trajtrack.reader import _listing

    async with trajtrack.Tracker(tmp_path) as tracker:
        await (await tracker.dump({"x": torch.zeros(3)}, "real"))
    real_size = (tmp_path / "real.pth").stat().st_size
    ghost = DumpRecord("real", "real.pth", 12345, "crc32:0", "h", 1, 0, "ghost", 9e9)
    early = _listing._early_segments

    async def with_a_ghost(*args: object) -> dict[str, bytes]:
        found = await early(*args)  # type: ignore[arg-type]
        return {**found, f"{RECORDS_PREFIX}/ghost-000000.jsonl": encode_segment([ghost])}

    async with open_run(tmp_path) as run:
        (dump,) = await run.list()
    assert (dump.stored_size, dump.writer != "ghost") == (real_size, True)
    monkeypatch.setattr(_listing, "_early_segments", with_a_ghost)
    async with open_run(tmp_path) as run:
        (dump,) = await run.list()
    assert (dump.stored_size, dump.size, dump.writer != "ghost") == (real_size, real_size, True)


async def test_a_segment_written_while_a_local_run_is_listed_is_read_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A segment the listing finds that was not there when the record was read first: read
    # then, and the ones read first not read again.
    from trajtrack.reader import _listing

    for writer in range(2):  # two trackers: two segments
        async with trajtrack.Tracker(tmp_path) as tracker:
            await (await tracker.dump({"x": torch.zeros(3)}, f"w{writer}"))
    early, read = _listing._early_segments, _listing._read_segment
    reads: list[str] = []

    async def one_missing(*args: object) -> dict[str, bytes]:
        found = await early(*args)  # type: ignore[arg-type]
        del found[max(found)]  # as if written after the record was read
        return found

    async def counted(storage: object, path: str) -> bytes:
        reads.append(path)
        return await read(storage, path)  # type: ignore[arg-type]

    monkeypatch.setattr(_listing, "_early_segments", one_missing)
    monkeypatch.setattr(_listing, "_read_segment", counted)
    async with open_run(tmp_path) as run:
        dumps = await run.list()
    assert sorted(d.name for d in dumps) == ["w0", "w1"] and all(d.recorded for d in dumps)
    segments = sorted(set(reads))
    assert len(segments) == 2 and reads.count(segments[0]) == 1  # the first, read once
    assert reads.count(segments[1]) == 2  # the new one (its first read dropped above), again


async def test_records_behind_a_link_leading_out_are_not_read(tmp_path: Path) -> None:
    from trajtrack.layouts.records import RECORDS_PREFIX

    run, outside = tmp_path / "run", tmp_path / "outside"
    run.mkdir()
    torch.save({"a": 1}, run / "a.pth")
    elsewhere = outside / RECORDS_PREFIX.partition("/")[2]
    elsewhere.mkdir(parents=True)
    line = '{"name": "ghost", "path": "ghost.pth", "size": 1, "checksum": "crc32:00000000"}\n'
    (elsewhere / "w-000000.jsonl").write_text(line)
    (run / ".trajtrack").symlink_to(outside, target_is_directory=True)
    async with open_run(run) as run_:
        listing = await run_.scan()
    assert [(d.name, d.recorded) for d in listing.dumps] == [("a", False)]
    assert listing.segments == 0
