"""A dump's future: settled once, from any thread; waited for from threads and coroutines."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading

import anyio
import pytest

from trajtrack.layouts.records import DumpRecord
from trajtrack.tracker._future import DumpFuture, outcome_of


def _record(name: str = "d") -> DumpRecord:
    return DumpRecord(
        name=name,
        path=f"{name}.pth",
        size=1,
        checksum="crc32:00000000",
        host="h",
        pid=1,
        rank=0,
        writer="w",
        time=0.0,
    )


def _settle_later(future: DumpFuture, **outcome: object) -> threading.Thread:
    ready = threading.Event()

    def run() -> None:
        ready.wait(5)
        future.settle(**outcome)  # type: ignore[arg-type]

    thread = threading.Thread(target=run)
    thread.start()
    ready.set()
    return thread


def test_settled_once_later_outcomes_are_ignored() -> None:
    future = DumpFuture()
    record = _record()
    assert not future.done()
    assert future.settle(record)
    assert not future.settle(error=OSError("late"))
    assert future.done()
    assert future.result() is record
    assert future.exception() is None


def test_a_thread_waits_for_the_outcome_set_by_another() -> None:
    future = DumpFuture()
    error = OSError("disk full")
    thread = _settle_later(future, error=error)
    assert future.exception(timeout=10) is error
    with pytest.raises(OSError, match="disk full"):
        future.result(timeout=0)
    thread.join()


def test_waiting_gives_up_after_the_timeout() -> None:
    future = DumpFuture()
    with pytest.raises(TimeoutError):
        future.result(timeout=0.01)
    with pytest.raises(TimeoutError):
        future.exception(timeout=0)
    assert not future.done()


def test_callbacks_run_once_at_settle_or_at_once_and_a_bad_one_stops_none(
    caplog: pytest.LogCaptureFixture,
) -> None:
    future = DumpFuture()
    seen: list[str] = []

    def bad(_f: DumpFuture) -> None:
        raise ValueError("callback bug")

    future.add_done_callback(lambda f: seen.append("first"))
    future.add_done_callback(bad)
    future.add_done_callback(lambda f: seen.append("third"))
    assert seen == []
    with caplog.at_level(logging.ERROR, logger="trajtrack.tracker._future"):
        future.settle(_record())
    assert seen == ["first", "third"]
    assert "callback bug" in caplog.text
    future.add_done_callback(lambda f: seen.append(f"late {f.done()}"))
    assert seen == ["first", "third", "late True"]
    future.settle(_record("again"))
    assert seen == ["first", "third", "late True"]


async def test_a_coroutine_awaits_an_outcome_set_from_a_thread() -> None:
    future = DumpFuture()
    record = _record()
    thread = _settle_later(future, record=record)
    with anyio.fail_after(10):
        assert await outcome_of(future) is record
    thread.join()


async def test_an_outcome_set_on_the_loop_wakes_its_waiter() -> None:
    future = DumpFuture()
    asyncio.get_running_loop().call_soon(lambda: future.settle(error=KeyError("x")))
    with anyio.fail_after(10), pytest.raises(KeyError):
        await outcome_of(future)


async def test_cancelling_an_await_leaves_the_future_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    future = DumpFuture()
    with anyio.move_on_after(0.01):
        await outcome_of(future)
    assert not future.done()
    record = _record()
    with caplog.at_level(logging.ERROR):
        assert future.settle(record)  # the cancelled wait's callback is harmless
        assert await outcome_of(future) is record
        await asyncio.sleep(0)  # its wake-up, if one was scheduled, has run
    assert caplog.records == []


def test_a_pending_future_is_one_tracked_object() -> None:
    # Why it exists: thousands of dumps wait for their shard at once, and every object the
    # collector tracks for them makes its full collections come sooner.
    gc.collect()
    before = len(gc.get_objects())
    futures = [DumpFuture() for _ in range(1000)]
    after = len(gc.get_objects())
    assert after - before <= 1000 + 10  # the futures and the list holding them
    assert len(futures) == 1000
