from __future__ import annotations

import gc
import io
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

from trajtrack import ConfigurationError, StoragePermissionError
from trajtrack.backends import (
    Storage,
    WriteResult,
    checksum_of,
    open_storage,
    write_payload_unbuffered,
)
from trajtrack.backends.local import LocalStorage
from trajtrack.tracker._payloads import BytesPayload
from trajtrack.tracker._snapshot import snapshot_plain

from .contract import Plant, StorageContract


class _LocalPlant:
    @pytest.fixture
    def plant(self, storage: LocalStorage) -> Plant:
        async def put(path: str, data: bytes) -> None:
            target = storage.root / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)

        return put


class TestLocalContract(_LocalPlant, StorageContract):
    @pytest.fixture
    async def storage(self, tmp_path: Path) -> AsyncIterator[Storage]:
        storage = open_storage(str(tmp_path / "dest"))
        await storage.prepare()
        yield storage
        await storage.aclose()


class TestLocalFsyncContract(_LocalPlant, StorageContract):
    @pytest.fixture
    async def storage(self, tmp_path: Path) -> AsyncIterator[Storage]:
        storage = open_storage(f"file://{tmp_path}/dest", fsync=True)
        await storage.prepare()
        yield storage
        await storage.aclose()


async def test_file_url_and_tilde(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    storage = open_storage("~/runs/r1")
    assert isinstance(storage, LocalStorage)
    assert storage.root == tmp_path / "runs" / "r1"  # '~' expanded, unlike the original
    await storage.prepare()
    assert storage.root.is_dir()


async def test_files_get_the_stated_mode(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        storage = LocalStorage(str(tmp_path), file_mode=0o640)
        await storage.prepare()
        await storage.write_atomic("m.pth", BytesPayload(b"x"), overwrite=True)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "m.pth").stat().st_mode) == 0o640


async def test_destination_that_is_a_file(tmp_path: Path) -> None:
    target = tmp_path / "afile"
    target.write_text("not a directory")
    with pytest.raises(ConfigurationError, match="not a directory"):
        await LocalStorage(str(target)).prepare()


async def test_symlink_out_of_the_destination_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "step1").symlink_to(outside)
    storage = LocalStorage(str(dest))
    await storage.prepare()
    with pytest.raises(StoragePermissionError, match="outside the destination"):
        await storage.write_atomic("step1/x.pth", BytesPayload(b"x"), overwrite=True)
    assert list(outside.iterdir()) == []


async def test_no_directory_is_created_outside_through_a_link(tmp_path: Path) -> None:
    # The link is an intermediate directory: the old mkdir(parents=True) created
    # outside/newdir before the containment check refused the write.
    outside, dest = tmp_path / "outside", tmp_path / "dest"
    outside.mkdir()
    dest.mkdir()
    (dest / "link").symlink_to(outside, target_is_directory=True)
    storage = LocalStorage(str(dest))
    await storage.prepare()
    with pytest.raises(StoragePermissionError, match="outside the destination"):
        await storage.write_atomic("link/newdir/deeper/x.pth", BytesPayload(b"x"), overwrite=True)
    assert list(outside.iterdir()) == []


