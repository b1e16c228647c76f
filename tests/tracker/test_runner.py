"""The tracker's lifecycle (tracker/_runner.py): a supervised background task, failed starts."""

from __future__ import annotations

import gc
import logging
import os
import threading
from typing import Any

import anyio
import pytest
import torch

from trajtrack import (
    StoragePermissionError,
    Tracker,
    TrackerFailedError,
    TrackerState,
)
from trajtrack.backends import register_backend
from trajtrack.backends.memory import MemoryStorage
from trajtrack.layouts.names import WriterIdentity, temp_path_for


class CountingStorage(MemoryStorage):
    """A memory storage that counts its ``aclose`` calls."""

    closed = 0

    async def aclose(self) -> None:
        self.closed += 1
        await super().aclose()


class RecordWritesExplode:
    """A fault: record segments fail with an unexpected exception type; dumps named slow* wait."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.slow_entered = threading.Event()

    def __call__(self, operation: str, path: str) -> None:
        if operation != "write":
            return
        if path.startswith(".trajtrack/records"):
            raise KeyError("the storage's own bug")
        if path.startswith("slow"):
            self.slow_entered.set()
            self.release.wait(timeout=60)


def tiny(i: int) -> dict[str, Any]:
    return {"i": i, "x": torch.full((4,), float(i))}


async def test_a_failing_background_task_fails_fast_and_loud(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fault = RecordWritesExplode()
    storage = CountingStorage("memory://sup/run", fault=fault)
    tracker = Tracker("memory://sup/run", storage=storage, workers=2, record_interval=0.05)
    await tracker.start()
    slow = await tracker.dump(tiny(0), "slow")  # in flight when the task group dies
    await anyio.to_thread.run_sync(fault.slow_entered.wait, 30)
    await (await tracker.dump(tiny(1), "first")).wait(30)  # committed: the ticker records it
    # flush waits for "slow", which the ticker's failure settles: far sooner than the timeout
    with anyio.fail_after(10), pytest.raises(TrackerFailedError) as flushed:
        await tracker.flush(timeout=30)
    assert tracker.state is TrackerState.FAILED
    assert isinstance(flushed.value.__cause__, KeyError)
    assert "KeyError" in str(flushed.value)
    assert slow.done()  # the pending dump failed with the cause, not left hanging
    pending_error = slow.exception(timeout=0)
    assert isinstance(pending_error, TrackerFailedError)
    assert isinstance(pending_error.__cause__, KeyError)
    with pytest.raises(TrackerFailedError):
        await tracker.dump(tiny(2), "later")
    stats = tracker.statistics()
    assert stats.state == "failed"
    assert stats.failure is not None and "KeyError" in stats.failure
    fault.release.set()
    with anyio.fail_after(10), pytest.raises(TrackerFailedError):
        await tracker.aclose(timeout=30)
    assert storage.closed == 1
    assert tracker.state is TrackerState.CLOSED
    gc.collect()
    assert "never retrieved" not in caplog.text
    assert any(r.levelno == logging.ERROR and "failed" in r.getMessage() for r in caplog.records)


async def test_threads_waiting_for_space_get_the_failure() -> None:
    fault = RecordWritesExplode()
    storage = CountingStorage("memory://sup2/run", fault=fault)
    tracker = Tracker(
        "memory://sup2/run", storage=storage, workers=1, record_interval=0.05, max_pending_items=1
    )
    await tracker.start()
    await (await tracker.dump(tiny(0), "first")).wait(30)
    await tracker.dump(tiny(1), "slow")  # holds the only slot
    await anyio.to_thread.run_sync(fault.slow_entered.wait, 30)

    def blocked_producer() -> BaseException | None:
        try:
            tracker.dump_threadsafe(tiny(2), "waits", timeout=30)
        except BaseException as exc:
            return exc
        return None

    with anyio.fail_after(10):
        error = await anyio.to_thread.run_sync(blocked_producer)
    assert isinstance(error, TrackerFailedError)
    fault.release.set()
    with pytest.raises(TrackerFailedError):
        await tracker.aclose(timeout=30)


def _counting_factory(storages: list[CountingStorage], fault: Any) -> Any:
    def make(url: str, **_options: Any) -> CountingStorage:
        storage = CountingStorage("memory://" + url.partition("://")[2], fault=fault)
        storages.append(storage)
        return storage

    return make


async def test_a_failed_prepare_closes_the_storage_it_opened() -> None:
    storages: list[CountingStorage] = []

    def refuse(operation: str, _path: str) -> None:
        if operation == "prepare":
            raise StoragePermissionError("no access")

    register_backend("refusing", _counting_factory(storages, refuse))
    tracker = Tracker("refusing://x/run")
    with pytest.raises(StoragePermissionError):
        await tracker.start()
    assert [s.closed for s in storages] == [1]
    assert tracker.state is TrackerState.NEW
    await tracker.aclose()  # nothing left to close twice
    assert [s.closed for s in storages] == [1]


async def test_a_failed_sweep_closes_the_storage_it_opened() -> None:
    storages: list[CountingStorage] = []

    def no_delete(operation: str, _path: str) -> None:
        if operation == "delete":
            raise StoragePermissionError("cannot delete")

    register_backend("nodelete", _counting_factory(storages, no_delete))
    dead = WriterIdentity.current()
    dead = WriterIdentity(dead.host, _dead_pid(), 0, 0, 1)
    MemoryStorage("memory://y/run").put_raw(temp_path_for("a.pth", dead), b"partial")
    with pytest.raises(StoragePermissionError):
        await Tracker("nodelete://y/run").start()
    assert [s.closed for s in storages] == [1]


async def test_closing_a_tracker_that_never_started_closes_a_given_storage() -> None:
    storage = CountingStorage("memory://z/run")
    await Tracker("memory://z/run", storage=storage).aclose()
    assert storage.closed == 1


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid
