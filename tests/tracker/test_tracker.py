"""The async Tracker: snapshots, completeness, full-policies, flush/close, errors, records."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import threading
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest
import torch

import trajtrack
from trajtrack import (
    ConfigurationError,
    DumpDroppedError,
    DumpExistsError,
    QueueFullError,
    RetryPolicy,
    SerializationError,
    StorageError,
    StorageUnavailableError,
    Tracker,
    TrackerClosedError,
    TrackerState,
    TrackerStateError,
)
from trajtrack.backends.memory import MemoryStorage
from trajtrack.layouts.names import WriterIdentity, temp_path_for
from trajtrack.layouts.records import decode_segment


def load(path: Path) -> Any:
    return torch.load(path, weights_only=True)


@dataclasses.dataclass
class Sample:
    """A non-plain object: serialized at dump time rather than copied."""

    tokens: torch.Tensor
    note: list[str]


class Gate:
    """A storage fault that blocks writes until opened (a slow or hung storage)."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.entered = threading.Semaphore(0)

    def __call__(self, operation: str, path: str) -> None:
        if operation == "write" and not path.startswith(".trajtrack"):
            self.entered.release()
            self.opened.wait(timeout=60)


class FailTimes:
    """A storage fault raising *error* for the first *times* dump writes."""

    def __init__(self, times: int, error: Callable[[], Exception]) -> None:
        self.left = times
        self.error = error
        self.lock = threading.Lock()

    def __call__(self, operation: str, path: str) -> None:
        if operation != "write" or path.startswith(".trajtrack"):
            return
        with self.lock:
            if self.left <= 0:
                return
            self.left -= 1
        raise self.error()


def memory_tracker(fault: Any = None, **options: Any) -> Tracker:
    return Tracker(
        "memory://t/run", storage=MemoryStorage("memory://t/run", fault=fault), **options
    )


# --------------------------------------------------------------------------- snapshots


async def test_mutation_after_dump_does_not_change_what_is_stored(tmp_path: Path) -> None:
    obs = torch.zeros(4)
    arr = np.zeros(3)
    nested = {"obs": obs, "more": [obs, {"arr": arr}], "step": 3, "tag": "a"}
    sample = Sample(tokens=torch.ones(2), note=["x"])
    async with Tracker(tmp_path) as tracker:
        h1 = await tracker.dump(nested, "plain")
        h2 = await tracker.dump(sample, "dataclass")
        obs.add_(7)
        arr += 5
        nested["more"][1]["arr"] = None  # type: ignore[index]
        sample.tokens.mul_(0)
        sample.note.append("y")
        await h1
        await h2
    plain = torch.load(tmp_path / "plain.pth", weights_only=False)  # numpy needs full unpickling
    assert torch.equal(plain["obs"], torch.zeros(4))
    assert torch.equal(plain["more"][0], torch.zeros(4))
    assert np.array_equal(plain["more"][1]["arr"], np.zeros(3))
    assert plain["step"] == 3
    assert plain["tag"] == "a"
    restored = torch.load(tmp_path / "dataclass.pth", weights_only=False)
    assert torch.equal(restored.tokens, torch.ones(2))
    assert restored.note == ["x"]


async def test_aliasing_and_requires_grad_survive(tmp_path: Path) -> None:
    weight = torch.ones(3, requires_grad=True)
    async with Tracker(tmp_path) as tracker:
        await (await tracker.dump({"a": weight, "b": weight, "view": torch.arange(10)[2:5]}, "x"))
    loaded = load(tmp_path / "x.pth")
    assert loaded["a"].requires_grad
    assert loaded["a"] is loaded["b"]  # the same tensor twice stays one tensor
    assert loaded["view"].tolist() == [2, 3, 4]
    assert loaded["view"].untyped_storage().nbytes() == 3 * 8  # compacted, not the whole base


async def test_large_plain_objects_are_copied_off_the_loop(tmp_path: Path) -> None:
    big = torch.arange(600_000, dtype=torch.float32)  # 2.4 MB > inline_snapshot_bytes below
    async with Tracker(tmp_path, inline_snapshot_bytes=1 << 20) as tracker:
        handle = await tracker.dump({"big": big}, "big")
        big.zero_()
        record = await handle
    assert torch.equal(load(tmp_path / record.path)["big"], torch.arange(600_000.0))
    # It was serialized into a spool file in the destination and renamed into place.
    assert list((tmp_path / ".trajtrack" / "spool").iterdir()) == []
    assert record.size == (tmp_path / record.path).stat().st_size


