"""``Run.read_many``: several dumps' bytes at once, each read's error in its own slot."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import anyio.to_thread
import pytest
import torch

from trajtrack import DumpLoadError, StorageNotFoundError, StoragePermissionError, Tracker
from trajtrack.backends import BytesPayload
from trajtrack.backends.memory import MemoryStorage
from trajtrack.reader import open_run


async def _write(root: Path | str, layout: str, **options: object) -> None:
    async with Tracker(root, layout=layout, **options) as tracker:  # type: ignore[arg-type]
        for i in range(6):
            await tracker.dump({"x": torch.full((50,), float(i))}, f"d{i}")


@pytest.mark.parametrize("layout", ["files", "shards"])
async def test_the_bytes_of_each_dump_as_read_bytes_gives_them(tmp_path: Path, layout: str) -> None:
    await _write(tmp_path, layout)
    async with open_run(tmp_path) as run:
        infos = await run.list()
        assert [await run.read_bytes(i) for i in infos] == await run.read_many(infos)
        if layout == "shards":
            assert {i.shard for i in infos} != {None}


async def test_a_failed_read_is_reported_in_its_slot_only(tmp_path: Path) -> None:
    root = tmp_path / "run"
    await _write(root, "files")
    (tmp_path / "elsewhere.pth").write_bytes(b"secret")
    async with open_run(root) as run:
        infos = await run.list()

        def break_two() -> None:
            os.unlink(root / "d1.pth")
            os.unlink(root / "d4.pth")
            os.symlink(tmp_path / "elsewhere.pth", root / "d4.pth")  # a link out, planted late

        await anyio.to_thread.run_sync(break_two)
        got = dict(zip((info.name for info in infos), await run.read_many(infos), strict=True))
    assert isinstance(got.pop("d1"), StorageNotFoundError)
    assert isinstance(got.pop("d4"), StoragePermissionError)
    assert len(got) == 4 and all(isinstance(data, bytes) and data for data in got.values())


async def test_other_storages_read_one_by_one_with_the_same_outcomes() -> None:
    storage = MemoryStorage("memory://many/run")
    await _write("memory://many/run", "shards", storage=storage)
    async with open_run("memory://many/run", storage=storage) as run:
        infos = await run.list()
        assert [await run.read_bytes(i) for i in infos] == await run.read_many(infos)


def test_group_small_keeps_the_order_and_puts_each_large_item_alone() -> None:
    from trajtrack.reader import group_small

    items = [1, 2, 30, 4, 5, 6, 70, 8]
    assert group_small(items, lambda x: x < 10, 2) == [[1, 2], [30], [4, 5], [70], [6, 8]]
    assert group_small([], lambda x: True, 3) == []
    groups = group_small(list(range(10)), lambda x: True, 4)
    assert [x for group in groups for x in group] == list(range(10))
    weighed = group_small([5, 5, 5, 9, 1, 1], lambda x: True, 10, weight=int, max_weight=10)
    assert weighed == [[5, 5], [5, 9], [1, 1]]  # closed once a group weighs 10


def test_read_batches_hold_up_to_4096_small_items_and_16_mib() -> None:
    from trajtrack.reader._batch_reads import read_batches

    items = [2048] * 9000 + [1 << 20] + [2048] * 10

    def small(size: int) -> bool:
        return size <= 65536

    groups = read_batches(items, small, int)
    assert [len(g) for g in groups] == [4096, 4096, 1, 818]  # 4,096 a group, at most
    huge = read_batches([60000] * 800, small, int)
    assert max(sum(g) for g in huge) < (16 << 20) + 60000  # and 16 MiB
    assert max(sum(g) for g in huge) > (16 << 20) - 60000
    assert sorted(x for g in groups for x in g) == sorted(items)


async def _files_run(root: Path) -> None:
    async with Tracker(root) as tracker:
        for i in range(4):
            await tracker.dump({"x": torch.full((50,), float(i))}, f"a/b/d{i}")


async def test_a_directory_linked_inside_the_run_is_followed(tmp_path: Path) -> None:
    root = tmp_path / "run"
    await _files_run(root)
    async with open_run(root) as run:
        infos = await run.list()
        want = [await run.read_bytes(i) for i in infos]
        os.rename(root / "a" / "b", root / "a" / "real_b")
        os.symlink(root / "a" / "real_b", root / "a" / "b")  # a link that stays inside
        assert await run.read_many(infos) == want


async def test_a_directory_linked_out_of_the_run_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "run"
    await _files_run(root)
    async with open_run(root) as run:
        infos = await run.list()
        os.rename(root / "a", tmp_path / "elsewhere")
        os.symlink(tmp_path / "elsewhere", root / "a")  # the same files, now outside
        got = await run.read_many(infos)
    assert all(isinstance(data, StoragePermissionError) for data in got)


@pytest.mark.parametrize("change", [b"grown" * 5000, b"short"])
async def test_a_file_rewritten_after_listing_is_read_up_to_one_byte_past_its_record(
    tmp_path: Path, change: bytes
) -> None:
    # A file shorter than its record is read whole; one longer only up to one byte past the
    # record's size: enough to tell it changed, and a run's file never sizes the read.
    root = tmp_path / "run"
    await _files_run(root)
    async with open_run(root) as run:
        infos = await run.list()
        (root / "a" / "b" / "d1.pth").write_bytes(change)
        got = dict(zip((i.name for i in infos), await run.read_many(infos), strict=True))
    size = next(i.size for i in infos if i.name == "a/b/d1")
    assert got.pop("a/b/d1") == change[: size + 1]
    sizes = {i.name: i.size for i in infos}
    assert all(isinstance(data, bytes) and len(data) == sizes[n] for n, data in got.items())


async def test_shard_members_read_in_spans_as_one_by_one(tmp_path: Path) -> None:
    # Members of two shards, interleaved and out of order: every one read exactly.
    root = tmp_path / "run"
    async with Tracker(root, layout="shards") as tracker:
        for i in range(10):
            await tracker.dump({"x": torch.full((50 + i,), float(i))}, f"d{i}")
            if i == 4:
                await tracker.flush()  # seals the first shard
    async with open_run(root) as run:
        infos = await run.list()
        assert len({i.shard for i in infos}) == 2
        order = [infos[k] for k in (0, 1, 2, 6, 7, 3, 4, 5, 9, 8)]
        assert await run.read_many(order) == [await run.read_bytes(i) for i in order]


async def test_a_dump_the_listing_refused_is_never_read(tmp_path: Path) -> None:
    # A record naming one of trajtrack's own files as a dump: a path inside the run (the
    # storage would open it), but not a dump's name, so the listing gives it a problem.
    import json

    from trajtrack.layouts.records import RECORDS_PREFIX

    root = tmp_path / "run"
    await _write(root, "files")
    (root / ".trajtrack" / "own.pth").write_bytes(b"trajtrack's own file")
    line = {"v": 1, "name": ".trajtrack/own", "path": ".trajtrack/own.pth", "size": 20}
    line |= {"checksum": "crc32:0", "host": "h", "pid": 1, "rank": 0, "writer": "x", "time": 0}
    (root / RECORDS_PREFIX / "planted-000000.jsonl").write_text(json.dumps(line) + "\n")
    async with open_run(root) as run:
        infos = await run.list()
        got = dict(zip((i.path for i in infos), await run.read_many(infos), strict=True))
    refused = got.pop(".trajtrack/own.pth")
    assert isinstance(refused, StoragePermissionError)
    assert "refusing to read" in str(refused)
    assert len(got) == 6 and all(isinstance(data, bytes) for data in got.values())


class _CountingMemory(MemoryStorage):
    """A storage that is not local (no ``local_path``), counting its reads."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.ranges: list[tuple[str, int, int]] = []
        self.whole: list[str] = []

    async def read(self, path: str) -> bytes:
        self.whole.append(path)
        return await super().read(path)

    async def read_range(self, path: str, offset: int, length: int) -> bytes:
        self.ranges.append((path, offset, length))
        return await super().read_range(path, offset, length)


