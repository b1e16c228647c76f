"""Reading a run back: what was dumped (from the record), the bytes, and the objects.

``open_run(url)`` gives a :class:`Run` over any destination a tracker can write to. The list
of dumps comes from the record segments the trackers wrote (``.trajtrack/records``), merged over
all writers with the latest commit of a path winning; files present in the storage but in no
record (the last seconds before a crash, or files copied in by hand) are listed too, flagged
``recorded=False``. Temporary files and trajtrack's own files are never listed.

Loading is safe by default (see :mod:`trajtrack.reader._safe_load`). The API is async;
:class:`SyncRun` wraps it for synchronous callers (the CLI, notebooks).
"""

from __future__ import annotations

import builtins
import fnmatch
import logging
import math
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

import anyio
import anyio.to_thread
from anyio.from_thread import BlockingPortal, start_blocking_portal

from trajtrack._exceptions import StorageError, StorageNotFoundError
from trajtrack.backends import FileInfo, Storage, open_storage
from trajtrack.backends.local import LocalStorage
from trajtrack.layouts.names import is_internal_path, parse_temp_path
from trajtrack.layouts.records import RECORDS_PREFIX, DumpRecord, decode_segment
from trajtrack.reader._safe_load import load_dump_bytes, load_dump_file

__all__ = ["DumpInfo", "Run", "RunListing", "SyncRun", "gather_bounded", "open_run"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

DEFAULT_CONCURRENCY = 16


@dataclass(frozen=True, slots=True)
class DumpInfo:
    """One dump of a run, as the record (or, for unrecorded files, the listing) describes it.

    Attributes:
        name: The dump name (``"step3/sample0"``); for unrecorded files the path without the
            run's suffix.
        path: The file, relative to the destination (``"step3/sample0.pth"``).
        size: Recorded size in bytes (the listed size for unrecorded files).
        checksum: Recorded ``"crc32:<hex>"``; ``None`` for unrecorded files.
        writer: Id of the tracker that wrote it (``""`` when unrecorded).
        host: Host of the writing process (``""`` when unrecorded).
        pid: Process id of the writer (``None`` when unrecorded).
        rank: ``RANK`` of the writer (``None`` when unrecorded).
        time: Commit time (seconds since the epoch); the file's mtime when unrecorded.
        recorded: Whether a record segment describes this dump.
        stored_size: Size of the file in the storage listing; ``None`` when it is missing.
    """

    name: str
    path: str
    size: int
    checksum: str | None
    writer: str
    host: str
    pid: int | None
    rank: int | None
    time: float | None
    recorded: bool
    stored_size: int | None

    @property
    def present(self) -> bool:
        """Whether the file exists in the storage."""
        return self.stored_size is not None

    def to_json(self) -> dict[str, Any]:
        """A JSON-serializable dict of every field plus ``present``."""
        return {
            "name": self.name,
            "path": self.path,
            "size": self.size,
            "checksum": self.checksum,
            "writer": self.writer,
            "host": self.host,
            "pid": self.pid,
            "rank": self.rank,
            "time": self.time,
            "recorded": self.recorded,
            "present": self.present,
            "stored_size": self.stored_size,
        }


@dataclass(frozen=True, slots=True)
class RunListing:
    """The result of scanning a run: its dumps in dump order plus record health.

    Attributes:
        dumps: Every recorded or listed dump, sorted by time then name.
        segments: Record segments read.
        bad_record_lines: Unreadable lines skipped in the segments.
    """

    dumps: tuple[DumpInfo, ...]
    segments: int
    bad_record_lines: int


def dump_order(info: DumpInfo) -> tuple[float, str]:
    """Sort key for "dump order": commit time, then name (unknown times last)."""
    return (info.time if info.time is not None else math.inf, info.name)


class Run:
    """Read access to the dumps of one destination.

    Use it as ``async with trajtrack.open_run(url) as run: ...``.

    Args:
        url: A local path, ``file://``, ``memory://``, ``webhdfs://``, ``swebhdfs://`` or
            ``hdfs://`` URL, as given to the tracker.
        storage: An already-open storage to read instead of opening *url*.
        suffix: The tracker's file suffix, stripped from unrecorded files to name them.
        concurrency: Reads in flight at once in :meth:`read_many`-style operations.
        storage_options: Keyword arguments for the storage backend.
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        storage: Storage | None = None,
        suffix: str = ".pth",
        concurrency: int = DEFAULT_CONCURRENCY,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self._url = os.fspath(url)
        self._owns_storage = storage is None
        self._storage = storage or open_storage(self._url, **dict(storage_options or {}))
        self._suffix = suffix
        self._concurrency = max(1, concurrency)
        self._listing: RunListing | None = None
        self._closed = False

    @property
    def url(self) -> str:
        """The destination, as given."""
        return self._url

    @property
    def storage(self) -> Storage:
        """The storage backend being read."""
        return self._storage

    @property
    def concurrency(self) -> int:
        """How many reads run at once in bulk operations."""
        return self._concurrency

    # ------------------------------------------------------------------ listing

    async def scan(self, *, refresh: bool = False) -> RunListing:
        """Read the record segments and the listing once (cached; ``refresh`` re-reads).

        Raises:
            StorageNotFoundError: The destination does not exist.
            StorageError: The storage failed.
        """
        if self._listing is None or refresh:
            self._listing = await self._scan()
        return self._listing

    async def list(
        self, glob: str | None = None, *, refresh: bool = False
    ) -> builtins.list[DumpInfo]:
        """The dumps of the run in dump order (commit time, then name).

        Args:
            glob: Only dumps whose name or path matches this ``fnmatch`` pattern (``*``
                matches across ``/``).
            refresh: Re-read the record and the listing instead of using the cached scan.
        """
        listing = await self.scan(refresh=refresh)
        return [d for d in listing.dumps if glob is None or matches(d, glob)]

    async def _scan(self) -> RunListing:
        files = await self._storage.list("")
        if not files:
            await self._check_exists()
        segment_paths = [
            f.path
            for f in files
            if f.path.startswith(RECORDS_PREFIX + "/")
            and f.path.endswith(".jsonl")
            and parse_temp_path(f.path) is None
        ]
        decoded = await gather_bounded(segment_paths, self._read_segment, limit=self._concurrency)
        latest: dict[str, DumpRecord] = {}
        bad = 0
        for records, skipped in decoded:
            bad += skipped
            for record in records:
                known = latest.get(record.path)
                if known is None or record.time >= known.time:
                    latest[record.path] = record
        if bad:
            logger.warning("%s: skipped %d unreadable record lines", self._url, bad)
        listed = {f.path: f for f in files if not is_internal_path(f.path)}
        dumps = [_from_record(r, listed.get(r.path)) for r in latest.values()]
        dumps.extend(self._unrecorded(info) for path, info in listed.items() if path not in latest)
        dumps.sort(key=dump_order)
        return RunListing(tuple(dumps), len(segment_paths), bad)

    async def _read_segment(self, path: str) -> tuple[builtins.list[DumpRecord], int]:
        try:
            data = await self._storage.read(path)
        except StorageNotFoundError:  # replaced between the listing and the read
            return [], 0
        return decode_segment(data)

    async def _check_exists(self) -> None:
        # An empty listing of a local path that does not exist is a typo, not an empty run.
        # Other backends report a missing root from list() themselves, or cannot tell.
        if isinstance(self._storage, LocalStorage):
            root = self._storage.root
            if not await anyio.to_thread.run_sync(root.is_dir):
                raise StorageNotFoundError(f"{self._url}: no such directory")

    def _unrecorded(self, info: FileInfo) -> DumpInfo:
        name = info.path
        if self._suffix and name.endswith(self._suffix) and len(name) > len(self._suffix):
            name = name[: -len(self._suffix)]
        return DumpInfo(
            name=name,
            path=info.path,
            size=info.size,
            checksum=None,
            writer="",
            host="",
            pid=None,
            rank=None,
            time=info.mtime,
            recorded=False,
            stored_size=info.size,
        )

    async def info(self, name: str) -> DumpInfo:
        """The dump called *name* (a dump name, or a path relative to the destination).

        Raises:
            StorageNotFoundError: No such dump in the record or the listing.
        """
        dumps = (await self.scan()).dumps
        for candidate in dumps:
            if candidate.name == name:
                return candidate
        for candidate in dumps:
            if candidate.path in (name, name + self._suffix):
                return candidate
        raise StorageNotFoundError(f"{self._url}: no dump named {name!r}")

    # ------------------------------------------------------------------ reading

    async def read_bytes(self, name: str | DumpInfo) -> bytes:
        """The stored bytes of one dump (by name, path or :class:`DumpInfo`)."""
        info = name if isinstance(name, DumpInfo) else await self.info(name)
        return await self._storage.read(info.path)

    async def load(self, name: str | DumpInfo, *, unsafe: bool = False) -> Any:
        """Read and deserialize one dump; tensors come back on the CPU.

        Args:
            name: A dump name, a path, or a :class:`DumpInfo` from :meth:`list`.
            unsafe: Allow a full unpickle (runs code from the dump; logs a warning).

        Raises:
            UnsafeLoadError: The dump needs a global outside the allow-list.
            DumpLoadError: The bytes are not a loadable dump.
            StorageNotFoundError: No such dump.
        """
        info = name if isinstance(name, DumpInfo) else await self.info(name)
        local = getattr(self._storage, "local_path", None)  # absent from older storages
        path = local(info.path) if local is not None else None
        if path is not None:  # torch reads the file itself: no copy of its bytes in between
            return await anyio.to_thread.run_sync(_load_file_sync, path, unsafe, info.name)
        data = await self._storage.read(info.path)
        return await anyio.to_thread.run_sync(_load_sync, data, unsafe, info.name)

    async def iter_loaded(
        self, glob: str | None = None, *, unsafe: bool = False
    ) -> AsyncIterator[tuple[DumpInfo, Any]]:
        """Yield ``(info, object)`` for each present dump, in dump order, one at a time."""
        for info in await self.list(glob):
            if info.present:
                yield info, await self.load(info, unsafe=unsafe)

    def __aiter__(self) -> AsyncIterator[tuple[DumpInfo, Any]]:
        return self.iter_loaded()

    # ------------------------------------------------------------------ lifecycle

    async def aclose(self) -> None:
        """Close the storage (when this run opened it)."""
        if not self._closed:
            self._closed = True
            if self._owns_storage:
                await self._storage.aclose()

    async def __aenter__(self) -> Run:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"Run({self._url!r})"


def _load_sync(data: bytes, unsafe: bool, where: str) -> Any:
    return load_dump_bytes(data, unsafe=unsafe, where=where)


def _load_file_sync(path: str, unsafe: bool, where: str) -> Any:
    try:
        return load_dump_file(path, unsafe=unsafe, where=where)
    except FileNotFoundError as exc:
        raise StorageNotFoundError(f"{where}: {path}: no such file") from exc
    except OSError as exc:
        if isinstance(exc, StorageError):
            raise
        raise StorageError(f"{where}: cannot read {path}: {exc.strerror or exc}") from exc


def _from_record(record: DumpRecord, listed: FileInfo | None) -> DumpInfo:
    return DumpInfo(
        name=record.name,
        path=record.path,
        size=record.size,
        checksum=record.checksum,
        writer=record.writer,
        host=record.host,
        pid=record.pid,
        rank=record.rank,
        time=record.time,
        recorded=True,
        stored_size=None if listed is None else listed.size,
    )


def matches(info: DumpInfo, glob: str) -> bool:
    """Whether a dump's name or path matches an ``fnmatch`` pattern."""
    return fnmatch.fnmatchcase(info.name, glob) or fnmatch.fnmatchcase(info.path, glob)


def open_run(url: str | os.PathLike[str], **options: Any) -> Run:
    """Open a run for reading: ``async with trajtrack.open_run(url) as run: ...``.

    Args:
        url: The destination a tracker wrote to (local path or any supported URL).
        **options: See :class:`Run`.
    """
    return Run(url, **options)


async def gather_bounded(
    items: Sequence[T],
    fn: Callable[[T], Awaitable[R]],
    *,
    limit: int,
    on_done: Callable[[int], None] | None = None,
) -> list[R]:
    """``[await fn(item) for item in items]`` with at most *limit* calls in flight.

    Results keep the order of *items*; the first exception cancels the rest and propagates.
    *on_done* is called with the number of finished calls after each one.
    """
    results: list[Any] = [None] * len(items)
    semaphore = anyio.Semaphore(max(1, limit))
    done = 0

    async def one(index: int, item: T) -> None:
        nonlocal done
        async with semaphore:
            results[index] = await fn(item)
        done += 1
        if on_done is not None:
            on_done(done)

    async with anyio.create_task_group() as group:
        for index, item in enumerate(items):
            # Each task parks on the semaphore; their number is bounded by len(items), which
            # the caller already holds in memory, while the reads themselves are bounded.
            group.start_soon(one, index, item)
    return results


class SyncRun:
    """A blocking facade over :class:`Run`, for synchronous code.

    ``with SyncRun(url) as run: run.list(); run.load(name)``. It runs the async reader in an
    event loop on a background thread (an anyio blocking portal).
    """

    def __init__(self, url: str | os.PathLike[str], **options: Any) -> None:
        self._portal_cm = start_blocking_portal()
        self._portal: BlockingPortal = self._portal_cm.__enter__()
        try:
            self._run: Run = self._portal.call(_make_run, os.fspath(url), options)
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise

    @property
    def run(self) -> Run:
        """The async :class:`Run` behind this facade."""
        return self._run

    def call(self, fn: Callable[..., Awaitable[R]], *args: Any) -> R:
        """Run ``await fn(*args)`` on the reader's event loop and return its result."""
        return self._portal.call(fn, *args)

    def scan(self, *, refresh: bool = False) -> RunListing:
        """See :meth:`Run.scan`."""
        listing: RunListing = self._portal.call(lambda: self._run.scan(refresh=refresh))
        return listing

    def list(self, glob: str | None = None, *, refresh: bool = False) -> builtins.list[DumpInfo]:
        """See :meth:`Run.list`."""
        return self._portal.call(lambda: self._run.list(glob, refresh=refresh))

    def info(self, name: str) -> DumpInfo:
        """See :meth:`Run.info`."""
        info: DumpInfo = self._portal.call(self._run.info, name)
        return info

    def read_bytes(self, name: str | DumpInfo) -> bytes:
        """See :meth:`Run.read_bytes`."""
        data: bytes = self._portal.call(self._run.read_bytes, name)
        return data

    def load(self, name: str | DumpInfo, *, unsafe: bool = False) -> Any:
        """See :meth:`Run.load`."""
        return self._portal.call(lambda: self._run.load(name, unsafe=unsafe))

    def __iter__(self) -> Iterator[tuple[DumpInfo, Any]]:
        for info in self.list():
            if info.present:
                yield info, self.load(info)

    def close(self) -> None:
        """Close the storage and stop the background event loop."""
        try:
            self._portal.call(self._run.aclose)
        finally:
            self._portal_cm.__exit__(None, None, None)

    def __enter__(self) -> SyncRun:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


async def _make_run(url: str, options: dict[str, Any]) -> Run:
    # Created on the portal's loop, so a backend that binds to the running loop binds there.
    return Run(url, **options)
