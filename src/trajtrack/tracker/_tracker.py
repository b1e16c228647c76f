"""The asyncio-native tracker: its lifecycle and the ways in for a dump.

Where a dump goes after ``dump()``::

    dump(obj, name) ── name template + validation        (layouts/names.py)
                    ── snapshot: copy, or serialize       (_snapshotter.py, _snapshot.py)
                    ── PendingQueue: bytes + items bound  (_queue.py)
                    ── upload worker → layout             (_worker.py, _files.py)
                    ── Storage.write_atomic, retried      (backends/, _retry.py)
                    ── handle settled, record segment     (_ledger.py, _recorder.py)

:class:`Tracker` itself only wires these parts together and owns their lifecycle: it starts
the workers in a task group that a supervisor watches (:mod:`trajtrack.tracker._runner`), and
drains, records and releases the storage when it closes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any, Literal

import anyio
import anyio.lowlevel
import anyio.to_thread

from trajtrack._exceptions import ConfigurationError, TrackerStateError
from trajtrack._retry import RetryPolicy
from trajtrack.backends import Storage, open_storage
from trajtrack.layouts.names import WriterIdentity, check_template, validate_name
from trajtrack.layouts.records import new_writer_id
from trajtrack.tracker._closing import release
from trajtrack.tracker._handle import DumpHandle
from trajtrack.tracker._intake import Intake, make_job
from trajtrack.tracker._layouts import (
    DEFAULT_SHARD_MAX_AGE,
    DEFAULT_SHARD_MAX_BYTES,
    LayoutName,
    LayoutOptions,
)
from trajtrack.tracker._ledger import Ledger, add_note
from trajtrack.tracker._queue import FullPolicy
from trajtrack.tracker._runner import Runner, RunnerConfig, TrackerState
from trajtrack.tracker._serialize import Serializer, torch_save
from trajtrack.tracker._snapshotter import Snapshotter
from trajtrack.tracker._stats import TrackerStatistics

__all__ = ["Tracker", "TrackerState"]

logger = logging.getLogger(__name__)

ExistingPolicy = Literal["overwrite", "error"]


class Tracker(Intake):
    """Dumps objects to a destination in the background, without blocking the event loop.

    Use it as ``async with Tracker(url) as t: await t.dump(obj, "step1/obs")``, or call
    :meth:`start` and :meth:`aclose` yourself (from any task of the same event loop).

    Args:
        destination: A local path, ``file://``, ``memory://``, ``webhdfs://``, ``swebhdfs://``
            or ``hdfs://`` URL.
        max_pending_bytes: Memory budget of snapshots admitted but not yet written.
        max_pending_items: Count budget of the same.
        full_policy: ``"block"`` (default), ``"drop_newest"``, ``"drop_oldest"`` or ``"raise"``.
        workers: Concurrent uploads (batches of small files for a local disk go one at a time).
        name_template: How a dump name becomes a file name; fields ``{name}``, ``{rank}``,
            ``{local_rank}``, ``{world_size}``, ``{pid}``, ``{host}``. Example:
            ``"{name}.rank{rank}"`` keeps many ranks apart in one directory.
        suffix: Appended to every file name (the original tracker's ``.pth``).
        on_exists: ``"overwrite"`` (default, like the original's ``-put -f``) or ``"error"``.
        serializer: ``serializer(obj, binary_file)``; default ``torch.save`` with tensors moved
            to the CPU.
        retry: Retries of transient storage failures.
        exit_timeout: Budget in seconds for draining when the ``async with`` block exits.
        inline_snapshot_bytes: Plain data up to this size is snapshotted on the caller's
            thread: copied (a copy runs at memory bandwidth, far cheaper than serializing;
            ``benchmarks/bench_core.py``) and serialized by an upload worker; for the shards
            layout, up to 64 KiB is serialized at once instead (the shard lays its members out
            from their bytes). Larger data is serialized in a worker thread into a spool file
            while ``dump()`` awaits, so the loop never copies it.
        record: Write the record of what was written (``.trajtrack/records``).
        record_interval: Seconds between record segments while dumps commit.
        sweep_stale: At start, delete temporary files left by dead processes of this host.
        spool_dir: Where large serialized snapshots spill (default: inside a local
            destination, else the system temporary directory).
        storage: An already-open storage to use instead of opening *destination*; the
            tracker closes it when it closes.
        storage_options: Keyword arguments for the storage backend (e.g. ``fsync=True``).
        layout: ``"files"`` (default: one ``<name><suffix>`` file per dump, what existing
            ``torch.load(path)`` scripts expect; right for large dumps) or ``"shards"``
            (dumps packed into tar shards below ``.trajtrack/shards/``; right for many small
            dumps, above all on HDFS). Readers and the CLI handle both, and mixes.
        shard_max_bytes: Shards layout: seal a shard once it holds this many bytes; a
            larger dump gets a shard of its own.
        shard_max_age: Shards layout: seal a shard once its oldest dump is this many
            seconds old (``flush()`` and close seal it too).
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
        layout: LayoutName = "files",
        shard_max_bytes: int = DEFAULT_SHARD_MAX_BYTES,
        shard_max_age: float = DEFAULT_SHARD_MAX_AGE,
    ) -> None:
        self._url = os.fspath(destination)
        _require(max_pending_bytes > 0, "max_pending_bytes must be > 0")
        _require(max_pending_items > 0, "max_pending_items must be > 0")
        _require(workers > 0, "workers must be > 0")
        _require(on_exists in ("overwrite", "error"), "on_exists must be 'overwrite' or 'error'")
        _require(exit_timeout is None or exit_timeout >= 0, "exit_timeout must be >= 0")
        _require(record_interval > 0, "record_interval must be > 0")
        self._policy = _policy(full_policy)
        self._template = check_template(name_template)
        if suffix:
            validate_name("x" + suffix)
        self._suffix = suffix
        self._exit_timeout = exit_timeout
        self._storage: Storage | None = storage
        self._storage_options = dict(storage_options or {})
        self._who = WriterIdentity.current()
        self._ledger = Ledger(self._url)
        self._snapshots = Snapshotter(
            serializer,
            inline_bytes=inline_snapshot_bytes,
            serialize_small=layout == "shards",
            spool_dir=spool_dir,
            who=self._who,
            threads=max(2, workers),
        )
        config = RunnerConfig(
            max_bytes=max_pending_bytes,
            max_items=max_pending_items,
            workers=workers,
            writer=new_writer_id(self._who),
            who=self._who,
            suffix=suffix,
            retry=retry or RetryPolicy(),
            overwrite=on_exists == "overwrite",
            record=record,
            record_interval=record_interval,
            sweep=sweep_stale,
            layout=LayoutOptions(layout, shard_max_bytes, shard_max_age, spool_dir),
        )
        self._runner = Runner(self._url, self._ledger, config)
        self._early = False  # _admit_early() ran: start() finishes that start
        self._serializer = serializer
        self._loop_waits_since: float | None = None  # a _loop_ran callback is pending

    # ------------------------------------------------------------------ properties

    @property
    def destination(self) -> str:
        """The destination URL or path, as given."""
        return self._url

    @property
    def layout(self) -> str:
        """``"files"`` or ``"shards"``."""
        return self._runner.layout

    @property
    def state(self) -> TrackerState:
        """Where the tracker is in its lifecycle."""
        return self._runner.state

    @property
    def storage(self) -> Storage:
        """The storage backend (opened at :meth:`start`)."""
        if self._storage is None:
            raise TrackerStateError("the tracker has not been started")
        return self._storage

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> Tracker:
        """Open the storage, check it, sweep stale temp files, start the upload workers.

        On failure the storage is closed again (the tracker stays unstarted) and the error
        raised.
        """
        await _on_asyncio()
        if self.state is not TrackerState.NEW and not self._early:
            raise TrackerStateError(f"cannot start: the tracker is {self.state.value}")
        self._early = False
        opened = self._storage is None
        if self._storage is None:
            # Opening may read configuration files (HADOOP_CONF_DIR): not on the loop.
            self._storage = await anyio.to_thread.run_sync(
                functools.partial(open_storage, self._url, **self._storage_options)
            )
        try:
            await self._runner.start(self._storage)
        except BaseException:
            storage = self._storage
            if opened:
                self._storage = None  # a later start() opens a fresh one
            with anyio.CancelScope(shield=True):
                await release(self._url, storage)
            raise
        self._snapshots.use_spool_of(self._storage.spool_dir)
        return self

    async def _admit_early(self) -> None:
        """Open the storage and queue dumps from now on, before :meth:`start` (run next,
        concurrently) has prepared it: for the sync shim, whose callers must never wait for a
        storage to come up (a dead WebHDFS would stall each ``dump_data`` for the whole retry
        deadline). A failed start fails the tracker (see :meth:`Runner.admit_early`).

        Raises:
            ConfigurationError: The destination is unusable (raised here, not in the start).
        """
        await _on_asyncio()
        if self.state is not TrackerState.NEW:
            raise TrackerStateError(f"cannot start: the tracker is {self.state.value}")
        if self._storage is None:
            self._storage = await anyio.to_thread.run_sync(
                functools.partial(open_storage, self._url, **self._storage_options)
            )
        self._runner.admit_early()
        self._early = True

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
            TimeoutError: Pending dumps were not written within *timeout* (their handles
                raise ``TimeoutError``; the count is logged).
            TrackerFailedError: The tracker's background task had failed.
            Exception: The first failure since the last :meth:`flush`, if any.
        """
        if self.state is TrackerState.NEW:
            self._runner.mark_closed()
            if self._storage is not None:  # given by the caller: ours to close
                await release(self._url, self._storage)
            return
        await self._runner.close(timeout)

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
            StorageError: A large dump could not be spooled to local disk (disk full, no
                permission; nothing was queued).
            TrackerClosedError: The tracker is closed or closing.
            TrackerFailedError: The tracker's background task failed.
            QueueFullError: Full queue under the ``raise`` policy.
            TimeoutError: No queue space within *timeout*.
        """
        self._runner.check_running()
        path = self._path_for(name, self._who)
        chosen = _policy(policy) if policy else None
        payload = await self._snapshots.take(obj)
        handle = await self._admit(name, path, payload, chosen, timeout)
        # A producer that awaits nothing but dump() would starve the upload workers (their
        # thread results come back through this loop): after a millisecond of dumps without
        # the loop running, yield. A producer that awaits other things between dumps (a
        # rollouter awaiting its generations) lets them run already; yielding here too would
        # make each of its dumps wait for the workers' turn on the loop
        # (benchmarks/bench_ray.py: await Tracker.dump, calls spaced apart).
        waits_since = self._loop_waits_since
        if waits_since is None:
            self._loop_waits_since = time.monotonic()
            asyncio.get_running_loop().call_soon(self._loop_ran)
        elif time.monotonic() - waits_since >= 0.001:
            await asyncio.sleep(0)  # the tracker runs on asyncio; anyio's costs more here
        return handle

    def _loop_ran(self) -> None:
        self._loop_waits_since = None

    def dump_nowait(self, obj: Any, name: str) -> DumpHandle:
        """Like :meth:`dump` but never waits: a full queue drops or raises, never blocks.

        The snapshot is taken on the calling thread (for large or non-plain objects prefer
        ``await dump``, which moves that work off the event loop). Under the ``block`` policy a
        full queue raises :class:`QueueFullError`.
        """
        self._runner.check_running()
        path = self._path_for(name, self._who)
        job = make_job(name, path, self._snapshots.take_here(obj))
        policy = FullPolicy.RAISE if self._policy is FullPolicy.BLOCK else self._policy
        self._runner.queue.offer(job, policy)
        return self._ledger.admitted(job)

    def dump_threadsafe(self, obj: Any, name: str, *, timeout: float | None = None) -> DumpHandle:
        """:meth:`dump` for plain threads (not the tracker's event loop thread).

        The snapshot is taken on the calling thread and the job handed over without an
        event-loop round trip; under ``block`` the thread waits for space.
        """
        self._runner.check_running()
        if self._runner.in_own_loop():
            raise TrackerStateError(
                "dump_threadsafe() was called on the tracker's own event loop: use await dump()"
            )
        path = self._path_for(name, self._who)
        job = make_job(name, path, self._snapshots.take_here(obj))
        deadline = None if timeout is None else time.monotonic() + timeout
        self._runner.queue.put_blocking(job, self._policy, deadline)
        handle = self._ledger.admitted(job)
        # Not on the loop: the tracker may have failed between the two calls, and its crash
        # then drained this job before the ledger knew of it.
        self._runner.fail_if_failed(job)
        return handle

    # ------------------------------------------------------------------ flush, statistics

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until every dump made before this call is written, and write the record.

        This is the original tracker's ``wait_for_hdfs``.

        Raises:
            TimeoutError: Not everything was written within *timeout* seconds.
            TrackerFailedError: The tracker's background task failed.
            Exception: The first dump failure since the previous flush (others are counted in
                a note on it and in :meth:`statistics`).
        """
        await self._runner.flush(timeout)

    def statistics(self) -> TrackerStatistics:
        """Counters and queue state; cheap, callable from any thread."""
        return self._runner.statistics()

    def __repr__(self) -> str:
        return f"<Tracker {self._url!r} {self.state.value}>"


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigurationError(message)


def _policy(value: FullPolicy | str) -> FullPolicy:
    try:
        return FullPolicy(value)
    except ValueError:
        known = ", ".join(p.value for p in FullPolicy)
        raise ConfigurationError(f"unknown full_policy {value!r}; one of: {known}") from None


async def _on_asyncio() -> None:
    """Fail clearly outside asyncio: the tracker's hot path uses asyncio's loop, futures and
    callbacks directly (anyio's helpers run on its asyncio backend only).

    anyio loads that backend on its first call in a running loop, on the loop's thread: an
    import of tens of milliseconds (``benchmarks/bench_core.py``: event-loop lag), here in the
    first ``start`` of the process. anyio's public ``anyio.run`` of a no-op, in a worker thread,
    loads it first, off the loop.
    """
    global _anyio_loaded
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        raise TrackerStateError(
            "trajtrack's Tracker runs on asyncio, and no asyncio event loop is running in this "
            "thread (trio is not supported); from synchronous code use trajtrack.SyncTracker"
        ) from None
    if not _anyio_loaded:
        await loop.run_in_executor(None, anyio.run, anyio.lowlevel.checkpoint)
        _anyio_loaded = True


_anyio_loaded = False
