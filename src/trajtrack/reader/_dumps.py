"""What a reader knows about the dumps of a run: :class:`DumpInfo` and :class:`RunListing`."""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = ["DumpInfo", "RunListing", "dump_order", "matches"]


class DumpInfo(NamedTuple):
    """One dump of a run, as the record (or, for unrecorded files, the listing) describes it.

    An immutable named tuple: a listing makes one per dump (hundreds of thousands for a big
    run), and a tuple is built in C, without a frozen dataclass's ``object.__setattr__`` per
    field (``benchmarks/bench_small_reads.py`` times listings). Compare and copy it by field
    (``info._replace(...)``).

    Attributes:
        name: The dump name (``"step3/sample0"``); for unrecorded files the path without the
            run's suffix.
        path: The dump's file as the files layout names it, relative to the destination
            (``"step3/sample0.pth"``); in a sharded run, the shard member's name.
        size: Recorded size in bytes (the listed size for unrecorded files).
        checksum: Recorded ``"crc32:<hex>"``; ``None`` for unrecorded files.
        writer: Id of the tracker that wrote it (``""`` when unrecorded).
        host: Host of the writing process (``""`` when unrecorded).
        pid: Process id of the writer (``None`` when unrecorded).
        rank: ``RANK`` of the writer (``None`` when unrecorded).
        time: Commit time (seconds since the epoch); the file's mtime when unrecorded.
        recorded: Whether a record segment describes this dump.
        stored_size: Bytes the storage holds for it: the file's listed size, or for a shard
            member what its shard holds of it; ``None`` when the file or shard is missing. A
            recorded file of a local run is listed with its recorded size, unchecked (no
            ``lstat`` per file: reading it tells, as ``verify`` and ``diff`` do).
        shard: The shard holding the dump (``.trajtrack/shards/...tar``), or ``None`` for a
            file of its own.
        offset: Where the dump's bytes begin in its shard.
        problem: Why the dump must not be read, when it must not: its path would leave the run
            (a hostile record, a symbolic link leading elsewhere). ``ls``/``verify`` report
            it; ``show``/``diff``/``load`` refuse it.
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
    shard: str | None = None
    offset: int | None = None
    problem: str | None = None

    @property
    def present(self) -> bool:
        """Whether the storage holds the dump's bytes (its file, or its shard)."""
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
            "shard": self.shard,
            "offset": self.offset,
            "problem": self.problem,
        }


@dataclass(frozen=True, slots=True)
class RunListing:
    """The result of scanning a run: its dumps in dump order plus record health.

    Attributes:
        dumps: Every recorded or listed dump, sorted by time then name.
        segments: Record segments read.
        bad_record_lines: Unreadable lines skipped in the segments.
        shards: Shard files found in the storage.
        unindexed_shards: Shards no record line describes, indexed from their tar headers.
    """

    dumps: tuple[DumpInfo, ...]
    segments: int
    bad_record_lines: int
    shards: int = 0
    unindexed_shards: int = 0


def dump_order(info: DumpInfo) -> tuple[float, str]:
    """Sort key for "dump order": commit time, then name (unknown times last)."""
    return (info.time if info.time is not None else math.inf, info.name)


def matches(info: DumpInfo, glob: str) -> bool:
    """Whether a dump's name or path matches an ``fnmatch`` pattern."""
    return fnmatch.fnmatchcase(info.name, glob) or fnmatch.fnmatchcase(info.path, glob)
