"""Scanning a run: the record segments and the storage listing, merged into one list of dumps.

The list comes from the record segments the trackers wrote (``.trajtrack/records``), merged
over all writers with the latest commit of a path winning. Files present in the storage but in
no record (the last seconds before a crash, files copied in by hand) are listed too, flagged
``recorded=False``, and so are the members of shards no record describes (a crash between a
shard's rename and its record), indexed from their tar headers. Temporary files and
trajtrack's own files are never listed as dumps.

A run directory is untrusted input: a record line whose path (or shard) would leave the run,
and a file that is a symbolic link leading out of it, are listed with a ``problem`` that
readers report and refuse, never read.
"""

from __future__ import annotations

import logging
import operator
import os.path
from collections.abc import Iterable
from typing import Final

import anyio.to_thread

from trajtrack._exceptions import (
    InvalidNameError,
    StorageError,
    StorageNotFoundError,
    StoragePermissionError,
)
from trajtrack.backends import FileInfo, Storage, check_relative
from trajtrack.backends.local import LocalStorage
from trajtrack.layouts.names import (
    is_internal_path,
    parse_temp_path,
    plainly_valid,
    validate_name,
)
from trajtrack.layouts.records import RECORDS_PREFIX, RecordFields, decode_segment_fields
from trajtrack.layouts.shards import is_shard_path, scan_members
from trajtrack.reader._dumps import DumpInfo, RunListing, dump_order
from trajtrack.reader._gather import gather_bounded

__all__ = ["scan_run"]

logger = logging.getLogger(__name__)

_OUTSIDE = "a symbolic link leading out of the run"


async def scan_run(storage: Storage, *, suffix: str, concurrency: int) -> RunListing:
    """Every dump of the run in *storage*, in dump order.

    The storage is read here; parsing the records and merging them with the listing (tens of
    microseconds a dump, seconds for a big run) is done in worker threads, never on the
    event loop.

    Raises:
        StorageNotFoundError: The destination does not exist.
        StorageError: The storage failed.
    """
    listed, internal, segments, (latest, bad) = await _listed_and_recorded(storage, concurrency)
    if bad:
        logger.warning("%s: skipped %d unreadable record lines", storage.url, bad)
    shards = {
        f.path: f for f in internal if is_shard_path(f.path) and parse_temp_path(f.path) is None
    }
    recorded_shards = {r[_SHARD] for r in latest.values() if r[_SHARD] is not None}
    unindexed = [info for path, info in shards.items() if path not in recorded_shards]
    found = await gather_bounded(
        unindexed, lambda shard: _index_shard(storage, shard, suffix), limit=concurrency
    )
    dumps = await anyio.to_thread.run_sync(_merge, latest, listed, shards, found, suffix)
    return RunListing(tuple(dumps), len(segments), bad, len(shards), len(unindexed))


_Recorded = tuple[dict[str, RecordFields], int]  # the newest record by path, bad lines


async def _listed_and_recorded(
    storage: Storage, concurrency: int
) -> tuple[dict[str, FileInfo], list[FileInfo], list[str], _Recorded]:
    """The run's files that may be dumps (by path), trajtrack's own files, the record
    segments among them, and what those record.

    A local run's segments are read first, so that its listing can skip what they record: a
    recorded file is listed with its recorded size, without an ``lstat`` (1.7 us a file
    here). Only the segments the listing then finds count (not those behind a link, which it
    never enters); if one read first is not among them, the run is listed again in full."""
    local = storage if isinstance(storage, LocalStorage) else None
    early = None if local is None else await _early_segments(local, concurrency)
    if local is None or early is None:
        files = await storage.list("")
    else:
        early_recorded = await anyio.to_thread.run_sync(_latest, early.values())
        known = {path: r[_SIZE] for path, r in early_recorded[0].items() if r[_SHARD] is None}
        files = await local.list("", known_sizes=known)
    if not files:
        await _check_exists(storage)
    listed, internal = _split(files)
    segments = [f.path for f in internal if _is_segment(f.path)]
    if early is not None and early.keys() == set(segments):
        return listed, internal, segments, early_recorded
    if early is not None and not early.keys() <= set(segments):
        listed, internal = _split(await storage.list(""))  # sizes that no record vouches for
        segments = [f.path for f in internal if _is_segment(f.path)]
    read = await gather_bounded(
        segments, lambda path: _read_segment(storage, path), limit=concurrency
    )
    return listed, internal, segments, await anyio.to_thread.run_sync(_latest, read)


async def _early_segments(storage: LocalStorage, concurrency: int) -> dict[str, bytes]:
    """A local run's record segments by path, read before the run is listed."""
    try:
        found = await storage.list(RECORDS_PREFIX)
    except StoragePermissionError:  # the records folder is a link leading out: not the run's
        return {}
    paths = [f.path for f in found if _is_segment(f.path)]
    data = await gather_bounded(paths, lambda path: _read_segment(storage, path), limit=concurrency)
    return dict(zip(paths, data, strict=True))


def _split(files: list[FileInfo]) -> tuple[dict[str, FileInfo], list[FileInfo]]:
    """The files that may be dumps, by path, and trajtrack's own (records, shards, temporary
    files: :func:`~trajtrack.layouts.names.is_internal_path`), in one pass (a listing holds a
    file per dump; three passes cost 2.2 us a file here, this one under 1)."""
    listed: dict[str, FileInfo] = {}
    internal: list[FileInfo] = []
    for info in files:
        if is_internal_path(info.path):
            internal.append(info)
        else:
            listed[info.path] = info
    return listed, internal