async def _sharded_remote(url: str, dumps: int, flush_at: int | None = None) -> _CountingMemory:
    storage = _CountingMemory(url)
    async with Tracker(url, layout="shards", storage=storage) as tracker:  # type: ignore[arg-type]
        for i in range(dumps):
            await tracker.dump({"x": torch.full((50 + i,), float(i))}, f"d{i}")
            if i == flush_at:
                await tracker.flush()  # seals the first shard
    return storage


async def test_other_storages_read_neighbouring_members_with_one_ranged_read() -> None:
    storage = await _sharded_remote("memory://spans/run", 12, flush_at=6)
    async with open_run("memory://spans/run", storage=storage) as run:
        infos = await run.list()
        want = [await run.read_bytes(i) for i in infos]
        assert len(storage.ranges) == 12  # one ranged read per member, one at a time
        storage.ranges.clear()
        assert await run.read_many(infos) == want
    assert len({i.shard for i in infos}) == 2
    assert len(storage.ranges) == 2  # one per shard: 12 members in two spans
    order = [infos[k] for k in (0, 1, 2, 9, 10, 3, 4, 11)]  # out of order, interleaved
    storage.ranges.clear()
    assert await run.read_many(order) == [want[k] for k in (0, 1, 2, 9, 10, 3, 4, 11)]
    assert len(storage.ranges) == 4  # (0, 1, 2), (9, 10), (3, 4), (11)


