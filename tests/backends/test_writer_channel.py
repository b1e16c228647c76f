"""The writer process driven from the event loop: batches in flight together, no thread hop,
the same outcomes and failures as through a thread, and a socket shared safely with threads."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import threading
from pathlib import Path

import anyio
import anyio.to_thread
import pytest

from _support.writer import write_batch
from trajtrack._exceptions import StorageUnavailableError
from trajtrack.backends import (
    WriteResult,
    _writer_child as child,
    _writer_process as writer_process,
    checksum_of,
)
from trajtrack.backends._writer_frames import split_answers
from trajtrack.backends.local import LocalStorage
from trajtrack.tracker._payloads import BytesPayload

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the helper is Linux-only here")


async def _started(path: Path) -> LocalStorage:
    """A storage whose helper runs (the first batch starts it, from a thread)."""
    storage = LocalStorage(str(path))
    await storage.prepare()
    assert await storage.write_atomic_many([("first.pth", BytesPayload(b"0"))], overwrite=True)
    assert storage._writer is not None and storage._writer._process is not None
    return storage


async def _until_in_flight(writer: writer_process.WriterProcess | None, count: int) -> None:
    """Wait until *count* batches are sent and unanswered on the loop's channel."""
    assert writer is not None
    for _ in range(2000):
        channel = writer._channel
        if channel is not None and len(channel._waiting) >= count:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never {count} batches in flight")


def _items(prefix: str, count: int, size: int = 100) -> list[tuple[str, BytesPayload]]:
    return [(f"{prefix}{i}.pth", BytesPayload(bytes([i % 251]) * size)) for i in range(count)]


