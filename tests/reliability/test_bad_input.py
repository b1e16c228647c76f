"""Case 6, bad input: each gives a typed error, never hangs, writes nothing outside the
destination, and leaves the tracker usable.

Faults the real thing cannot produce on demand are simulated, and say so: a tensor whose device
is gone (a copy raising the ``RuntimeError`` CUDA raises), and, where ``mount`` is not permitted,
a read-only or full filesystem (the local backend with ``os`` errors injected). Where ``mount``
works (root in this sandbox), real read-only bind mounts and a real 1 MB tmpfs are used.
"""

from __future__ import annotations

import errno
import random
import subprocess
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import trajtrack
from trajtrack import (
    ConfigurationError,
    InvalidNameError,
    SerializationError,
    StorageError,
    StoragePermissionError,
    TrackerClosedError,
    TrajtrackError,
)
from trajtrack.backends.local import LocalStorage
from trajtrack.layouts.names import is_internal_path
from trajtrack.reader import open_run

from ._proc import final_files

BAD_NAMES = [
    "",
    "/etc/passwd",
    "../escape",
    "a/../../escape",
    "..",
    ".",
    "a//b",
    "a/./b",
    "a/",
    "a\\b",
    "..\\..\\escape",
    "nul\x00byte",
    "new\nline",
    "tab\there",
    "del\x7f",
    ".hidden",
    "step1/.tmp~host~1~ab",
    ".trajtrack/records/forged",
    "x" * 256,
    "é" * 128,  # 256 bytes in UTF-8: over HDFS's component limit
    "a/" * 2100 + "b",  # over 4096 bytes in total
    "z" * 100_000,  # huge
    "lone_\ud800",  # not valid Unicode text: no storage can store it
    "step1/\udcff",  # what os.fsdecode makes of an undecodable byte: a reader's, not a writer's
]
NOT_STRINGS: list[Any] = [None, 3, 3.5, b"bytes", Path("a/b"), ["a"], ("a",), object()]


def _outside(tmp_path: Path, dest: Path) -> list[Path]:
    return [p for p in tmp_path.rglob("*") if dest not in (p, *p.parents)]


@pytest.fixture
async def started(tmp_path: Path) -> AsyncIterator[trajtrack.Tracker]:
    async with trajtrack.Tracker(tmp_path / "dest", record_interval=0.1) as tracker:
        yield tracker


async def _still_usable(tracker: trajtrack.Tracker, name: str = "after/ok") -> None:
    record = await (await tracker.dump({"ok": torch.ones(3)}, name)).wait(30)
    assert record.path == f"{name}.pth"
    await tracker.flush(timeout=30)


@pytest.mark.parametrize("name", BAD_NAMES, ids=lambda n: repr(n)[:24])
async def test_invalid_names_are_refused_before_anything_is_written(
    tmp_path: Path, started: trajtrack.Tracker, name: str
) -> None:
    with anyio.fail_after(30), pytest.raises(InvalidNameError):
        await started.dump({"x": torch.zeros(2)}, name)
    with pytest.raises(InvalidNameError):
        started.dump_nowait({"x": 1}, name)
    assert started.statistics().enqueued == 0
    await _still_usable(started)
    assert _outside(tmp_path, tmp_path / "dest") == []
    assert set(final_files(tmp_path / "dest")) == {"after/ok"}


@pytest.mark.parametrize("layout", ["files", "shards"])
async def test_a_lone_surrogate_fails_only_its_own_dump(tmp_path: Path, layout: str) -> None:
    """Such a name once passed the check and failed later, in the shards appender (which then
    failed the whole tracker, the dumps queued before it included) or on the files layout's
    handle as an untyped UnicodeEncodeError."""
    async with trajtrack.Tracker(tmp_path / "dest", layout=layout) as tracker:
        before = await tracker.dump({"x": torch.ones(2)}, "before")
        with anyio.fail_after(30), pytest.raises(InvalidNameError, match="lone surrogate"):
            await tracker.dump({"x": torch.ones(2)}, "bad_\ud800")
        await before.wait(30)
        await _still_usable(tracker)
    async with open_run(tmp_path / "dest") as run:
        assert sorted(info.name for info in await run.list()) == ["after/ok", "before"]


