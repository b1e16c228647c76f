"""The shards layout: many small dumps per storage file, for per-sample dumping on HDFS.

Dumps are appended, as tar members named and filled exactly as the files layout would write
them (:mod:`trajtrack.layouts.shards`), to a shard built in a local spool file. A shard is
sealed when it reaches ``max_bytes``, when its oldest dump is ``max_age`` seconds old, on
``flush()`` and at close; sealing writes the end-of-archive blocks and commits the file
atomically (temporary name, then rename -- a local destination renames the spool file itself
into place), retried like any write. Only then are its dumps committed: their handles resolve
and their records (shard, offset, length, CRC-32) are written. A dump larger than
``max_bytes`` gets a shard of its own. Until its shard is committed a dump's bytes count
against the tracker's ``max_pending_bytes``; its item slot is freed once it is in the spool.

Each batch of queued dumps is appended in one worker-thread hop, so that thousands of small
dumps a second cost thousands of appends, not thousands of thread hand-offs.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import BinaryIO

import anyio
import anyio.to_thread
from anyio.streams.memory import MemoryObjectReceiveStream

from trajtrack._exceptions import DumpExistsError, SerializationError
from trajtrack._retry import RetryPolicy, retry_async
from trajtrack.backends import BytesPayload, Storage, write_payload
from trajtrack.backends._local_errors import translate
from trajtrack.layouts.names import WriterIdentity, temp_path_for
from trajtrack.layouts.shards import (
    END_OF_ARCHIVE,
    ShardFormatError,
    header_size,
    member_header,
    padding,
    shard_path,
)
from trajtrack.tracker._payloads import FilePayload
from trajtrack.tracker._queue import Job, PendingQueue
from trajtrack.tracker._worker import Outcomes, Spawn

__all__ = ["ShardsLayout"]

logger = logging.getLogger(__name__)

_IN_MEMORY_MAX = 1 << 20  # smaller payloads are serialized into memory, then written at once
_BATCH_BYTES = 8 << 20


@dataclass(eq=False)
class _Member:
    job: Job
    offset: int
    size: int
    checksum: str
    written_at: float = field(default_factory=time.time)  # in order: dump order across shards


@dataclass(eq=False)
class _Shard:
    """One shard in the making: a local spool file and the members appended to it."""

    path: str  # its final path in the storage
    spool: str  # the local file
    file: BinaryIO
    size: int = 0
    members: list[_Member] = field(default_factory=list)
    opened_at: float = field(default_factory=time.monotonic)

    def append(self, job: Job) -> _Member:
        """Write *job*'s payload as the next member (blocking; in a worker thread)."""
        start = self.size
        try:
            if job.nbytes <= _IN_MEMORY_MAX:
                member = self._append_small(job)
            else:
                member = self._append_streamed(job)
        except BaseException:
            self.file.seek(start)  # nothing of a failed member stays in the shard
            self.file.truncate()
            self.size = start
            raise
        self.members.append(member)
        return member

    def plan(self, job: Job, chunks: list[bytes | memoryview]) -> _Member:
        """Lay out *job* (bytes already, a :class:`BytesPayload`) as the next member: its
        pieces go to *chunks*, for :meth:`write_planned` (cheap; on the loop)."""
        payload = job.payload
        assert isinstance(payload, BytesPayload)
        result = payload.counted()
        header = member_header(job.path, result.size, time.time())
        tail = padding(result.size)
        chunks += (header, payload.data, tail)
        offset = self.size + len(header)
        self.size = offset + result.size + len(tail)
        return _Member(job, offset, result.size, result.checksum)

    def write_planned(self, chunks: list[bytes | memoryview], start: int) -> None:
        """Write what :meth:`plan` laid out from *start* (blocking; in a worker thread): one
        write, so the thread takes the GIL back once, not once a member."""
        try:
            self.file.write(b"".join(chunks))
        except BaseException:
            self.file.seek(start)  # nothing of a failed batch stays in the shard
            self.file.truncate()
            raise

    def _append_small(self, job: Job) -> _Member:
        buffer = io.BytesIO()
        written = write_payload(job.payload, buffer)
        size = written.size
        header = member_header(job.path, size, time.time())
        self.file.write(header)
        self.file.write(buffer.getbuffer())
        self.file.write(padding(size))
        offset = self.size + len(header)
        self.size = offset + size + len(padding(size))
        return _Member(job, offset, size, written.checksum)

    def _append_streamed(self, job: Job) -> _Member:
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
        return _Member(job, offset, written.size, written.checksum)

    def finish(self) -> None:
        """End the archive and close the spool file (blocking)."""
        self.file.write(END_OF_ARCHIVE)
        self.file.close()
        self.size += len(END_OF_ARCHIVE)

    def discard(self) -> None:
        self.file.close()
        with contextlib.suppress(OSError):
            os.unlink(self.spool)