async def test_large_snapshots_stream_from_the_spool_to_other_storages(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    big = torch.arange(600_000, dtype=torch.float32)
    storage = MemoryStorage("memory://spooled/run")
    async with Tracker(
        "memory://spooled/run", storage=storage, inline_snapshot_bytes=1 << 20, spool_dir=str(spool)
    ) as tracker:
        handle = await tracker.dump({"big": big}, "big")
        big.zero_()
        record = await handle
    data = await storage.read(record.path)
    assert len(data) == record.size
    assert torch.equal(torch.load(io.BytesIO(data))["big"], torch.arange(600_000.0))
    assert list(spool.iterdir()) == []  # the spool file is gone once written


async def test_a_spool_file_is_deleted_in_a_thread_before_its_dump_resolves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trajtrack.tracker._payloads import FilePayload

    releases: list[tuple[bool, bool]] = []  # (on the event loop's thread, file still there)
    real_release = FilePayload.release

    def release(self: FilePayload) -> None:
        releases.append((threading.current_thread() is threading.main_thread(), bool(self.path)))
        real_release(self)

    monkeypatch.setattr(FilePayload, "release", release)
    spool = tmp_path / "spool"
    spool.mkdir()
    async with Tracker(
        "memory://spool-release/run",
        storage=MemoryStorage("memory://spool-release/run"),
        inline_snapshot_bytes=1 << 20,
        spool_dir=str(spool),
    ) as tracker:
        await (await tracker.dump({"big": torch.ones(600_000)}, "big"))
    assert releases[0] == (False, True)  # not on the loop (an unlink), and not left to the GC


# --------------------------------------------------------------------------- completeness


async def test_1000_dumps_from_50_concurrent_tasks_all_land(tmp_path: Path) -> None:
    async def producer(task: int, tracker: Tracker) -> None:
        for i in range(20):
            payload = {"task": torch.tensor([task]), "i": torch.tensor([i]), "x": torch.randn(8)}
            await tracker.dump(payload, f"task{task}/dump{i}")
            if i % 5 == 0:
                await anyio.lowlevel.checkpoint()

    async with Tracker(tmp_path, workers=8) as tracker:
        async with anyio.create_task_group() as group:
            for task in range(50):
                group.start_soon(producer, task, tracker)
        await tracker.flush()
        stats = tracker.statistics()
    assert stats.enqueued == stats.committed == 1000
    assert stats.failed == 0
    assert stats.pending_items == 0
    files = sorted(tmp_path.glob("task*/dump*.pth"))
    assert len(files) == 1000
    for task, i in [(0, 0), (17, 9), (49, 19)]:
        loaded = load(tmp_path / f"task{task}" / f"dump{i}.pth")
        assert loaded["task"].item() == task
        assert loaded["i"].item() == i


@pytest.mark.parametrize("layout", ["files", "shards"])
async def test_a_dump_frees_its_budget_before_its_handle_resolves(
    tmp_path: Path, layout: str
) -> None:
    # A flush that returns, or a handle that resolves, must find the budget already freed.
    seen: list[tuple[int, int]] = []  # (pending_items, pending_bytes) as each handle resolves
    async with Tracker(tmp_path, layout=layout, workers=2) as tracker:  # type: ignore[arg-type]

        def resolved(_: object) -> None:  # in whichever thread settles the dump
            now = tracker.statistics()
            seen.append((now.pending_items, now.pending_bytes))

        for i in range(5):
            handle = tracker.dump_nowait({"x": torch.full((64,), float(i))}, f"d{i}")
            handle.add_done_callback(resolved)
            await tracker.flush()
            assert tracker.statistics().pending_bytes == 0
    assert seen == [(0, 0)] * 5


# --------------------------------------------------------------------------- full-policies


def tiny(i: int) -> dict[str, torch.Tensor]:
    return {"v": torch.full((4,), float(i))}


async def test_block_policy_waits_for_space_then_times_out() -> None:
    gate = Gate()
    async with memory_tracker(gate, max_pending_items=2, workers=1) as tracker:
        await tracker.dump(tiny(0), "a")
        await tracker.dump(tiny(1), "b")
        with pytest.raises(TimeoutError, match="pending"):
            await tracker.dump(tiny(2), "c", timeout=0.2)

        async def late_open() -> None:
            await anyio.to_thread.run_sync(gate.entered.acquire)
            gate.opened.set()

        async with anyio.create_task_group() as group:
            group.start_soon(late_open)
            handle = await tracker.dump(tiny(3), "d")  # blocks until the gate opens
        await handle
        stats = tracker.statistics()
    assert stats.committed == 3
    assert stats.dropped == {}


async def test_raise_policy() -> None:
    gate = Gate()
    async with memory_tracker(gate, max_pending_items=1, full_policy="raise") as tracker:
        await tracker.dump(tiny(0), "a")
        with pytest.raises(QueueFullError, match="1 dumps"):
            await tracker.dump(tiny(1), "b")
        gate.opened.set()
        await tracker.flush()
        await tracker.dump(tiny(2), "c")  # usable again


async def test_drop_newest_policy_counts_and_resolves_the_handle() -> None:
    gate = Gate()
    async with memory_tracker(gate, max_pending_items=2, full_policy="drop_newest") as tracker:
        kept = [await tracker.dump(tiny(i), f"k{i}") for i in range(2)]
        dropped = await tracker.dump(tiny(9), "dropped")
        with pytest.raises(DumpDroppedError, match="drop_newest"):
            await dropped
        gate.opened.set()
        for handle in kept:
            await handle
        stats = tracker.statistics()
    assert stats.dropped == {"drop_newest": 1}
    assert stats.committed == 2
    names = {i.path for i in await MemoryStorage("memory://t/run").list()}
    assert "dropped.pth" not in names


async def test_drop_oldest_policy_discards_queued_not_in_flight() -> None:
    gate = Gate()
    async with memory_tracker(
        gate, max_pending_items=3, full_policy="drop_oldest", workers=1
    ) as tracker:
        first = await tracker.dump(tiny(0), "in_flight")
        await anyio.to_thread.run_sync(gate.entered.acquire)  # the worker holds `first`
        oldest = await tracker.dump(tiny(1), "oldest_queued")
        await tracker.dump(tiny(2), "queued")
        newest = await tracker.dump(tiny(3), "newest")  # full: the oldest *queued* goes
        with pytest.raises(DumpDroppedError, match="drop_oldest"):
            await oldest
        gate.opened.set()
        await first
        await newest
        await tracker.flush()
        stats = tracker.statistics()
    assert stats.dropped == {"drop_oldest": 1}
    assert stats.committed == 3


async def _charged_bytes(obj: Any) -> int:
    """What the memory budget counts for one dump of *obj* (held in a blocked worker)."""
    gate = Gate()
    async with memory_tracker(gate, workers=1) as tracker:
        handle = await tracker.dump(obj, "probe")
        await anyio.to_thread.run_sync(gate.entered.acquire)
        charged = tracker.statistics().pending_bytes
        gate.opened.set()
        await handle
    return charged


async def test_drop_oldest_under_a_byte_budget_frees_exactly_what_it_drops() -> None:
    def block(i: int) -> dict[str, Any]:
        return {"i": i, "x": torch.full((1000,), float(i))}

    size = await _charged_bytes(block(0))
    gate = Gate()
    async with memory_tracker(
        gate, max_pending_bytes=3 * size, full_policy="drop_oldest", workers=1
    ) as tracker:
        first = await tracker.dump(block(0), "in_flight")
        await anyio.to_thread.run_sync(gate.entered.acquire)  # the worker holds it
        queued = [await tracker.dump(block(i), f"q{i}") for i in (1, 2)]
        assert tracker.statistics().pending_bytes == 3 * size  # full, by bytes
        newest = [await tracker.dump(block(i), f"n{i}") for i in (3, 4)]  # each drops one
        for handle in queued:
            with pytest.raises(DumpDroppedError, match="drop_oldest"):
                await handle
        assert tracker.statistics().pending_bytes == 3 * size  # dropped bytes were released
        gate.opened.set()
        for handle in [first, *newest]:
            await handle
        await tracker.flush(timeout=30)
        stats = tracker.statistics()
        assert (stats.pending_bytes, stats.pending_items) == (0, 0)
        assert stats.dropped == {"drop_oldest": 2}
        assert stats.committed == 3
        # nothing leaked: a full budget's worth is admitted again without a drop
        again = [await tracker.dump(block(i), f"a{i}") for i in range(3)]
        for handle in again:
            await handle
        assert tracker.statistics().dropped == {"drop_oldest": 2}


async def test_oversize_item_is_admitted_alone(tmp_path: Path) -> None:
    big = {"x": torch.zeros(100_000)}  # 400 KB, budget 10 KB
    async with Tracker(tmp_path, max_pending_bytes=10_000) as tracker:
        records = [await (await tracker.dump(big, f"big{i}")) for i in range(3)]
        small = await tracker.dump(tiny(1), "small")
        await small
    assert [r.path for r in records] == ["big0.pth", "big1.pth", "big2.pth"]
    assert load(tmp_path / "big2.pth")["x"].shape == (100_000,)


async def test_dump_nowait_never_blocks() -> None:
    gate = Gate()
    async with memory_tracker(gate, max_pending_items=1) as tracker:
        first = tracker.dump_nowait(tiny(0), "a")
        with pytest.raises(QueueFullError):
            tracker.dump_nowait(tiny(1), "b")  # block policy becomes raise: never wait
        gate.opened.set()
        record = await first
    assert record.path == "a.pth"


# --------------------------------------------------------------------------- flush / close


async def test_flush_with_timeout_on_a_hung_storage_then_recovers() -> None:
    gate = Gate()
    async with memory_tracker(gate) as tracker:
        handle = await tracker.dump(tiny(0), "slow")
        with pytest.raises(TimeoutError):
            await tracker.flush(timeout=0.2)
        assert not handle.done()
        gate.opened.set()
        await tracker.flush(timeout=30)
        assert (await handle).path == "slow.pth"


async def test_close_with_timeout_reports_unwritten_dumps(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gate = Gate()
    tracker = memory_tracker(gate, workers=1)
    await tracker.start()
    handles = [await tracker.dump(tiny(i), f"d{i}") for i in range(3)]
    await anyio.to_thread.run_sync(gate.entered.acquire)  # d0 is in flight, d1 and d2 queued
    with pytest.raises(TimeoutError, match="3 dumps were not written"):
        await tracker.aclose(timeout=0.3)
    assert tracker.state is TrackerState.CLOSED
    # close itself settled every handle, the one in flight included: nothing left to wait for
    for handle in handles:
        assert handle.done()
        error = handle.exception(timeout=0)
        assert isinstance(error, TimeoutError)
        assert "close deadline" in str(error)
    gate.opened.set()
    assert "3 dumps were not written" in caplog.text


async def test_leaving_the_block_by_an_exception_drains_first(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="training crashed"):
        async with Tracker(tmp_path) as tracker:
            for i in range(20):
                await tracker.dump(tiny(i), f"last/{i}")
            raise RuntimeError("training crashed")
    assert len(list((tmp_path / "last").glob("*.pth"))) == 20


async def test_leaving_the_block_by_system_exit_drains_first(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        async with Tracker(tmp_path) as tracker:
            await tracker.dump(tiny(1), "before_exit")
            raise SystemExit(3)
    assert (tmp_path / "before_exit.pth").exists()


async def test_dump_after_close_and_double_close(tmp_path: Path) -> None:
    tracker = Tracker(tmp_path)
    with pytest.raises(TrackerStateError, match="not been started"):
        await tracker.dump(tiny(0), "early")
    await tracker.start()
    await tracker.aclose()
    with pytest.raises(TrackerClosedError, match="closed"):
        await tracker.dump(tiny(0), "late")
    with pytest.raises(TrackerClosedError):
        await tracker.flush()
    await tracker.aclose()  # idempotent
    with pytest.raises(TrackerStateError, match="cannot start"):
        await tracker.start()


# --------------------------------------------------------------------------- errors and retries


async def test_failures_surface_through_handle_and_flush_then_recover() -> None:
    fault = FailTimes(2, lambda: StorageError("disk on fire"))
    async with memory_tracker(fault, workers=1) as tracker:
        bad = [await tracker.dump(tiny(i), f"bad{i}") for i in range(2)]
        for handle in bad:
            with pytest.raises(StorageError, match="disk on fire"):
                await handle
        with pytest.raises(StorageError, match="disk on fire") as info:
            await tracker.flush()
        assert "1 more dumps failed" in "".join(getattr(info.value, "__notes__", []))
        await tracker.flush()  # reported once: the next flush is clean
        good = await tracker.dump(tiny(3), "good")
        assert (await good).path == "good.pth"
        stats = tracker.statistics()
    assert stats.failed == 2
    assert stats.committed == 1


async def test_pending_failure_is_raised_when_the_block_exits() -> None:
    fault = FailTimes(1, lambda: StorageError("refused"))
    with pytest.raises(StorageError, match="refused"):
        async with memory_tracker(fault) as tracker:
            await tracker.dump(tiny(0), "x")


async def test_transient_failures_are_retried() -> None:
    fault = FailTimes(3, lambda: StorageUnavailableError("connection reset"))
    retry = RetryPolicy(initial_backoff=0.01, max_backoff=0.02, deadline=30)
    async with memory_tracker(fault, retry=retry) as tracker:
        record = await (await tracker.dump(tiny(0), "flaky"))
        stats = tracker.statistics()
    assert record.path == "flaky.pth"
    assert stats.retries == 3
    assert stats.failed == 0


async def test_retries_stop_at_the_deadline() -> None:
    fault = FailTimes(10_000, lambda: StorageUnavailableError("namenode down"))
    retry = RetryPolicy(initial_backoff=0.01, max_backoff=0.02, deadline=0.2)
    async with memory_tracker(fault, retry=retry) as tracker:
        handle = await tracker.dump(tiny(0), "doomed")
        with pytest.raises(StorageUnavailableError, match=r"gave up writing 'doomed\.pth'"):
            await handle
        with pytest.raises(StorageUnavailableError):
            await tracker.flush()
        fault.left = 0
        assert (await (await tracker.dump(tiny(1), "later"))).path == "later.pth"


async def test_permanent_failures_are_not_retried() -> None:
    fault = FailTimes(1, lambda: trajtrack.StoragePermissionError("denied"))
    async with memory_tracker(fault) as tracker:
        with pytest.raises(trajtrack.StoragePermissionError):
            await (await tracker.dump(tiny(0), "x"))
        assert tracker.statistics().retries == 0
        with pytest.raises(trajtrack.StoragePermissionError):
            await tracker.flush()


async def test_unserializable_object_raises_from_dump_and_nothing_is_queued(
    tmp_path: Path,
) -> None:
    async with Tracker(tmp_path) as tracker:
        with pytest.raises(SerializationError):
            await tracker.dump({"fn": lambda x: x}, "lambda")
        with pytest.raises(SerializationError):
            await tracker.dump(threading.Lock(), "lock")
        assert tracker.statistics().enqueued == 0
        await (await tracker.dump(tiny(0), "fine"))
    assert sorted(p.name for p in tmp_path.glob("*.pth")) == ["fine.pth"]


# --------------------------------------------------------------------------- names


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("", "empty"),
        ("/etc/passwd", "absolute"),
        ("../escape", "'..'"),
        ("a/../../b", "'..'"),
        ("a//b", "empty path segment"),
        ("a/", "empty path segment"),
        ("./a", "'.'"),
        ("a\x00b", "control"),
        ("a\nb", "control"),
        ("x" * 256, "longer than 255 bytes"),
        ("é" * 128, "longer than 255 bytes"),  # 256 bytes in UTF-8
        ("a\\b", "backslash"),
        (".hidden", "reserved"),
        ("/".join(["d" * 200] * 30), "4096"),
        (42, "must be a str"),
        (None, "must be a str"),
    ],
)
async def test_invalid_names_are_rejected_before_anything_is_queued(
    tmp_path: Path, name: Any, message: str
) -> None:
    async with Tracker(tmp_path) as tracker:
        with pytest.raises(trajtrack.InvalidNameError, match=message) as info:
            await tracker.dump(tiny(0), name)
        assert isinstance(info.value, ValueError)
        assert tracker.statistics().enqueued == 0
    assert [p for p in tmp_path.rglob("*") if ".trajtrack" not in p.parts] == []


async def test_longest_names_fit_with_their_suffix_and_temp_name(tmp_path: Path) -> None:
    async with Tracker(tmp_path) as tracker:
        longest = "n" * (255 - len(".pth"))
        record = await (await tracker.dump(tiny(0), f"dir/{longest}"))
        assert record.path == f"dir/{longest}.pth"
        with pytest.raises(trajtrack.InvalidNameError, match="255"):
            await tracker.dump(tiny(0), longest + "n")  # fits alone, not with ".pth"
    assert (tmp_path / record.path).exists()


async def test_name_template_keeps_ranks_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    async with Tracker(tmp_path, name_template="{name}.rank{rank}of{world_size}.{pid}") as t:
        record = await (await t.dump(tiny(0), "step1/obs"))
    assert record.path == f"step1/obs.rank3of8.{os.getpid()}.pth"
    assert record.rank == 3
    assert (tmp_path / record.path).exists()


def test_bad_templates_and_options_are_configuration_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="unknown fields"):
        Tracker(tmp_path, name_template="{name}{gpu}")
    with pytest.raises(ConfigurationError, match="must contain"):
        Tracker(tmp_path, name_template="{rank}")
    with pytest.raises(ConfigurationError, match="max_pending_bytes"):
        Tracker(tmp_path, max_pending_bytes=0)
    with pytest.raises(ConfigurationError, match="max_pending_items"):
        Tracker(tmp_path, max_pending_items=-1)
    with pytest.raises(ConfigurationError, match="workers"):
        Tracker(tmp_path, workers=0)
    with pytest.raises(ConfigurationError, match="full_policy"):
        Tracker(tmp_path, full_policy="sometimes")
    with pytest.raises(ConfigurationError, match="on_exists"):
        Tracker(tmp_path, on_exists="merge")  # type: ignore[arg-type]


