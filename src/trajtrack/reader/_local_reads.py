"""Reading a batch of dumps off a local disk in one worker thread: :func:`read_local`.

One pass over the batch (dump order, so consecutive shard members are mostly neighbours): a
member outside the bytes read last starts a *span*, the run of following members of the same
shard that lie close together, read with one ``pread`` and sliced; a dump in a file of its own
is read relative to its directory's descriptor, never through a link leading out of the run
(:class:`~trajtrack.backends._local_paths.DirectoryReader`). Shards are opened checked not
to lead out of the run either: once a batch, or by a :class:`LocalReader` once for all its
batches (a run's first 64).

This is per-dump work on the hot path of ``diff`` and ``verify`` (tens of thousands of small
dumps): no call per member but the slice, the checks of :func:`check_readable` and
:func:`whole_member` written out.
"""

from __future__ import annotations

import os
import stat
import threading
import weakref
from collections.abc import Sequence
from typing import Final

from trajtrack._exceptions import DumpLoadError, StorageError, StoragePermissionError
from trajtrack.backends import check_relative
from trajtrack.backends.local import DirectoryReader, resolve_inside, translate
from trajtrack.reader._batch_reads import check_held, check_readable, span_end, whole_member
from trajtrack.reader._dumps import DumpInfo
from trajtrack.reader._files import real_root

__all__ = ["LocalReader", "read_local"]

# O_NONBLOCK: a FIFO planted as a shard since the listing is opened without waiting for a
# writer, then refused (it changes nothing for a regular file).
_SHARD_FLAGS: Final = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK


def read_local(
    url: str,
    root: str,
    infos: Sequence[DumpInfo],
    *,
    real: str | None = None,
    kept: _ShardFiles | None = None,
) -> list[bytes | Exception]:
    """The bytes of each dump of *infos* below the local root *root*, or the error that
    reading it raised (blocking). *real*: ``os.path.realpath(root)``, if known; *kept*: shard
    descriptors kept open across calls."""
    reader = _Reader(url, root, real_root(root) if real is None else real, kept)
    out: list[bytes | Exception] = []
    append = out.append
    shard_at, start, end, window = None, 0, 0, b""  # the span read last, [start, end)
    try:
        for index, info in enumerate(infos):
            try:
                shard = info.shard
                if info.problem is not None or shard is None:
                    append(reader.file(info))
                    continue
                offset = info.offset or 0
                if shard != shard_at or offset < start or offset + info.size > end:
                    check_held(info)
                    shard_at, start = shard, offset
                    length = span_end(infos, index)[0] - start
                    window = os.pread(reader.shard(info), length, start)
                    end = start + len(window)
                data = window[offset - start : offset - start + info.size]
                append(data if len(data) == info.size else whole_member(info, data))
            except (StorageError, DumpLoadError) as exc:  # refused, missing, short shard
                append(exc)
            except OSError as exc:
                append(translate(exc, f"{info.name}: {info.shard or info.path}"))
    finally:
        reader.close()
    return out


class _Reader:
    """The open descriptors of one batch: a directory at a time, each shard once (or kept
    open across batches by a :class:`_ShardFiles`)."""

    def __init__(self, url: str, root: str, real: str, kept: _ShardFiles | None = None) -> None:
        self._url = url
        self._root = root
        self._real = real
        self._files = DirectoryReader(root, real)
        self._shards: dict[str, int] = {}  # opened for this batch: closed with it
        self._kept = kept

    def file(self, info: DumpInfo) -> bytes:
        """A dump in a file of its own (or refused: :func:`check_readable`)."""
        check_readable(self._url, info)
        expected = info.stored_size if info.stored_size is not None else info.size
        try:
            return self._files.read(check_relative(info.path), expected)
        except StoragePermissionError as exc:  # a link leading out, planted since listing
            raise StoragePermissionError(f"{info.name}: {exc} (outside the run)") from exc

    def shard(self, info: DumpInfo) -> int:
        """The descriptor of *info*'s shard, opened once (checked not to lead out)."""
        shard = info.shard or ""
        fd = self._shards.get(shard)
        if fd is None and self._kept is not None:
            fd = self._kept.get(shard)
        if fd is None:
            try:
                path = resolve_inside(self._root, self._real, check_relative(shard))
            except StoragePermissionError as exc:
                raise StoragePermissionError(f"{info.name}: {exc} (outside the run)") from exc
            fd = _open_shard(path, info)
            if self._kept is None or not self._kept.keep(shard, fd):
                self._shards[shard] = fd
        return fd

    def close(self) -> None:
        self._files.close()
        for fd in self._shards.values():
            os.close(fd)


def _open_shard(path: str, info: DumpInfo) -> int:
    """A descriptor of the shard at *path*, if it is a regular file (``fstat``: never a
    FIFO, socket or device planted since the listing)."""
    fd = os.open(path, _SHARD_FLAGS)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise StoragePermissionError(
            f"{info.name}: refusing to read its shard {info.shard}: not a regular file"
        )
    return fd


class _ShardFiles:
    """Shard descriptors kept open from one batch to the next (up to :attr:`LIMIT`: others
    are opened a batch at a time), for any thread; closed by :meth:`close`, or when the
    object is collected. An open descriptor keeps reading the file it was opened on, whatever
    is planted at its path later."""

    LIMIT: Final = 64

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._finalizer = weakref.finalize(self, _close_all, self._fds)

    def get(self, shard: str) -> int | None:
        return self._fds.get(shard)

    def keep(self, shard: str, fd: int) -> bool:
        """Keep *fd* open for *shard* (``False``: full, closed, or kept already)."""
        with self._lock:
            if self._closed or len(self._fds) >= self.LIMIT or shard in self._fds:
                return False
            self._fds[shard] = fd
            return True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._finalizer()


def _close_all(fds: dict[str, int]) -> None:
    for fd in fds.values():
        os.close(fd)
    fds.clear()


class LocalReader:
    """:func:`read_local` of one run, called batch after batch (blocking; from any number of
    threads): the run's root resolved once (in the first worker thread that reads), and its
    shards kept open from one batch to the next until :meth:`close` (the run's 64 first: a
    batch opens any other itself)."""

    def __init__(self, url: str, root: str) -> None:
        self._url = url
        self._root = root
        self._real: str | None = None
        self._shards = _ShardFiles()

    def __call__(self, infos: Sequence[DumpInfo]) -> list[bytes | Exception]:
        if self._real is None:
            self._real = real_root(self._root)  # two threads may both: the same answer
        return read_local(self._url, self._root, infos, real=self._real, kept=self._shards)

    def close(self) -> None:
        """Close the shards kept open (call once no thread reads any more)."""
        self._shards.close()