async def test_a_truncated_shard_fails_only_the_members_it_lost() -> None:
    storage = await _sharded_remote("memory://cut/run", 6)
    async with open_run("memory://cut/run", storage=storage) as run:
        infos = await run.list()
        (shard,) = {i.shard for i in infos}
        assert shard is not None
        last = infos[-1]
        whole = await storage.read(shard)
        cut = (last.offset or 0) + 10  # the last member loses all but 10 bytes
        await storage.write_atomic(shard, BytesPayload(whole[:cut]), overwrite=True)
        got = await run.read_many(infos)
    assert [isinstance(g, bytes) for g in got] == [True] * 5 + [False]
    assert isinstance(got[-1], DumpLoadError) and "truncated" in str(got[-1])


async def test_a_missing_shard_fails_each_of_its_members_in_its_slot() -> None:
    storage = await _sharded_remote("memory://gone/run", 8, flush_at=3)
    async with open_run("memory://gone/run", storage=storage) as run:
        infos = await run.list()
        first = infos[0].shard
        assert first is not None
        await storage.delete(first)
        storage.ranges.clear()
        got = await run.read_many(infos)
    lost = [i.shard == first for i in infos]
    assert lost == [True] * 4 + [False] * 4
    assert all(isinstance(g, StorageNotFoundError) for g, x in zip(got, lost, strict=True) if x)
    assert all(isinstance(g, bytes) for g, x in zip(got, lost, strict=True) if not x)
    assert len(storage.ranges) == 2  # the missing shard asked once, not once per member


async def test_export_of_a_remote_sharded_run_reads_a_span_at_a_time(tmp_path: Path) -> None:
    from trajtrack.backends.local import LocalStorage
    from trajtrack.reader import export_run

    storage = await _sharded_remote("memory://export/run", 30, flush_at=14)
    async with open_run("memory://export/run", storage=storage) as run:
        infos = await run.list()
        want = {i.path: await run.read_bytes(i) for i in infos}
        storage.ranges.clear()
        done: list[tuple[int, int]] = []
        result = await export_run(
            run, LocalStorage(str(tmp_path / "out")), on_progress=lambda *p: done.append(p)
        )
    assert (result.written, result.skipped) == (30, ())
    assert len(storage.ranges) == 2  # two shards, each one span
    assert {p: (tmp_path / "out" / p).read_bytes() for p in want} == want
    assert done[-1] == (30, 30)


async def test_other_storages_read_a_batch_with_requests_in_flight_together() -> None:
    class Slow(MemoryStorage):
        in_flight = peak = 0

        async def read(self, path: str) -> bytes:
            Slow.in_flight += 1
            Slow.peak = max(Slow.peak, Slow.in_flight)
            await anyio.sleep(0.01)  # a round trip
            Slow.in_flight -= 1
            return await super().read(path)

    storage = Slow("memory://slow/run")
    async with Tracker("memory://slow/run", storage=storage) as tracker:
        for i in range(40):
            await tracker.dump({"x": torch.full((8,), float(i))}, f"d{i}")
    async with open_run("memory://slow/run", storage=storage) as run:
        infos = await run.list()
        Slow.peak = 0
        got = await run.read_many(infos)
    assert all(isinstance(data, bytes) for data in got) and len(got) == 40
    assert Slow.peak == 16  # not one round trip after the other; 16 at most


async def test_both_runs_the_two_at_once_and_raises_unwrapped() -> None:
    from trajtrack.reader._gather import both

    order: list[str] = []

    async def step(name: str, delay: float) -> str:
        order.append(f"{name} starts")
        await anyio.sleep(delay)
        order.append(f"{name} ends")
        return name

    assert await both(lambda: step("a", 0.05), lambda: step("b", 0.01)) == ("a", "b")
    assert order == ["a starts", "b starts", "b ends", "a ends"]  # overlapped

    async def fail() -> None:
        await anyio.sleep(0.01)
        raise StorageNotFoundError("gone")

    order.clear()
    with pytest.raises(StorageNotFoundError, match="gone"):  # not an exception group
        await both(lambda: step("slow", 5.0), fail)
    assert order == ["slow starts"]  # cancelled, not waited for


