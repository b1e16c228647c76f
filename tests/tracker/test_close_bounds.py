"""Bounds of close and flush (tracker/_runner.py): a cancelled close still finishes, a flush
and a second close keep their own timeouts over a hung storage, a dump admitted from a thread
as the tracker fails is not left pending."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from trajtrack import (
    StoragePermissionError,
    SyncTracker,
    Tracker,
    TrackerFailedError,
    TrackerState,
)
from trajtrack.backends import Payload, WriteResult
from trajtrack.backends.local import LocalStorage
from trajtrack.backends.memory import MemoryStorage
from trajtrack.layouts.records import decode_segment
from trajtrack.tracker._ledger import Ledger

#: The longest any hang here lasts; each test releases its hang before that.
HANG = 4.0


class Hang:
    """A fault: writes whose path starts with *prefix* wait for ``release`` (at most HANG s),
    then raise *error* if one is given."""

    def __init__(self, prefix: str, error: Exception | None = None) -> None:
        self.prefix = prefix
        self.error = error
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, operation: str, path: str) -> None:
        if operation == "write" and path.startswith(self.prefix):
            self.entered.set()
            self.release.wait(HANG)
            if self.error is not None:
                raise self.error


class CountingStorage(MemoryStorage):
    """A memory storage that counts its ``aclose`` calls."""

    closed = 0

    async def aclose(self) -> None:
        self.closed += 1
        await super().aclose()


class ShardsHangLocal(LocalStorage):
    """The local storage, but a shard's upload waits for ``release`` (in a thread)."""

    release = threading.Event()
    entered = threading.Event()
    closed = 0

    async def write_atomic(self, path: str, payload: Payload, *, overwrite: bool) -> WriteResult:
        if path.startswith(".trajtrack/shards"):
            self.entered.set()
            await anyio.to_thread.run_sync(self.release.wait, HANG)
        return await super().write_atomic(path, payload, overwrite=overwrite)

    async def aclose(self) -> None:
        self.closed += 1
        await super().aclose()


def tiny(i: int) -> dict[str, Any]:
    return {"i": i, "x": torch.full((4,), float(i))}


def recorded(files: dict[str, bytes]) -> list[str]:
    """The dump paths listed by the record segments among *files* (path -> bytes)."""
    paths = []
    for path, data in files.items():
        if ".trajtrack/records/" in path:
            entries, bad = decode_segment(data)
            assert bad == 0
            paths += [entry.path for entry in entries]
    return sorted(paths)


def memory_files(store: str) -> dict[str, bytes]:
    return {path: data for path, (data, _) in MemoryStorage._stores[store].items()}


# --------------------------------------------------------------------------- cancelled close


async def test_a_cancelled_aclose_still_drains_records_and_releases() -> None:
    fault = Hang("slow")
    storage = CountingStorage("memory://cancel/run", fault=fault)
    tracker = Tracker("memory://cancel/run", storage=storage, workers=1)
    await tracker.start()
    handles = [await tracker.dump(tiny(0), "slow")]
    handles += [await tracker.dump(tiny(i), f"d{i}") for i in range(1, 4)]
    await anyio.to_thread.run_sync(fault.entered.wait, 10)
    closing = asyncio.create_task(tracker.aclose(timeout=10))
    await asyncio.sleep(0.1)
    closing.cancel()
    asyncio.get_running_loop().call_later(0.3, fault.release.set)
    started = time.monotonic()
    with anyio.fail_after(8), pytest.raises(asyncio.CancelledError):
        await closing  # the cancellation goes on, once the close has done its work
    assert time.monotonic() - started >= 0.2
    assert tracker.state is TrackerState.CLOSED
    assert storage.closed == 1
    assert all(h.done() for h in handles)
    written = sorted([(await h).path for h in handles])
    assert recorded(memory_files("cancel")) == written  # the final record was written


async def test_an_async_with_exit_cancelled_while_sealing_still_records(tmp_path: Path) -> None:
    ShardsHangLocal.release.clear()
    ShardsHangLocal.entered.clear()
    storage = ShardsHangLocal(str(tmp_path))
    handles = []
    tracker = Tracker(tmp_path, storage=storage, layout="shards", shard_max_age=60, exit_timeout=10)
    loop = asyncio.get_running_loop()
    with anyio.CancelScope() as outer:  # an outer timeout, a task group's cancellation, ...
        async with tracker:
            handles = [await tracker.dump(tiny(i), f"s/{i}") for i in range(5)]
            # the last shard is sealed when the block is left: cancel during that upload
            loop.call_later(0.3, outer.cancel)
            loop.call_later(0.6, ShardsHangLocal.release.set)
    assert outer.cancelled_caught
    assert ShardsHangLocal.entered.is_set()
    assert tracker.state is TrackerState.CLOSED
    assert storage.closed == 1
    written = sorted([(await h).path for h in handles])
    assert len(written) == 5
    files = {
        str(p.relative_to(tmp_path)): p.read_bytes()
        for p in (tmp_path / ".trajtrack" / "records").glob("*.jsonl")
    }
    assert recorded(files) == written


# --------------------------------------------------------------------------- flush bounds


