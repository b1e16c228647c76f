"""The record of what was written, kept in the storage itself.

Each tracker appends *segments* below ``<destination>/.trajtrack/records/``: small JSON-lines
files describing committed dumps (name, path, size, checksum, writer, time; for a shard member
its shard and offset), each written atomically like a dump. A segment is written at every
``flush()``, at close and every few seconds while dumps commit, so after a crash at most the
last few seconds are unrecorded (the reader then falls back to listing those files). Segment
names carry a per-tracker writer id, so any number of processes can record into one
destination without coordination.

Two kinds of line, both read back (:func:`decode_segment`):

* ``"v": 2`` (written since 0.1.0's record format 2): one line per writer and layout, in
  columns -- ``name``, ``path``, ``size``, ``checksum``, ``time`` lists of one entry per dump,
  the writer's ``host``, ``pid``, ``rank`` and ``writer`` once, and for shard members the
  ``shards`` they are in, each dump's ``shard`` (an index into ``shards``) and ``offset``.
  Parsing a column costs a tenth of parsing an object per dump (:mod:`trajtrack.layouts.columns`);
* ``"v": 1``: one JSON object per dump with the same fields (what earlier writers wrote).

A line that is not one of these (damaged, forged) is skipped and counted, never trusted: for a
``v2`` line that means every dump it describes (readers then list those files as unrecorded,
and index unrecorded shards from their tar headers).
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from itertools import groupby
from typing import Any

from trajtrack.layouts.columns import (
    COLUMNS_VERSION,
    Columns,
    column_lines,
    columns_of,
    fits_columns,
    ints_in_range,
    times_in_range,
)
from trajtrack.layouts.names import RECORDS_DIR, WriterIdentity

__all__ = [
    "RECORDS_PREFIX",
    "DumpRecord",
    "RecordFields",
    "SegmentPart",
    "decode_segment",
    "decode_segment_fields",
    "decode_segment_parts",
    "encode_segment",
    "new_writer_id",
    "record_fields",
]

RECORDS_PREFIX = f"{RECORDS_DIR}/records"
FORMAT_VERSION = 1  # of a line per dump; the columns' lines are version 2 (layouts.columns)


@dataclass(frozen=True, slots=True)
class DumpRecord:
    """A committed dump.

    Attributes:
        name: The dump name after the name template (``"step3/rank0_obs"``).
        path: The file, relative to the destination (``"step3/rank0_obs.pth"``).
        size: Bytes written.
        checksum: ``"crc32:<8 hex digits>"`` of the file's bytes.
        host: Host name of the writing process.
        pid: Process id of the writing process.
        rank: ``RANK`` of the writing process (0 when unset).
        writer: Id of the tracker that wrote it (one per tracker instance).
        time: Commit time, seconds since the epoch (for a shard member: when it was written
            into its shard, so that dump order survives shards committed out of order).
        shard: The shard file holding the dump (sharded layout), relative to the
            destination; ``None`` when the dump is a file of its own at *path*.
        offset: Where the dump's bytes begin in *shard* (they are *size* bytes long).
    """

    name: str
    path: str
    size: int
    checksum: str
    host: str
    pid: int
    rank: int
    writer: str
    time: float
    shard: str | None = None
    offset: int | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "v": FORMAT_VERSION,
            "name": self.name,
            "path": self.path,
            "size": self.size,
            "checksum": self.checksum,
            "host": self.host,
            "pid": self.pid,
            "rank": self.rank,
            "writer": self.writer,
            "time": self.time,
        }
        if self.shard is not None:  # the files layout's lines stay as they always were
            out["shard"], out["offset"] = self.shard, self.offset
        return out


RecordFields = tuple[str, str, int, str, str, int, int, str, float, str | None, int | None]
"""A record line's values in :class:`DumpRecord`'s field order (what a reader keeps of a line:
building the frozen dataclass costs more than parsing the line)."""


def record_fields(data: dict[str, Any]) -> RecordFields:
    """The values of one parsed record line, checked and converted.

    Raises:
        ValueError, KeyError, TypeError, AttributeError, OverflowError: The line is not a
            record (``OverflowError``: ``int()`` of an infinite size, ``float()`` of a
            400-digit time).
    """
    get = data.get
    shard, offset = get("shard"), get("offset")
    fields: RecordFields = (
        str(data["name"]),
        str(data["path"]),
        int(data["size"]),
        str(data["checksum"]),
        str(get("host", "")),
        int(get("pid", 0)),
        int(get("rank", 0)),
        str(get("writer", "")),
        float(get("time", 0.0)),
        None if shard is None else str(shard),
        None if offset is None else int(offset),
    )
    ints = [fields[2], fields[5], fields[6], fields[10] or 0]  # size, pid, rank, offset
    if not (ints_in_range(ints) and times_in_range([fields[8]])):
        raise ValueError("a value of the line is out of range")
    return fields


def new_writer_id(who: WriterIdentity) -> str:
    """A unique id for one tracker instance: host, pid, start time and a random suffix."""
    return f"{who.host}-{who.pid}-{int(time.time())}-{secrets.token_hex(3)}"


def segment_path(writer: str, sequence: int) -> str:
    return f"{RECORDS_PREFIX}/{writer}-{sequence:06d}.jsonl"


_ENCODER = json.JSONEncoder(sort_keys=True)  # once: json.dumps(sort_keys=...) makes one a call


def encode_segment(records: list[DumpRecord]) -> bytes:
    """The segment of *records*: in columns (a line per writer and layout), each record that
    columns cannot hold (a shard member without an offset) on a line of its own."""
    encode = _ENCODER.encode
    lines = []
    for fits, group in groupby(records, key=fits_columns):
        if fits:
            lines += [encode(line) for line in column_lines(list(group))]
        else:
            lines += [encode(record.to_json()) for record in group]
    return "".join([line + "\n" for line in lines]).encode()


def decode_segment(data: bytes) -> tuple[list[DumpRecord], int]:
    """Parse a segment; returns the records and the number of unreadable lines skipped."""
    fields, bad = decode_segment_fields(data)
    return [DumpRecord(*values) for values in fields], bad


def decode_segment_fields(data: bytes) -> tuple[list[RecordFields], int]:
    """:func:`decode_segment`, each record as its :data:`RecordFields`."""
    parts, bad = decode_segment_parts(data)
    records: list[RecordFields] = []
    for part in parts:
        if isinstance(part, Columns):
            records += part.fields()
        else:
            records.append(part)
    return records, bad


SegmentPart = Columns | RecordFields
"""What one good line of a segment holds: a version-2 line's :class:`Columns`, or a
version-1 line's :data:`RecordFields` (tell them apart by ``isinstance(part, Columns)``)."""


