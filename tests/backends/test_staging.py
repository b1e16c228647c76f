"""Staging memory shared with the writer process: the arena, and staged files written by it."""

from __future__ import annotations

import gc
import os
import sys
import threading
from pathlib import Path

import anyio
import anyio.to_thread
import pytest

from _support.writer import write_batch
from trajtrack.backends import WriteResult, _staging as staging, checksum_of
from trajtrack.backends._staging import Arena, Block, StagedPayload, Staging
from trajtrack.backends._writer_process import Failure
from trajtrack.backends.local import LocalStorage
from trajtrack.tracker._payloads import BytesPayload

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="memfd staging is Linux-only")

PAGE = os.sysconf("SC_PAGE_SIZE")


def _staged(block: Block, data: bytes) -> StagedPayload:
    block.view()[:] = data
    return StagedPayload(block, checksum_of(data))


async def _storage_with_staging(path: Path) -> tuple[LocalStorage, Staging]:
    storage = LocalStorage(str(path))
    await storage.prepare()
    stage = storage.staging()
    assert stage is not None
    return storage, stage


def test_blocks_are_taken_lowest_first_in_whole_pages_and_merge_when_given_back() -> None:
    arena = Arena(8 * PAGE)
    a = arena.take(1)
    b = arena.take(PAGE + 1)  # two pages
    c = arena.take(PAGE)
    assert a is not None and b is not None and c is not None
    assert (a.offset, b.offset, c.offset) == (0, PAGE, 3 * PAGE)
    assert (a.nbytes, b.nbytes) == (1, PAGE + 1)
    assert arena.in_use() == 4 * PAGE
    assert arena.take(5 * PAGE) is None  # four pages free
    a.release()
    c.release()
    again = arena.take(1)
    assert again is not None and again.offset == 0  # the lowest free block
    again.release()
    b.release()
    b.release()  # once only
    assert arena.in_use() == 0
    whole = arena.take(8 * PAGE)  # the free extents merged back into one
    assert whole is not None and whole.offset == 0


def test_a_release_wakes_the_waiters_once_and_a_late_waiter_is_told_at_once() -> None:
    arena = Arena(2 * PAGE)
    block = arena.take(PAGE)
    assert block is not None
    woken: list[str] = []
    since = arena.releases
    assert arena.on_release(lambda: woken.append("first"), since)
    arena.on_release(lambda: woken.append("gone"), since)
    arena.forget(woken.append)  # not registered: no error
    block.release()
    assert woken == ["first", "gone"]
    assert not arena.on_release(lambda: woken.append("late"), since)  # released since
    assert woken == ["first", "gone"]


def test_a_fork_child_neither_takes_nor_gives_back_the_parents_pages() -> None:
    arena = Arena(4 * PAGE)
    block = arena.take(PAGE)
    assert block is not None
    block.view()[:] = b"\xab" * PAGE
    pid = os.fork()
    if pid == 0:  # the child: releasing or trimming must not free the parent's pages
        ok = arena.take(PAGE) is None
        block.release()
        arena.trim()
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert bytes(block.view()) == b"\xab" * PAGE  # still the parent's data
    assert arena.in_use() == PAGE


def test_trim_gives_the_free_pages_back_to_the_system() -> None:
    arena = Arena(16 * PAGE)
    held = arena.take(PAGE)
    freed = arena.take(8 * PAGE)
    assert held is not None and freed is not None
    held.view()[:] = b"h" * PAGE
    freed.view()[:] = b"f" * 8 * PAGE
    assert os.fstat(arena.fd).st_blocks * 512 >= 9 * PAGE
    freed.release()
    arena.trim()
    assert os.fstat(arena.fd).st_blocks * 512 == PAGE  # only the held block's page is left
    assert bytes(held.view()) == b"h" * PAGE


def test_a_staged_payload_written_after_its_release_raises() -> None:
    arena = Arena(2 * PAGE)
    block = arena.take(10)
    assert block is not None
    payload = _staged(block, b"0123456789")
    assert payload.counted() == WriteResult(10, checksum_of(b"0123456789"))
    payload.release()
    assert arena.in_use() == 0
    with pytest.raises(RuntimeError, match="after its block was released"):
        payload.counted()


def test_a_dropped_staged_payload_gives_its_block_back() -> None:
    arena = Arena(2 * PAGE)
    block = arena.take(10)
    assert block is not None
    payload = _staged(block, b"0123456789")
    del payload
    assert arena.in_use() == 0


async def test_freed_waits_for_a_release_from_another_thread() -> None:
    arena = Arena(PAGE)
    block = arena.take(PAGE)
    assert block is not None
    waiter = Staging(arena, lambda: True)
    assert waiter.take(1) is None
    timer = threading.Timer(0.05, block.release)
    timer.start()
    assert await waiter.freed(30.0)
    assert waiter.take(PAGE) is not None


async def test_after_a_wait_that_timed_out_the_next_waits_only_once_a_block_came_back() -> None:
    arena = Arena(2 * PAGE)
    first, second = arena.take(PAGE), arena.take(PAGE)
    assert first is not None and second is not None
    waiter = Staging(arena, lambda: True)
    assert not await waiter.freed(0.01)
    with anyio.fail_after(5):  # would wait the full minute if it waited again
        assert not await waiter.freed(60.0)
    first.release()
    threading.Timer(0.05, second.release).start()
    assert await waiter.freed(30.0)  # a block came back: it waits again


