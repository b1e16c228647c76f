"""Shard spools written by a helper process: bytes where they belong, and what a failure does."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
import torch

from trajtrack import Tracker
from trajtrack.backends import _writer_process as writer_process
from trajtrack.backends._writer_frames import Failure, WriterGone
from trajtrack.tracker import _shard_spool as shard_spool, _shards as shards_module

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the helper is Linux-only here")


@contextlib.contextmanager
def _opened(path: Path, flags: int) -> Iterator[int]:
    fd = os.open(path, flags)
    try:
        yield fd
    finally:
        os.close(fd)


async def _started() -> writer_process.WriterProcess:
    process = writer_process.WriterProcess(arena=False)
    assert await anyio.to_thread.run_sync(process.start)
    return process


async def _close(process: writer_process.WriterProcess) -> None:
    await process.settle_channel()
    await anyio.to_thread.run_sync(process.close)


async def test_pieces_are_written_at_their_offset_and_the_rest_stays(tmp_path: Path) -> None:
    path = tmp_path / "spool"
    path.write_bytes(b"A" * 10)
    process = await _started()
    try:
        with _opened(path, os.O_RDWR) as fd:
            pieces: list[bytes | memoryview] = [b"xy", memoryview(b"z" * 5), b""]
            assert await process.append_async(fd, 4, pieces) is None
            assert await process.append_async(fd, 11, [b"tail"]) is None
            assert os.lseek(fd, 0, os.SEEK_CUR) == 0  # pwrite leaves the shared offset alone
    finally:
        await _close(process)
    assert path.read_bytes() == b"AAAAxyzzzzz" + b"tail"


async def test_a_write_that_fails_comes_back_with_its_errno(tmp_path: Path) -> None:
    path = tmp_path / "spool"
    path.write_bytes(b"")
    process = await _started()
    try:
        with _opened(path, os.O_RDONLY) as fd:  # not for writing: the helper's pwrite fails
            outcome = await process.append_async(fd, 0, [b"data"])
        assert isinstance(outcome, Failure)
        assert (outcome.operation, outcome.error) == ("writing", errno.EBADF)
        with _opened(path, os.O_RDWR) as fd:  # the helper goes on
            assert await process.append_async(fd, 0, [b"next"]) is None
    finally:
        await _close(process)
    assert path.read_bytes() == b"next"


async def test_without_a_started_helper_nothing_is_written(tmp_path: Path) -> None:
    process = writer_process.WriterProcess(arena=False)
    path = tmp_path / "spool"
    path.write_bytes(b"")
    with _opened(path, os.O_RDWR) as fd:
        outcome = await process.append_async(fd, 0, [b"data"])
    assert isinstance(outcome, WriterGone)
    assert path.read_bytes() == b""
    await anyio.to_thread.run_sync(process.close)


def _tiny(i: int) -> dict[str, Any]:
    return {"i": i, "x": torch.arange(8) + i}


def _members(dest: Path) -> dict[str, int]:
    """Every dump in the shards under *dest*: its ``i``."""
    found = {}
    for shard in sorted(dest.rglob("*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                data = tar.extractfile(member)
                assert data is not None
                found[member.name] = torch.load(io.BytesIO(data.read()))["i"]
    return found


async def test_the_spools_of_a_sharded_run_are_written_by_the_helper(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shards_module, "WRITE_AT", 1)  # every batch written at once

    def no_thread(fd: int, pieces: list[Any]) -> None:
        raise AssertionError("a thread wrote the spool")

    monkeypatch.setattr(shard_spool, "_write_all", no_thread)
    async with Tracker(tmp_path / "run", layout="shards", shard_max_bytes=20_000) as tracker:
        for i in range(200):
            await tracker.dump(_tiny(i), f"d{i}")
        await tracker.flush(timeout=60)
        layout = tracker._runner._layout
        assert isinstance(layout, shards_module.ShardsLayout)
        assert layout._spool_writer.written >= 10
        process = layout._spool_writer._process
        assert process is not None and process._process is not None
        helper = process._process
    assert helper.returncode == 0  # closed with the tracker: it finished and exited
    assert _members(tmp_path / "run") == {f"d{i}.pth": i for i in range(200)}


async def _until_spooled(tracker: Tracker) -> None:
    with anyio.fail_after(30):  # a hang guard, not a timing
        while tracker.statistics().pending_items:  # noqa: ASYNC110  (the appender's progress)
            await anyio.sleep(0.005)


async def test_a_helper_lost_mid_shard_hands_its_writes_to_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shards_module, "WRITE_AT", 1)
    async with Tracker(tmp_path / "run", layout="shards", shard_max_age=600) as tracker:
        layout = tracker._runner._layout
        assert isinstance(layout, shards_module.ShardsLayout)
        process = layout._spool_writer._process
        assert process is not None
        for round_ in range(writer_process.MAX_STARTS + 1):  # each new helper killed too
            for i in range(25):  # in the spool, written by the helper
                await tracker.dump(_tiny(1000 * round_ + i), f"r{round_}/d{i}")
            await _until_spooled(tracker)
            helper = process._process
            if helper is not None:
                os.kill(helper.pid, 9)
            for i in range(25, 50):  # the same shard, on
                await tracker.dump(_tiny(1000 * round_ + i), f"r{round_}/d{i}")
            await tracker.flush(timeout=60)
        assert not process.usable  # given up: threads write
        assert tracker.statistics().failed == 0
    found = _members(tmp_path / "run")
    rounds = writer_process.MAX_STARTS + 1
    assert found == {f"r{r}/d{i}.pth": 1000 * r + i for r in range(rounds) for i in range(50)}


async def test_writer_processes_off_means_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAJTRACK_WRITER_PROCESS", "0")
    monkeypatch.setattr(shards_module, "WRITE_AT", 1)
    async with Tracker(tmp_path / "run", layout="shards") as tracker:
        for i in range(20):
            await tracker.dump(_tiny(i), f"d{i}")
        await tracker.flush(timeout=60)
        layout = tracker._runner._layout
        assert isinstance(layout, shards_module.ShardsLayout)
        assert layout._spool_writer._process is None
        assert layout._spool_writer.written == 0
    assert _members(tmp_path / "run") == {f"d{i}.pth": i for i in range(20)}
