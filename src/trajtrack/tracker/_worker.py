"""The layout interface, and what happens to a dump once its write ended.

A layout's workers take the next job from the pending queue and write it
(:mod:`trajtrack.tracker._files`: one file per dump; :mod:`trajtrack.tracker._shards`: shards).
The layout reports the outcome to :class:`Outcomes`, which builds the dump's record, settles its
handle, counts it and releases its share of the memory budget. A failure belongs to its dump,
never to the worker: the worker goes on with the next job.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import anyio

from trajtrack._exceptions import StorageError
from trajtrack.layouts.names import WriterIdentity
from trajtrack.layouts.records import DumpRecord
from trajtrack.tracker._ledger import Ledger
from trajtrack.tracker._queue import Job, PendingQueue
from trajtrack.tracker._recorder import Recorder

__all__ = ["Layout", "Outcomes", "Spawn"]

logger = logging.getLogger(__name__)


Spawn = Callable[..., None]
"""``spawn(part, *args)``: run ``await part(*args)`` in the tracker's supervised task group."""


class Layout:
    """How jobs become storage files (the files layout; the shards layout).

    A layout that commits each dump as its write returns (the files layout) has nothing to
    seal or discard: it inherits these methods as they are here, doing nothing.
    """

    def start(self, spawn: Spawn, queue: PendingQueue, workers: int, stop: anyio.Event) -> None:
        """Start the layout's tasks with *spawn*: they take jobs from *queue* until it is
        closed and empty (*workers*: how many may upload at once; *stop*: set at close)."""
        raise NotImplementedError

    async def seal_after(self, jobs: list[Job]) -> None:
        """Once every job of *jobs* is written (or settled), commit what holds them."""

    async def seal(self) -> None:
        """Commit everything written so far (close); report the outcomes."""

    def discard(self) -> None:
        """Drop what is not committed (close gave up); its dumps were already failed."""


class Outcomes:
    """Settles dumps: builds the record, resolves the handle, counts, frees the budget.

    Args:
        ledger: The tracker's ledger.
        recorder: Where committed records go.
        queue: Whose budget a finished job releases.
        writer: The tracker's writer id.
        who: The tracker's process identity (a job made elsewhere carries its own).
        suffix: The file suffix, stripped from the path to name the record.
    """

    def __init__(
        self,
        ledger: Ledger,
        recorder: Recorder,
        queue: PendingQueue,
        *,
        writer: str,
        who: WriterIdentity,
        suffix: str,
    ) -> None:
        self._ledger = ledger
        self._recorder = recorder
        self._queue = queue
        self._writer = writer
        self._who = who
        self._suffix = suffix

    def committed(
        self,
        job: Job,
        size: int,
        checksum: str,
        *,
        shard: str | None = None,
        offset: int | None = None,
        at: float | None = None,
    ) -> None:
        """*job* is in the storage: under its own path, or at *offset* in *shard*.

        *at* is the record's time when not now: a shard member's is when it was written into
        its shard, which keeps dump order across shards committed out of order.
        """
        who = job.who or self._who
        record = DumpRecord(
            name=job.path[: len(job.path) - len(self._suffix)] if self._suffix else job.path,
            path=job.path,
            size=size,
            checksum=checksum,
            host=who.host,
            pid=who.pid,
            rank=who.rank,
            writer=self._writer,
            time=time.time() if at is None else at,
            shard=shard,
            offset=offset,
        )
        self._recorder.add(record)
        latency = time.monotonic() - job.enqueued_at
        self._release(job)  # before the handle resolves: a waiter sees the budget freed
        self._ledger.committed(job, record, latency)

    def failed(self, job: Job, exc: BaseException) -> None:
        """*job* failed for good."""
        self._release(job)
        self._ledger.failed(job, exc)

    def retrying(self, what: str, attempt: int, delay: float, exc: StorageError) -> None:
        """A transient failure of *what*; retry number *attempt* in *delay* seconds."""
        self._ledger.retried()
        logger.warning("retrying %s in %.2f s (attempt %d): %s", what, delay, attempt, exc)

    def _release(self, job: Job) -> None:
        self._queue.done(job)
        job.payload = None  # free the snapshot now, not when the handle goes
