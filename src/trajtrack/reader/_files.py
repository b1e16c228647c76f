"""Two local dump files compared byte for byte: :func:`same_contents`.

``diff`` asks first whether a pair is byte-identical (then nothing is loaded). The two files are
read chunk by chunk into two buffers that each thread keeps (no allocation and no fresh pages
per file; ``readinto`` releases the GIL) and compared as 8-byte words with numpy, stopping at
the first chunk that differs. Memory maps of the files were measured too
(``benchmarks/README.md``): mapping and unmapping two files per pair (page faults, TLB
shootdowns) cost more than the copy, and a map dies with ``SIGBUS`` when its file is truncated.
"""

from __future__ import annotations

import functools
import io
import os
import stat
import threading
from typing import NamedTuple

import numpy as np

from trajtrack._exceptions import StoragePermissionError
from trajtrack.backends import Storage, check_relative
from trajtrack.backends.local import resolve_inside
from trajtrack.reader._dumps import DumpInfo

__all__ = ["LocalFile", "inside_run", "local_file", "real_root", "same_contents"]

_CHUNK = 1 << 20  # bytes read and compared at a time, per file
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
def real_root(root: str) -> str:
    """``os.path.realpath(root)``, once per run root."""
    return os.path.realpath(root)


def inside_run(file: LocalFile, where: str) -> str:
    """The file's path, checked not to lead out of its run (blocking: an ``lstat`` per level).

    A symbolic link planted in a run never leads a reader out of it, as with
    :meth:`~trajtrack.backends.local.LocalStorage.read`.

    Raises:
        StoragePermissionError: It resolves outside the run.
    """
    try:
        return resolve_inside(file.root, real_root(file.root), file.relative)
    except StoragePermissionError as exc:
        raise StoragePermissionError(f"{where}: {exc} (outside the run)") from exc


def same_contents(path_a: str, path_b: str) -> bool:
    """Whether two files hold the same bytes (blocking).

    Raises:
        StoragePermissionError: A file is not a regular file (a FIFO planted since listing).
        OSError: A file cannot be opened or read.
    """
    buffer_a, buffer_b = _thread_buffers()
    with _open_regular(path_a) as file_a, _open_regular(path_b) as file_b:
        if os.fstat(file_a.fileno()).st_size != os.fstat(file_b.fileno()).st_size:
            return False
        return _same_from_here(file_a, file_b, buffer_a, buffer_b)


def _open_regular(path: str) -> io.FileIO:
    """*path* opened to read, if it is a regular file (``O_NONBLOCK``: a FIFO does not block
    the open; it changes nothing for a regular file's reads)."""
    file = io.FileIO(os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK), "rb")
    if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
        file.close()
        raise StoragePermissionError(f"refusing to read {path}: not a regular file")
    return file


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