def test_only_new_names_must_be_valid_text() -> None:
    """A reader checks names an operating system listed (os.fsdecode makes an undecodable
    byte a lone surrogate, e.g. an unrecorded shard member named in Latin-1): still names to
    read. Only a name about to be written must be valid Unicode text."""
    from trajtrack.layouts.names import validate_name

    assert validate_name("caf\udce9.pth") == "caf\udce9.pth"
    with pytest.raises(InvalidNameError, match="lone surrogate"):
        validate_name("caf\udce9.pth", new=True)
    assert validate_name("café.pth", new=True) == "café.pth"


def test_the_fast_name_check_agrees_with_the_full_one() -> None:
    """Short ASCII names skip the full check; on random names built from the characters the
    rules are about, both must accept and refuse exactly the same names."""
    from trajtrack.layouts.names import _validate_str, validate_name

    rng = random.Random(1234)
    alphabet = ["a", "b", "0", "_", "-", "~", ".", "/", "\\", "\x00", "\x1f", "\x7f", " ", "é"]
    verdicts = {True: 0, False: 0}
    for _ in range(20_000):
        name = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        if rng.random() < 0.01:
            name = name.replace("a", "a" * 300)  # segments over 255 bytes
        try:
            _validate_str.__wrapped__(name, False)
        except InvalidNameError:
            full = False
        else:
            full = True
        try:
            validate_name(name)
        except InvalidNameError:
            fast = False
        else:
            fast = True
        assert fast == full, name
        verdicts[full] += 1
    assert verdicts[True] > 1000 and verdicts[False] > 1000  # both kinds were exercised


@pytest.mark.parametrize("name", NOT_STRINGS, ids=lambda n: type(n).__name__)
async def test_names_that_are_not_strings(started: trajtrack.Tracker, name: Any) -> None:
    with anyio.fail_after(30), pytest.raises(InvalidNameError, match="must be a str"):
        await started.dump({"x": 1}, name)
    await _still_usable(started)


async def test_a_template_cannot_smuggle_a_bad_name(tmp_path: Path) -> None:
    async with trajtrack.Tracker(tmp_path / "dest", name_template="{name}/../{rank}") as tracker:
        with pytest.raises(InvalidNameError):
            await tracker.dump({"x": 1}, "a")
    with pytest.raises(ConfigurationError):
        trajtrack.Tracker(tmp_path / "dest", name_template="{name}{__class__}")
    with pytest.raises(InvalidNameError):
        trajtrack.Tracker(tmp_path / "dest", suffix="/../x")


class _ReduceRaises:
    def __reduce__(self) -> Any:
        raise ValueError("refusing to be pickled")


