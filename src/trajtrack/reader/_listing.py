"""Scanning a run: the record segments and the storage listing, merged into one list of dumps.

The list comes from the record segments the trackers wrote (``.trajtrack/records``), merged
over all writers with the latest commit of a path winning. Files present in the storage but in
no record (the last seconds before a crash, files copied in by hand) are listed too, flagged
``recorded=False``, and so are the members of shards no record describes (a crash between a
shard's rename and its record), indexed from their tar headers. Temporary files and
trajtrack's own files are never listed as dumps.

A run directory is untrusted input: a record line whose path (or shard) would leave the run,
a file that is a symbolic link leading out of it, and a file that is not a regular file (a
FIFO, whose opening would block; a socket, a device; a record segment or shard among them
too) are listed with a ``problem`` that readers report and refuse, never read.
"""

from __future__ import annotations

import logging
import operator
import os.path
from typing import Final

import anyio.from_thread
import anyio.to_thread

from trajtrack._exceptions import (
    ConfigurationError,
    StorageNotFoundError,
    StoragePermissionError,
)
from trajtrack.backends import FileInfo, Storage
from trajtrack.backends.local import LocalStorage
from trajtrack.layouts.names import is_internal_path, parse_temp_path
from trajtrack.layouts.records import RECORDS_PREFIX
from trajtrack.layouts.shards import ShardHeaderError, index_members, is_shard_path
from trajtrack.reader._dumps import DumpInfo, RunListing, dump_order
from trajtrack.reader._gather import gather_bounded
from trajtrack.reader._record_set import RecordSet, file_problem, path_problem

__all__ = ["scan_run"]

logger = logging.getLogger(__name__)


async def scan_run(storage: Storage, *, suffix: str, concurrency: int) -> RunListing:
    """Every dump of the run in *storage*, in dump order.

    The storage is read here; parsing the records and merging them with the listing (tens of
    microseconds a dump, seconds for a big run) is done in worker threads, never on the
    event loop.

    Raises:
        StorageNotFoundError: The destination does not exist.
        StorageError: The storage failed.
    """
    listed, internal, segments, record = await _listed_and_recorded(storage, concurrency)
    if record.bad:
        logger.warning("%s: skipped %d unreadable record lines", storage.url, record.bad)
    shards = {
        f.path: f for f in internal if is_shard_path(f.path) and parse_temp_path(f.path) is None
    }
    recorded_shards = await anyio.to_thread.run_sync(record.shards)
    unindexed = [
        info for path, info in shards.items() if path not in recorded_shards and not info.special
    ]
    found = await gather_bounded(
        unindexed, lambda shard: _index_shard(storage, shard, suffix), limit=concurrency
    )
    found.append(  # never read: listed with their problem
        [_unrecorded(f, suffix) for f in internal if f.special and f.path in shards]
        + [
            _refused_segment(f, suffix)
            for f in internal
            if _is_segment(f.path) and not _readable(f)
        ]
    )
    dumps = await anyio.to_thread.run_sync(_merge, record, listed, shards, found, suffix)
    return RunListing(tuple(dumps), len(segments), record.bad, len(shards), len(unindexed))


