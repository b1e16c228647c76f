"""The asyncio-native tracker: snapshot on the caller, bounded queue, upload workers.

Where a dump goes after ``dump()``::

    dump(obj, name) ── name template + validation (_names)
                    ── snapshot (_snapshot: copy plain data, or serialize in a thread)
                    ── PendingQueue (_queue: bounded by bytes and items, full-policy)
                    ── upload worker (here: retries under a deadline)
                    ── Storage.write_atomic (backends/: temp file + rename)
                    ── record segment (_record: what was written, in the storage itself)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import functools
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from types import TracebackType
from typing import Any, Literal

import anyio
import anyio.lowlevel
import anyio.to_thread

from trajtrack._exceptions import (
    ConfigurationError,
    DumpDroppedError,
    StorageError,
    StorageUnavailableError,
    TrackerClosedError,
    TrackerStateError,
)
from trajtrack._retry import RetryPolicy
from trajtrack.backends import Payload, Storage, open_storage
from trajtrack.layouts.names import (
    WriterIdentity,
    check_template,
    parse_temp_path,
    render_name,
    temp_path_for,
    validate_name,
)
from trajtrack.layouts.records import DumpRecord, encode_segment, new_writer_id, segment_path
from trajtrack.tracker._handle import DumpHandle
from trajtrack.tracker._payloads import (
    BytesPayload,
    DeferredPayload,
    ObjectPayload,
    serialize_to_file,
    serialize_to_spool,
)
from trajtrack.tracker._queue import FullPolicy, Job, PendingQueue
from trajtrack.tracker._serialize import Serializer, torch_save
from trajtrack.tracker._snapshot import (
    NotPlainError,
    has_cuda_tensor,
    measure_plain,
    snapshot_plain,
)
from trajtrack.tracker._stats import Counters, TrackerStatistics

__all__ = ["Tracker", "TrackerState"]

logger = logging.getLogger("trajtrack")

ExistingPolicy = Literal["overwrite", "error"]

#: Seconds close() still gives cancelled workers, the final record and the storage's aclose
#: once its budget is spent (each bounded: a hanging storage costs at most 3 x this).
_GRACE = 1.0


class TrackerState(enum.Enum):
    """Lifecycle of a :class:`Tracker`."""

    NEW = "new"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"


class Tracker:
    """Dumps objects to a destination in the background, without blocking the event loop.

    Use it as ``async with Tracker(url) as t: await t.dump(obj, "step1/obs")``, or call
    :meth:`start` and :meth:`aclose` yourself (from any task of the same event loop).

    Args:
        destination: A local path, ``file://``, ``memory://``, ``webhdfs://``, ``swebhdfs://``
            or ``hdfs://`` URL.
        max_pending_bytes: Memory budget of snapshots admitted but not yet written.
        max_pending_items: Count budget of the same.
        full_policy: ``"block"`` (default), ``"drop_newest"``, ``"drop_oldest"`` or ``"raise"``.
        workers: Concurrent uploads.
        name_template: How a dump name becomes a file name; fields ``{name}``, ``{rank}``,
            ``{local_rank}``, ``{world_size}``, ``{pid}``, ``{host}``. Example:
            ``"{name}.rank{rank}"`` keeps many ranks apart in one directory.
        suffix: Appended to every file name (the original tracker's ``.pth``).
        on_exists: ``"overwrite"`` (default, like the original's ``-put -f``) or ``"error"``.
        serializer: ``serializer(obj, binary_file)``; default ``torch.save`` with tensors moved
            to the CPU.
        retry: Retries of transient storage failures.
        exit_timeout: Budget in seconds for draining when the ``async with`` block exits.
        inline_snapshot_bytes: Plain data up to this size is copied on the caller's thread
            (a 4 MB copy takes well under a millisecond); larger data is serialized in a worker
            thread into a spool file while ``dump()`` awaits, so the loop never copies it.
        record: Write the record of what was written (``.trajtrack/records``).
        record_interval: Seconds between record segments while dumps commit.
        sweep_stale: At start, delete temporary files left by dead processes of this host.
        spool_dir: Where large serialized snapshots spill (default: inside a local
            destination, else the system temporary directory).
        storage: An already-open storage to use instead of opening *destination*.
        storage_options: Keyword arguments for the storage backend (e.g. ``fsync=True``).
    """

    def __init__(
        self,
        destination: str | os.PathLike[str],
        *,
        max_pending_bytes: int = 1 << 30,
        max_pending_items: int = 10_000,
        full_policy: FullPolicy | str = FullPolicy.BLOCK,
        workers: int = 4,
        name_template: str = "{name}",
        suffix: str = ".pth",
        on_exists: ExistingPolicy = "overwrite",
        serializer: Serializer = torch_save,
        retry: RetryPolicy | None = None,
        exit_timeout: float | None = 600.0,
        inline_snapshot_bytes: int = 4 << 20,
        record: bool = True,
        record_interval: float = 5.0,
        sweep_stale: bool = True,
        spool_dir: str | None = None,
        storage: Storage | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self._url = os.fspath(destination)
        _require(max_pending_bytes > 0, "max_pending_bytes must be > 0")
        _require(max_pending_items > 0, "max_pending_items must be > 0")
        _require(workers > 0, "workers must be > 0")
        _require(on_exists in ("overwrite", "error"), "on_exists must be 'overwrite' or 'error'")
        _require(exit_timeout is None or exit_timeout >= 0, "exit_timeout must be >= 0")
        _require(record_interval > 0, "record_interval must be > 0")
        self._max_bytes = max_pending_bytes
        self._max_items = max_pending_items
        self._policy = _policy(full_policy)
        self._workers = workers
        self._template = check_template(name_template)
        if suffix:
            validate_name("x" + suffix)
        self._suffix = suffix
        self._overwrite = on_exists == "overwrite"
        self._serializer = serializer
        self._retry = retry or RetryPolicy()
        self._exit_timeout = exit_timeout
        self._inline_bytes = inline_snapshot_bytes
        self._record_enabled = record
        self._record_interval = record_interval
        self._sweep = sweep_stale
        self._spool_dir = spool_dir
        self._storage: Storage | None = storage
        self._storage_options = dict(storage_options or {})

        self._who = WriterIdentity.current()
        self._writer_id = new_writer_id(self._who)
        self._state = TrackerState.NEW
        self._counters = Counters()
        self._outstanding: set[concurrent.futures.Future[DumpRecord]] = set()
        self._failure: BaseException | None = None
        self._failure_count = 0
        self._unrecorded: list[DumpRecord] = []
        self._segment = 0
        self._last_segment_at = time.monotonic()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: PendingQueue | None = None
        self._runner: asyncio.Task[None] | None = None
        self._task_group: anyio.abc.TaskGroup | None = None
        self._record_lock: asyncio.Lock | None = None
        self._stop_ticker: asyncio.Event | None = None
        self._close_done: asyncio.Event | None = None
        self._snapshot_limiter = anyio.CapacityLimiter(max(2, workers))
        self._last_checkpoint = 0.0

    # ------------------------------------------------------------------ properties

    @property
    def destination(self) -> str:
        """The destination URL or path, as given."""
        return self._url

    @property
    def state(self) -> TrackerState:
        """Where the tracker is in its lifecycle."""
        return self._state

    @property
    def storage(self) -> Storage:
        """The storage backend (opened at :meth:`start`)."""
        if self._storage is None:
            raise TrackerStateError("the tracker has not been started")
        return self._storage

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> Tracker:
        """Open the storage, check it, sweep stale temp files, start the upload workers."""
        if self._state is not TrackerState.NEW:
            raise TrackerStateError(f"cannot start: the tracker is {self._state.value}")
        self._loop = asyncio.get_running_loop()
        if self._storage is None:
            # Opening may read configuration files (HADOOP_CONF_DIR): not on the loop.
            self._storage = await anyio.to_thread.run_sync(
                functools.partial(open_storage, self._url, **self._storage_options)
            )
        await self._storage.prepare()
        self._queue = PendingQueue(self._loop, self._max_bytes, self._max_items, self._dropped)
        self._record_lock = asyncio.Lock()
        self._stop_ticker = asyncio.Event()
        self._close_done = asyncio.Event()
        if self._sweep:
            await self._sweep_stale()
        started = asyncio.Event()
        self._runner = self._loop.create_task(self._run(started), name=f"trajtrack:{self._url}")
        await started.wait()
        self._state = TrackerState.RUNNING
        logger.debug("tracker started: %s (%d workers)", self._url, self._workers)
        return self

    async def _run(self, started: asyncio.Event) -> None:
        # The tracker's own task group: the workers and the record ticker live and die here.
        async with anyio.create_task_group() as group:
            self._task_group = group
            for _ in range(self._workers):
                group.start_soon(self._worker)
            if self._record_enabled:
                group.start_soon(self._record_ticker)
            started.set()

    async def __aenter__(self) -> Tracker:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            await self.aclose(self._exit_timeout)
            return
        # The block failed (an exception, SystemExit, a cancellation): the dumps just before
        # a crash are the most valuable ones, so drain them, shielded, under the exit budget.
        with anyio.CancelScope(shield=True):
            try:
                await self.aclose(self._exit_timeout)
            except Exception as close_error:
                logger.error("while leaving after %r: %s", exc, close_error)
                add_note(exc, f"trajtrack: draining on exit also failed: {close_error!r}")

    async def aclose(self, timeout: float | None = None) -> None:
        """Stop accepting dumps, drain what is pending, write the record, release the storage.

        Raises:
            TimeoutError: Pending dumps were not written within *timeout* (they are reported
                failed; the count is logged).
            Exception: The first failure since the last :meth:`flush`, if any.
        """
        if self._state is TrackerState.NEW:
            self._state = TrackerState.CLOSED
            return
        if self._state is not TrackerState.RUNNING:
            assert self._close_done is not None
            await self._close_done.wait()  # a concurrent or earlier close did the work
            return
        self._state = TrackerState.CLOSING
        assert self._queue is not None
        assert self._stop_ticker is not None
        self._queue.close()
        self._stop_ticker.set()  # the runner's task group ends when workers and ticker have
        try:
            deadline = None if timeout is None else time.monotonic() + timeout
            unfinished = await self._drain(timeout)
            await self._finish(deadline)
        finally:
            self._state = TrackerState.CLOSED
            assert self._close_done is not None
            self._close_done.set()
        if unfinished:
            raise TimeoutError(
                f"closing {self._url}: {unfinished} dumps were not written within {timeout} s"
            )
        self._raise_failure()

    async def _drain(self, timeout: float | None) -> int:
        assert self._queue is not None
        assert self._runner is not None
        done, _ = await asyncio.wait({self._runner}, timeout=timeout)
        if done:
            return 0
        abandoned = self._queue.drain_queued()
        in_flight = self._queue.pending_items
        for job in abandoned:
            self._settle(job, error=TimeoutError("not written before the close deadline"))
        if self._task_group is not None:
            self._task_group.cancel_scope.cancel()
        # Workers blocked in a storage thread cannot be cancelled: do not wait long for them.
        await asyncio.wait({self._runner}, timeout=_GRACE)
        count = len(abandoned) + in_flight
        logger.error("closing %s: %d dumps were not written within %s s", self._url, count, timeout)
        return count

    async def _finish(self, deadline: float | None) -> None:
        # A storage that hangs must not hang close(): fail_after cannot interrupt a blocking
        # call in a worker thread, so these steps are abandoned (not awaited) past the budget.
        left = 30.0 if deadline is None else max(_GRACE, deadline - time.monotonic())
        try:
            if not await _finished_within(self._write_record(), left):
                logger.error("could not write the final record segment to %s in time", self._url)
        except StorageError as exc:
            logger.error("could not write the final record segment to %s: %s", self._url, exc)
        if self._storage is not None and not await _finished_within(
            self._storage.aclose(), 30.0 if deadline is None else _GRACE
        ):
            logger.error("closing the storage of %s did not finish in time", self._url)
        logger.debug("tracker closed: %s", self._url)

    # ------------------------------------------------------------------ dumping

    async def dump(
        self,
        obj: Any,
        name: str,
        *,
        policy: FullPolicy | str | None = None,
        timeout: float | None = None,
    ) -> DumpHandle:
        """Snapshot *obj* and queue it for upload as *name*; return once it is snapshotted.

        Args:
            obj: Any object the serializer accepts (tensors, dicts, dataclasses, ...).
            name: A relative path such as ``"step3/rank0_obs"`` (see the name template).
            policy: The full-policy for this dump (default: the tracker's).
            timeout: Seconds to wait for queue space under ``block`` before ``TimeoutError``.

        Returns:
            A :class:`DumpHandle`; ``await`` it for the committed :class:`DumpRecord`.

        Raises:
            InvalidNameError: The name (after the template) is not a safe relative path.
            SerializationError: The object cannot be serialized (nothing was queued).
            TrackerClosedError: The tracker is closed or closing.
            QueueFullError: Full queue under the ``raise`` policy.
            TimeoutError: No queue space within *timeout*.
        """
        self._check_running()
        path = self._path_for(name)
        payload = await self._snapshot_async(obj)
        job = self._job(name, path, payload)
        deadline = None if timeout is None else time.monotonic() + timeout
        assert self._queue is not None
        await self._queue.put(job, _policy(policy) if policy else self._policy, deadline)
        handle = self._admitted(job)
        # A producer that awaits nothing but dump() would starve the upload workers (their
        # thread results come back through this loop), so yield now and then: at most every
        # millisecond of dumping, which keeps the per-dump cost of the checkpoint negligible.
        now = time.monotonic()
        if now - self._last_checkpoint >= 0.001:
            self._last_checkpoint = now
            await anyio.lowlevel.checkpoint()
        return handle

    def dump_nowait(self, obj: Any, name: str) -> DumpHandle:
        """Like :meth:`dump` but never waits: a full queue drops or raises, never blocks.

        The snapshot is taken on the calling thread (for large or non-plain objects prefer
        ``await dump``, which moves that work off the event loop). Under the ``block`` policy a
        full queue raises :class:`QueueFullError`.
        """
        self._check_running()
        path = self._path_for(name)
        payload = self._snapshot_sync(obj)
        job = self._job(name, path, payload)
        policy = FullPolicy.RAISE if self._policy is FullPolicy.BLOCK else self._policy
        assert self._queue is not None
        self._queue.offer(job, policy)
        return self._admitted(job)

    def dump_threadsafe(self, obj: Any, name: str, *, timeout: float | None = None) -> DumpHandle:
        """:meth:`dump` for plain threads (not the tracker's event loop thread).

        The snapshot is taken on the calling thread and the job handed over without an
        event-loop round trip; under ``block`` the thread waits for space.
        """
        self._check_running()
        if self._in_own_loop():
            raise TrackerStateError(
                "dump_threadsafe() was called on the tracker's own event loop: use await dump()"
            )
        path = self._path_for(name)
        payload = self._snapshot_sync(obj)
        job = self._job(name, path, payload)
        deadline = None if timeout is None else time.monotonic() + timeout
        assert self._queue is not None
        self._queue.put_blocking(job, self._policy, deadline)
        return self._admitted(job)

    async def _dump_serialized(
        self,
        data: bytes | bytearray | memoryview,
        name: str,
        who: WriterIdentity,
        *,
        timeout: float | None = None,
    ) -> DumpHandle:
        """Queue bytes another process already serialized (the Ray adapter's actor uses it).

        The snapshot was taken by the caller, so nothing is copied or serialized here. The name
        template is applied with *who*, the identity of the process that made the dump, not
        this tracker's own.
        """
        return await self._dump_from(BytesPayload(data), name, who, timeout)

    async def _dump_decoded(
        self, make: Callable[[], Any], nbytes: int, name: str, who: WriterIdentity
    ) -> DumpHandle:
        """Queue plain data another process sent as raw buffers (the Ray adapter's channel).

        ``make()`` rebuilds the object from the received bytes (owned by the tracker: nothing
        is copied); the upload worker calls it, then serializes the object with the tracker's
        serializer.
        """
        return await self._dump_from(
            DeferredPayload(make, nbytes, serializer=self._serializer), name, who, None
        )

    async def _dump_from(
        self, payload: Any, name: str, who: WriterIdentity, timeout: float | None
    ) -> DumpHandle:
        self._check_running()
        path = validate_name(render_name(self._template, name, who) + self._suffix)
        job = self._job(name, path, payload)
        job.who = who  # the record names the process that made the dump
        deadline = None if timeout is None else time.monotonic() + timeout
        assert self._queue is not None
        await self._queue.put(job, self._policy, deadline)
        return self._admitted(job)

    def _in_own_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    def _check_running(self) -> None:
        if self._state is not TrackerState.RUNNING:
            if self._state is TrackerState.NEW:
                raise TrackerStateError("cannot dump: the tracker has not been started")
            raise TrackerClosedError(f"cannot dump: the tracker is {self._state.value}")

    def _path_for(self, name: str) -> str:
        # Validated again with the suffix: the stored file name must fit HDFS's 255 bytes.
        return validate_name(render_name(self._template, name, self._who) + self._suffix)

    async def _snapshot_async(self, obj: Any) -> Payload:
        nbytes = _plain_size(obj)
        if self._copy_inline(obj, nbytes):
            return self._plain(obj, nbytes)
        # Serialization (or a big copy) holds the GIL in pieces: never on the event loop.
        return await anyio.to_thread.run_sync(
            self._snapshot_blocking, obj, nbytes, limiter=self._snapshot_limiter
        )

    def _snapshot_sync(self, obj: Any) -> Payload:
        nbytes = _plain_size(obj)
        if self._copy_inline(obj, nbytes):
            return self._plain(obj, nbytes)
        return self._snapshot_blocking(obj, nbytes)

    def _copy_inline(self, obj: Any, nbytes: int | None) -> bool:
        # Small plain data is copied on the caller's thread (microseconds). CUDA tensors too, at
        # any size: the copy is a device clone plus an asynchronous device-to-host transfer.
        return nbytes is not None and (nbytes <= self._inline_bytes or has_cuda_tensor(obj))

    def _snapshot_blocking(self, obj: Any, nbytes: int | None) -> Payload:
        if nbytes is None:  # not plain data: the serialized bytes are the snapshot
            return serialize_to_spool(obj, self._serializer, self._spool_dir)
        # Large plain data: serialize straight into a spool file (faster than copying it in
        # memory, and holds no RAM); a local destination then renames it into place.
        spool = os.path.join(self._spool_base(), temp_path_for("spool", self._who))
        return serialize_to_file(obj, self._serializer, spool)

    def _spool_base(self) -> str:
        storage_spool = getattr(self._storage, "spool_dir", None)
        return str(storage_spool or self._spool_dir or tempfile.gettempdir())

    def _plain(self, obj: Any, nbytes: int | None) -> ObjectPayload:
        payload = snapshot_plain(obj, nbytes)
        payload.serializer = self._serializer
        return payload

    def _job(self, name: str, path: str, payload: Any) -> Job:
        future: concurrent.futures.Future[DumpRecord] = concurrent.futures.Future()
        return Job(name=name, path=path, payload=payload, nbytes=payload.nbytes, future=future)

    def _admitted(self, job: Job) -> DumpHandle:
        with self._counters.lock:
            self._counters.enqueued += 1
            if not job.future.done():  # a drop_newest job is already settled
                self._outstanding.add(job.future)
        return DumpHandle(job.name, job.path, job.future)

    def _dropped(self, job: Job, reason: str) -> None:
        logger.warning("dropped dump %r (%s): the pending queue is full", job.name, reason)
        with self._counters.lock:
            self._counters.dropped[reason] += 1
        self._settle(job, error=DumpDroppedError(f"dump {job.name!r} was dropped ({reason})"))

    # ------------------------------------------------------------------ uploading

    async def _worker(self) -> None:
        assert self._queue is not None
        while (job := await self._queue.get()) is not None:
            try:
                result = await self._upload(job)
            except Exception as exc:  # any failure belongs to this dump, never to the worker
                self._failed(job, exc)
            else:
                self._committed(job, result.size, result.checksum)
            finally:
                self._queue.done(job)
                job.payload = None  # free the snapshot now, not when the handle goes

    async def _upload(self, job: Job) -> Any:
        storage = self.storage
        started = time.monotonic()
        attempt = 0
        while True:
            try:
                return await storage.write_atomic(job.path, job.payload, overwrite=self._overwrite)
            except StorageError as exc:
                if not exc.retryable:
                    raise
                delay = self._retry.backoff(attempt)
                waited = time.monotonic() - started
                if waited + delay > self._retry.deadline:
                    raise StorageUnavailableError(
                        f"gave up writing {job.path!r} after {attempt + 1} attempts over "
                        f"{waited:.1f} s (retry deadline {self._retry.deadline} s): {exc}",
                        remote_exception=exc.remote_exception,
                    ) from exc
                attempt += 1
                with self._counters.lock:
                    self._counters.retries += 1
                logger.warning(
                    "retrying %r in %.2f s (attempt %d): %s", job.path, delay, attempt, exc
                )
                await anyio.sleep(delay)

    def _committed(self, job: Job, size: int, checksum: str) -> None:
        who = job.who or self._who
        record = DumpRecord(
            name=job.path[: len(job.path) - len(self._suffix)] if self._suffix else job.path,
            path=job.path,
            size=size,
            checksum=checksum,
            host=who.host,
            pid=who.pid,
            rank=who.rank,
            writer=self._writer_id,
            time=time.time(),
        )
        with self._counters.lock:
            self._counters.committed += 1
            self._counters.bytes_written += size
            self._counters.latencies.append(time.monotonic() - job.enqueued_at)
            self._unrecorded.append(record)
        self._settle(job, record=record)

    def _failed(self, job: Job, exc: Exception) -> None:
        logger.error("dump %r to %s failed: %s", job.name, self._url, exc, exc_info=exc)
        with self._counters.lock:
            self._counters.failed += 1
            self._failure_count += 1
            if self._failure is None:
                self._failure = exc
        self._settle(job, error=exc)

    def _settle(
        self, job: Job, *, record: DumpRecord | None = None, error: BaseException | None = None
    ) -> None:
        future = job.future
        with self._counters.lock:
            self._outstanding.discard(future)
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(record)

    # ------------------------------------------------------------------ flush and record

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until every dump made before this call is written, and write the record.

        This is the original tracker's ``wait_for_hdfs``.

        Raises:
            TimeoutError: Not everything was written within *timeout* seconds.
            Exception: The first dump failure since the previous flush (others are counted in
                a note on it and in :meth:`statistics`).
        """
        if self._state is TrackerState.NEW:
            raise TrackerStateError("cannot flush: the tracker has not been started")
        if self._state is TrackerState.CLOSED:
            raise TrackerClosedError("cannot flush: the tracker is closed")
        with self._counters.lock:
            waiting = list(self._outstanding)
        with anyio.fail_after(timeout):
            await _wait_all(waiting)
            await self._write_record()
        self._raise_failure()

    def _raise_failure(self) -> None:
        with self._counters.lock:
            failure, count = self._failure, self._failure_count
            self._failure, self._failure_count = None, 0
        if failure is None:
            return
        if count > 1:
            add_note(failure, f"trajtrack: {count - 1} more dumps failed since the last flush")
        raise failure

    async def _record_ticker(self) -> None:
        assert self._stop_ticker is not None
        while not self._stop_ticker.is_set():
            with anyio.move_on_after(self._record_interval):
                await self._stop_ticker.wait()
            if self._unrecorded and not self._stop_ticker.is_set():
                try:
                    await self._write_record()
                except StorageError as exc:
                    logger.warning("could not write a record segment to %s: %s", self._url, exc)

    async def _write_record(self) -> None:
        if not self._record_enabled or self._storage is None or self._record_lock is None:
            return
        async with self._record_lock:
            with self._counters.lock:
                batch, self._unrecorded = self._unrecorded, []
            if not batch:
                return
            path = segment_path(self._writer_id, self._segment)
            try:
                await self._storage.write_atomic(
                    path, BytesPayload(encode_segment(batch)), overwrite=True
                )
            except BaseException:
                with self._counters.lock:  # keep them for the next attempt
                    self._unrecorded[:0] = batch
                raise
            self._segment += 1
            with self._counters.lock:
                self._counters.records_written += 1

    async def _sweep_stale(self) -> None:
        """Delete temporary files that dead processes of this host left behind."""
        assert self._storage is not None
        try:
            files = await self._storage.list()
        except StorageError as exc:
            logger.warning("could not list %s to sweep stale temporary files: %s", self._url, exc)
            return
        for info in files:
            owner = parse_temp_path(info.path)
            if owner is None or owner[0] != self._who.host or _alive(owner[1]):
                continue
            logger.info("removing stale temporary file %s (writer pid %d)", info.path, owner[1])
            await self._storage.delete(info.path)

    # ------------------------------------------------------------------ statistics

    def statistics(self) -> TrackerStatistics:
        """Counters and queue state; cheap, callable from any thread."""
        queue = self._queue
        counters = self._counters
        p50, p99 = counters.percentile(0.5), counters.percentile(0.99)
        with counters.lock:
            return TrackerStatistics(
                pending_items=queue.pending_items if queue else 0,
                pending_bytes=queue.pending_bytes if queue else 0,
                queued_items=queue.queued_items if queue else 0,
                enqueued=counters.enqueued,
                committed=counters.committed,
                failed=counters.failed,
                dropped=dict(counters.dropped),
                retries=counters.retries,
                bytes_written=counters.bytes_written,
                records_written=counters.records_written,
                commit_latency_p50=p50,
                commit_latency_p99=p99,
            )

    def __repr__(self) -> str:
        return f"<Tracker {self._url!r} {self._state.value}>"


async def _finished_within(coro: Coroutine[Any, Any, None], seconds: float) -> bool:
    """Run *coro* for at most *seconds*; past that, cancel it without waiting for it."""
    task = asyncio.ensure_future(coro)
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if not done:
        task.cancel()  # takes effect when its blocked thread returns, if ever
        return False
    task.result()  # re-raise its error
    return True


async def _wait_all(futures: list[concurrent.futures.Future[DumpRecord]]) -> None:
    """Wait for thread-safe futures without wrapping (and so never cancelling) each one."""
    pending = [f for f in futures if not f.done()]
    if not pending:
        return
    loop = asyncio.get_running_loop()
    all_done = asyncio.Event()
    left = [len(pending)]
    lock = threading.Lock()

    def one_done(_future: object) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last and not loop.is_closed():
            loop.call_soon_threadsafe(all_done.set)

    for future in pending:
        future.add_done_callback(one_done)
    await all_done.wait()


def _plain_size(obj: Any) -> int | None:
    try:
        return measure_plain(obj)
    except NotPlainError:
        return None


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigurationError(message)


def _policy(value: FullPolicy | str) -> FullPolicy:
    try:
        return FullPolicy(value)
    except ValueError:
        known = ", ".join(p.value for p in FullPolicy)
        raise ConfigurationError(f"unknown full_policy {value!r}; one of: {known}") from None


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note`` where Python has it (3.11+)."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
