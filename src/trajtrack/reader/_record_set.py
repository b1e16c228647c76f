"""What a run's record says: :class:`RecordSet`, and the recorded dumps it gives.

The segments' good lines are kept as they were decoded: a version-2 line as its
:class:`~trajtrack.layouts.columns.Columns` (a list per field), a version-1 line as one
record's fields. When no path is recorded twice (a run whose names are not reused: the common
case), the dumps of a line in columns are built a column at a time: the checks of every path,
shard and place made over whole columns by C functions (``map``, ``all``), each
:class:`DumpInfo` made by ``zip`` and ``tuple.__new__``, no Python code per dump. Any line
with something to report (a path that is not a dump path, a shard that is missing, outside or
not a shard, a place past its shard's end) takes the record-by-record way, which words each
problem; so does a run that records a path twice (the newest record wins).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from itertools import chain, repeat
from typing import Final

from trajtrack._exceptions import InvalidNameError, StorageError
from trajtrack.backends import FileInfo, check_relative
from trajtrack.layouts.columns import Columns
from trajtrack.layouts.names import plainly_valid, plainly_valid_all, validate_name
from trajtrack.layouts.records import RecordFields, SegmentPart, decode_segment_parts
from trajtrack.layouts.shards import is_shard_path
from trajtrack.reader._dumps import DumpInfo

__all__ = ["OUTSIDE", "SPECIAL", "RecordSet", "file_problem", "path_problem"]

OUTSIDE: Final = "a symbolic link leading out of the run"
SPECIAL: Final = "not a regular file (a FIFO, socket or device)"

# Where a record's path, size, time and shard are in its RecordFields.
_PATH: Final = 1
_SIZE: Final = 2
_TIME: Final = 8
_SHARD: Final = 9


class RecordSet:
    """The good lines of a run's record segments, and the number of bad lines skipped."""

    def __init__(self, parts: list[SegmentPart], bad: int) -> None:
        self.parts = parts
        self.bad = bad
        self._latest: dict[str, RecordFields] | None = None
        self.paths: set[str] = set()
        count = 0
        for part in parts:
            if isinstance(part, Columns):
                self.paths.update(part.paths)
                count += len(part.paths)
            else:
                self.paths.add(part[_PATH])
                count += 1
        self.unique = len(self.paths) == count
        """Whether no path is recorded twice (each record is then the newest of its path)."""

    @classmethod
    def decode(cls, segments: Iterable[bytes]) -> RecordSet:
        """The record of these segments (blocking: parses them)."""
        parts: list[SegmentPart] = []
        bad = 0
        for data in segments:
            found, skipped = decode_segment_parts(data)
            parts += found
            bad += skipped
        return cls(parts, bad)

    def latest(self) -> dict[str, RecordFields]:
        """The newest record of every path (the latest commit time; on a tie, the one read
        last)."""
        if self._latest is None:
            latest: dict[str, RecordFields] = {}
            for record in self._records():
                path = record[_PATH]
                known = latest.get(path)
                if known is None or record[_TIME] >= known[_TIME]:
                    latest[path] = record
            self._latest = latest
        return self._latest

    def shards(self) -> set[str]:
        """The shards the record places dumps in."""
        found: set[str] = set()
        for part in self.parts:
            if isinstance(part, Columns):
                if part.shards is not None and part.shard is not None:
                    found.update(map(part.shards.__getitem__, set(part.shard)))
            elif part[_SHARD] is not None:
                found.add(part[_SHARD])
        return found

    def file_sizes(self) -> dict[str, int]:
        """The recorded size of each dump that is a file of its own (shard members aside)."""
        if not self.unique:
            return {p: r[_SIZE] for p, r in self.latest().items() if r[_SHARD] is None}
        sizes: dict[str, int] = {}
        for part in self.parts:
            if isinstance(part, Columns):
                if part.shards is None:
                    sizes.update(zip(part.paths, part.sizes, strict=True))
            elif part[_SHARD] is None:
                sizes[part[_PATH]] = part[_SIZE]
        return sizes

    def dumps(self, listed: dict[str, FileInfo], shards: dict[str, FileInfo]) -> list[DumpInfo]:
        """A :class:`DumpInfo` per recorded dump, as the listed files (*listed*: dumps' own
        files by path) and *shards* hold them."""
        if not self.unique:
            return _from_records(self.latest().values(), listed, shards)
        dumps: list[DumpInfo] = []
        for part in self.parts:
            found = _from_columns(part, listed, shards) if isinstance(part, Columns) else None
            if found is None:
                found = _from_records(_fields(part), listed, shards)
            dumps += found
        return dumps

    def _records(self) -> Iterable[RecordFields]:
        return chain.from_iterable(map(_fields, self.parts))


