"""A shard in the making: its local spool file and the members laid out in it.

Members whose bytes are ready (a serialized small dump) are laid out on the event loop
(:meth:`Shard.plan`: a tar header, the bytes, the padding) and written to the spool together
with one ``writev``, once :data:`WRITE_AT` bytes are waiting or before anything else is
appended or the shard is sealed (:meth:`Shard.write_pending`). Other payloads are appended by
a thread, one by one (:meth:`Shard.append`). Offsets are known when a member is laid out: the
file is written strictly in order.

The ``writev`` runs in a worker thread, a megabyte at a time: a write into the page cache is
usually a memory copy, but under writeback pressure the kernel throttles the writer until dirty
pages reach the disk, for as long as the disk takes, which the event loop must never wait out.
Each thread hop costs the caller GIL hand-offs, so a hop per batch of a few dumps would cost
more than the dumps; one per megabyte is few (``benchmarks/bench_shards.py`` measures the
shards layout's rate and ``await dump`` p50).
"""

from __future__ import annotations

import contextlib
import io
import os
import time
from dataclasses import dataclass, field
from typing import BinaryIO, Final

from trajtrack.backends import WRITE_PIECE, BytesPayload, write_payload
from trajtrack.layouts.shards import (
    END_OF_ARCHIVE,
    ShardFormatError,
    header_size,
    member_header,
    padding,
)
from trajtrack.tracker._queue import Job

__all__ = ["WRITE_AT", "Member", "Shard", "create_spool"]

IN_MEMORY_MAX: Final = 1 << 20  # smaller payloads are serialized into memory, then written
WRITE_AT: Final = 1 << 20
"""Bytes of laid-out members that are written to the spool at once."""


@dataclass(eq=False)
class Member:
    """A dump in a shard: where its bytes are, their size and CRC-32."""

    job: Job
    offset: int
    size: int
    checksum: str
    written_at: float = field(default_factory=time.time)  # in order: dump order across shards


@dataclass(eq=False)
class Shard:
    """One shard in the making: a local spool file and the members appended to it."""

    path: str  # its final path in the storage
    spool: str  # the local file
    file: BinaryIO
    size: int = 0  # laid out, written or not
    members: list[Member] = field(default_factory=list)  # in the spool file
    opened_at: float = field(default_factory=time.monotonic)
    pending: list[Member] = field(default_factory=list)  # laid out, not written yet
    _pieces: list[bytes | memoryview] = field(default_factory=list)
    _written: int = 0  # bytes in the spool file

    @property
    def pending_bytes(self) -> int:
        """Bytes laid out and not written yet."""
        return self.size - self._written

    def plan(self, job: Job) -> Member:
        """Lay out *job* (its bytes ready: a :class:`BytesPayload`) as the next member, to be
        written by :meth:`write_pending` (cheap; on the loop)."""
        payload = job.payload
        assert isinstance(payload, BytesPayload)
        result = payload.counted()
        header = member_header(job.path, result.size, time.time())
        tail = padding(result.size)
        self._pieces += (header, payload.data, tail)
        offset = self.size + len(header)
        self.size = offset + result.size + len(tail)
        member = Member(job, offset, result.size, result.checksum)
        self.pending.append(member)
        return member

    def write_pending(self) -> None:
        """Write the members laid out so far (blocking; in a worker thread): one ``writev``.

        On failure nothing of them stays in the file; they stay :attr:`pending` (the caller
        fails them and calls :meth:`drop_pending`).
        """
        if not self._pieces:
            return
        try:
            fd = self.file.fileno()
            os.lseek(fd, self._written, os.SEEK_SET)  # after a failed write, from its start
            _write_all(fd, self._pieces)
        except BaseException:
            self._truncate()
            raise
        self.members += self.pending
        self.pending = []
        self._pieces = []
        self._written = self.size

    def drop_pending(self) -> None:
        """Forget the members laid out and not written (their write failed)."""
        self.pending = []
        self._pieces = []
        self.size = self._written

    def append(self, job: Job) -> Member:
        """Write *job*'s payload as the next member (blocking; in a worker thread; nothing
        may be pending)."""
        assert not self.pending
        try:
            self.file.seek(self.size)  # after a failed write, from the last member's end
            if job.nbytes <= IN_MEMORY_MAX:
                member = self._append_small(job)
            else:
                member = self._append_streamed(job)
            self.file.flush()  # all of it in the file: the next pending write goes after it
        except BaseException:
            self.size = self._written
            self._truncate()  # nothing of a failed member stays in the shard
            raise
        self._written = self.size
        self.members.append(member)
        return member

    def _truncate(self) -> None:
        self.file.seek(self._written)
        self.file.truncate()

    def _append_small(self, job: Job) -> Member:
        buffer = io.BytesIO()
        written = write_payload(job.payload, buffer)
        size = written.size
        header = member_header(job.path, size, time.time())
        self.file.write(header)
        self.file.write(buffer.getbuffer())
        self.file.write(padding(size))
        offset = self.size + len(header)
        self.size = offset + size + len(padding(size))
        return Member(job, offset, size, written.checksum)

    def _append_streamed(self, job: Job) -> Member:
        # A large payload streams straight into the shard; its header, which holds its size,
        # is written in place afterwards (its length depends only on the name).
        reserved = header_size(job.path)
        offset = self.size + reserved
        self.file.seek(offset)
        written = write_payload(job.payload, self.file)
        self.file.write(padding(written.size))
        self.file.flush()
        header = member_header(job.path, written.size, time.time())
        if len(header) != reserved:
            raise ShardFormatError(f"{job.path}: the member header changed size")
        os.pwrite(self.file.fileno(), header, self.size)
        self.size = offset + written.size + len(padding(written.size))
        return Member(job, offset, written.size, written.checksum)

    def finish(self) -> None:
        """End the archive and close the spool file (blocking; nothing may be pending)."""
        assert not self.pending
        self.file.seek(self.size)
        self.file.write(END_OF_ARCHIVE)
        self.file.close()
        self.size += len(END_OF_ARCHIVE)

    def discard(self) -> None:
        """Close and delete the spool file (blocking)."""
        self.file.close()
        with contextlib.suppress(OSError):
            os.unlink(self.spool)


def _write_all(fd: int, pieces: list[bytes | memoryview]) -> None:
    """Write *pieces* in order with ``writev`` (no joined copy: a fresh megabyte faulted in
    256 pages, with the GIL held), at most :data:`~trajtrack.backends.WRITE_PIECE` bytes a
    call, going on after a short write. Empty pieces (a member needing no padding) are left
    out: after the last real byte, a call with nothing to write would return 0 forever."""
    views = [view for view in (memoryview(piece).cast("B") for piece in pieces) if view]
    index = 0
    while index < len(views):
        batch: list[memoryview] = []
        room = WRITE_PIECE
        for view in views[index : index + _IOV_MAX]:
            batch.append(view[:room])
            room -= len(batch[-1])
            if not room:
                break
        written = os.writev(fd, batch)
        if not written:
            raise OSError("the spool file accepted no more bytes")
        while written:
            size = len(views[index])
            if written < size:
                views[index] = views[index][written:]
                break
            written -= size
            index += 1


_IOV_MAX: Final = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "sysconf") else 16


def create_spool(path: str) -> BinaryIO:
    """A new spool file at *path* (blocking)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    return os.fdopen(os.open(path, flags, 0o600), "w+b", buffering=1 << 20)
