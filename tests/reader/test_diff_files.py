"""``diff`` of local runs: pairs compared in place, loaded from their files, read ahead."""

from __future__ import annotations

import io
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

import trajtrack.reader._diff as diff_module
import trajtrack.reader._pair_checks as pair_checks
from trajtrack import Tracker
from trajtrack.reader import Tolerance, diff_runs, open_run
from trajtrack.reader._files import same_contents
from trajtrack.reader._readahead import ReadAhead
from trajtrack.reader._run import Run


@pytest.mark.parametrize(
    ("a", "b", "equal"),
    [
        (b"", b"", True),
        (bytes(range(256)) * 40, bytes(range(256)) * 40, True),
        (bytes(1000) + b"x", bytes(1000) + b"y", False),  # the last, unaligned byte
        (bytes(3 << 20) + b"1" + bytes(7), bytes(3 << 20) + b"2" + bytes(7), False),  # chunk 4
        (bytes(3 << 20) + b"12345678", bytes(3 << 20) + b"12345678", True),  # several chunks
        (bytes(100), bytes(101), False),
    ],
)
def test_same_contents(tmp_path: Path, a: bytes, b: bytes, equal: bool) -> None:
    (tmp_path / "a").write_bytes(a)
    (tmp_path / "b").write_bytes(b)
    assert same_contents(str(tmp_path / "a"), str(tmp_path / "b")) is equal


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every file diff loads from its path."""
    seen: list[str] = []
    real = pair_checks.load_dump_file

    def recording(path: str, **options: Any) -> Any:
        seen.append(Path(path).name)
        return real(path, **options)

    monkeypatch.setattr(pair_checks, "load_dump_file", recording)
    return seen


async def test_local_pairs_are_loaded_from_their_files_and_identical_ones_not_at_all(
    tmp_path: Path, loads: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    read_ahead: list[list[str]] = []
    real_run = ReadAhead.run

    async def recorded_run(self: ReadAhead) -> None:
        read_ahead.append(sorted(Path(a).name for a, _, _ in self._pairs))
        await real_run(self)

    monkeypatch.setattr(ReadAhead, "run", recorded_run)
    # In place and read ahead: large files only (small ones are read, then loaded from the
    # bytes; advising opens each file). These are tiny: count them as large.
    monkeypatch.setattr(diff_module, "_AHEAD_MIN", 0)
    monkeypatch.setattr(diff_module, "_SMALL", 0)
    a, b = tmp_path / "a", tmp_path / "b"
    for run, value in ((a, 1.0), (b, 2.0)):
        run.mkdir()
        torch.save({"x": torch.ones(3)}, run / "same.pth")
        torch.save({"x": torch.full((3,), value)}, run / "zipped.pth")
        torch.save(
            {"x": torch.full((3,), value)}, run / "legacy.pth", _use_new_zipfile_serialization=False
        )
    async with open_run(a) as run_a, open_run(b) as run_b:
        result = await diff_runs(run_a, run_b)
    status = {c.name: c.status for c in result.comparisons}
    assert status == {"same": "equal", "zipped": "different", "legacy": "different"}
    assert sorted(loads) == ["legacy.pth"] * 2 + ["zipped.pth"] * 2
    assert read_ahead == [["legacy.pth", "same.pth", "zipped.pth"]]  # every local pair
    monkeypatch.undo()
    ahead_min, small = diff_module._AHEAD_MIN, diff_module._SMALL
    monkeypatch.setattr(ReadAhead, "run", recorded_run)
    for patched, value in (("_AHEAD_MIN", ahead_min), ("_SMALL", small)):
        # in place, but far below the read-ahead's average size; or small, read in batches
        monkeypatch.setattr(diff_module, "_AHEAD_MIN", 0)
        monkeypatch.setattr(diff_module, "_SMALL", 0)
        monkeypatch.setattr(diff_module, patched, value)
        read_ahead.clear()
        async with open_run(a) as run_a, open_run(b) as run_b:
            assert (await diff_runs(run_a, run_b)).counts()["different"] == 2
        assert read_ahead == [], patched  # no advice


async def test_runs_of_other_storages_are_read_and_loaded_from_bytes(
    loads: list[str],
) -> None:
    for url, value in (("memory://m/a", 1.0), ("memory://m/b", 2.0)):
        async with open_run(url) as run:
            storage = run.storage
            buffer = io.BytesIO()
            torch.save({"x": torch.full((3,), value)}, buffer)
            storage.put_raw("d.pth", buffer.getvalue())  # type: ignore[attr-defined]
    async with open_run("memory://m/a") as run_a, open_run("memory://m/b") as run_b:
        result = await diff_runs(run_a, run_b)
    assert [c.status for c in result.comparisons] == ["different"]
    assert loads == []


def _batches_of_four(monkeypatch: pytest.MonkeyPatch, method: str) -> list[int]:
    """Small pairs in batches of 4 (10 pairs: 4, 4 and 2); the size of each batch that the
    comparer's *method* is given, as it goes."""
    from trajtrack.reader import _batch_reads

    monkeypatch.setattr(_batch_reads, "_BATCH", 4)
    hops: list[int] = []
    real = getattr(diff_module._Comparer, method)

    def counted(self: Any, batch: list[Any], *data: Any) -> Any:
        hops.append(len(batch))
        return real(self, batch, *data)

    monkeypatch.setattr(diff_module._Comparer, method, counted)
    return hops