class ShardsLayout:
    """Packs dumps into tar shards; see the module docstring.

    One appender task takes the queued dumps in order, in batches, and appends each batch in
    one worker-thread hop (so members, and records, keep dump order); sealed shards go to
    ``workers`` sealer tasks that commit them concurrently; a third task seals by age.

    Args:
        storage: The destination.
        outcomes: Where each dump's outcome goes.
        retry: Retries of a shard's commit.
        writer: The tracker's writer id (shard names carry it).
        who: The tracker's identity (spool file names carry it, for the stale-file sweep).
        spool_dir: Local directory for shards in the making.
        max_bytes: Seal a shard once it holds this many bytes.
        max_age: Seal a shard once its oldest dump is this many seconds old.
        existing: Dump paths that must not be written again (``on_exists="error"``), or
            ``None`` to let the latest commit win.
    """

    batch_items = 4096
    batch_bytes = _BATCH_BYTES

    def __init__(
        self,
        storage: Storage,
        outcomes: Outcomes,
        *,
        retry: RetryPolicy,
        writer: str,
        who: WriterIdentity,
        spool_dir: str,
        max_bytes: int,
        max_age: float,
        existing: set[str] | None,
    ) -> None:
        self._storage = storage
        self._outcomes = outcomes
        self._retry = retry
        self._writer = writer
        self._who = who
        self._spool_dir = spool_dir
        self._max_bytes = max_bytes
        self._max_age = max_age
        self._existing = existing
        self._claims = threading.Lock()
        self._sequence = 0
        self._open: _Shard | None = None
        self._lock = anyio.Lock()  # guards the open shard: appends, and detaching it to seal
        self._progress = anyio.Event()  # set (and replaced) whenever dumps were appended
        # Sealed shards on their way to the sealers; their bytes count in the tracker's budget.
        self._sealed_in, self._sealed_out = anyio.create_memory_object_stream[_Shard](math.inf)
        self._detached: set[_Shard] = set()  # sealed, not yet committed (discard() frees them)

    def start(self, spawn: Spawn, queue: PendingQueue, workers: int, stop: anyio.Event) -> None:
        spawn(self._appender, queue)
        for _ in range(workers):
            spawn(self._sealer, self._sealed_out.clone())
        self._sealed_out.close()
        spawn(self._ager, stop)

    # ------------------------------------------------------------------ appending

    async def _appender(self, queue: PendingQueue) -> None:
        async with self._sealed_in:  # closed at the end: the sealers finish, then stop
            while jobs := await queue.get_batch(self.batch_items, self.batch_bytes):
                await self._write_many(queue, jobs)
            await self._detach_and_send()

    async def _write_many(self, queue: PendingQueue, jobs: list[Job]) -> None:
        run: list[Job] = []  # small dumps in a row: appended to the open shard together
        for job in jobs:
            if job.nbytes <= self._max_bytes:
                run.append(job)
                continue
            await self._append_run(queue, run)
            run = []
            await self._detach_and_send()  # dump order: what came before goes first
            shard = await self._new_shard()  # a dump larger than a shard gets its own
            await anyio.to_thread.run_sync(self._append_all, shard, [job])
            await self._send(shard)
        await self._append_run(queue, run)

    async def _append_run(self, queue: PendingQueue, jobs: list[Job]) -> None:
        while jobs:
            async with self._lock:
                shard = self._open or await self._new_shard()
                self._open = shard
                if isinstance(jobs[0].payload, BytesPayload):
                    added, jobs = await self._append_bytes(shard, jobs)
                else:
                    added, jobs = await anyio.to_thread.run_sync(self._append_all, shard, jobs)
                full = shard.size >= self._max_bytes
                if full:
                    self._open = None
            queue.spooled(added)
            self._notify()
            if full:
                await self._send(shard)

    async def _detach_and_send(self) -> None:
        async with self._lock:
            shard, self._open = self._open, None
        if shard is not None:
            await self._send(shard)

    async def _send(self, shard: _Shard) -> None:
        self._detached.add(shard)
        await self._sealed_in.send(shard)

    async def _sealer(self, sealed: MemoryObjectReceiveStream[_Shard]) -> None:
        async with sealed:
            async for shard in sealed:
                await self._seal(shard)

    async def _append_bytes(self, shard: _Shard, jobs: list[Job]) -> tuple[list[Job], list[Job]]:
        """Append the leading jobs whose bytes are ready, until the shard is full: laid out on
        the loop, written in one thread hop. Returns those added, and the rest."""
        start = shard.size
        chunks: list[bytes | memoryview] = []
        members: list[_Member] = []
        rest: list[Job] = []
        for index, job in enumerate(jobs):
            if shard.size >= self._max_bytes or not isinstance(job.payload, BytesPayload):
                rest = jobs[index:]
                break
            try:
                self._claim(job.path)
            except DumpExistsError as exc:  # this dump's failure: the others go on
                self._outcomes.failed(job, exc)
                continue
            members.append(shard.plan(job, chunks))
        try:
            await anyio.to_thread.run_sync(shard.write_planned, chunks, start)
        except Exception as exc:  # the whole batch's write: each of its dumps failed
            shard.size = start
            for member in members:
                self._outcomes.failed(member.job, _as_dump_error(exc, member.job))
            return [], rest
        shard.members += members
        for member in members:
            member.job.payload = None  # the spool has its bytes now
        return [member.job for member in members], rest

    def _append_all(self, shard: _Shard, jobs: list[Job]) -> tuple[list[Job], list[Job]]:
        """Append jobs until the shard is full (blocking); returns those added, and the rest.

        A job that fails is settled at once; the others wait for their shard's commit.
        """
        added: list[Job] = []
        for index, job in enumerate(jobs):
            if shard.size >= self._max_bytes:
                return added, jobs[index:]
            try:
                self._claim(job.path)
                shard.append(job)
            except Exception as exc:  # this dump's failure: the others go on
                self._outcomes.failed(job, _as_dump_error(exc, job))
            else:
                job.payload = None  # the spool has its bytes now
                added.append(job)
        return added, []

    def _claim(self, path: str) -> None:
        if self._existing is None:
            return
        with self._claims:  # appends run in threads: two must not both claim one name
            if path in self._existing:
                raise DumpExistsError(
                    f"{path} exists (existing-name policy 'error'); nothing was written"
                )
            self._existing.add(path)

    async def _new_shard(self) -> _Shard:
        sequence, self._sequence = self._sequence, self._sequence + 1
        spool = os.path.join(self._spool_dir, temp_path_for("shard", self._who))
        file = await anyio.to_thread.run_sync(_create, spool)
        return _Shard(shard_path(self._writer, sequence), spool, file)

    # ------------------------------------------------------------------ sealing

    async def seal(self) -> None:
        async with self._lock:
            shard, self._open = self._open, None
        if shard is not None:
            await self._seal(shard)

    async def seal_after(self, jobs: list[Job]) -> None:
        # Wait until each job is in a spool or settled (queued ones are appended by the
        # workers meanwhile), then seal the open shard if one of them is in it.
        while any(not job.spooled and not job.future.done() for job in jobs):
            event = self._progress
            with anyio.move_on_after(0.05):  # settled without an append (dropped): poll
                await event.wait()
        if any(not job.future.done() for job in jobs):
            await self.seal()

    async def _seal(self, shard: _Shard) -> None:
        self._detached.discard(shard)
        if not shard.members:
            await anyio.to_thread.run_sync(shard.discard)
            return
        await anyio.to_thread.run_sync(shard.finish)
        payload = FilePayload(shard.spool, shard.size, checksum="")
        what = f"writing shard {shard.path!r}"
        write = functools.partial(self._storage.write_atomic, shard.path, payload, overwrite=True)
        try:
            await retry_async(
                self._retry,
                write,
                what=what,
                on_retry=functools.partial(self._outcomes.retrying, what),
            )
        except Exception as exc:  # every dump of the shard failed with it
            for member in shard.members:
                self._outcomes.failed(member.job, exc)
        else:
            logger.debug("committed %s: %d dumps", shard.path, len(shard.members))
            for member in shard.members:
                self._outcomes.committed(
                    member.job,
                    member.size,
                    member.checksum,
                    shard=shard.path,
                    offset=member.offset,
                    at=member.written_at,
                )
        finally:
            await anyio.to_thread.run_sync(payload.release)  # an unlink: not on the loop

    async def _ager(self, stop: anyio.Event) -> None:
        """Seal the open shard once its oldest dump is ``max_age`` old, until *stop*."""
        while not stop.is_set():
            shard = self._open
            wait = self._max_age
            if shard is not None:
                wait = shard.opened_at + self._max_age - time.monotonic()
            with anyio.move_on_after(max(0.01, wait)):
                await stop.wait()
            shard = self._open
            if shard is not None and time.monotonic() - shard.opened_at >= self._max_age:
                await self._seal_if_open(shard)  # here, not by the sealers: they may be gone

    async def _seal_if_open(self, shard: _Shard) -> None:
        async with self._lock:
            if self._open is not shard:
                return  # sealed meanwhile (full, or a flush)
            self._open = None
        await self._seal(shard)

    def discard(self) -> None:
        shard, self._open = self._open, None
        for each in [*self._detached, *([shard] if shard is not None else [])]:
            each.discard()
        self._detached.clear()

    def _notify(self) -> None:
        event, self._progress = self._progress, anyio.Event()
        event.set()


def _create(path: str) -> BinaryIO:
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    return os.fdopen(os.open(path, flags, 0o600), "w+b", buffering=1 << 20)


def _as_dump_error(exc: Exception, job: Job) -> Exception:
    if isinstance(exc, ShardFormatError):
        return SerializationError(str(exc))
    if isinstance(exc, OSError):  # the local spool (a full disk, ...): typed, with its cause
        error = translate(exc, f"appending {job.path} to a shard's local spool")
        error.__cause__ = exc
        return error
    return exc
