"""The writer process: writes small files for a :class:`~trajtrack.backends.local.LocalStorage`,
and the shards layout's spool files.

Run as a script (``python -I -S _writer_child.py FD ARENA_FD ARENA_SIZE``), never imported by
it: it needs nothing but the standard library, so it starts in milliseconds and holds no GIL
that the tracker's process needs. See :mod:`trajtrack.backends._writer_process` for why it
exists and for the protocol, which is all this file knows:

* a *frame* from the parent: a header (:data:`HEADER`: item count, flags, file mode, body
  length, file offset) sent with one directory's descriptor (``SCM_RIGHTS``), then the body:
  per item
  :data:`ITEM` (temporary name length, final name length, data length, arena offset), the two
  names (UTF-8) and the data -- or, when the offset is not :data:`INLINE`, no data: it is in
  the staging arena (:mod:`~trajtrack.backends._staging`, a ``memfd`` inherited as
  ``ARENA_FD``, -1 for none), at that offset;
* per item one :data:`RESULT` back: status (0 written, 1 failed), the operation that failed,
  its ``errno``; those of a frame together, or what is done every :data:`REPORT_EVERY`
  seconds when the disk is slow.

An :data:`APPEND` frame carries a regular file's descriptor instead (a shard's spool file,
opened by the parent): its items have no names, and their data is written into that file with
``pwrite``, one after the other from the header's file offset. Any other frame's items are
files, each written as the thread path writes it: created under its temporary name with
``O_EXCL | O_NOFOLLOW`` relative to the directory's descriptor, written, optionally fsynced,
then published under its final name with ``rename`` (overwrite) or ``link`` + ``unlink`` (no
overwrite: fails if the name exists); a failed item leaves no temporary file. The names were
checked by the parent; the descriptor was opened by it, inside its destination.

The process exits when the parent's end of the socket closes (the parent closed the storage,
exited or was killed): an item already being written is finished first. It ignores SIGINT, so
that Ctrl-C in a terminal (sent to the whole process group) does not kill it before the parent
has flushed.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import signal
import socket
import struct
import sys
import time
from typing import Final

HEADER: Final = struct.Struct("<IIIQQ")
"""Item count, flags (:data:`OVERWRITE`, :data:`FSYNC`, :data:`APPEND`), file mode, body
length, file offset (of an :data:`APPEND` frame's first item)."""
ITEM: Final = struct.Struct("<HHIQ")
"""Temporary name length, final name length, data length, arena offset (:data:`INLINE`: the
data follows the names)."""
INLINE: Final = (1 << 64) - 1
RESULT: Final = struct.Struct("<BBi")
"""Status (:data:`WRITTEN` or :data:`FAILED`), operation (``OP_*``), ``errno``."""

REPORT_EVERY: Final = 0.002
"""Results go back together at the end of a frame, or every this many seconds (a wake-up of
the parent per file would cost more than the file)."""

OVERWRITE: Final = 1
FSYNC: Final = 2
APPEND: Final = 4
WRITTEN: Final = 0
FAILED: Final = 1
OP_CREATE, OP_WRITE, OP_FSYNC, OP_PUBLISH, OP_EXISTS = 1, 2, 3, 4, 5
OPERATIONS: Final = {
    OP_CREATE: "creating",
    OP_WRITE: "writing",
    OP_FSYNC: "syncing",
    OP_PUBLISH: "publishing",
    OP_EXISTS: "publishing",
}

_CREATE: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)


class _Failed(Exception):
    def __init__(self, operation: int, error: int) -> None:
        super().__init__(operation, error)
        self.operation = operation
        self.error = error


def _exactly(sock: socket.socket, buffer: memoryview) -> bool:
    """Fill *buffer* from *sock*; False on end of stream."""
    got = 0
    while got < len(buffer):
        n = sock.recv_into(buffer[got:])
        if not n:
            return False
        got += n
    return True