async def test_small_local_pairs_compared_in_batches_keep_their_own_outcomes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hops = _batches_of_four(monkeypatch, "_compare_read")
    a, b = tmp_path / "a", tmp_path / "b"
    for run in (a, b):
        run.mkdir()
        for i in range(10):
            torch.save({"x": torch.full((3,), float(i))}, run / f"d{i}.pth")
    torch.save({"x": torch.zeros(3)}, b / "d3.pth")  # one differs
    (b / "d7.pth").write_bytes(b"not a dump")  # one cannot be loaded
    progress: list[tuple[int, int]] = []
    async with open_run(a) as run_a, open_run(b) as run_b:
        result = await diff_runs(run_a, run_b, on_progress=lambda *p: progress.append(p))
    status = {c.name: c.status for c in result.comparisons}
    assert status.pop("d3") == "different" and status.pop("d7") == "error"
    assert set(status.values()) == {"equal"}
    assert sorted(hops) == [2, 4, 4]
    assert progress[-1] == (10, 10)


@pytest.mark.parametrize("layout", ["files", "shards"])
async def test_small_pairs_are_read_in_dump_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    # Neighbours in a batch: one directory opened, shard members fetched together.
    names = [f"step{i // 40}/s{(i * 7) % 40}" for i in range(150)]  # not in name order
    for run in ("a", "b"):
        async with Tracker(tmp_path / run, layout=layout) as tracker:  # type: ignore[arg-type]
            for name in names:
                await tracker.dump({"x": torch.ones(4)}, name)
    requested: list[str] = []
    real = Run.blocking_reader

    def recording(self: Run) -> Any:
        read = real(self)
        assert read is not None

        class Reading:
            def __call__(self_, infos: Any) -> Any:  # self is the run's
                if self.url.endswith("a"):
                    requested.extend(info.name for info in infos)
                return read(infos)

            def close(self_) -> None:
                read.close()

        return Reading()

    monkeypatch.setattr(Run, "blocking_reader", recording)
    run_a = open_run(tmp_path / "a")
    result = await diff_runs(run_a, open_run(tmp_path / "b"))
    assert result.equal
    in_dump_order = [info.name for info in await run_a.list()]
    assert sorted(in_dump_order) != in_dump_order  # dump order is not name order here
    assert requested == in_dump_order


@pytest.mark.parametrize("layout", ["files", "shards"])
async def test_identical_bytes_holding_nan_differ_when_nan_is_not_nan(
    tmp_path: Path, layout: str
) -> None:
    # Byte-identical small pairs are equal without loading only while NaN == NaN.
    for run in ("a", "b"):
        async with Tracker(tmp_path / run, layout=layout) as tracker:  # type: ignore[arg-type]
            await tracker.dump({"x": torch.tensor([1.0, float("nan")])}, "nan")
            await tracker.dump({"x": torch.tensor([1.0, 2.0])}, "plain")
    assert (tmp_path / "a" / "nan.pth").exists() == (layout == "files")
    async with open_run(tmp_path / "a") as run_a, open_run(tmp_path / "b") as run_b:
        by_default = await diff_runs(run_a, run_b)
        strict = await diff_runs(run_a, run_b, tolerance=Tolerance(equal_nan=False))
    assert {c.name: c.status for c in by_default.comparisons} == {"nan": "equal", "plain": "equal"}
    assert {c.name: c.status for c in strict.comparisons} == {"nan": "different", "plain": "equal"}