def decode_segment_parts(data: bytes) -> tuple[list[SegmentPart], int]:
    """A segment's good lines, in order, and the number of unreadable lines skipped."""
    lines = [line for line in data.decode("utf-8", "replace").splitlines() if line.strip()]
    parsed = _parse_whole(lines)
    if parsed is None:  # some line is not one JSON object: parse line by line
        parsed = []
        for line in lines:
            try:
                parsed.append(json.loads(line))
            except (ValueError, RecursionError):  # RecursionError: nested too deep
                parsed.append(None)
    parts: list[SegmentPart] = []
    bad = 0
    for item in parsed:
        if type(item) is dict and item.get("v") == COLUMNS_VERSION:
            columns = columns_of(item)
            if columns is None:
                bad += 1
            else:
                parts.append(columns)
            continue
        try:
            parts.append(record_fields(item))
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError):
            bad += 1  # AttributeError: not a dict; RecursionError: str() of a deep value
    return parts, bad


def _parse_whole(lines: list[str]) -> list[Any] | None:
    """The JSON object on each line, parsed as one array (one call into the C parser instead of a
    Python-level call per line; ``benchmarks/bench_small_reads.py``), or ``None`` if that does not
    give exactly one object per line (a line that is not one object: each line is then parsed
    alone)."""
    if not all(line.lstrip().startswith("{") and line.rstrip().endswith("}") for line in lines):
        return None
    try:
        parsed = json.loads("[" + ",".join(lines) + "]")
    except (ValueError, RecursionError):  # RecursionError: a line nested too deep
        return None
    if len(parsed) != len(lines) or not all(type(item) is dict for item in parsed):
        return None
    return parsed  # type: ignore[no-any-return]