async def test_a_link_that_stays_inside_may_be_written_through(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    (dest / "real").mkdir(parents=True)
    (dest / "alias").symlink_to(dest / "real", target_is_directory=True)
    storage = LocalStorage(str(dest))
    await storage.prepare()
    await storage.write_atomic("alias/new/x.pth", BytesPayload(b"x"), overwrite=True)
    assert (dest / "real" / "new" / "x.pth").read_bytes() == b"x"


async def test_a_prefix_through_a_link_leading_out_is_not_listed(tmp_path: Path) -> None:
    outside, dest = tmp_path / "outside", tmp_path / "dest"
    (outside / "records").mkdir(parents=True)
    (outside / "records" / "secret.jsonl").write_bytes(b"x")
    (dest / "real" / "sub").mkdir(parents=True)
    (dest / "real" / "sub" / "a.pth").write_bytes(b"a")
    (dest / ".trajtrack").symlink_to(outside, target_is_directory=True)
    (dest / "alias").symlink_to(dest / "real", target_is_directory=True)
    storage = LocalStorage(str(dest))
    with pytest.raises(StoragePermissionError, match="outside the destination"):
        await storage.list(".trajtrack/records")
    assert [info.path for info in await storage.list("alias/sub")] == ["alias/sub/a.pth"]
    assert [info.path for info in await storage.list("")] == ["real/sub/a.pth"]


async def test_reads_never_follow_a_link_out_of_the_destination(tmp_path: Path) -> None:
    dest, secret = tmp_path / "dest", tmp_path / "secret.txt"
    dest.mkdir()
    secret.write_bytes(b"top secret")
    (dest / "linked.pth").symlink_to(secret)
    (dest / "real.pth").write_bytes(b"fine")
    storage = LocalStorage(str(dest))
    await storage.prepare()
    with pytest.raises(StoragePermissionError):
        await storage.read("linked.pth")
    with pytest.raises(StoragePermissionError):
        await storage.read_range("linked.pth", 0, 3)
    listed = {info.path: info.outside for info in await storage.list()}
    assert listed == {"linked.pth": True, "real.pth": False}


@pytest.mark.parametrize("path", ["../x.pth", "/etc/passwd", "a/../../x", "a//b", "a\\b"])
async def test_paths_that_could_leave_the_root_are_refused(tmp_path: Path, path: str) -> None:
    storage = LocalStorage(str(tmp_path / "dest"))
    await storage.prepare()
    with pytest.raises(StoragePermissionError):
        await storage.read(path)
    with pytest.raises(StoragePermissionError):
        await storage.write_atomic(path, BytesPayload(b"x"), overwrite=True)
    assert not (tmp_path / "x.pth").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
async def test_read_only_destination(tmp_path: Path) -> None:
    dest = tmp_path / "ro"
    dest.mkdir()
    dest.chmod(0o555)
    with pytest.raises(StoragePermissionError):
        await LocalStorage(str(dest)).prepare()


class _Observing:
    """A payload that looks at its directory while it is being written."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.seen: list[str] = []
        self.nbytes = 5

    def write_to(self, out: Any) -> None:
        out.write(b"12")
        self.seen = sorted(p.name for p in self.directory.iterdir())
        out.write(b"345")


async def test_a_write_goes_to_a_hidden_temporary_name_then_is_renamed(tmp_path: Path) -> None:
    storage = LocalStorage(str(tmp_path / "dest"))
    await storage.prepare()
    await storage.write_atomic("d/x.pth", BytesPayload(b"first"), overwrite=True)
    payload = _Observing(tmp_path / "dest" / "d")
    await storage.write_atomic("d/x.pth", payload, overwrite=True)  # type: ignore[arg-type]
    # mid-write: the final name still holds the old bytes, the new ones go to a temp file
    (temp,) = [name for name in payload.seen if name != "x.pth"]
    assert temp.startswith(".x.pth.tmp~") and "x.pth" in payload.seen
    assert (tmp_path / "dest" / "d" / "x.pth").read_bytes() == b"12345"
    assert sorted(p.name for p in (tmp_path / "dest" / "d").iterdir()) == ["x.pth"]


@pytest.mark.parametrize("fsync", [True, False])
async def test_fsync_is_honoured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsync: bool
) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    storage = LocalStorage(str(tmp_path / "dest"), fsync=fsync)
    await storage.prepare()
    monkeypatch.setattr(os, "fsync", recording_fsync)
    await storage.write_atomic("d/x.pth", BytesPayload(b"durable"), overwrite=True)
    if not fsync:
        assert synced == []
        return
    directory = str(tmp_path / "dest" / "d")
    assert directory in synced  # the directory entry, after the rename
    assert any(".x.pth.tmp~" in path for path in synced)  # the file's data, before it


class _CountsDescriptors:
    """A payload that notes how many descriptors the process holds while it is written."""

    def __init__(self, seen: list[int]) -> None:
        self.seen = seen
        self.nbytes = 10

    def write_to(self, out: Any) -> None:
        self.seen.append(len(os.listdir("/proc/self/fd")))
        out.write(b"x" * self.nbytes)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
async def test_a_batch_over_many_directories_holds_one_directory_open(tmp_path: Path) -> None:
    storage = LocalStorage(str(tmp_path))
    await storage.prepare()
    seen: list[int] = []
    items = []
    for i in range(40):  # forty files in forty directories, in one batch
        items.append((f"dir{i}/d.pth", _CountsDescriptors(seen)))
    outcomes = await storage.write_atomic_many(items, overwrite=False, done=None)
    assert all(not isinstance(o, Exception) for o in outcomes)
    assert sorted(p.name for p in tmp_path.glob("dir*/d.pth")) == ["d.pth"] * 40
    assert max(seen) - min(seen) <= 2  # not one more descriptor per directory


async def test_the_listing_is_what_os_walk_finds_without_following_links(tmp_path: Path) -> None:
    root, outside = tmp_path / "run", tmp_path / "outside"
    (root / "a" / "b").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret.pth").write_bytes(b"s")
    (root / "top.pth").write_bytes(b"1")
    (root / "a" / "mid.pth").write_bytes(b"22")
    (root / "a" / "b" / "deep.pth").write_bytes(b"333")
    os.symlink(root / "a" / "mid.pth", root / "link_in.pth")
    os.symlink(outside / "secret.pth", root / "a" / "link_out.pth")
    os.symlink(outside, root / "linked_dir")  # never entered
    os.symlink(root / "a" / "b", root / "a" / "linked_in_dir")  # never entered either
    os.symlink(tmp_path / "nothing", root / "dangling.pth")
    listed = await LocalStorage(str(root)).list()
    assert [(f.path, f.outside) for f in listed] == [
        ("a/b/deep.pth", False),
        ("a/link_out.pth", True),
        ("a/mid.pth", False),
        ("dangling.pth", True),  # its target would be outside
        ("link_in.pth", False),
        ("top.pth", False),
    ]
    sizes = {f.path: f.size for f in listed}
    assert (sizes["top.pth"], sizes["a/mid.pth"], sizes["a/b/deep.pth"]) == (1, 2, 3)
    prefixed = await LocalStorage(str(root)).list("a/b")
    assert [f.path for f in prefixed] == ["a/b/deep.pth"]


async def test_files_of_known_size_are_listed_with_it_and_links_still_looked_at(
    tmp_path: Path,
) -> None:
    root, outside = tmp_path / "run", tmp_path / "outside"
    (root / "a").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret.pth").write_bytes(b"s")
    (root / "a" / "known.pth").write_bytes(b"12345")
    (root / "other.pth").write_bytes(b"123")
    os.symlink(outside / "secret.pth", root / "a" / "link_out.pth")
    known = {"a/known.pth": 99, "a/link_out.pth": 1, "absent.pth": 7}
    listed = {f.path: f for f in await LocalStorage(str(root)).list(known_sizes=known)}
    assert set(listed) == {"a/known.pth", "a/link_out.pth", "other.pth"}
    # The recorded size, unchecked (no lstat: its real size is 5), and no time.
    assert (listed["a/known.pth"].size, listed["a/known.pth"].mtime) == (99, None)
    # A link is looked at whatever the caller knows: it leads out.
    assert listed["a/link_out.pth"].outside and listed["a/link_out.pth"].mtime is not None
    assert (listed["other.pth"].size, listed["other.pth"].outside) == (3, False)
    assert listed["other.pth"].mtime is not None


class _CountingFile(io.FileIO):
    """A raw file that counts the writes it is given."""

    writes: list[int]

    def write(self, data: Any) -> int:
        self.writes.append(memoryview(data).nbytes)
        return super().write(data)


def _counting_file(path: Path) -> _CountingFile:
    raw = _CountingFile(path, "wb")
    raw.writes = []
    return raw


class _InPieces:
    """A payload that writes itself in many small pieces, as ``torch.save`` does."""

    def __init__(self, pieces: int) -> None:
        self.data = bytes(range(256)) * (pieces // 256 + 1)
        self.pieces = pieces

    @property
    def nbytes(self) -> int:
        return self.pieces

    def write_to(self, out: Any) -> None:
        for i in range(self.pieces):
            out.write(self.data[i : i + 1])


def test_a_payload_written_in_small_pieces_reaches_a_raw_file_through_a_buffer(
    tmp_path: Path,
) -> None:
    payload = _InPieces(5000)
    with _counting_file(tmp_path / "f") as raw:
        result = write_payload_unbuffered(payload, raw, 1 << 20)
        gc.collect()  # the buffer, collected, must not close the caller's file
        assert not raw.closed
        raw.write(b"!")  # still the caller's to write to and close
        assert raw.writes == [5000, 1]  # one write for the 5,000 pieces
    expected = payload.data[:5000]
    assert (tmp_path / "f").read_bytes() == expected + b"!"
    assert result == WriteResult(size=5000, checksum=checksum_of(expected))


def test_an_archive_goes_straight_into_a_raw_file(tmp_path: Path) -> None:
    tensors = {"obs": torch.randn(1 << 18), "actions": torch.arange(1 << 15)}
    payload = snapshot_plain(tensors)
    with _counting_file(tmp_path / "f") as raw:
        result = write_payload_unbuffered(payload, raw, 1 << 20)
    # Each storage in a write of its own, from the tensor's memory (no copy into a buffer).
    assert {1 << 20, 1 << 18} <= set(raw.writes) and len(raw.writes) <= 6
    data = (tmp_path / "f").read_bytes()
    assert result == WriteResult(size=len(data), checksum=checksum_of(data))
    loaded = torch.load(tmp_path / "f", weights_only=True)
    assert all(torch.equal(loaded[key], tensors[key]) for key in tensors)


async def test_the_local_storage_hands_payloads_an_unbuffered_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    given: list[type] = []
    real = write_payload_unbuffered

    def spy(payload: Any, raw: Any, buffer_size: int) -> WriteResult:
        given.append(type(raw))
        return real(payload, raw, buffer_size)

    monkeypatch.setattr("trajtrack.backends.local.write_payload_unbuffered", spy)
    storage = LocalStorage(str(tmp_path / "dest"))
    await storage.prepare()
    await storage.write_atomic("a.pth", snapshot_plain({"x": torch.ones(4)}), overwrite=True)
    await storage.aclose()
    assert given == [io.FileIO]
    assert torch.equal(
        torch.load(tmp_path / "dest" / "a.pth", weights_only=True)["x"], torch.ones(4)
    )


def test_the_writer_process_option_is_deprecated_and_ignored(tmp_path: Path) -> None:
    # #34: the helper process it switched is gone; old callers keep working, warned.
    with pytest.warns(DeprecationWarning, match="writer_process"):
        storage = LocalStorage(str(tmp_path), writer_process=True)
    assert storage.root == tmp_path
