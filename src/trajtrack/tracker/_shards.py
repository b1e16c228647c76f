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

Serialized small dumps (their CRC-32 known) and ready bytes up to a megabyte are laid out on
the loop and written to the spool a megabyte at a time (:mod:`~trajtrack.tracker._shard_spool`)
by a worker thread; other payloads, larger ready bytes among them (their CRC-32 would stall
the loop), are appended by a thread, a batch per hop. Thousands of small dumps a second cost
a few thread hops, not thousands. A spool write that fails fails the dumps it held (typed),
and the shard goes on without them; a shard whose end cannot be written fails its dumps, not
the tracker.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
import time

import anyio
import anyio.to_thread
from anyio.streams.memory import MemoryObjectReceiveStream

from trajtrack._exceptions import DumpExistsError, SerializationError
from trajtrack._retry import RetryPolicy, retry_async
from trajtrack.backends import BytesPayload, Storage
from trajtrack.backends.local import translate
from trajtrack.layouts.names import WriterIdentity, temp_path_for
from trajtrack.layouts.shards import ShardFormatError, shard_path
from trajtrack.tracker._payloads import FilePayload, SerializedPayload
from trajtrack.tracker._queue import Job, PendingQueue
from trajtrack.tracker._shard_spool import WRITE_AT, Member, Shard, create_spool
from trajtrack.tracker._worker import Layout, Outcomes, Spawn

__all__ = ["ShardsLayout"]

logger = logging.getLogger(__name__)


class ShardsLayout(Layout):
    """Packs dumps into tar shards; see the module docstring.

    One appender task takes the queued dumps in order, in batches, and appends them in that
    order (so members, and records, keep dump order); sealed shards go to
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
    batch_bytes = 8 << 20

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
        self._open: Shard | None = None
        self._lock = anyio.Lock()  # guards the open shard: appends, and detaching it to seal
        self._progress = anyio.Event()  # set (and replaced) whenever dumps were appended
        # Sealed shards on their way to the sealers; their bytes count in the tracker's budget.
        self._sealed_in, self._sealed_out = anyio.create_memory_object_stream[Shard](math.inf)
        self._detached: set[Shard] = set()  # sealed, not yet committed (discard() frees them)

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
                if _ready(jobs[0]):
                    added, jobs = await self._append_bytes(shard, jobs)
                else:
                    await self._write_pending(shard)  # the file is written in order
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

    async def _send(self, shard: Shard) -> None:
        self._detached.add(shard)
        await self._sealed_in.send(shard)

    async def _sealer(self, sealed: MemoryObjectReceiveStream[Shard]) -> None:
        async with sealed:
            async for shard in sealed:
                await self._seal(shard)

    async def _append_bytes(self, shard: Shard, jobs: list[Job]) -> tuple[list[Job], list[Job]]:
        """Lay out the leading jobs whose bytes are ready, until the shard is full; write them
        once :data:`WRITE_AT` bytes wait (or the shard is full). Returns those laid out (and
        not failed), and the rest."""
        added: list[Job] = []
        rest: list[Job] = []
        for index, job in enumerate(jobs):
            if shard.size >= self._max_bytes or not _ready(job):
                rest = jobs[index:]
                break
            try:
                self._claim(job.path)
            except DumpExistsError as exc:  # this dump's failure: the others go on
                self._outcomes.failed(job, exc)
                continue
            shard.plan(job)
            job.payload = None  # the shard has its bytes now
            added.append(job)
        if shard.pending_bytes >= WRITE_AT or shard.size >= self._max_bytes:
            await self._write_pending(shard)
            added = [job for job in added if not job.future.done()]  # a failed write
        return added, rest

    async def _write_pending(self, shard: Shard) -> None:
        """Write the members laid out in *shard* (in a thread); if that fails, they fail."""
        if not shard.pending:
            return
        try:
            await anyio.to_thread.run_sync(shard.write_pending)
        except Exception as exc:  # their dumps failed; the shard goes on without them
            failed = shard.pending
            shard.drop_pending()
            self._fail(failed, exc)

    def _fail(self, members: list[Member], exc: Exception) -> None:
        """The dumps of *members* failed with *exc* (a spool write)."""
        for member in members:
            self._outcomes.failed(member.job, _as_dump_error(exc, member.job))

    def _append_all(self, shard: Shard, jobs: list[Job]) -> tuple[list[Job], list[Job]]:
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

    async def _new_shard(self) -> Shard:
        sequence, self._sequence = self._sequence, self._sequence + 1
        spool = os.path.join(self._spool_dir, temp_path_for("shard", self._who))
        file = await anyio.to_thread.run_sync(create_spool, spool)
        return Shard(shard_path(self._writer, sequence), spool, file)

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

    async def _seal(self, shard: Shard) -> None:
        self._detached.discard(shard)
        await self._write_pending(shard)
        if not shard.members:
            await anyio.to_thread.run_sync(shard.discard)
            return
        try:
            await anyio.to_thread.run_sync(shard.finish)
        except Exception as exc:  # the spool's end could not be written: its dumps failed
            await anyio.to_thread.run_sync(shard.discard)
            self._fail(shard.members, exc)
            return
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

    async def _seal_if_open(self, shard: Shard) -> None:
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


def _ready(job: Job) -> bool:
    """Whether *job* is laid out on the loop: bytes whose CRC-32 is known, or at most one
    spool write's worth (:data:`WRITE_AT`); a larger CRC-32 would stall the loop."""
    payload = job.payload
    if isinstance(payload, SerializedPayload):
        return True
    return isinstance(payload, BytesPayload) and payload.data.nbytes <= WRITE_AT


def _as_dump_error(exc: Exception, job: Job) -> Exception:
    if isinstance(exc, ShardFormatError):
        return SerializationError(str(exc))
    if isinstance(exc, OSError):  # the local spool (a full disk, ...): typed, with its cause
        error = translate(exc, f"appending {job.path} to a shard's local spool")
        error.__cause__ = exc
        return error
    return exc