class _LostDeviceTensor(torch.Tensor):
    """Simulates a tensor whose device is gone: reading it raises CUDA's kind of RuntimeError."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")


UNSERIALIZABLE: dict[str, Any] = {
    "lambda": lambda x: x,
    "lock": threading.Lock(),
    "dict_with_lock": {"step": 1, "lock": threading.Lock()},
    "generator": (i for i in range(3)),
    "reduce_raises": _ReduceRaises(),
    "reduce_raises_nested": {"ok": torch.ones(2), "bad": [_ReduceRaises()]},
    "lost_device_tensor_subclass": torch.ones(4).as_subclass(_LostDeviceTensor),
}


@pytest.mark.parametrize("kind", sorted(UNSERIALIZABLE))
async def test_unserializable_objects(
    tmp_path: Path, started: trajtrack.Tracker, kind: str
) -> None:
    with anyio.fail_after(30), pytest.raises(SerializationError):
        await started.dump(UNSERIALIZABLE[kind], f"bad/{kind}")
    with pytest.raises(SerializationError):
        started.dump_nowait(UNSERIALIZABLE[kind], f"bad/{kind}")
    await _still_usable(started)
    assert set(final_files(tmp_path / "dest")) == {"after/ok"}  # nothing half-written


async def test_plain_tensor_on_a_lost_device(
    tmp_path: Path, started: trajtrack.Tracker, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Simulated: the snapshot copy of a plain tensor raises what CUDA raises for a lost device.
    import trajtrack.tracker._payloads as payloads
    import trajtrack.tracker._snapshot as snapshot

    def lost(*_args: Any) -> Any:
        raise RuntimeError("CUDA error: device not ready (simulated)")

    monkeypatch.setattr(snapshot, "_copy_tensor", lost)  # copied (larger dumps)
    monkeypatch.setattr(payloads, "archive_plan", lost)  # serialized at once (small dumps)
    with anyio.fail_after(30), pytest.raises(SerializationError, match="device not ready"):
        await started.dump({"obs": torch.ones(8)}, "bad/lost")
    big = {"obs": torch.ones(1 << 19)}  # copied in a worker thread: same error, same type
    with anyio.fail_after(30), pytest.raises(SerializationError):
        await started.dump(big, "bad/lost_big")
    monkeypatch.undo()
    await _still_usable(started)


@pytest.mark.parametrize(
    "options",
    [
        {"max_pending_bytes": 0},
        {"max_pending_bytes": -1},
        {"max_pending_items": 0},
        {"max_pending_items": -5},
        {"workers": 0},
        {"workers": -1},
        {"exit_timeout": -1},
        {"record_interval": 0},
        {"full_policy": "sometimes"},
        {"on_exists": "append"},
    ],
    ids=str,
)
def test_bad_budgets_and_options(tmp_path: Path, options: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        trajtrack.Tracker(tmp_path / "dest", **options)
    assert not (tmp_path / "dest").exists()


def test_bad_retry_policies() -> None:
    for bad in ({"deadline": -1}, {"initial_backoff": -1}, {"multiplier": 0.5}, {"jitter": 2}):
        with pytest.raises(ConfigurationError):
            trajtrack.RetryPolicy(**bad)


async def test_dump_after_close_and_double_close(tmp_path: Path) -> None:
    tracker = trajtrack.Tracker(tmp_path / "dest")
    with pytest.raises(trajtrack.TrackerStateError):
        await tracker.dump({"x": 1}, "early")
    await tracker.start()
    await tracker.dump({"x": 1}, "a")
    await tracker.aclose(timeout=30)
    await tracker.aclose(timeout=30)  # idempotent
    for call in (
        lambda: tracker.dump({"x": 1}, "b"),
        lambda: tracker.flush(timeout=5),
    ):
        with anyio.fail_after(30), pytest.raises(TrackerClosedError):
            await call()
    with pytest.raises(TrackerClosedError):
        tracker.dump_nowait({"x": 1}, "c")
    assert set(final_files(tmp_path / "dest")) == {"a"}


def test_sync_dump_after_close_and_double_close(tmp_path: Path) -> None:
    tracker = trajtrack.SyncTracker(tmp_path / "dest")
    tracker.dump({"x": 1}, "a").result(30)
    tracker.close(timeout=30)
    tracker.close(timeout=30)
    with pytest.raises(TrackerClosedError):
        tracker.dump({"x": 1}, "b")
    with pytest.raises(TrackerClosedError):
        tracker.flush(timeout=5)


async def test_flush_from_inside_a_done_callback(started: trajtrack.Tracker) -> None:
    # Async tracker: the callback runs on the tracker's loop; it can only schedule a flush.
    flushed = anyio.Event()
    outcome: list[BaseException | None] = []

    async def flush_now() -> None:
        try:
            await started.flush(timeout=30)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)
        flushed.set()

    import asyncio

    tasks: list[Any] = []
    handle = await started.dump({"x": 1}, "cb/a")
    handle.add_done_callback(lambda _h: tasks.append(asyncio.ensure_future(flush_now())))
    with anyio.fail_after(30):
        await handle
        await flushed.wait()
    assert outcome == [None]
    await _still_usable(started)


def test_sync_flush_from_inside_a_done_callback_does_not_deadlock(tmp_path: Path) -> None:
    # Sync shim: the callback runs on the shim's event-loop thread, where a blocking flush
    # would wait for itself. It must fail fast with an error, not hang.
    tracker = trajtrack.SyncTracker(tmp_path / "dest")
    try:
        seen: list[BaseException | None] = []
        on_own_thread: list[bool] = []
        done = threading.Event()
        caller = threading.get_ident()

        def callback(_handle: trajtrack.DumpHandle) -> None:
            on_own_thread.append(threading.get_ident() != caller)
            try:
                tracker.flush(timeout=5)
                seen.append(None)
            except BaseException as exc:
                seen.append(exc)
            done.set()

        tracker.dump({"x": 1}, "cb/a").add_done_callback(callback)
        assert done.wait(30), "flush inside the callback hung"
        if on_own_thread[0]:  # the usual case: the callback ran where the dump committed
            assert isinstance(seen[0], trajtrack.TrackerStateError), seen
            assert "own thread" in str(seen[0])
        else:  # the dump had already committed: the callback ran here, and flush works
            assert seen[0] is None, seen
        tracker.dump({"x": 2}, "cb/b").result(30)
        tracker.flush(timeout=30)
    finally:
        tracker.close(timeout=30)


async def test_destination_that_is_a_file(tmp_path: Path) -> None:
    target = tmp_path / "a-file"
    target.write_bytes(b"precious")
    with anyio.fail_after(30), pytest.raises(ConfigurationError, match="not a directory"):
        async with trajtrack.Tracker(target):
            pass
    assert target.read_bytes() == b"precious"
    with anyio.fail_after(30), pytest.raises(StorageError):
        async with trajtrack.Tracker(target / "below"):
            pass


# --------------------------------------------------------------------------- mounts


def _mount(*args: str) -> bool:
    try:
        done = subprocess.run(["mount", *args], capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30, check=False)


@pytest.fixture
def readonly_dir(tmp_path: Path) -> Iterator[Path]:
    """A real read-only directory: a read-only bind mount (root ignores permission bits)."""
    source, target = tmp_path / "src", tmp_path / "ro"
    source.mkdir()
    target.mkdir()
    if not _mount("--bind", str(source), str(target)):
        pytest.skip("mount is not permitted here (the injected-EROFS test covers this)")
    if not _mount("-o", "remount,bind,ro", str(target)):
        _umount(target)
        pytest.skip("read-only remount is not permitted here")
    try:
        yield target
    finally:
        _umount(target)


async def test_destination_on_a_read_only_mount(readonly_dir: Path) -> None:
    with anyio.fail_after(30), pytest.raises(StoragePermissionError):
        async with trajtrack.Tracker(readonly_dir / "run"):
            pass


async def test_destination_becomes_read_only_then_writable(tmp_path: Path) -> None:
    source, target = tmp_path / "src", tmp_path / "mnt"
    source.mkdir()
    target.mkdir()
    if not _mount("--bind", str(source), str(target)):
        pytest.skip("mount is not permitted here (the injected-EROFS test covers this)")
    try:
        async with trajtrack.Tracker(target / "run") as tracker:
            await _still_usable(tracker, "before")
            assert _mount("-o", "remount,bind,ro", str(target))
            handle = await tracker.dump({"x": torch.ones(4)}, "while_ro")
            with anyio.fail_after(30), pytest.raises(StoragePermissionError):
                await handle
            with anyio.fail_after(30), pytest.raises(StoragePermissionError):
                await tracker.flush(timeout=30)  # the failure is re-raised, not swallowed
            assert _mount("-o", "remount,bind,rw", str(target))
            await _still_usable(tracker, "after")
        assert set(final_files(target / "run")) == {"before", "after"}
    finally:
        _umount(target)


async def test_disk_full_then_space_freed(tmp_path: Path) -> None:
    target = tmp_path / "small"
    target.mkdir()
    if not _mount("-t", "tmpfs", "-o", "size=1m", "tmpfs", str(target)):
        pytest.skip("mount is not permitted here (the injected-ENOSPC test covers this)")
    try:
        async with trajtrack.Tracker(target / "run", record=False) as tracker:
            filler = await tracker.dump({"x": torch.ones(96 * 1024)}, "filler")  # ~384 KB
            await filler.wait(30)
            handle = await tracker.dump({"x": torch.ones(256 * 1024)}, "too_big")  # ~1 MB
            with anyio.fail_after(30), pytest.raises(StorageError, match="no space left"):
                await handle
            with anyio.fail_after(30), pytest.raises(StorageError):
                await tracker.flush(timeout=30)
            assert not any(is_internal_path(p) for p in _files(target / "run")), "temp left"
            (target / "run" / "filler.pth").unlink()  # space freed
            retry = await tracker.dump({"x": torch.ones(128 * 1024)}, "fits_now")  # ~512 KB
            await retry.wait(30)
            await tracker.flush(timeout=30)
        assert set(final_files(target / "run")) == {"fits_now"}
    finally:
        _umount(target)


def _files(root: Path) -> list[str]:
    return [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()]


# --------------------------------------------------------------------------- injected faults


class _FaultyLocal(LocalStorage):
    """The local backend with an ``OSError`` injected into file creation while ``fault`` is set.

    For sandboxes where ``mount`` is not permitted (root ignores permission bits), so that the
    translation of EROFS / EACCES / ENOSPC and the recovery path are still exercised.
    """

    fault: int | None = None

    def _write_temp(self, directory: int, temp: str, payload: Any) -> Any:
        if self.fault is not None:
            raise OSError(self.fault, __import__("os").strerror(self.fault), temp)
        return super()._write_temp(directory, temp, payload)


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (errno.EROFS, StoragePermissionError),
        (errno.EACCES, StoragePermissionError),
        (errno.ENOSPC, StorageError),
        (errno.EIO, StorageError),
    ],
    ids=["EROFS", "EACCES", "ENOSPC", "EIO"],
)
async def test_injected_filesystem_errors_then_recovery(
    tmp_path: Path, code: int, expected: type[Exception]
) -> None:
    storage = _FaultyLocal(str(tmp_path / "dest"))
    async with trajtrack.Tracker(tmp_path / "dest", storage=storage) as tracker:
        storage.fault = code
        handle = await tracker.dump({"x": torch.ones(4)}, "failing")
        with anyio.fail_after(30), pytest.raises(expected):
            await handle
        with anyio.fail_after(30), pytest.raises(expected):
            await tracker.flush(timeout=30)
        storage.fault = None
        await _still_usable(tracker)
    assert set(final_files(tmp_path / "dest")) == {"after/ok"}
    assert _outside(tmp_path, tmp_path / "dest") == []


# --------------------------------------------------------------------------- HDFS


async def test_unreachable_hdfs_at_start() -> None:
    # Port 9 (discard) on 127.0.0.1: connection refused at once; retried, then a typed error.
    tracker = trajtrack.Tracker(
        "webhdfs://127.0.0.1:9/user/nobody/run",
        storage_options={"prepare_timeout": 3, "timeout": 2},
    )
    with anyio.fail_after(60), pytest.raises(TrajtrackError) as info:
        await tracker.start()
    assert isinstance(info.value, StorageError | ConfigurationError), info.value
    await tracker.aclose()


async def test_hdfs_url_without_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("HADOOP_CONF_DIR", "HADOOP_HOME", "TRAJTRACK_WEBHDFS_URL"):
        monkeypatch.delenv(var, raising=False)
    with anyio.fail_after(30), pytest.raises(ConfigurationError, match="HADOOP_CONF_DIR"):
        async with trajtrack.Tracker("hdfs://nameservice1/user/me/run"):
            pass