def _recorded_run(url: str, dumps: dict[str, tuple[float, Any]]) -> Run:
    """A run in memory: each ``name: (commit time, object)`` saved and recorded, in order."""
    from trajtrack.backends.memory import MemoryStorage
    from trajtrack.layouts.records import RECORDS_PREFIX, DumpRecord, encode_segment

    storage = MemoryStorage(url)
    records = []
    for name, (time, obj) in dumps.items():
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        blob = buffer.getvalue()
        storage.put_raw(f"{name}.pth", blob)
        crc = f"crc32:{zlib.crc32(blob):08x}"
        records.append(DumpRecord(name, f"{name}.pth", len(blob), crc, "h", 1, 0, "w", time))
    storage.put_raw(f"{RECORDS_PREFIX}/w-000000.jsonl", encode_segment(records))
    return open_run(url, storage=storage)


async def test_comparisons_come_in_dump_order_then_name_order() -> None:
    # Dumps committed at one time (one order), recorded out of name order, one later; "b" is
    # large (compared on its own, its result may come ahead of a group of small pairs).
    dumps = {"c": (5.0, 1), "a": (5.0, 2), "late": (9.0, 3), "b": (5.0, torch.zeros(1 << 15))}
    runs = [_recorded_run(f"memory://order/{run}", dumps) for run in "ab"]
    result = await diff_runs(*runs)
    assert [c.name for c in result.comparisons] == ["a", "b", "c", "late"]
    assert result.equal


async def test_a_dump_in_one_run_only_keeps_its_place_whatever_the_runs_pace() -> None:
    """Run A is slow after its first dump, run B fast: B's extra dumps still come after the
    dumps that preceded them in B, not where B's clock would put them against A's."""
    run_a = {"s0": (0.0, 0), "s1": (30.0, 1), "s2": (31.0, 2), "gone": (32.0, 0)}
    run_b = {"early": (0.0, 0), "s0": (0.1, 0), "s1": (0.2, 9), "new": (0.3, 0), "s2": (0.4, 2)}
    result = await diff_runs(
        _recorded_run("memory://pace/a", run_a), _recorded_run("memory://pace/b", run_b)
    )
    got = [(c.name, c.status, c.order) for c in result.comparisons]
    assert got == [
        ("early", "only_in_b", 0),
        ("s0", "equal", 1),
        ("s1", "different", 2),
        ("new", "only_in_b", 3),
        ("s2", "equal", 4),
        ("gone", "only_in_a", 5),
    ]


class _Unsafe:
    """A class no allow-list has (module level: picklable)."""

    def __init__(self, value: int) -> None:
        self.value = value


async def test_batches_of_shard_members_keep_their_own_outcomes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Read and byte-compared by two threads, the pairs that need loading then loaded in one:
    # each pair's own outcome, in dump order, whichever thread decided it.
    hops = _batches_of_four(monkeypatch, "_read_and_compare_unloaded")
    for run in ("a", "b"):
        async with Tracker(tmp_path / run, layout="shards") as tracker:
            for i in range(10):
                value = 0.0 if (run, i) == ("b", 3) else float(i)  # d3 differs
                obj: Any = _Unsafe(i) if i == 7 else {"x": torch.full((3,), value)}
                await tracker.dump(obj, f"d{i}")
    async with open_run(tmp_path / "a") as run_a, open_run(tmp_path / "b") as run_b:
        result = await diff_runs(run_a, run_b)
    assert [c.name for c in result.comparisons] == [f"d{i}" for i in range(10)]
    status = {c.name: c.status for c in result.comparisons}
    # d7: equal bytes, unloaded; what a safe load would refuse is a note (issue 33).
    assert status.pop("d3") == "different" and status.pop("d7") == "equal"
    assert set(status.values()) == {"equal"}
    assert "_Unsafe" in result.comparisons[7].notes[0]
    assert sorted(hops) == [2, 4, 4]
