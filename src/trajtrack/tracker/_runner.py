"""The tracker's background work and its lifecycle: start, supervise, flush, drain, close.

The upload workers and the record ticker run in one task group, which a supervisor task owns.
The supervisor is what makes a failure loud: if anything in the task group raises outside the
per-dump error handling (a bug, a storage that raises an unexpected exception type while the
record is written, ...), the tracker becomes ``FAILED`` at once -- every pending dump fails
with :class:`TrackerFailedError` carrying the cause, every later ``dump``/``flush``/``close``
raises it promptly, and ``state``/``statistics()`` show it -- instead of workers silently gone
and a ``flush`` that waits out its timeout.

Nothing here waits without a bound: closing drains under the caller's budget, and the steps
that a hanging storage could block (a thread that cannot be cancelled) are abandoned past it
(:mod:`~trajtrack.tracker._closing`).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio

from trajtrack._exceptions import TrackerClosedError, TrackerFailedError, TrackerStateError
from trajtrack._retry import RetryPolicy
from trajtrack.backends import Storage
from trajtrack.layouts.names import WriterIdentity
from trajtrack.tracker._closing import GRACE, close_bound, final_steps, not_written, when
from trajtrack.tracker._files import FilesLayout
from trajtrack.tracker._layouts import (
    NOT_STARTED,
    LayoutOptions,
    existing_paths,
    sharded_paths,
)
from trajtrack.tracker._ledger import Ledger
from trajtrack.tracker._queue import Job, PendingQueue
from trajtrack.tracker._recorder import Recorder
from trajtrack.tracker._shards import ShardsLayout
from trajtrack.tracker._stats import TrackerStatistics, statistics_of
from trajtrack.tracker._sweep import sweep_local, sweep_stale
from trajtrack.tracker._waits import finished_within, retrieve, wait_all
from trajtrack.tracker._worker import Layout, Outcomes

__all__ = ["Runner", "TrackerState"]

logger = logging.getLogger(__name__)


class TrackerState(enum.Enum):
    """Lifecycle of a :class:`~trajtrack.Tracker`."""

    NEW = "new"
    STARTING = "starting"
    """Dumps are admitted (queued) while the storage is being prepared (the sync shim)."""
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"
    FAILED = "failed"
    """The background task failed; see ``statistics().failure``. ``aclose()`` still releases
    the storage (and raises the failure)."""


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    """A tracker's configuration, as the runner needs it.

    Attributes:
        max_bytes: The pending queue's byte budget.
        max_items: Its item budget.
        workers: Upload workers.
        writer: The tracker's writer id (records, shard names).
        who: The tracker's process identity.
        suffix: The file suffix.
        retry: Retries of transient storage failures.
        overwrite: The existing-name policy.
        record: Whether to write the record.
        record_interval: Seconds between record segments.
        sweep: Whether to sweep stale temporary files at start.
        layout: How dumps map onto storage files (``files`` or ``shards``, and its options).
    """

    max_bytes: int
    max_items: int
    workers: int
    writer: str
    who: WriterIdentity
    suffix: str
    retry: RetryPolicy
    overwrite: bool
    record: bool
    record_interval: float
    sweep: bool
    layout: LayoutOptions


class Runner:
    """Starts, supervises and closes the background work of one tracker.

    Args:
        url: The destination, for messages.
        ledger: The tracker's ledger (handles, counters, failures).
        config: Everything else the tracker was configured with.
    """

    def __init__(self, url: str, ledger: Ledger, config: RunnerConfig) -> None:
        self._url = url
        self._ledger = ledger
        self._config = config
        self.state = TrackerState.NEW
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: PendingQueue | None = None
        self._recorder: Recorder | None = None
        self._layout: Layout = NOT_STARTED
        self._storage: Storage | None = None
        self._group: anyio.abc.TaskGroup | None = None
        self._task: asyncio.Task[None] | None = None
        self._finished: anyio.Event | None = None  # events are made on the loop, at start
        self._stop_ticker: anyio.Event | None = None
        self._close_done: anyio.Event | None = None
        self._fatal: BaseException | None = None
        self._start_done: anyio.Event | None = None  # admit_early(): set when start() ends
        self._closing: asyncio.Task[None] | None = None  # close(): the one task that closes
        self._drain_scope: anyio.CancelScope | None = None  # close(): the drain's wait

    # ------------------------------------------------------------------ parts

    @property
    def layout(self) -> str:
        return self._config.layout.kind

    @property
    def queue(self) -> PendingQueue:
        if self._queue is None:
            raise TrackerStateError("the tracker has not been started")
        return self._queue

    def in_own_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    def check_running(self, what: str = "dump") -> None:
        """Raise the error that says why *what* is not possible, unless running."""
        if self.state is TrackerState.RUNNING or self.state is TrackerState.STARTING:
            return
        if self.state is TrackerState.NEW:
            raise TrackerStateError(f"cannot {what}: the tracker has not been started")
        if self.state is TrackerState.FAILED:
            if what == "dump":  # refused at once, and counted (the failure was logged once)
                with self._ledger.counters.lock:
                    self._ledger.counters.failed += 1
            raise self._failed_error()
        raise TrackerClosedError(f"cannot {what}: the tracker is {self.state.value}")

    def mark_closed(self) -> None:
        self.state = TrackerState.CLOSED

    # ------------------------------------------------------------------ start

    def admit_early(self) -> None:
        """Queue dumps from now on, before :meth:`start` (called next, on the same loop) has
        prepared the storage. Should that start fail, the tracker becomes ``FAILED``: the
        queued dumps fail with it and later ones at once, instead of each waiting for
        another start."""
        self._open_queue()
        self._start_done = anyio.Event()
        self.state = TrackerState.STARTING

    def _open_queue(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._finished, self._stop_ticker, self._close_done = (anyio.Event() for _ in range(3))
        self._queue = PendingQueue(
            self._loop, self._config.max_bytes, self._config.max_items, self._ledger.dropped
        )

    async def start(self, storage: Storage) -> None:
        """Prepare *storage*, sweep it, start the workers under the supervisor."""
        early = self._start_done is not None
        try:
            await self._start(storage, early)
        except BaseException as exc:
            if early:
                assert self._finished is not None
                self._crash(exc)  # the queued dumps fail; later ones at once
                self._finished.set()  # no workers will ever run
            raise
        finally:
            if self._start_done is not None:
                self._start_done.set()

    async def _start(self, storage: Storage, early: bool) -> None:
        await storage.prepare()
        spool = self._config.layout.spool_dir_for(storage)
        if self._config.sweep:
            await sweep_stale(storage, self._config.who)
            if storage.spool_dir is None:  # a remote destination spools on this machine
                await anyio.to_thread.run_sync(sweep_local, spool, self._config.who)
        if not early:
            self._open_queue()
        assert self._queue is not None
        assert self._loop is not None
        self._storage = storage
        self._recorder = Recorder(
            storage,
            self._config.writer,
            self._ledger.counters,
            interval=self._config.record_interval,
            enabled=self._config.record,
        )
        outcomes = Outcomes(
            self._ledger,
            self._recorder,
            self._queue,
            writer=self._config.writer,
            who=self._config.who,
            suffix=self._config.suffix,
        )
        self._layout = await self._make_layout(storage, outcomes, spool)
        started = anyio.Event()
        self._task = self._loop.create_task(self._supervise(started), name=f"trajtrack:{self._url}")
        self._task.add_done_callback(retrieve)
        await started.wait()
        if self._fatal is None:
            self.state = TrackerState.RUNNING
        logger.debug("tracker started: %s (%d workers)", self._url, self._config.workers)

    async def _make_layout(self, storage: Storage, outcomes: Outcomes, spool: str) -> Layout:
        options = self._config.layout
        if options.kind == "files":
            overwrite = self._config.overwrite
            return FilesLayout(
                storage,
                outcomes,
                retry=self._config.retry,
                overwrite=overwrite,
                in_shards=frozenset() if overwrite else frozenset(await sharded_paths(storage)),
            )
        return ShardsLayout(
            storage,
            outcomes,
            retry=self._config.retry,
            writer=self._config.writer,
            who=self._config.who,
            spool_dir=spool,
            max_bytes=options.shard_max_bytes,
            max_age=options.shard_max_age,
            existing=None if self._config.overwrite else await existing_paths(storage),
        )

    async def _supervise(self, started: anyio.Event) -> None:
        assert self._queue is not None
        assert self._recorder is not None
        assert self._finished is not None
        assert self._stop_ticker is not None
        try:
            async with anyio.create_task_group() as group:
                self._group = group

                def spawn(part: Callable[..., Awaitable[None]], *args: Any) -> None:
                    group.start_soon(self._guarded, part, *args)

                self._layout.start(spawn, self._queue, self._config.workers, self._stop_ticker)
                if self._recorder.enabled:
                    spawn(self._recorder.run_ticker, self._stop_ticker)
                started.set()
        except Exception as exc:  # already reported by _guarded; nothing more to raise
            self._crash(exc)
        finally:
            started.set()
            self._finished.set()

    async def _guarded(self, part: Callable[..., Awaitable[None]], *args: Any) -> None:
        # A part that fails is reported at once, not when the task group has ended: that
        # waits for the other workers, and one of them may sit in a storage call for minutes.
        try:
            await part(*args)
        except Exception as exc:
            self._crash(exc)
            raise

    def _crash(self, exc: BaseException) -> None:
        if self._fatal is not None:
            return  # the first failure is the cause; the rest follow from it
        cause = _leaf(exc)
        self._fatal = cause
        if self.state is not TrackerState.CLOSED:
            self.state = TrackerState.FAILED
        logger.error(
            "the background task of the tracker for %s failed; pending and later dumps fail: %r",
            self._url,
            cause,
            exc_info=cause,
        )
        if self._queue is not None:
            self._queue.close(self._failed_error)
            self._queue.drain_queued()
        count = self._ledger.settle_all(self._failed_error)
        with self._ledger.counters.lock:
            self._ledger.counters.failed += count
        if count:
            logger.error("%d pending dumps of %s were not written", count, self._url)

    def fail_if_failed(self, job: Job) -> None:
        """Fail *job*, just admitted from a thread other than the loop's, if the tracker has
        failed: its crash may have drained the job from the queue before the ledger held it,
        and then nothing else would settle it. (A crash after the ledger held it settles it
        itself; a future settles once.)"""
        if self._fatal is None or job.future.done():
            return
        if job.future.settle(error=self._failed_error()):
            with self._ledger.counters.lock:
                self._ledger.counters.failed += 1
        self._ledger.settle(job.future)  # forget it (already settled: nothing changes)

    def _failed_error(self) -> TrackerFailedError:
        cause = self._fatal
        assert cause is not None
        error = TrackerFailedError(f"the tracker for {self._url} failed: {_describe(cause)}")
        error.__cause__ = cause
        return error

    # ------------------------------------------------------------------ flush

    async def flush(self, timeout: float | None) -> None:
        """Wait for every dump admitted so far, write the record, raise the first failure.

        The waiting runs as a task given up on past *timeout*, the way :meth:`close` bounds
        its steps, but abandoned rather than cancelled: a shard's upload or the record write
        blocked in a storage thread cannot be interrupted, and when it returns it must still
        settle its dumps (or keep the records for the next segment).
        """
        self.check_running("flush")
        waiting = self._ledger.outstanding()
        step = ["waiting for the storage to start"]  # what the flush is at, for the message
        if not await finished_within(self._flush(waiting, step), timeout, abandon=True):
            left = sum(not job.future.done() for job in waiting)
            raise TimeoutError(
                f"flush of {self._url} timed out after {timeout} s while {step[0]}: "
                f"{left} of the {len(waiting)} dumps it waited for are still pending"
            )
        failure = self._ledger.take_failure()
        if failure is not None:
            raise failure

    async def _flush(self, waiting: list[Job], step: list[str]) -> None:
        if self._start_done is not None:  # queued while the storage starts: wait for it
            await self._start_done.wait()
            self.check_running("flush")  # the start failed: say so
        assert self._recorder is not None
        if self.layout == "shards":
            step[0] = "sealing and uploading the open shard"
        await self._layout.seal_after(waiting)
        step[0] = "waiting for their writes"
        await wait_all([job.future for job in waiting])
        if self._fatal is not None:
            raise self._failed_error()
        step[0] = "writing the record segment"
        await self._recorder.write()

    # ------------------------------------------------------------------ close

    async def close(self, timeout: float | None) -> None:
        """Drain (under *timeout*), seal, record, release the storage; raise what failed.

        The work runs as one task, so that it is neither cut short nor done twice: a caller
        that is cancelled meanwhile still waits (shielded) for it to end within its bounds,
        then the cancellation goes on; a close that finds another one under way waits for it
        under its own *timeout* and raises what that one raised.
        """
        assert self._close_done is not None
        assert self._stop_ticker is not None
        if self._start_done is not None and not await self._started_within(timeout):
            return
        if self._closing is not None:
            if not self._closing.done():  # a concurrent close does the work
                await self._join_close(self._closing, timeout)
            return  # an earlier close did it, and raised its outcome to its caller
        if self.state not in (TrackerState.RUNNING, TrackerState.FAILED):
            return  # closed while it was starting
        if self.state is TrackerState.RUNNING:
            self.state = TrackerState.CLOSING
        self.queue.close()
        self._stop_ticker.set()  # the task group ends when the workers and the ticker have
        drain_end = math.inf if timeout is None else anyio.current_time() + timeout
        self._drain_scope = anyio.CancelScope(deadline=drain_end)
        closing = asyncio.get_running_loop().create_task(
            self._close(timeout), name=f"trajtrack-close:{self._url}"
        )
        closing.add_done_callback(retrieve)
        self._closing = closing
        try:
            await finished_within(closing, None, abandon=True)  # bounded by *timeout* itself
        except anyio.get_cancelled_exc_class():
            # Cancelled (an outer timeout, a task group): finish the bounded work first, or
            # the record and the storage's release are skipped. Without a budget the drain is
            # cut short now (the only way it ends unfinished); then only the steps' grace
            # periods remain.
            if timeout is None:
                self._drain_scope.cancel()
            # Its error must not replace the cancellation; it is logged already (the wait
            # that was cancelled above left the task finished_within's late-failure log).
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await finished_within(closing, close_bound(timeout), abandon=True)
            raise

    async def _join_close(self, closing: asyncio.Task[None], timeout: float | None) -> None:
        if not await finished_within(closing, timeout, abandon=True):
            raise TimeoutError(
                f"closing {self._url}: the close already under way did not finish "
                f"within {timeout} s"
            )

    async def _close(self, timeout: float | None) -> None:
        assert self._close_done is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            unfinished = await self._drain(timeout)
            if unfinished and timeout is None:
                deadline = time.monotonic()  # cut short: each step only gets its grace
            assert self._recorder is not None
            seal = not unfinished and self._fatal is None
            await final_steps(
                self._url, self._recorder, self._layout, self._storage, deadline, seal=seal
            )
        finally:
            self.state = TrackerState.CLOSED
            self._close_done.set()
        if self._fatal is not None:
            raise self._failed_error()
        if unfinished:
            raise TimeoutError(
                f"closing {self._url}: {unfinished} dumps were not written {when(timeout)}"
            )
        failure = self._ledger.take_failure()
        if failure is not None:
            raise failure

    async def _started_within(self, timeout: float | None) -> bool:
        """Whether a tracker that admitted dumps early has started (or failed to) in time to
        be closed as usual; else (or when its start failed) it is closed here, its queued
        dumps failed, and ``False`` returned or the failure raised."""
        assert self._start_done is not None
        assert self._close_done is not None
        with anyio.move_on_after(timeout):
            await self._start_done.wait()
        if self._task is not None or self._close_done.is_set():  # started: the usual close
            return True
        if self.state is TrackerState.STARTING:  # still starting: nothing can be written
            self.queue.close(lambda: TrackerClosedError("the tracker closed while starting"))
            self.queue.drain_queued()
            count = self._ledger.settle_all(not_written)
            logger.error(
                "closing %s: %d dumps were not written: the storage never started within %s s",
                self._url,
                count,
                timeout,
            )
        self.state = TrackerState.CLOSED
        self._close_done.set()
        if self._fatal is not None:
            raise self._failed_error()
        return False

    async def _drain(self, timeout: float | None) -> int:
        assert self._finished is not None
        assert self._drain_scope is not None
        with self._drain_scope:
            await self._finished.wait()
        if self._finished.is_set():
            return 0
        abandoned = self.queue.drain_queued()
        for job in abandoned:
            self._ledger.settle(job.future, error=not_written())
        if self._group is not None:
            self._group.cancel_scope.cancel()
        # Workers blocked in a storage thread cannot be cancelled: do not wait long for them,
        # and settle their handles now (a write that still completes is then not reported).
        with anyio.move_on_after(GRACE):
            await self._finished.wait()
        in_flight = self._ledger.settle_all(not_written)
        count = len(abandoned) + in_flight
        logger.error("closing %s: %d dumps were not written %s", self._url, count, when(timeout))
        return count

    # ------------------------------------------------------------------ statistics

    def statistics(self) -> TrackerStatistics:
        """Counters and queue state; cheap, callable from any thread."""
        failure = None if self._fatal is None else _describe(self._fatal)
        return statistics_of(self._queue, self._ledger.counters, self.state.value, failure)


def _leaf(exc: BaseException) -> BaseException:
    """The first real error inside (nested) exception groups."""
    inner = getattr(exc, "exceptions", None)  # a BaseExceptionGroup (3.11, or anyio's backport)
    while isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException):
        exc = inner[0]
        inner = getattr(exc, "exceptions", None)
    return exc


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
