"""Record lines in columns (format version 2): many dumps of one writer in one JSON object.

A line per dump (version 1) costs a reader a JSON object, a dict and a conversion of every
field per dump, most of what listing a sharded run cost (``benchmarks/bench_small_reads.py``).
A line in columns holds one list per field (``name``, ``path``, ``size``, ``checksum``,
``time``) and what all its dumps share once (``host``, ``pid``, ``rank``, ``writer``); a shard
member's shard is an index into the line's ``shards``, its place an ``offset``. JSON parses a
list of plain values for a tenth of an object per dump, the types are checked a column at a
time, and the dumps' values come out zipped, in C.

The checks are exact: every column a list of the dumps' count, each entry of the one type the
field has (a ``bool`` is not an ``int``), each shard index inside ``shards``. A line that
fails any of them is refused whole (:func:`columns_of` returns ``None``); the reader then
counts it as unreadable and lists the dumps it described as unrecorded files or shard members.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import groupby, repeat
from typing import TYPE_CHECKING, Any, Final, NamedTuple, cast

if TYPE_CHECKING:
    from trajtrack.layouts.records import DumpRecord, RecordFields

__all__ = [
    "COLUMNS_VERSION",
    "INT_LIMIT",
    "TIME_LIMIT",
    "Columns",
    "column_lines",
    "columns_of",
    "fits_columns",
]

COLUMNS_VERSION: Final = 2

INT_LIMIT: Final = 1 << 63
"""Every integer of a record line (size, offset, pid, rank, shard index) lies in
``(-INT_LIMIT, INT_LIMIT)``: JSON admits integers of any length, and one past a C ``off_t`` or
``ssize_t`` would end a read with ``OverflowError``, not with the line counted as bad."""

TIME_LIMIT: Final = 1e11
"""Every time of a record line is finite and lies in ``(-TIME_LIMIT, TIME_LIMIT)`` seconds
(before the year 5000): JSON admits ``1e999`` and ``Infinity``, and a time the platform's
``time_t`` cannot hold ends printing it with ``OverflowError``."""


def fits_columns(record: DumpRecord) -> bool:
    """Whether *record* can be written in columns (a shard member always has its offset)."""
    return (record.shard is None) == (record.offset is None)


def column_lines(records: Sequence[DumpRecord]) -> list[dict[str, Any]]:
    """One line (a JSON-ready dict) per run of consecutive *records* of one writer and one
    layout; every record must :func:`fit <fits_columns>`."""
    return [_line(list(group)) for _, group in groupby(records, key=_shared)]


def _shared(record: DumpRecord) -> tuple[str, int, int, str, bool]:
    return (record.host, record.pid, record.rank, record.writer, record.shard is None)


def _line(group: list[DumpRecord]) -> dict[str, Any]:
    first = group[0]
    line: dict[str, Any] = {
        "v": COLUMNS_VERSION,
        "host": first.host,
        "pid": first.pid,
        "rank": first.rank,
        "writer": first.writer,
        "name": [r.name for r in group],
        "path": [r.path for r in group],
        "size": [r.size for r in group],
        "checksum": [r.checksum for r in group],
        "time": [r.time for r in group],
    }
    if first.shard is not None:
        shards = list(dict.fromkeys(r.shard for r in group))
        index = {shard: i for i, shard in enumerate(shards)}
        line["shards"] = shards
        line["shard"] = [index[r.shard] for r in group]
        line["offset"] = [r.offset for r in group]
    return line


class Columns(NamedTuple):
    """One version-2 line, checked: a list per field, one entry per dump; what its dumps
    share once; for shard members, the line's shards, each dump's index into them and its
    offset (``None`` for files)."""

    names: list[str]
    paths: list[str]
    sizes: list[int]
    checksums: list[str]
    times: list[float]
    host: str
    pid: int
    rank: int
    writer: str
    shards: list[str] | None
    shard: list[int] | None
    offsets: list[int] | None

    def fields(self) -> list[RecordFields]:
        """Each dump as its :data:`RecordFields`."""
        count = len(self.names)
        if self.shards is None or self.shard is None or self.offsets is None:
            shard_paths: Iterable[str | None] = repeat(None, count)
            offsets: Iterable[int | None] = repeat(None, count)
        else:
            shard_paths, offsets = map(self.shards.__getitem__, self.shard), self.offsets
        return list(
            zip(
                self.names,
                self.paths,
                self.sizes,
                self.checksums,
                repeat(self.host, count),
                repeat(self.pid, count),
                repeat(self.rank, count),
                repeat(self.writer, count),
                self.times,
                shard_paths,
                offsets,
                strict=True,
            )
        )


def columns_of(line: dict[str, Any]) -> Columns | None:
    """The checked :class:`Columns` of a version-2 *line*, or ``None`` if the line is not
    exactly what :func:`column_lines` writes (see the module's checks)."""
    columns = _lists(line, ("name", "path", "size", "checksum", "time"))
    if columns is None:
        return None
    names, paths, sizes, checksums, times = columns
    host, pid, rank, writer = (line.get(key) for key in ("host", "pid", "rank", "writer"))
    if not (type(host) is str and type(pid) is int and type(rank) is int and type(writer) is str):
        return None
    if not (_all(names, str) and _all(paths, str) and _all(checksums, str) and _all(sizes, int)):
        return None
    if not (ints_in_range(sizes) and ints_in_range([pid, rank])):
        return None
    if not _all(times, float):  # whole seconds may have been written as integers
        if not all(type(t) is int or type(t) is float for t in times):
            return None
        if not all(type(t) is float or -INT_LIMIT < t < INT_LIMIT for t in times):
            return None  # float() of a 400-digit integer raises OverflowError
        times = [float(t) for t in times]
    if not times_in_range(times):
        return None
    placed = _places(line, len(names))
    if placed is None:
        return None
    return Columns(names, paths, sizes, checksums, times, host, pid, rank, writer, *placed)


def _lists(line: dict[str, Any], keys: tuple[str, ...]) -> list[list[Any]] | None:
    """The values of *keys* in *line*, if each is a list and all are of one length."""
    columns = [line.get(key) for key in keys]
    lengths = {len(column) if type(column) is list else -1 for column in columns}
    if len(lengths) != 1 or -1 in lengths:
        return None
    return cast("list[list[Any]]", columns)  # each one checked to be a list above


def _places(
    line: dict[str, Any], count: int
) -> tuple[list[str] | None, list[int] | None, list[int] | None] | None:
    """The line's shards, each dump's index into them and its offset (``None`` for files),
    or ``None``: not valid."""
    if "shards" not in line and "shard" not in line and "offset" not in line:
        return None, None, None
    shards, index, offsets = line.get("shards"), line.get("shard"), line.get("offset")
    if not (type(shards) is list and _all(shards, str)):
        return None
    if not (type(index) is list and len(index) == count and _all(index, int)):
        return None
    if not (type(offsets) is list and len(offsets) == count and _all(offsets, int)):
        return None
    if not ints_in_range(offsets):
        return None
    if index and (min(index) < 0 or max(index) >= len(shards)):
        return None
    return shards, index, offsets


def ints_in_range(values: list[int]) -> bool:
    """Whether every integer of *values* lies within :data:`INT_LIMIT` (by ``min`` and ``max``
    in C: a column at a time)."""
    return not values or (min(values) > -INT_LIMIT and max(values) < INT_LIMIT)


def times_in_range(times: list[float]) -> bool:
    """Whether every time of *times* is finite and within :data:`TIME_LIMIT` (``NaN`` fails
    both comparisons, so is refused too)."""
    return all(map(_time_in_range, times))


def _time_in_range(value: float) -> bool:
    return -TIME_LIMIT < value < TIME_LIMIT


def _all(values: list[Any], kind: type) -> bool:
    """Whether every entry of *values* is exactly of type *kind* (subclasses refused)."""
    return not values or set(map(type, values)) == {kind}