def test_no_block_for_a_writer_process_that_cannot_write() -> None:
    arena = Arena(2 * PAGE)
    assert Staging(arena, lambda: False).take(1) is None
    assert Staging(arena, lambda: True).take(1) is not None


async def test_staged_files_are_written_by_the_helper_with_inline_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage, stage = await _storage_with_staging(tmp_path / "dest")
    on_threads: list[str] = []
    thread_write = storage._write_sync

    def recorded(path: str, *args: object, **kwargs: object) -> WriteResult:
        on_threads.append(path)
        return thread_write(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(storage, "_write_sync", recorded)
    try:
        big = [os.urandom(300_000 + i) for i in range(3)]
        items: list[tuple[str, BytesPayload]] = []
        for i, data in enumerate(big):
            block = stage.take(len(data))
            assert block is not None
            items.append((f"s/big{i}.pth", _staged(block, data)))
            items.append((f"s/small{i}.pth", BytesPayload(b"x" * (i + 1))))
        outcomes = await storage.write_atomic_many(items, overwrite=False)
        assert [type(o) for o in outcomes] == [WriteResult] * 6
        for i, data in enumerate(big):
            assert (tmp_path / "dest/s" / f"big{i}.pth").read_bytes() == data
            assert outcomes[2 * i] == WriteResult(len(data), checksum_of(data))
            assert (tmp_path / "dest/s" / f"small{i}.pth").read_bytes() == b"x" * (i + 1)
        # One staged file alone goes to the helper too.
        block = stage.take(5)
        assert block is not None
        one = _staged(block, b"alone")
        assert await storage.write_atomic("s/alone.pth", one, overwrite=True) == one.counted()
        assert (tmp_path / "dest/s/alone.pth").read_bytes() == b"alone"
        assert on_threads == []  # the helper wrote every one
    finally:
        await storage.aclose()


async def test_a_staged_file_goes_through_a_thread_when_the_helper_is_given_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage, stage = await _storage_with_staging(tmp_path / "dest")
    try:
        block = stage.take(100_000)
        assert block is not None
        data = os.urandom(100_000)
        payload = _staged(block, data)
        writer = storage._writer
        assert writer is not None
        monkeypatch.setattr(writer, "_starts", 99)  # given up: threads only
        assert stage.take(1) is None  # and no new block for it
        result = await storage.write_atomic("d.pth", payload, overwrite=True)
        assert result == WriteResult(len(data), checksum_of(data))
        assert (tmp_path / "dest/d.pth").read_bytes() == data
        assert writer._process is None  # no helper was started
    finally:
        await storage.aclose()


async def test_the_helper_refuses_an_offset_outside_the_arena(tmp_path: Path) -> None:
    storage = LocalStorage(str(tmp_path / "dest"))
    await storage.prepare()
    try:
        writer = storage._writer
        assert writer is not None and writer._arena is not None
        outside = Block(writer._arena, writer._arena.size - PAGE, 2 * PAGE, 0)
        directory = os.open(tmp_path / "dest", os.O_RDONLY | os.O_DIRECTORY)
        try:
            answers = await anyio.to_thread.run_sync(
                write_batch, writer, directory, [(".t", "d", outside)]
            )
        finally:
            os.close(directory)
        outcomes = [outcome for _, outcome in answers]
        assert len(outcomes) == 1 and isinstance(outcomes[0], Failure)
        assert outcomes[0].error == 14  # EFAULT
        assert sorted(p.name for p in (tmp_path / "dest").iterdir()) == [".trajtrack"]
    finally:
        await storage.aclose()


async def test_closing_the_storage_trims_and_closes_its_arena(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage, stage = await _storage_with_staging(tmp_path / "dest")
    block = stage.take(PAGE)
    assert block is not None
    block.view()[:] = b"z" * PAGE
    block.release()
    writer = storage._writer
    assert writer is not None and writer._arena is not None
    arena = writer._arena
    assert os.fstat(arena.fd).st_blocks > 0
    trimmed: list[bool] = []
    monkeypatch.setattr(arena, "trim", lambda: trimmed.append(True))
    await storage.aclose()
    assert trimmed == [True]
    assert arena.fd == -1
    assert stage.take(1) is None  # closed: not usable


def test_no_arena_without_memfd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(os, "memfd_create")
    assert staging.make_arena() is None
    storage = LocalStorage("/tmp/unused-trajtrack-dest")
    assert storage.staging() is None


def test_a_payload_collected_inside_take_gives_its_block_back_without_deadlock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    arena = Arena(4 * PAGE)
    block = arena.take(PAGE)
    assert block is not None
    cycle: list[object] = [_staged(block, b"c" * PAGE)]
    cycle.append(cycle)  # freed only by the cycle collector
    del cycle

    class CollectingBlock(Block):
        def __init__(self, *args: object) -> None:
            gc.collect()  # as the collector may run at any allocation, under the arena's lock
            super().__init__(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(staging, "Block", CollectingBlock)
    taken: list[Block | None] = []
    worker = threading.Thread(target=lambda: taken.append(arena.take(PAGE)), daemon=True)
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), "take() deadlocked on the finalizer's release"
    assert taken[0] is not None
    assert arena.in_use() == PAGE  # the collected payload's block came back