async def _listed_and_recorded(
    storage: Storage, concurrency: int
) -> tuple[dict[str, FileInfo], list[FileInfo], list[str], RecordSet]:
    """The run's files that may be dumps (by path), trajtrack's own files, the record
    segments among them, and what those record.

    A local run's segments are read first, so that its listing can skip what they record: a recorded
    file is listed with its recorded size, without an ``lstat`` (a system call per file saved). Only
    the segments the listing then finds count (not those behind a link, which it never enters); if
    one read first is not among them, the run is listed again in full."""
    local = storage if isinstance(storage, LocalStorage) else None
    early = None if local is None else await _early_segments(local, concurrency)
    if local is None or early is None:
        files = await storage.list("")
    else:
        early_record = await anyio.to_thread.run_sync(RecordSet.decode, early.values())
        known = await anyio.to_thread.run_sync(early_record.file_sizes)
        files = await local.list("", known_sizes=known)
    if not files:
        await _check_exists(storage)
    listed, internal = _split(files)
    segments = [f.path for f in internal if _is_segment(f.path) and _readable(f)]
    if early is not None and early.keys() == set(segments):
        return listed, internal, segments, early_record
    if early is not None and not early.keys() <= set(segments):
        listed, internal = _split(await storage.list(""))  # sizes that no record vouches for
        segments = [f.path for f in internal if _is_segment(f.path) and _readable(f)]
    read_first = early or {}

    async def segment(path: str) -> bytes:  # one read first is not read again
        data = read_first.get(path)
        return data if data is not None else await _read_segment(storage, path)

    read = await gather_bounded(segments, segment, limit=concurrency)
    return listed, internal, segments, await anyio.to_thread.run_sync(RecordSet.decode, read)


async def _early_segments(storage: LocalStorage, concurrency: int) -> dict[str, bytes]:
    """A local run's record segments by path, read before the run is listed."""
    try:
        found = await storage.list(RECORDS_PREFIX)
    except StoragePermissionError:  # the records folder is a link leading out: not the run's
        return {}
    paths = [f.path for f in found if _is_segment(f.path) and _readable(f)]
    data = await gather_bounded(paths, lambda path: _read_segment(storage, path), limit=concurrency)
    return dict(zip(paths, data, strict=True))


def _split(files: list[FileInfo]) -> tuple[dict[str, FileInfo], list[FileInfo]]:
    """The files that may be dumps, by path, and trajtrack's own (records, shards, temporary
    files: :func:`~trajtrack.layouts.names.is_internal_path`), in one pass (a listing holds a
    file per dump, so each pass is per-file Python work; ``benchmarks/bench_small_reads.py``)."""
    listed: dict[str, FileInfo] = {}
    internal: list[FileInfo] = []
    for info in files:
        if is_internal_path(info.path):
            internal.append(info)
        else:
            listed[info.path] = info
    return listed, internal


def _merge(
    record: RecordSet,
    listed: dict[str, FileInfo],
    shards: dict[str, FileInfo],
    found: list[list[DumpInfo]],
    suffix: str,
) -> list[DumpInfo]:
    """The recorded dumps, the files (*listed*: not trajtrack's own) and shard members no
    record describes, in dump order."""
    dumps = record.dumps(listed, shards)
    recorded = record.paths
    unrecorded = [
        _unrecorded(info, suffix) for path, info in listed.items() if path not in recorded
    ]
    unrecorded += [d for members in found for d in members if d.path not in recorded]
    dumps.extend(_newest_by_path(unrecorded))
    if all(dump.time is not None for dump in dumps):
        # Two stable sorts by C key functions: time, then name among equal times (a tuple key
        # would build a tuple per dump; the dumps come mostly in time order already, which
        # stable sorts exploit).
        dumps.sort(key=_BY_NAME)
        dumps.sort(key=_BY_TIME)
    else:
        dumps.sort(key=dump_order)
    return dumps


_BY_NAME: Final = operator.itemgetter(0)  # DumpInfo.name
_BY_TIME: Final = operator.itemgetter(8)  # DumpInfo.time


SEGMENT_MAX: Final = 1 << 30
"""The largest record segment read (segments are written every few seconds: a few MB at
most); a bigger one is listed as refused, never read whole into memory."""


def _readable(segment: FileInfo) -> bool:
    """Whether a record *segment* may be read: a regular file within :data:`SEGMENT_MAX`."""
    return not segment.special and segment.size <= SEGMENT_MAX


def _refused_segment(segment: FileInfo, suffix: str) -> DumpInfo:
    refused = _unrecorded(segment, suffix)
    if refused.problem is not None:
        return refused
    problem = f"a record segment of {segment.size} bytes (more than {SEGMENT_MAX})"
    return refused._replace(problem=problem)


