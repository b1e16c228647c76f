"""The local storage's writer process: small files written by a helper, errors as before."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import anyio.to_thread
import pytest

from _support.writer import write_batch
from trajtrack import DumpExistsError, StorageError, StoragePermissionError, Tracker
from trajtrack._exceptions import StorageUnavailableError
from trajtrack.backends import (
    WriteResult,
    _writer_process as writer_process,
    _writer_spawn as writer_spawn,
    checksum_of,
)
from trajtrack.backends.local import LocalStorage
from trajtrack.tracker._payloads import BytesPayload

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the helper is Linux-only here")


def _helper(storage: LocalStorage) -> subprocess.Popen[bytes]:
    writer = storage._writer
    assert writer is not None and writer._process is not None
    return writer._process


async def _storage(path: Path, **options: object) -> LocalStorage:
    storage = LocalStorage(str(path), **options)  # type: ignore[arg-type]
    await storage.prepare()
    return storage


async def test_a_batch_of_small_files_is_written_by_the_helper(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = await _storage(tmp_path / "dest", file_mode=0o640)
    created: list[str] = []
    real_open = os.open

    def recording_open(path: str, flags: int, *args: object, **kwargs: object) -> int:
        created.append(str(path))
        return real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", recording_open)
    items = [(f"s/d{i}.pth", BytesPayload(bytes([i]) * (100 + i))) for i in range(50)]
    outcomes = await storage.write_atomic_many(items, overwrite=True)
    assert outcomes == [
        WriteResult(100 + i, checksum_of(bytes([i]) * (100 + i))) for i in range(50)
    ]
    for i in range(50):
        path = tmp_path / "dest" / "s" / f"d{i}.pth"
        assert path.read_bytes() == bytes([i]) * (100 + i)
        assert stat_mode(path) == 0o640 & ~current_umask()
    assert sorted(p.name for p in (tmp_path / "dest" / "s").iterdir()) == sorted(
        f"d{i}.pth" for i in range(50)
    )
    assert not [path for path in created if ".pth" in path]  # no file opened by this process
    helper = _helper(storage)
    assert helper.poll() is None
    await storage.aclose()
    assert helper.wait(10) == 0


def stat_mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


async def test_each_file_has_its_own_outcome(tmp_path: Path) -> None:
    storage = await _storage(tmp_path / "dest")
    (tmp_path / "dest" / "e").mkdir()
    (tmp_path / "dest" / "e" / "kept.pth").write_bytes(b"old")
    (tmp_path / "dest" / "e" / "adir.pth").mkdir()
    items = [
        ("e/a.pth", BytesPayload(b"a")),
        ("e/kept.pth", BytesPayload(b"new")),  # exists: refused under 'error'
        ("e/adir.pth", BytesPayload(b"x")),  # a directory: link fails (EEXIST too)
        ("e/b.pth", BytesPayload(b"bb")),
    ]
    seen: list[int] = []
    outcomes = await storage.write_atomic_many(
        items, overwrite=False, done=lambda index, _outcome: seen.append(index)
    )
    assert seen == [0, 1, 2, 3]
    assert outcomes[0] == WriteResult(1, checksum_of(b"a"))
    assert isinstance(outcomes[1], DumpExistsError) and "kept.pth exists" in str(outcomes[1])
    assert isinstance(outcomes[2], DumpExistsError)
    assert outcomes[3] == WriteResult(2, checksum_of(b"bb"))
    assert (tmp_path / "dest" / "e" / "kept.pth").read_bytes() == b"old"
    # overwrite: a directory in the way fails the rename with the errno's typed error
    (replaced,) = await storage.write_atomic_many(
        [("e/adir.pth", BytesPayload(b"x"))], overwrite=True
    )
    assert isinstance(replaced, StorageError) and "adir.pth" in str(replaced)
    assert "directory" in str(replaced).lower()
    names = sorted(p.name for p in (tmp_path / "dest" / "e").iterdir())
    assert names == ["a.pth", "adir.pth", "b.pth", "kept.pth"]  # no temporary file left
    await storage.aclose()


async def test_a_directory_through_a_link_leading_out_is_refused(tmp_path: Path) -> None:
    outside, dest = tmp_path / "outside", tmp_path / "dest"
    outside.mkdir()
    storage = await _storage(dest)
    (dest / "link").symlink_to(outside, target_is_directory=True)
    outcomes = await storage.write_atomic_many(
        [("link/x.pth", BytesPayload(b"x")), ("link/new/y.pth", BytesPayload(b"y"))],
        overwrite=True,
    )
    assert all(isinstance(o, StoragePermissionError) for o in outcomes)
    assert list(outside.iterdir()) == []
    await storage.aclose()


async def test_a_helper_that_died_fails_its_files_as_retryable_and_is_replaced(
    tmp_path: Path,
) -> None:
    storage = await _storage(tmp_path / "dest")
    await storage.write_atomic_many([("k/a.pth", BytesPayload(b"a"))], overwrite=True)
    first = _helper(storage)
    first.kill()
    first.wait(10)
    lost = await storage.write_atomic_many([("k/b.pth", BytesPayload(b"b"))], overwrite=True)
    assert isinstance(lost[0], StorageUnavailableError) and lost[0].retryable
    again = await storage.write_atomic_many([("k/c.pth", BytesPayload(b"c"))], overwrite=True)
    assert again == [WriteResult(1, checksum_of(b"c"))]
    assert _helper(storage).pid != first.pid
    await storage.aclose()


async def test_a_tracker_commits_every_dump_when_the_helper_cannot_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writer_spawn, "_CHILD", str(tmp_path / "no-such-helper.py"))
    records = []
    async with Tracker(tmp_path / "run", workers=1) as tracker:
        for start in range(0, 30, 10):  # a batch per flush: a helper started for each
            handles = [await tracker.dump({"i": i}, f"d{i}") for i in range(start, start + 10)]
            await tracker.flush()
            records += [await handle for handle in handles]
        storage = tracker._storage
        assert isinstance(storage, LocalStorage) and storage._writer is not None
        assert not storage._writer.usable  # given up after MAX_STARTS helpers
    assert [r.name for r in records] == [f"d{i}" for i in range(30)]
    assert all((tmp_path / "run" / f"d{i}.pth").exists() for i in range(30))


async def test_it_can_be_turned_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAJTRACK_WRITER_PROCESS", "0")
    off = await _storage(tmp_path / "a")
    assert off._writer is None
    assert (await off.write_atomic_many([("x.pth", BytesPayload(b"x"))], overwrite=True)) == [
        WriteResult(1, checksum_of(b"x"))
    ]
    monkeypatch.delenv("TRAJTRACK_WRITER_PROCESS")
    assert (await _storage(tmp_path / "b"))._writer is not None
    assert (await _storage(tmp_path / "c", writer_process=False))._writer is None


async def test_the_helper_ignores_ctrl_c(tmp_path: Path) -> None:
    storage = await _storage(tmp_path / "dest")
    await storage.write_atomic_many([("a.pth", BytesPayload(b"a"))], overwrite=True)
    helper = _helper(storage)
    helper.send_signal(signal.SIGINT)
    await anyio.sleep(0.2)
    assert helper.poll() is None
    assert await storage.write_atomic_many([("b.pth", BytesPayload(b"b"))], overwrite=True) == [
        WriteResult(1, checksum_of(b"b"))
    ]
    await storage.aclose()


def test_the_helper_exits_when_its_process_is_killed(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import asyncio, os, signal, sys
        from trajtrack.backends.local import LocalStorage
        from trajtrack.tracker._payloads import BytesPayload

        async def main():
            storage = LocalStorage({str(tmp_path / "dest")!r})
            await storage.prepare()
            await storage.write_atomic_many([("a.pth", BytesPayload(b"a"))], overwrite=True)
            print(storage._writer._process.pid, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

        asyncio.run(main())
        """
    )
    # stderr to a file: the helper inherits it, and a pipe would make run() wait for the
    # helper too, which would hide one that outlives its parent.
    with open(tmp_path / "stderr", "w") as stderr:
        done = subprocess.run(
            [sys.executable, "-c", script],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            timeout=120,
        )
    assert done.returncode == -signal.SIGKILL, (tmp_path / "stderr").read_text()
    helper = int(done.stdout.split()[0])
    deadline = time.monotonic() + 10
    while _alive(helper) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(helper)
    assert (tmp_path / "dest" / "a.pth").read_bytes() == b"a"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def test_a_fork_child_starts_its_own_helper(tmp_path: Path) -> None:
    storage = await _storage(tmp_path / "dest")
    await storage.write_atomic_many([("p.pth", BytesPayload(b"p"))], overwrite=True)
    parents = _helper(storage).pid
    pid = os.fork()
    if pid == 0:  # the child: its writer forgot the parent's helper
        code = 1
        try:
            writer = storage._writer
            if writer is not None and writer._process is None:
                storage._write_many_sync([("c.pth", BytesPayload(b"c"))], True, None)
                child = writer._process
                code = 0 if child is not None and child.pid != parents else 2
                writer.close()
        finally:
            os._exit(code)
    _, status = await anyio.to_thread.run_sync(os.waitpid, pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert (tmp_path / "dest" / "c.pth").read_bytes() == b"c"
    assert _helper(storage).pid == parents and _helper(storage).poll() is None
    assert await storage.write_atomic_many([("q.pth", BytesPayload(b"q"))], overwrite=True) == [
        WriteResult(1, checksum_of(b"q"))
    ]
    await storage.aclose()


async def test_writes_after_close_go_through_threads(tmp_path: Path) -> None:
    storage = await _storage(tmp_path / "dest")
    await storage.write_atomic_many([("a.pth", BytesPayload(b"a"))], overwrite=True)
    await storage.aclose()
    assert storage._writer is not None and not storage._writer.usable
    assert await storage.write_atomic_many([("b.pth", BytesPayload(b"b"))], overwrite=True) == [
        WriteResult(1, checksum_of(b"b"))
    ]


async def test_a_storage_dropped_unclosed_lets_its_helper_go(tmp_path: Path) -> None:
    storage = await _storage(tmp_path / "dest")
    await storage.write_atomic_many([("a.pth", BytesPayload(b"a"))], overwrite=True)
    helper = _helper(storage)
    del storage
    gc.collect()
    # it saw its socket close and exited
    assert await anyio.to_thread.run_sync(helper.wait, 10) == 0
    writer_spawn.reap_orphans()
    assert helper not in writer_spawn._ORPHANS


async def test_a_helper_that_does_not_answer_is_killed_after_the_reply_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writer_process, "REPLY_TIMEOUT", 0.5)
    storage = await _storage(tmp_path / "dest")
    await storage.write_atomic_many([("a.pth", BytesPayload(b"a"))], overwrite=True)
    stuck = _helper(storage)
    stuck.send_signal(signal.SIGSTOP)  # a helper stuck on a hung disk
    try:
        (late,) = await storage.write_atomic_many([("b.pth", BytesPayload(b"b"))], overwrite=True)
        assert isinstance(late, StorageUnavailableError) and late.retryable
        assert "timed out" in str(late)
        assert stuck.wait(10) == -signal.SIGKILL  # killed (from the loop: reaped later)
    finally:
        if stuck.poll() is None:
            stuck.kill()
    assert await storage.write_atomic_many([("c.pth", BytesPayload(b"c"))], overwrite=True) == [
        WriteResult(1, checksum_of(b"c"))
    ]
    await storage.aclose()