def _no_thread_writes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the batches that go through a thread (the writer's blocking path)."""
    calls: list[int] = []
    original = writer_process.WriterProcess.write

    def write(self: writer_process.WriterProcess, *args: object, **kwargs: object) -> None:
        calls.append(len(args[1]))  # type: ignore[arg-type]
        original(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(writer_process.WriterProcess, "write", write)
    return calls


async def test_batches_from_the_loop_are_written_without_a_thread_and_in_flight_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = await _started(tmp_path / "dest")
    threads = _no_thread_writes(monkeypatch)
    writer = storage._writer
    assert writer is not None
    most = 0
    original = writer_process.Channel.write

    async def counting(self: writer_process.Channel, *args: object) -> None:
        nonlocal most
        most = max(most, len(self._waiting) + 1)
        await original(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(writer_process.Channel, "write", counting)
    batches = [_items(f"b{n}_", 200, 4096) for n in range(4)]
    results = await asyncio.gather(
        *(storage.write_atomic_many(batch, overwrite=True) for batch in batches)
    )
    assert threads == []  # every batch on the loop
    assert most >= 2  # sent while another was unanswered
    for batch, outcomes in zip(batches, results, strict=True):
        assert outcomes == [payload.counted() for _, payload in batch]
        for path, payload in batch:
            assert (tmp_path / "dest" / path).read_bytes() == bytes(payload.data)
    assert writer._channel is None  # idle: the socket is back with the threads
    assert writer._lock.acquire(blocking=False)
    writer._lock.release()
    await storage.aclose()


async def test_a_helper_killed_with_batches_in_flight_fails_them_as_retryable(
    tmp_path: Path,
) -> None:
    storage = await _started(tmp_path / "dest")
    assert storage._writer is not None and storage._writer._process is not None
    helper = storage._writer._process
    helper.send_signal(signal.SIGSTOP)  # holds the batches in flight
    try:
        writes = [
            asyncio.ensure_future(storage.write_atomic_many(_items(f"k{n}_", 50), overwrite=True))
            for n in range(3)
        ]
        await _until_in_flight(storage._writer, 3)
        helper.kill()
        with anyio.fail_after(20):  # the end of the socket, not the reply timeout (300 s)
            done = await asyncio.gather(*writes)
        for outcomes in done:
            assert all(isinstance(o, StorageUnavailableError) and o.retryable for o in outcomes)
    finally:
        helper.kill()
    assert await anyio.to_thread.run_sync(helper.wait, 10) == -signal.SIGKILL
    again = await storage.write_atomic_many([("again.pth", BytesPayload(b"a"))], overwrite=True)
    assert again == [WriteResult(1, checksum_of(b"a"))]  # a new helper
    assert storage._writer._process is not None and storage._writer._process.pid != helper.pid
    await storage.aclose()


async def test_a_report_that_raises_on_the_loop_breaks_only_that_helper(tmp_path: Path) -> None:
    storage = await _started(tmp_path / "dest")
    assert storage._writer is not None and storage._writer._process is not None
    first = storage._writer._process

    def raising(index: int, outcome: object) -> None:
        raise RuntimeError("a callback bug")

    with pytest.raises(RuntimeError, match="callback bug"), anyio.fail_after(20):
        await storage.write_atomic_many(_items("r", 500), overwrite=True, done=raising)
    assert await anyio.to_thread.run_sync(first.wait, 10) == -signal.SIGKILL
    # No answer of that batch is read as one of the next
    (tmp_path / "dest" / "adir.pth").mkdir()
    outcomes = await storage.write_atomic_many(
        [("ok.pth", BytesPayload(b"ok")), ("adir.pth", BytesPayload(b"no"))], overwrite=True
    )
    assert outcomes[0] == WriteResult(2, checksum_of(b"ok"))
    assert isinstance(outcomes[1], Exception)
    await storage.aclose()


async def test_a_thread_and_the_loop_share_the_helper_without_mixing_answers(
    tmp_path: Path,
) -> None:
    storage = await _started(tmp_path / "dest")
    writer = storage._writer
    assert writer is not None
    (tmp_path / "dest" / "blocked").mkdir()
    seen: list[tuple[int, object]] = []
    directory = os.open(tmp_path / "dest", os.O_RDONLY | os.O_DIRECTORY)

    def from_thread() -> None:  # every one fails: a directory is in the way
        items = [(f".t{i}", "blocked", memoryview(b"x")) for i in range(100)]
        seen.extend(write_batch(writer, directory, items))

    try:
        batches = [_items(f"s{n}_", 300) for n in range(6)]
        loop_writes = [storage.write_atomic_many(b, overwrite=True) for b in batches]
        thread = anyio.to_thread.run_sync(from_thread)
        *results, _ = await asyncio.gather(*loop_writes, thread)
    finally:
        os.close(directory)
    for batch, outcomes in zip(batches, results, strict=True):
        assert outcomes == [payload.counted() for _, payload in batch]
    assert [i for i, _ in seen] == list(range(100))
    assert all(isinstance(o, writer_process.Failure) for _, o in seen)
    await storage.aclose()


def test_a_loop_closed_with_a_batch_in_flight_gives_the_helper_back(tmp_path: Path) -> None:
    async def abandon() -> LocalStorage:
        storage = await _started(tmp_path / "dest")
        assert storage._writer is not None and storage._writer._process is not None
        storage._writer._process.send_signal(signal.SIGSTOP)
        write = asyncio.ensure_future(storage.write_atomic_many(_items("x", 20), overwrite=True))
        await _until_in_flight(storage._writer, 1)
        write.cancel()  # the loop ends: its writer never returns
        return storage

    storage = asyncio.run(abandon())
    writer = storage._writer
    assert writer is not None and writer._channel is not None  # still bound, to a closed loop
    stopped = writer._process
    assert stopped is not None
    directory = os.open(tmp_path / "dest", os.O_RDONLY | os.O_DIRECTORY)
    seen: list[object] = []
    result: list[BaseException] = []

    def from_thread() -> None:
        try:
            answers = write_batch(writer, directory, [(".t", "later.pth", memoryview(b"later"))])
            seen.extend(outcome for _, outcome in answers)
        except BaseException as exc:  # pragma: no cover - reported below
            result.append(exc)

    thread = threading.Thread(target=from_thread)
    thread.start()
    thread.join(20)
    os.close(directory)
    assert not thread.is_alive() and not result
    assert seen == [None]  # written, by a new helper
    assert (tmp_path / "dest" / "later.pth").read_bytes() == b"later"
    assert stopped.wait(10) == -signal.SIGKILL
    writer.close()


async def test_a_directory_removed_and_made_again_gets_the_next_files(tmp_path: Path) -> None:
    storage = await _started(tmp_path / "dest")
    step = tmp_path / "dest" / "step1"
    assert await storage.write_atomic_many([("step1/a.pth", BytesPayload(b"a"))], overwrite=True)
    shutil.rmtree(step)
    step.mkdir()
    outcomes = await storage.write_atomic_many(
        [("step1/b.pth", BytesPayload(b"b"))], overwrite=True
    )
    assert outcomes == [WriteResult(1, checksum_of(b"b"))]
    assert (step / "b.pth").read_bytes() == b"b"  # not in the removed directory
    await storage.aclose()


async def test_close_gives_up_on_batches_that_are_never_answered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writer_process, "STOP_TIMEOUT", 0.3)
    storage = await _started(tmp_path / "dest")
    assert storage._writer is not None and storage._writer._process is not None
    helper = storage._writer._process
    helper.send_signal(signal.SIGSTOP)
    write = asyncio.ensure_future(storage.write_atomic_many(_items("c", 10), overwrite=True))
    await _until_in_flight(storage._writer, 1)
    with anyio.fail_after(10):
        await storage.aclose()
    outcomes = await write
    assert all(isinstance(o, StorageUnavailableError) and o.retryable for o in outcomes)
    assert await anyio.to_thread.run_sync(helper.wait, 10) == -signal.SIGKILL


def test_answers_split_across_reads_are_joined() -> None:
    sent = [(child.WRITTEN, 0, 0), (child.FAILED, child.OP_CREATE, 13), (child.WRITTEN, 0, 0)]
    stream = b"".join(child.RESULT.pack(*answer) for answer in sent)
    received: list[tuple[int, int, int]] = []
    rest = b""
    for start in range(0, len(stream), 4):  # reads that end inside an answer
        answers, rest = split_answers(rest + stream[start : start + 4])
        received += answers
    assert received == sent and rest == b""
