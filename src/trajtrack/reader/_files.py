"""Two local dump files compared byte for byte: :func:`same_contents`.

``diff`` asks first whether a pair is byte-identical (then nothing is loaded). The two files are
read chunk by chunk into two buffers that each thread keeps (no allocation and no fresh pages
per file; ``readinto`` releases the GIL) and compared as 8-byte words with numpy, stopping at
the first chunk that differs. Memory maps of the files were measured too
(``benchmarks/README.md``): mapping and unmapping two files per pair cost more than the copy on
a 2-core VM, and a map dies with ``SIGBUS`` when its file is truncated.
"""

from __future__ import annotations

import errno
import functools
import io
import os
import threading
from typing import NamedTuple

import numpy as np

from trajtrack._exceptions import StoragePermissionError
from trajtrack.backends import Storage, check_relative
from trajtrack.backends.local import resolve_inside
from trajtrack.reader._dumps import DumpInfo

__all__ = ["DirectoryReader", "LocalFile", "inside_run", "local_file", "same_contents"]

_CHUNK = 1 << 20  # bytes read and compared at a time, per file
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOT_PLAIN = (errno.ELOOP, errno.ENOTDIR, errno.EMLINK)  # a link where O_NOFOLLOW refused it
_buffers = threading.local()


class LocalFile(NamedTuple):
    """A dump's own local file: its run's root, and its path there (checked, ``/``-separated)."""

    root: str
    relative: str

    @property
    def path(self) -> str:
        return os.path.join(self.root, self.relative)


def local_file(storage: Storage, info: DumpInfo) -> LocalFile | None:
    """The local file that holds *info* alone, or ``None`` (not local, or a shard member).

    Open it through :func:`inside_run`, in a thread.
    """
    if info.shard is not None:
        return None
    root = storage.local_path("")  # a capability of the storage protocol
    if root is None:
        return None
    return LocalFile(root, check_relative(info.path))


@functools.lru_cache(maxsize=64)
def _real_root(root: str) -> str:
    return os.path.realpath(root)


def inside_run(file: LocalFile, where: str) -> str:
    """The file's path, checked not to lead out of its run (blocking: an ``lstat`` per level).

    A symbolic link planted in a run never leads a reader out of it, as with
    :meth:`~trajtrack.backends.local.LocalStorage.read`.

    Raises:
        StoragePermissionError: It resolves outside the run.
    """
    try:
        return resolve_inside(file.root, _real_root(file.root), file.relative)
    except StoragePermissionError as exc:
        raise StoragePermissionError(f"{where}: {exc} (outside the run)") from exc


def same_contents(path_a: str, path_b: str) -> bool:
    """Whether two files hold the same bytes (blocking).

    Raises:
        OSError: A file cannot be opened or read.
    """
    buffer_a, buffer_b = _thread_buffers()
    with open(path_a, "rb", buffering=0) as file_a, open(path_b, "rb", buffering=0) as file_b:
        if os.fstat(file_a.fileno()).st_size != os.fstat(file_b.fileno()).st_size:
            return False
        return _same_from_here(file_a, file_b, buffer_a, buffer_b)


def _thread_buffers() -> tuple[bytearray, bytearray]:
    buffers: tuple[bytearray, bytearray] | None = getattr(_buffers, "pair", None)
    if buffers is None:
        buffers = _buffers.pair = (bytearray(_CHUNK), bytearray(_CHUNK))
    return buffers


def _same_from_here(file_a: io.FileIO, file_b: io.FileIO, a: bytearray, b: bytearray) -> bool:
    while True:
        got_a, got_b = file_a.readinto(a), file_b.readinto(b)
        if got_a != got_b:  # a file changed size meanwhile (or a short read: then compare)
            return False
        if not got_a:
            return True
        whole = got_a // 8 * 8
        words_a = np.frombuffer(a, dtype=np.uint64, count=whole // 8)
        words_b = np.frombuffer(b, dtype=np.uint64, count=whole // 8)
        if not np.array_equal(words_a, words_b) or a[whole:got_a] != b[whole:got_a]:
            return False


class DirectoryReader:
    """Reads many files below one run root, each opened relative to its directory's open
    descriptor (kept for the next file of the same directory; one at a time), never through
    a symbolic link: every component is opened with ``O_NOFOLLOW``. Three system calls per
    file (open, read, close) instead of an ``lstat`` per path component, an open, a stat and
    two reads. A path through a link takes :func:`inside_run`'s way (links inside the run are
    followed, links out of it refused). Blocking; one thread; :meth:`close` when done.
    """

    def __init__(self, root: str) -> None:
        self._root = root
        self._directory: tuple[str, int] | None = None  # (relative directory, its fd)

    def read(self, relative: str, expected: int, where: str) -> bytes:
        """The whole file *relative* (checked, ``/``-separated), *expected* bytes long.

        Raises:
            StoragePermissionError: It leads out of the run through a symbolic link.
            OSError: As opening and reading it raise.
        """
        head, _, name = relative.rpartition("/")
        try:
            directory = self._open_directory(head)
            fd = os.open(name, os.O_RDONLY | _NOFOLLOW | _CLOEXEC, dir_fd=directory)
        except OSError as exc:
            if exc.errno not in _NOT_PLAIN:
                raise
            path = inside_run(LocalFile(self._root, relative), where)
            fd = os.open(path, os.O_RDONLY | _CLOEXEC)
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
        fd = os.open(self._root, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
        for part in head.split("/") if head else ():
            try:
                child = os.open(part, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=fd)
            finally:
                os.close(fd)
            fd = child
        self._directory = (head, fd)
        return fd

    def close(self) -> None:
        if self._directory is not None:
            os.close(self._directory[1])
            self._directory = None


def _read_to_end(fd: int, expected: int) -> bytes:
    """Everything *fd* holds from here: one read when the file has its *expected* size."""
    data = os.read(fd, expected + 1)
    if not data or len(data) == expected:
        return data
    return data + _rest(fd)  # shorter or longer than expected: on to the end, as readall()


def _rest(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, _CHUNK):
        chunks.append(chunk)
    return b"".join(chunks)