def _fields(part: SegmentPart) -> list[RecordFields]:
    return part.fields() if isinstance(part, Columns) else [part]


def _from_columns(
    part: Columns, listed: dict[str, FileInfo], shards: dict[str, FileInfo]
) -> list[DumpInfo] | None:
    """The dumps of a line in columns, built a column at a time, or ``None`` if any of them
    has a problem to report (the caller then goes record by record)."""
    if not plainly_valid_all(part.paths) or (part.sizes and min(part.sizes) < 0):
        return None
    count = len(part.paths)
    if part.shards is None or part.shard is None or part.offsets is None:
        files = list(map(listed.get, part.paths))
        if any(file is not None and (file.outside or file.special) for file in files):
            return None
        stored: Iterable[int | None] = [None if f is None else f.size for f in files]
        shard_paths: Iterable[str | None] = repeat(None, count)
        offsets: Iterable[int | None] = repeat(None, count)
    else:
        held = _shard_sizes(part.shards, shards)
        if held is None or (part.offsets and min(part.offsets) < 0):
            return None
        ends = map(operator.add, part.offsets, part.sizes)
        if not all(map(operator.le, ends, map(held.__getitem__, part.shard))):
            return None  # a member past its shard's end: held bytes worked out one by one
        stored, offsets = part.sizes, part.offsets
        shard_paths = map(part.shards.__getitem__, part.shard)
    fields = zip(
        part.names,
        part.paths,
        part.sizes,
        part.checksums,
        repeat(part.writer, count),
        repeat(part.host, count),
        repeat(part.pid, count),
        repeat(part.rank, count),
        part.times,
        repeat(True, count),  # recorded
        stored,
        shard_paths,
        offsets,
        repeat(None, count),  # no problem
        strict=True,
    )
    return list(map(tuple.__new__, repeat(DumpInfo, count), fields))


def _shard_sizes(line_shards: list[str], shards: dict[str, FileInfo]) -> list[int] | None:
    """The size of each of a line's shards, or ``None`` if one has a problem to report (not a
    shard of the run, missing, a link leading out)."""
    sizes = []
    for shard in line_shards:
        file = shards.get(shard)
        if file is None or file_problem(file) or shard_problem(shard) is not None:
            return None
        sizes.append(file.size)
    return sizes


def _from_records(
    records: Iterable[RecordFields], listed: dict[str, FileInfo], shards: dict[str, FileInfo]
) -> list[DumpInfo]:
    """A :class:`DumpInfo` per record, each with its problem worded (one loop, no call per
    dump but the name check)."""
    shard_problems: dict[str, str | None] = {}  # one check per shard, not per member
    dumps: list[DumpInfo] = []
    append = dumps.append
    get_file, get_shard = listed.get, shards.get
    new = tuple.__new__  # DumpInfo(...) from a tuple of its fields, no keyword binding
    for record in records:
        name, path, size, checksum, host, pid, rank, writer, time, shard_path, offset = record
        problem = None if plainly_valid(path) else path_problem(path)
        if shard_path is None:
            file = get_file(path)
            stored = None if file is None else file.size
        else:
            if problem is None:
                if shard_path not in shard_problems:
                    shard_problems[shard_path] = shard_problem(shard_path)
                problem = shard_problems[shard_path]
                if problem is None and (offset is None or offset < 0 or size < 0):
                    problem = f"its place in the shard ({offset}, {size} bytes) is invalid"
            file = get_shard(shard_path)
            if file is None:
                stored = None
            else:  # what the shard holds of the member's bytes
                held = file.size - (offset or 0)
                stored = size if held >= size else max(0, held)
        if problem is None and file is not None:
            problem = file_problem(file)
        recorded = True
        fields = (name, path, size, checksum, writer, host, pid, rank, time, recorded, stored)
        append(new(DumpInfo, (*fields, shard_path, offset, problem)))
    return dumps


def file_problem(file: FileInfo) -> str | None:
    """Why a listed *file* must not be opened (a link leading out of the run, not a regular
    file), or ``None``."""
    if file.outside:
        return OUTSIDE
    if file.special:
        return SPECIAL
    return None


def path_problem(path: str) -> str | None:
    """Why a dump's *path* must not be read (not a dump path inside the run), or ``None``."""
    try:
        validate_name(path)
    except InvalidNameError:
        return f"its path {path!r} is not a path inside the run"
    return None


def shard_problem(shard: str) -> str | None:
    """Why a recorded *shard* must not be read (not a shard of the run), or ``None``."""
    try:
        check_relative(shard)
    except StorageError:
        return f"its shard {shard!r} is not a path inside the run"
    if not is_shard_path(shard):
        return f"its shard {shard!r} is not a shard of the run"
    return None
