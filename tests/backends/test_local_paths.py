"""Path containment under a local root (``backends._local_paths``): the one directory walk the
local writer and the bulk reader share."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trajtrack._exceptions import StoragePermissionError
from trajtrack.backends._local_paths import (
    DirectoryReader,
    is_inside,
    open_directory,
    resolve_inside,
)


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path]:
    """A root with ``a/b/x.pth``, a secret outside it, and links both ways."""
    root, outside = tmp_path / "run", tmp_path / "outside"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "x.pth").write_bytes(b"inside")
    outside.mkdir()
    (outside / "x.pth").write_bytes(b"secret")
    (root / "in_link").symlink_to(root / "a", target_is_directory=True)
    (root / "out_link").symlink_to(outside, target_is_directory=True)
    (root / "a" / "file_in.pth").symlink_to(root / "a" / "b" / "x.pth")
    (root / "a" / "file_out.pth").symlink_to(outside / "x.pth")
    return root, outside


def _real(root: Path) -> str:
    return os.path.realpath(root)


def _listing(fd: int) -> list[str]:
    try:
        return sorted(os.listdir(fd))
    finally:
        os.close(fd)


def test_open_directory_walks_plain_levels(tree: tuple[Path, Path]) -> None:
    root, _ = tree
    assert _listing(open_directory(str(root), ["a", "b"], real_root=_real(root))) == ["x.pth"]


def test_open_directory_follows_a_link_that_stays_inside(tree: tuple[Path, Path]) -> None:
    root, _ = tree
    fd = open_directory(str(root), ["in_link", "b"], real_root=_real(root))
    assert _listing(fd) == ["x.pth"]


def test_open_directory_refuses_a_link_leading_out(tree: tuple[Path, Path]) -> None:
    root, outside = tree
    with pytest.raises(StoragePermissionError, match="resolves outside"):
        open_directory(str(root), ["out_link"], real_root=_real(root))
    with pytest.raises(StoragePermissionError):  # nothing created through it either
        open_directory(str(root), ["out_link", "new"], real_root=_real(root), create=0o755)
    assert sorted(os.listdir(outside)) == ["x.pth"]


def test_open_directory_creates_missing_levels_inside(tree: tuple[Path, Path]) -> None:
    root, _ = tree
    parts = ["in_link", "new", "deeper"]
    os.close(open_directory(str(root), parts, real_root=_real(root), create=0o700))
    assert (root / "a" / "new" / "deeper").is_dir()  # created through the inside link


def test_open_directory_does_not_create_without_being_asked(tree: tuple[Path, Path]) -> None:
    root, _ = tree
    with pytest.raises(FileNotFoundError):
        open_directory(str(root), ["missing"], real_root=_real(root))
    assert not (root / "missing").exists()


def test_open_directory_refuses_a_file_as_a_level(tree: tuple[Path, Path]) -> None:
    root, _ = tree
    with pytest.raises(NotADirectoryError):
        open_directory(str(root), ["a", "b", "x.pth"], real_root=_real(root))


def test_directory_reader_reads_through_inside_links_only(tree: tuple[Path, Path]) -> None:
    root, _ = tree
    reader = DirectoryReader(str(root), _real(root))
    try:
        assert reader.read("a/b/x.pth", 6) == b"inside"
        assert reader.read("in_link/b/x.pth", 6) == b"inside"  # a linked directory inside
        assert reader.read("a/file_in.pth", 6) == b"inside"  # a linked file inside
        with pytest.raises(StoragePermissionError):
            reader.read("out_link/x.pth", 6)
        with pytest.raises(StoragePermissionError):
            reader.read("a/file_out.pth", 6)
        # A size hint (a run's record: untrusted) far above the file reads the file; one
        # below it reads one byte past the hint, enough to tell, never the rest (#32).
        assert reader.read("a/b/x.pth", 1 << 40) == b"inside"
        assert reader.read("a/b/x.pth", 2) == b"ins"
    finally:
        reader.close()


def test_directory_reader_reopens_a_directory_replaced_by_a_link(
    tree: tuple[Path, Path],
) -> None:
    root, outside = tree
    reader = DirectoryReader(str(root), _real(root))
    try:
        assert reader.read("a/b/x.pth", 6) == b"inside"
        assert reader.read("a/file_in.pth", 6) == b"inside"  # another directory in between
        (root / "a" / "b" / "x.pth").unlink()
        (root / "a" / "b").rmdir()
        (root / "a" / "b").symlink_to(outside, target_is_directory=True)
        with pytest.raises(StoragePermissionError):
            reader.read("a/b/x.pth", 6)
    finally:
        reader.close()


def test_resolve_inside(tree: tuple[Path, Path]) -> None:
    root, _ = tree
    real = _real(root)
    assert resolve_inside(str(root), real, "a/b/x.pth") == str(root / "a" / "b" / "x.pth")
    assert resolve_inside(str(root), real, "in_link/b/x.pth") == str(
        Path(real) / "a" / "b" / "x.pth"
    )
    with pytest.raises(StoragePermissionError):
        resolve_inside(str(root), real, "a/file_out.pth")


def test_is_inside_is_by_path_component() -> None:
    assert is_inside("/data/run", "/data/run")
    assert is_inside("/data/run/a", "/data/run")
    assert not is_inside("/data/run2/a", "/data/run")  # a sibling sharing the prefix
    assert not is_inside("/data", "/data/run")