def _is_segment(path: str) -> bool:
    return (
        path.startswith(RECORDS_PREFIX + "/")
        and path.endswith(".jsonl")
        and parse_temp_path(path) is None
    )


async def _check_exists(storage: Storage) -> None:
    # An empty listing of a local path that does not exist is a typo, not an empty run.
    # Other backends report a missing root from list() themselves, or cannot tell.
    root = storage.local_path("")
    if root is not None and not await anyio.to_thread.run_sync(os.path.isdir, root):
        if await anyio.to_thread.run_sync(os.path.lexists, root):  # a file given for a run
            raise ConfigurationError(
                f"{storage.url} is not a directory: a run is the folder the tracker wrote"
            )
        raise StorageNotFoundError(f"{storage.url}: no such directory")


async def _read_segment(storage: Storage, path: str) -> bytes:
    try:
        return await storage.read(path)
    except StorageNotFoundError:  # replaced between the listing and the read
        return b""


def _unrecorded(info: FileInfo, suffix: str) -> DumpInfo:
    return _unrecorded_dump(info.path, info.size, info.mtime, suffix, file_problem(info))


def _unrecorded_dump(
    path: str,
    size: int,
    mtime: float | None,
    suffix: str,
    problem: str | None,
    shard: str | None = None,
    offset: int | None = None,
) -> DumpInfo:
    """A dump found in the storage (a file, or a member of a shard) that no record describes."""
    return DumpInfo(
        name=_name_of(path, suffix),
        path=path,
        size=size,
        checksum=None,
        writer="",
        host="",
        pid=None,
        rank=None,
        time=mtime,
        recorded=False,
        stored_size=size,
        shard=shard,
        offset=offset,
        problem=problem,
    )


def _name_of(path: str, suffix: str) -> str:
    if suffix and path.endswith(suffix) and len(path) > len(suffix):
        return path[: -len(suffix)]
    return path


async def _index_shard(storage: Storage, shard: FileInfo, suffix: str) -> list[DumpInfo]:
    """The members of a shard no record describes, from its tar headers alone (ranged reads
    of its headers from a worker thread: never the whole shard, whose size the run sets).
    A header refused (:class:`~trajtrack.layouts.shards.ShardHeaderError`: corrupt, a pax
    header too long or malformed, or the shard cut short) is listed as the shard's problem,
    after the members before it: the members after it cannot be found, and the user must be
    told."""
    if shard.outside:
        return []

    def read(offset: int, length: int) -> bytes:
        return anyio.from_thread.run(storage.read_range, shard.path, offset, length)

    refused: list[DumpInfo] = []
    try:
        members = await anyio.to_thread.run_sync(index_members, read, shard.size)
    except StorageNotFoundError:
        return []
    except ShardHeaderError as exc:
        members = exc.members
        after = f" after the first {len(members)}" if members else ""
        problem = f"its dumps{after} could not be listed: {exc}"
        refused.append(_unrecorded_dump(shard.path, shard.size, shard.mtime, suffix, problem))
    logger.info("%s: indexed %d members of unrecorded shard %s", storage.url, len(members), shard)
    return refused + [
        _unrecorded_dump(
            member.name,
            member.size,
            shard.mtime,
            suffix,
            path_problem(member.name),
            shard=shard.path,
            offset=member.offset,
        )
        for member in members
    ]


def _newest_by_path(dumps: list[DumpInfo]) -> list[DumpInfo]:
    """One dump per path: the one with the latest time (a later shard or file wins)."""
    newest: dict[str, DumpInfo] = {}
    for dump in dumps:
        known = newest.get(dump.path)
        if known is None or (dump.time or 0.0) >= (known.time or 0.0):
            newest[dump.path] = dump
    return list(newest.values())