async def test_flush_times_out_while_the_record_write_hangs() -> None:
    fault = Hang(".trajtrack/records")
    storage = MemoryStorage("memory://flushrec/run", fault=fault)
    tracker = Tracker("memory://flushrec/run", storage=storage, exit_timeout=5)
    await tracker.start()
    try:
        await (await tracker.dump(tiny(0), "x"))
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="while writing the record segment: 0 of the"):
            await tracker.flush(timeout=0.5)
        assert time.monotonic() - started < 0.5 + 1.5
    finally:
        fault.release.set()
    await tracker.aclose(5)  # the abandoned record write finishes; close records the rest
    assert recorded(memory_files("flushrec")) == ["x.pth"]


async def test_flush_times_out_while_a_shard_upload_hangs() -> None:
    fault = Hang(".trajtrack/shards")
    storage = MemoryStorage("memory://flushshard/run", fault=fault)
    tracker = Tracker("memory://flushshard/run", storage=storage, layout="shards", shard_max_age=60)
    await tracker.start()
    try:
        handle = await tracker.dump(tiny(0), "x")
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="the open shard: 1 of the 1 dumps"):
            await tracker.flush(timeout=0.5)
        assert time.monotonic() - started < 0.5 + 1.5
    finally:
        fault.release.set()
    # the upload was not cut off: it completes and settles the dump
    assert (await handle.wait(10)).path == "x.pth"
    await tracker.aclose(5)


# --------------------------------------------------------------------------- concurrent close


async def closing_over_a_hang(
    store: str, error: Exception | None = None, timeout: float | None = 10
) -> tuple[Hang, Tracker, asyncio.Task[None], CountingStorage]:
    """A tracker whose one dump's write hangs (then raises *error*), and its close under way."""
    fault = Hang("x", error)
    storage = CountingStorage(f"memory://{store}/run", fault=fault)
    tracker = Tracker(f"memory://{store}/run", storage=storage)
    await tracker.start()
    await tracker.dump(tiny(0), "x")
    await anyio.to_thread.run_sync(fault.entered.wait, 10)
    first = asyncio.create_task(tracker.aclose(timeout=timeout))
    await asyncio.sleep(0.05)
    return fault, tracker, first, storage


async def test_a_second_aclose_keeps_its_own_timeout() -> None:
    fault, tracker, first, _ = await closing_over_a_hang("twice")
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="under way"):
            await tracker.aclose(timeout=0.5)
        assert time.monotonic() - started < 0.5 + 1.5
    finally:
        fault.release.set()
    with anyio.fail_after(8):
        await first


async def test_a_second_aclose_reports_what_the_first_one_raised() -> None:
    fault, tracker, first, _ = await closing_over_a_hang(
        "outcome", StoragePermissionError("no access")
    )
    asyncio.get_running_loop().call_later(0.2, fault.release.set)
    with anyio.fail_after(8), pytest.raises(StoragePermissionError):
        await tracker.aclose(timeout=5)
    with anyio.fail_after(8), pytest.raises(StoragePermissionError):
        await first


async def test_a_cancelled_aclose_without_a_budget_stops_draining(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No timeout, then cancelled: the drain is cut short at once (not waiting out the hung
    write), the final steps get their grace, the storage is released."""
    fault, tracker, first, storage = await closing_over_a_hang("cut", timeout=None)
    started = time.monotonic()
    first.cancel()
    try:
        with anyio.fail_after(8), pytest.raises(asyncio.CancelledError):
            await first
        assert time.monotonic() - started < HANG - 1  # the grace periods, not the hang
    finally:
        fault.release.set()
    assert tracker.state is TrackerState.CLOSED
    assert storage.closed == 1
    assert "1 dumps were not written before the close was cancelled" in caplog.text


# --------------------------------------------------------------------------- admit vs crash


def test_a_threadsafe_dump_admitted_as_the_tracker_fails_fails_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The job is in the queue, the ledger does not hold it yet, and the tracker fails (its
    start): the crash drains the queue. The handle must fail, not stay pending."""
    go = threading.Event()

    def refuse(operation: str, _path: str) -> None:
        if operation == "prepare":
            go.wait(HANG)
            raise KeyError("storage broke at start")

    storage = MemoryStorage("memory://race/run", fault=refuse)
    tracker = SyncTracker("memory://race/run", storage=storage, exit_timeout=2)
    admitted = Ledger.admitted

    def late_admitted(self: Ledger, job: Any) -> Any:
        if threading.current_thread().name == "producer":
            go.set()  # queued: now let the start fail, and wait until it has
            deadline = time.monotonic() + HANG
            while tracker.statistics().state != "failed" and time.monotonic() < deadline:
                time.sleep(0.01)
        return admitted(self, job)

    monkeypatch.setattr(Ledger, "admitted", late_admitted)
    box: dict[str, Any] = {}
    producer = threading.Thread(
        target=lambda: box.setdefault("h", tracker.dump(tiny(0), "x")), name="producer"
    )
    producer.start()
    producer.join(10)
    assert tracker.statistics().state == "failed"
    error = box["h"].exception(timeout=3)
    assert isinstance(error, TrackerFailedError)
    assert isinstance(error.__cause__, KeyError)
    with pytest.raises(TrackerFailedError):
        tracker.close(2)
