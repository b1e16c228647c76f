"""The files layout: one file per dump, ``<name><suffix>`` (the original tracker's layout).

Each dump is one atomic write (a hidden temporary name, then a rename; see the storage
backends), retried under the tracker's retry policy when the failure is transient. What
existing ``torch.load(path)`` scripts expect; right for large dumps.
"""

from __future__ import annotations

import functools

import anyio

from trajtrack._retry import RetryPolicy, retry_async
from trajtrack.backends import Storage
from trajtrack.tracker._queue import Job, PendingQueue
from trajtrack.tracker._worker import Outcomes, Spawn, upload_worker

__all__ = ["FilesLayout"]


class FilesLayout:
    """Writes each job to its own file and reports the outcome at once.

    Args:
        storage: The destination.
        outcomes: Where each dump's outcome goes.
        retry: Retries of transient storage failures.
        overwrite: Replace an existing file of the same name (else ``DumpExistsError``).
    """

    def __init__(
        self, storage: Storage, outcomes: Outcomes, *, retry: RetryPolicy, overwrite: bool
    ) -> None:
        self._storage = storage
        self._outcomes = outcomes
        self._retry = retry
        self._overwrite = overwrite

    def start(self, spawn: Spawn, queue: PendingQueue, workers: int, stop: anyio.Event) -> None:
        for _ in range(workers):  # each file its own write: uploads in parallel
            spawn(upload_worker, queue, self.write)

    async def write(self, job: Job) -> None:
        what = f"writing {job.path!r}"
        write = functools.partial(
            self._storage.write_atomic, job.path, job.payload, overwrite=self._overwrite
        )
        try:
            result = await retry_async(
                self._retry,
                write,
                what=what,
                on_retry=functools.partial(self._outcomes.retrying, what),
            )
        except Exception as exc:  # any failure belongs to this dump, never to the worker
            self._outcomes.failed(job, exc)
        else:
            self._outcomes.committed(job, result.size, result.checksum)

    async def seal_after(self, jobs: list[Job]) -> None:
        return None  # every file is committed when its write returns

    async def seal(self) -> None:
        return None

    def discard(self) -> None:
        return None