def test_a_report_that_raises_leaves_no_unread_answers_behind(tmp_path: Path) -> None:
    writer = writer_process.WriterProcess()
    directory = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    # Enough files that the helper is still answering when the first answer's report raises.
    items = [(f".t{i}", f"f{i}", memoryview(b"x" * 100)) for i in range(3000)]
    (tmp_path / "adir").mkdir()

    def raising(index: int, outcome: object) -> None:
        raise RuntimeError("a callback bug")

    try:
        with pytest.raises(RuntimeError, match="callback bug"):
            writer.write(directory, items, overwrite=True, fsync=False, mode=0o644, report=raising)
        again = [(".u", "adir", memoryview(b"yy"))]  # fails: a directory is in the way
        seen = write_batch(writer, directory, again)
        # its own answer, not a "written" left over from the batch before
        ((index, outcome),) = seen
        assert index == 0 and isinstance(outcome, writer_process.Failure)
    finally:
        writer.close()
        os.close(directory)


def test_a_batch_after_close_fails_its_files_without_blaming_a_helper(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    writer = writer_process.WriterProcess()
    writer.close()
    directory = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        seen = [
            outcome
            for _, outcome in write_batch(writer, directory, [(".t", "f", memoryview(b"x"))])
        ]
    finally:
        os.close(directory)
    ((outcome,),) = [seen]
    assert isinstance(outcome, writer_process.WriterGone) and "closed" in str(outcome)
    assert "failed" not in caplog.text
    assert not (tmp_path / "f").exists()