def _frame(
    sock: socket.socket,
) -> tuple[tuple[int, int, int, int, int], int, memoryview] | None:
    """The next frame: its header, its descriptor and its body; None at the end."""
    head, fds, _flags, _address = socket.recv_fds(sock, HEADER.size, 1)
    if not head:
        for fd in fds:
            os.close(fd)
        return None
    if len(fds) != 1:
        raise SystemExit(f"trajtrack writer: a frame without its directory ({len(fds)})")
    rest = bytearray(HEADER.size - len(head))
    if rest and not _exactly(sock, memoryview(rest)):
        return None
    header = HEADER.unpack(head + rest)
    body = memoryview(bytearray(header[3]))
    if not _exactly(sock, body):
        os.close(fds[0])
        return None
    return header, fds[0], body


def _write_one(
    directory: int, temp: str, name: str, data: memoryview, flags: int, mode: int
) -> None:
    try:
        fd = os.open(temp, _CREATE, mode, dir_fd=directory)
    except OSError as exc:
        raise _Failed(OP_CREATE, exc.errno or 0) from None
    try:
        operation = OP_WRITE
        try:
            written = 0
            while written < len(data):
                written += os.write(fd, data[written:])
            if flags & FSYNC:
                operation = OP_FSYNC
                os.fsync(fd)
        finally:
            os.close(fd)
        operation = OP_PUBLISH
        if flags & OVERWRITE:
            os.replace(temp, name, src_dir_fd=directory, dst_dir_fd=directory)
        else:
            try:
                os.link(
                    temp, name, src_dir_fd=directory, dst_dir_fd=directory, follow_symlinks=False
                )
            except FileExistsError:
                operation = OP_EXISTS
                raise
            os.unlink(temp, dir_fd=directory)
        if flags & FSYNC:
            operation = OP_FSYNC
            os.fsync(directory)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(temp, dir_fd=directory)
        raise _Failed(operation, exc.errno or 0) from None


def _write_at(fd: int, data: memoryview, position: int) -> None:
    written = 0
    try:
        while written < len(data):
            written += os.pwrite(fd, data[written:], position + written)
    except OSError as exc:
        raise _Failed(OP_WRITE, exc.errno or 0) from None


def _arena(fd: int, size: int) -> memoryview:
    """The staging arena's pages, read-only (empty without one)."""
    if fd < 0 or size <= 0:
        return memoryview(b"")
    try:
        return memoryview(mmap.mmap(fd, size, access=mmap.ACCESS_READ))
    finally:
        os.close(fd)  # the mapping stays


def _serve(sock: socket.socket, arena: memoryview) -> None:
    while (frame := _frame(sock)) is not None:
        (count, flags, mode, _length, position), directory, body = frame
        offset = 0
        results: list[bytes] = []
        since = time.monotonic()
        try:
            for _ in range(count):
                temp_len, name_len, data_len, where = ITEM.unpack_from(body, offset)
                offset += ITEM.size
                temp = str(body[offset : offset + temp_len], "utf-8")
                offset += temp_len
                name = str(body[offset : offset + name_len], "utf-8")
                offset += name_len
                if where == INLINE:
                    data = body[offset : offset + data_len]
                    offset += data_len
                else:
                    data = arena[where : where + data_len]
                try:
                    if len(data) != data_len:  # outside the arena: refused, nothing written
                        raise _Failed(OP_WRITE, errno.EFAULT)
                    if flags & APPEND:
                        _write_at(directory, data, position)
                        position += data_len
                    else:
                        _write_one(directory, temp, name, data, flags, mode)
                    result = RESULT.pack(WRITTEN, 0, 0)
                except _Failed as failed:
                    result = RESULT.pack(FAILED, failed.operation, failed.error)
                results.append(result)
                now = time.monotonic()
                if now - since >= REPORT_EVERY:  # a slow disk: say what is done so far
                    sock.sendall(b"".join(results))
                    results.clear()
                    since = now
            sock.sendall(b"".join(results))
        finally:
            os.close(directory)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    gone = contextlib.suppress(BrokenPipeError, ConnectionResetError)  # the parent is gone
    arena = _arena(int(argv[2]), int(argv[3]))
    with socket.socket(fileno=int(argv[1])) as sock, gone:
        _serve(sock, arena)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