def _merge(
    latest: dict[str, RecordFields],
    listed: dict[str, FileInfo],
    shards: dict[str, FileInfo],
    found: list[list[DumpInfo]],
    suffix: str,
) -> list[DumpInfo]:
    """The recorded dumps, the files (*listed*: not trajtrack's own) and shard members no
    record describes, in dump order."""
    dumps = _recorded(latest, listed, shards)
    unrecorded = [_unrecorded(info, suffix) for path, info in listed.items() if path not in latest]
    unrecorded += [d for members in found for d in members if d.path not in latest]
    dumps.extend(_newest_by_path(unrecorded))
    if all(dump.time is not None for dump in dumps):
        # Two stable sorts by C key functions: time, then name among equal times (a tuple key
        # per dump cost 0.3 us; the dumps come mostly in time order already).
        dumps.sort(key=_BY_NAME)
        dumps.sort(key=_BY_TIME)
    else:
        dumps.sort(key=dump_order)
    return dumps


_BY_NAME: Final = operator.itemgetter(0)  # DumpInfo.name
_BY_TIME: Final = operator.itemgetter(8)  # DumpInfo.time


def _recorded(
    latest: dict[str, RecordFields], listed: dict[str, FileInfo], shards: dict[str, FileInfo]
) -> list[DumpInfo]:
    """A :class:`DumpInfo` per record (one per dump of the run: one loop, no call per dump
    but the name check)."""
    shard_problems: dict[str, str | None] = {}  # one check per shard, not per member
    dumps: list[DumpInfo] = []
    append = dumps.append
    get_file, get_shard = listed.get, shards.get
    new = tuple.__new__  # DumpInfo(...) from a tuple of its fields: half the cost
    for record in latest.values():
        name, path, size, checksum, host, pid, rank, writer, time, shard_path, offset = record
        problem = None if plainly_valid(path) else _path_problem(path)
        if shard_path is None:
            file = get_file(path)
            stored = None if file is None else file.size
        else:
            if problem is None:
                if shard_path not in shard_problems:
                    shard_problems[shard_path] = _shard_problem(shard_path)
                problem = shard_problems[shard_path]
                if problem is None and (offset is None or offset < 0 or size < 0):
                    problem = _place_problem(offset, size)
            file = get_shard(shard_path)
            if file is None:
                stored = None
            else:  # what the shard holds of the member's bytes
                held = file.size - (offset or 0)
                stored = size if held >= size else max(0, held)
        if problem is None and file is not None and file.outside:
            problem = _OUTSIDE
        recorded = True
        fields = (name, path, size, checksum, writer, host, pid, rank, time, recorded, stored)
        append(new(DumpInfo, (*fields, shard_path, offset, problem)))
    return dumps


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
        raise StorageNotFoundError(f"{storage.url}: no such directory")


async def _read_segment(storage: Storage, path: str) -> bytes:
    try:
        return await storage.read(path)
    except StorageNotFoundError:  # replaced between the listing and the read
        return b""


# Where a record's path, size, time and shard are in its RecordFields.
_PATH: Final = 1
_SIZE: Final = 2
_TIME: Final = 8
_SHARD: Final = 9
_BY_PATH: Final = operator.itemgetter(_PATH)


def _latest(segments: Iterable[bytes]) -> tuple[dict[str, RecordFields], int]:
    """The newest record of every path in the *segments*, and the number of unreadable lines."""
    latest: dict[str, RecordFields] = {}
    bad = 0
    for data in segments:
        records, skipped = decode_segment_fields(data)
        bad += skipped
        if not latest:  # the first segment: in C, unless it names a path twice
            latest = dict(zip(map(_BY_PATH, records), records, strict=True))
            if len(latest) == len(records):
                continue
            latest = {}
        for record in records:
            path = record[_PATH]
            known = latest.get(path)
            if known is None or record[_TIME] >= known[_TIME]:
                latest[path] = record
    return latest, bad


def _path_problem(path: str) -> str | None:
    try:
        validate_name(path)
    except InvalidNameError:
        return f"its path {path!r} is not a path inside the run"
    return None


def _shard_problem(shard: str) -> str | None:
    try:
        check_relative(shard)
    except StorageError:
        return f"its shard {shard!r} is not a path inside the run"
    if not is_shard_path(shard):
        return f"its shard {shard!r} is not a shard of the run"
    return None


def _place_problem(offset: int | None, size: int) -> str:
    return f"its place in the shard ({offset}, {size} bytes) is invalid"


def _unrecorded(info: FileInfo, suffix: str) -> DumpInfo:
    problem = _OUTSIDE if info.outside else None
    return _unrecorded_dump(info.path, info.size, info.mtime, suffix, problem)


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
    """The members of a shard no record describes, from its tar headers."""
    if shard.outside:
        return []
    try:
        data = await storage.read(shard.path)
    except StorageNotFoundError:
        return []
    members = await anyio.to_thread.run_sync(scan_members, data)
    logger.info("%s: indexed %d members of unrecorded shard %s", storage.url, len(members), shard)
    return [
        _unrecorded_dump(
            member.name,
            member.size,
            shard.mtime,
            suffix,
            _path_problem(member.name),
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