async def test_existing_name_policy_error(tmp_path: Path) -> None:
    (tmp_path / "taken.pth").write_bytes(b"precious")
    async with Tracker(tmp_path, on_exists="error") as tracker:
        handle = await tracker.dump(tiny(0), "taken")
        with pytest.raises(DumpExistsError):
            await handle
        with pytest.raises(DumpExistsError):
            await tracker.flush()
    assert (tmp_path / "taken.pth").read_bytes() == b"precious"


async def test_existing_name_policy_overwrite_is_the_default(tmp_path: Path) -> None:
    async with Tracker(tmp_path) as tracker:
        await (await tracker.dump(tiny(1), "same"))
        await (await tracker.dump(tiny(2), "same"))
    assert load(tmp_path / "same.pth")["v"][0].item() == 2.0


# --------------------------------------------------------------------------- record and sweep


async def test_record_lists_every_committed_dump(tmp_path: Path) -> None:
    async with Tracker(tmp_path) as tracker:
        records = [await (await tracker.dump(tiny(i), f"r/{i}")) for i in range(5)]
        await tracker.flush()
        await (await tracker.dump(tiny(9), "after_flush"))
    segments = sorted((tmp_path / ".trajtrack" / "records").glob("*.jsonl"))
    assert len(segments) == 2  # one at flush, one at close
    decoded = [decode_segment(seg.read_bytes()) for seg in segments]
    assert [bad for _, bad in decoded] == [0, 0]
    by_path = {entry.path: entry for found, _ in decoded for entry in found}
    assert set(by_path) == {f"r/{i}.pth" for i in range(5)} | {"after_flush.pth"}
    for record in records:
        entry = by_path[record.path]
        data = (tmp_path / record.path).read_bytes()
        assert entry == record
        assert entry.size == len(data)
        assert entry.checksum == f"crc32:{zlib.crc32(data):08x}"
        assert entry.pid == os.getpid()


