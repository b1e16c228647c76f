"""The files layout: one file per dump, ``<name><suffix>`` (the original tracker's layout).

Each dump is one atomic write (a hidden temporary name, then a rename; see the storage
backends), retried under the tracker's retry policy when the failure is transient. What
existing ``torch.load(path)`` scripts expect; right for large dumps.

Small and mid-size dumps are written in batches: an upload worker takes what is queued (up to
:data:`BATCH_ITEMS` dumps, :data:`BATCH_BYTES` bytes) and writes it with one
``write_atomic_many`` -- one worker-thread hop (and one open of the directory) for a local disk
instead of one per dump. For 4 KB dumps a hop costs more than the write itself; for 1 MB dumps
the hops' round trips through the event loop share the GIL with the dumping caller
(``benchmarks/bench_core.py``, 1 MB against the thread pool). Remote storages write a batch's
files concurrently. Dumps of a batch whose write failed transiently are retried one by one,
each under the retry policy.

Batches of small files (:data:`SMALL_BYTES` on average) for a local disk are written one
after another, the other workers waiting on the loop for their turn: such a file is a few
system calls, each of which hands the GIL to whichever thread waits for it, and workers writing
them side by side spent their time handing it back and forth (``bench_core.py`` throughput,
4 KB). Larger files, and remote storages' writes, which wait on a disk or a network, go side
by side. A retry waits out a backoff: the turn is handed on first.
"""

from __future__ import annotations

import functools
from typing import TypeGuard

import anyio

from trajtrack._exceptions import DumpExistsError, StorageError
from trajtrack._retry import RetryPolicy, retry_async
from trajtrack.backends import Storage, WriteResult
from trajtrack.tracker._payloads import FilePayload, release_spool
from trajtrack.tracker._queue import Job, PendingQueue
from trajtrack.tracker._worker import Layout, Outcomes, Spawn

__all__ = ["BATCH_BYTES", "BATCH_ITEMS", "FilesLayout"]

BATCH_ITEMS = 64
BATCH_BYTES = 8 << 20
"""A batch's bytes at most: a few mid-size dumps per hop, while four workers still write
large ones side by side."""
SMALL_BYTES = 128 << 10
"""Batches of local files this small on average are written one after another."""


class FilesLayout(Layout):
    """Writes each job to its own file and reports the outcome at once.

    Args:
        storage: The destination.
        outcomes: Where each dump's outcome goes.
        retry: Retries of transient storage failures.
        overwrite: Replace an existing file of the same name (else ``DumpExistsError``).
        in_shards: Without *overwrite*: the paths the destination holds in shards, refused
            too (the atomic publish only finds files taken).
    """

    def __init__(
        self,
        storage: Storage,
        outcomes: Outcomes,
        *,
        retry: RetryPolicy,
        overwrite: bool,
        in_shards: frozenset[str] = frozenset(),
    ) -> None:
        self._storage = storage
        self._outcomes = outcomes
        self._retry = retry
        self._overwrite = overwrite
        self._in_shards = in_shards
        self._local = storage.local_path("") is not None
        self._turn = anyio.Lock()

    def start(self, spawn: Spawn, queue: PendingQueue, workers: int, stop: anyio.Event) -> None:
        for _ in range(workers):  # each file its own write: uploads in parallel
            spawn(self._worker, queue)

    async def _worker(self, queue: PendingQueue) -> None:
        while True:
            async with self._turn:  # the workers take batches one at a time
                jobs = await queue.get_batch(BATCH_ITEMS, BATCH_BYTES)
                if not jobs:
                    return
                kept = self._one_at_a_time(jobs)
                if kept:  # small local files: written with the turn kept, retried after it
                    jobs = await self._write_once(jobs, kept=True)
            if not kept:
                jobs = await self._write_once(jobs, kept=False)
            for job in jobs:  # failed transiently: retried under the policy
                await self.write(job)

    def _one_at_a_time(self, jobs: list[Job]) -> bool:
        """Whether *jobs* are small files for a local disk, written before the next worker
        takes a batch (see the module's docstring)."""
        return self._local and sum(job.nbytes for job in jobs) <= SMALL_BYTES * len(jobs)

    async def _write_once(self, jobs: list[Job], *, kept: bool) -> list[Job]:
        """Write *jobs*; those that failed transiently, to retry. A single dump is retried
        here already unless the worker *kept* the turn for it."""
        if self._in_shards:
            jobs = await self._refuse_sharded(jobs)
        if len(jobs) == 1:
            return [] if await self.write(jobs[0], once=kept) else jobs
        return await self._write_batch(jobs) if jobs else []

    async def _refuse_sharded(self, jobs: list[Job]) -> list[Job]:
        """Fail the jobs whose path a shard holds; the others, to write."""
        kept = []
        for job in jobs:
            if job.path in self._in_shards:
                await _release_spool(job)
                self._outcomes.failed(job, DumpExistsError(f"{job.path} {_IN_A_SHARD}"))
            else:
                kept.append(job)
        return kept

    async def _write_batch(self, jobs: list[Job]) -> list[Job]:
        items = [(job.path, job.payload) for job in jobs]
        again: list[Job] = []

        def done(index: int, outcome: WriteResult | Exception) -> None:
            # Reported as each file ends (in the writing thread: Outcomes is thread-safe), so
            # one write that hangs holds back no other dump of the batch.
            job = jobs[index]
            if isinstance(outcome, WriteResult):
                release_spool(job.payload)  # here, in a thread: an unlink
                self._outcomes.committed(job, outcome.size, outcome.checksum)
            elif _transient(outcome):
                again.append(job)
                self._outcomes.retrying(f"writing {job.path!r}", 1, 0.0, outcome)
            else:
                release_spool(job.payload)
                self._outcomes.failed(job, outcome)

        try:
            await self._storage.write_atomic_many(items, overwrite=self._overwrite, done=done)
        except Exception:  # the call itself failed: each dump it did not report, on its own
            again += [job for job in jobs if not job.future.done() and job not in again]
        return again

    async def write(self, job: Job, *, once: bool = False) -> bool:
        """Write one job, retrying transient failures; report the outcome.

        With *once*, a transient failure is reported as a retry and the job left unsettled:
        False, for the caller to retry it later.
        """
        what = f"writing {job.path!r}"
        write = functools.partial(
            self._storage.write_atomic, job.path, job.payload, overwrite=self._overwrite
        )
        on_retry = functools.partial(self._outcomes.retrying, what)
        try:
            if once:
                result = await write()
            else:
                result = await retry_async(self._retry, write, what=what, on_retry=on_retry)
        except Exception as exc:  # any failure belongs to this dump, never to the worker
            if once and _transient(exc):
                on_retry(1, 0.0, exc)
                return False
            await _release_spool(job)
            self._outcomes.failed(job, exc)
        else:
            await _release_spool(job)
            self._outcomes.committed(job, result.size, result.checksum)
        return True


def _transient(error: BaseException) -> TypeGuard[StorageError]:
    return isinstance(error, StorageError) and error.retryable


_IN_A_SHARD = (
    "exists in a shard of the destination (existing-name policy 'error'); nothing was written"
)


async def _release_spool(job: Job) -> None:
    """Delete the job's spool file, if any, in a thread (before its outcome is reported)."""
    if isinstance(job.payload, FilePayload):  # an unlink: not on the event loop
        await anyio.to_thread.run_sync(job.payload.release)
