"""Path containment under a local root: never through a symbolic link that leads out of it.

A run directory is untrusted: anyone who can write to it can plant a symbolic link. Every
local access goes through one of these, so that no link planted below the root makes a write
land, a directory appear, or a read come from outside it:

* :func:`open_directory` — a descriptor of ``root/parts...``, level by level: the writer's and
  the bulk reader's way;
* :func:`resolve_inside` — the path of ``root/relative``: for a single read, and for torch
  reading a file itself;
* :class:`DirectoryReader` — many files read below one root.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Sequence
from typing import Final

from trajtrack._exceptions import StoragePermissionError

__all__ = ["DirectoryReader", "is_inside", "open_directory", "resolve_inside"]

_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NOFOLLOW: Final = getattr(os, "O_NOFOLLOW", 0)
# O_NONBLOCK: a FIFO planted in a run is opened without waiting for a writer (and then reads
# as empty or fails with EAGAIN); it changes nothing for a regular file.
_FILE_FLAGS: Final = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK
# How opening with O_NOFOLLOW refuses a link: ELOOP, or ENOTDIR for a link opened with
# O_DIRECTORY (Linux), EMLINK on FreeBSD.
_REFUSED_LINK: Final = (errno.ELOOP, errno.ENOTDIR, errno.EMLINK)


def is_inside(real: str, real_root: str) -> bool:
    """Whether the resolved path *real* is *real_root* or below it (both ``realpath``-ed)."""
    return real == real_root or real.startswith(real_root + os.sep)


def _followed_inside(path: str, real_root: str) -> str:
    """``realpath(path)``, a path through a symbolic link, if it stays inside *real_root*."""
    real = os.path.realpath(path)
    if not is_inside(real, real_root):
        raise StoragePermissionError(
            f"refusing to use {path}: it resolves outside the destination ({real}), "
            "through a symbolic link"
        )
    return real


def resolve_inside(root: str, real_root: str, relative: str) -> str:
    """The path of *relative* (checked, ``/``-separated) under *root*, never leading out of it.

    *real_root* is ``os.path.realpath(root)``. Without a symbolic link below *root* (one
    ``lstat`` per component: the common case) that is ``root/relative`` itself; through a link,
    the resolved path if it stays inside *real_root*.

    Raises:
        StoragePermissionError: A symbolic link leads outside *root*.
    """
    path = root
    for part in relative.split("/"):
        path = os.path.join(path, part)
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return os.path.join(root, relative)  # nothing there to follow: opening will say so
        if stat.S_ISLNK(mode):
            return _followed_inside(os.path.join(root, relative), real_root)
    return path


def open_directory(
    root: str, parts: Sequence[str], *, real_root: str, create: int | None = None
) -> int:
    """A descriptor of the directory ``root/parts...`` (the caller closes it).

    Each level is opened relative to its parent's descriptor without following a link; a level
    that is a symbolic link is followed only when it resolves inside *real_root* (the
    ``realpath`` of *root*). With *create* (permission bits), missing levels are created first,
    relative to their parent: nothing is ever created outside the root, whatever links it holds.

    Raises:
        StoragePermissionError: A level is a link leading out of the root.
        OSError: As opening (or creating) a level raises.
    """
    fd = os.open(root, _DIR_FLAGS)
    try:
        for depth, part in enumerate(parts, start=1):
            if create is not None:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, create, dir_fd=fd)
            child = _open_level(fd, part, root, parts[:depth], real_root)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_level(parent: int, part: str, root: str, parts: Sequence[str], real_root: str) -> int:
    try:
        return os.open(part, _DIR_FLAGS | _NOFOLLOW, dir_fd=parent)
    except OSError as exc:
        if exc.errno not in _REFUSED_LINK:
            raise
        if not stat.S_ISLNK(os.stat(part, dir_fd=parent, follow_symlinks=False).st_mode):
            raise
    # A symbolic link: followed only if it stays inside.
    return os.open(_followed_inside(os.path.join(root, *parts), real_root), _DIR_FLAGS)


class DirectoryReader:
    """Reads many files below one root, each opened relative to its directory's descriptor
    (kept for the next file of the same directory; one at a time) with ``O_NOFOLLOW``: three
    system calls per file (open, read, close) instead of an ``lstat`` per path component, an
    open, a stat and two reads. A link is followed only when it stays inside the root (a
    linked directory by :func:`open_directory`, a linked file by :func:`resolve_inside`).
    Blocking; one thread; :meth:`close` when done.
    """

    def __init__(self, root: str, real_root: str) -> None:
        self._root = root
        self._real_root = real_root
        self._directory: tuple[str, int] | None = None  # (relative directory, its fd)

    def read(self, relative: str, expected: int) -> bytes:
        """The file *relative* (checked, ``/``-separated), *expected* bytes long: all of it,
        or, when it is longer, its first ``expected + 1`` bytes (enough to tell it is longer).

        Raises:
            StoragePermissionError: It leads out of the root through a symbolic link.
            OSError: As opening and reading it raise.
        """
        head, _, name = relative.rpartition("/")
        directory = self._open_directory(head)
        try:
            fd = os.open(name, _FILE_FLAGS | _NOFOLLOW, dir_fd=directory)
        except OSError as exc:
            if exc.errno not in _REFUSED_LINK:
                raise
            fd = os.open(resolve_inside(self._root, self._real_root, relative), _FILE_FLAGS)
        try:
            return _read_to_end(fd, expected)
        finally:
            os.close(fd)

    def _open_directory(self, head: str) -> int:
        if self._directory is not None:
            if self._directory[0] == head:
                return self._directory[1]
            os.close(self._directory[1])
            self._directory = None
        parts = head.split("/") if head else []
        fd = open_directory(self._root, parts, real_root=self._real_root)
        self._directory = (head, fd)
        return fd

    def close(self) -> None:
        if self._directory is not None:
            os.close(self._directory[1])
            self._directory = None


_FIRST_READ: Final = 64 << 20


def _read_to_end(fd: int, expected: int) -> bytes:
    """What *fd* holds from here, up to ``expected + 1`` bytes: one read when the file has
    its *expected* size. *expected* comes from a run's record (untrusted): it never sizes an
    allocation beyond what the file holds (a first read of at most 64 MiB, then chunks until
    the end), and a file far longer than it is not read past ``expected + 1`` bytes."""
    data = os.read(fd, min(expected, _FIRST_READ) + 1)
    if not data or len(data) == expected or len(data) > expected:
        return data
    chunks = [data]  # shorter than expected (or than the first read): on, up to expected + 1
    held = len(data)
    while held <= expected and (chunk := os.read(fd, min(_FIRST_READ, expected + 1 - held))):
        chunks.append(chunk)
        held += len(chunk)
    return b"".join(chunks)