async def test_stale_temp_files_of_dead_writers_are_swept(tmp_path: Path) -> None:
    who = WriterIdentity.current()
    dead = dataclasses.replace(who, pid=_dead_pid())
    stale = tmp_path / temp_path_for("step/x.pth", dead)
    live = tmp_path / temp_path_for("step/y.pth", dataclasses.replace(who, pid=os.getppid()))
    other_host = tmp_path / temp_path_for("z.pth", dataclasses.replace(dead, host="elsewhere"))
    for path in (stale, live, other_host):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"partial")
    async with Tracker(tmp_path):
        pass
    assert not stale.exists()
    assert live.exists()  # its writer is alive
    assert other_host.exists()  # cannot know whether a remote writer is alive


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


# --------------------------------------------------------------------------- observability


async def test_statistics_count_bytes_and_latency(tmp_path: Path) -> None:
    async with Tracker(tmp_path) as tracker:
        records = [await (await tracker.dump(tiny(i), f"s{i}")) for i in range(4)]
        stats = tracker.statistics()
    assert stats.enqueued == stats.committed == 4
    assert stats.bytes_written == sum(r.size for r in records)
    assert stats.commit_latency_p50 is not None
    assert stats.commit_latency_p99 is not None
    assert stats.commit_latency_p50 <= stats.commit_latency_p99
    assert stats.dropped_total == 0


async def test_custom_serializer(tmp_path: Path) -> None:
    def as_json(obj: Any, out: Any) -> None:
        out.write(json.dumps({k: v.tolist() for k, v in obj.items()}).encode())

    async with Tracker(tmp_path, serializer=as_json, suffix=".json") as tracker:
        await (await tracker.dump({"v": torch.tensor([1, 2])}, "j"))
    assert json.loads((tmp_path / "j.json").read_text()) == {"v": [1, 2]}