async def _diff_of_two(storage_class: type[MemoryStorage], base: str, dumps: int) -> Any:
    """``diff_runs`` of two identical runs *base*/a and *base*/b of *dumps* small dumps, each in
    its own *storage_class*."""
    from trajtrack.reader import diff_runs

    runs = []
    for name in ("a", "b"):
        url = f"{base}/{name}"
        storage = storage_class(url)
        async with Tracker(url, storage=storage) as tracker:
            for i in range(dumps):
                await tracker.dump({"x": torch.full((8,), float(i))}, f"d{i:02d}")
        runs.append(open_run(url, storage=storage))
    async with runs[0] as run_a, runs[1] as run_b:
        return await diff_runs(run_a, run_b)


async def test_diff_reads_both_runs_of_a_batch_at_the_same_time() -> None:

    events: list[tuple[str, str]] = []

    class Slow(MemoryStorage):
        async def read(self, path: str) -> bytes:
            if path.endswith(".pth"):
                events.append(("start", self.url))
                await anyio.sleep(0.02)
                events.append(("end", self.url))
            return await super().read(path)

    result = await _diff_of_two(Slow, "memory://both", 5)
    assert result.equal
    first_b = events.index(("start", "memory://both/b"))
    last_a = max(i for i, event in enumerate(events) if event == ("end", "memory://both/a"))
    assert first_b < last_a  # B's reads began while A's were still in flight


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
async def test_a_local_reader_keeps_shards_open_across_batches_until_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trajtrack.reader import _local_reads

    monkeypatch.setattr(_local_reads._ShardFiles, "LIMIT", 2)
    async with Tracker(tmp_path, layout="shards", shard_max_bytes=30_000) as tracker:
        for i in range(24):  # several shards of a few members each
            await tracker.dump({"x": torch.full((500,), i)}, f"d{i:02d}")
    checked: list[str] = []
    real_check = _local_reads.resolve_inside

    def counting(root: str, real: str, relative: str) -> str:
        checked.append(relative)
        return real_check(root, real, relative)

    monkeypatch.setattr(_local_reads, "resolve_inside", counting)
    async with open_run(tmp_path) as run:
        infos = await run.list()
        shards = sorted({info.shard for info in infos if info.shard})
        assert len(shards) >= 4
        reader = run.blocking_reader()
        assert reader is not None
        before = _open_fds()
        expected = [await run.read_bytes(info) for info in infos]
        checked.clear()
        for _ in range(3):  # three passes, a batch of two members each
            for start in range(0, len(infos), 2):
                got = await anyio.to_thread.run_sync(reader, infos[start : start + 2])
                assert got == expected[start : start + 2]
        # The first two shards are checked and opened once, kept; the others once a batch.
        assert sorted(set(checked)) == shards
        assert [checked.count(shard) > 1 for shard in shards] == [False, False] + [True] * (
            len(shards) - 2
        )
        assert _open_fds() == before + 2
        reader.close()
        assert _open_fds() == before


async def test_diff_and_verify_close_the_shards_they_kept_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trajtrack.cli.verify import verify_run
    from trajtrack.reader import diff_runs
    from trajtrack.reader._local_reads import LocalReader

    for run in ("a", "b"):
        async with Tracker(tmp_path / run, layout="shards", shard_max_bytes=30_000) as tracker:
            for i in range(24):
                await tracker.dump({"x": torch.full((500,), i)}, f"d{i:02d}")
    closed: list[LocalReader] = []
    real_close = LocalReader.close

    def recording(self: LocalReader) -> None:
        closed.append(self)
        real_close(self)

    monkeypatch.setattr(LocalReader, "close", recording)
    async with open_run(tmp_path / "a") as run_a, open_run(tmp_path / "b") as run_b:
        assert (await diff_runs(run_a, run_b)).equal
        assert len(closed) == 2 and closed[0] is not closed[1]  # both runs' readers
        assert {f.problem for f in await verify_run(run_a)} == {"ok"}
        assert len(closed) == 3


async def test_diff_keeps_at_most_four_batches_of_small_pairs_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from trajtrack.reader import _batch_reads

    monkeypatch.setattr(_batch_reads, "_BATCH", 2)  # 24 pairs: 12 batches
    in_flight, most = [0], [0]

    class Slow(MemoryStorage):
        async def read(self, path: str) -> bytes:
            if not path.endswith(".pth"):
                return await super().read(path)
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
            await anyio.sleep(0.01)
            in_flight[0] -= 1
            return await super().read(path)

    result = await _diff_of_two(Slow, "memory://inflight", 24)
    assert result.equal and len(result.comparisons) == 24
    # Four batches at a time, each reading its two pairs from both runs at once: 16 reads.
    assert 8 < most[0] <= 16
