"""Exporting a run into the files layout: one ``<name>.pth`` per dump, with its record.

Whatever layout the source has (files, shards or a mix), the destination gets each dump's
bytes unchanged under the file name the files layout gives it, written atomically, plus a
record segment describing them (size and CRC-32 as the source recorded them, the original
writer and commit time), so that ``trajtrack verify``, ``diff`` and plain
``torch.load(path)`` scripts work on the copy.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Union

import anyio

from trajtrack._exceptions import ConfigurationError, DumpExistsError, StorageError
from trajtrack.backends import BytesPayload, Storage, checksum_of
from trajtrack.layouts.names import WriterIdentity, plainly_valid
from trajtrack.layouts.records import DumpRecord, encode_segment, new_writer_id, segment_path
from trajtrack.reader._batch_reads import dump_batches
from trajtrack.reader._dumps import DumpInfo
from trajtrack.reader._gather import gather_bounded
from trajtrack.reader._record_set import path_problem
from trajtrack.reader._run import Run

__all__ = ["ExportResult", "export_run"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ExportResult:
    """What an export wrote.

    Attributes:
        written: Dumps written to the destination.
        skipped: Dumps not written, with the reason (missing, refused, corrupt, unreadable,
            or already in the destination with other bytes).
        bytes_written: Their bytes.
        unchanged: Dumps the destination already held with the same bytes (an earlier
            export): not written again, recorded again.
        existing: The names of the skipped dumps that the destination holds with other bytes
            (``overwrite=True`` replaces them).
    """

    written: int
    skipped: tuple[tuple[str, str], ...]
    bytes_written: int
    unchanged: int = 0
    existing: tuple[str, ...] = ()


_Outcome = Union[DumpRecord, "_Same", str, StorageError]
"""One dump's outcome: written (its record), already there, skipped (why), or a write error."""


@dataclass(frozen=True, slots=True)
class _Same:
    record: DumpRecord  # the destination already holds these bytes


async def export_run(
    source: Run,
    destination: Storage,
    *,
    glob: str | None = None,
    overwrite: bool = False,
    on_progress: Callable[[int, int], None] | None = None,
) -> ExportResult:
    """Copy every present dump of *source* (matching *glob*) into *destination* as files.

    Idempotent: a dump the destination already holds with the same bytes is not written
    again (``unchanged``); one it holds with other bytes is skipped, by name, unless
    *overwrite*. A dump whose bytes do not match its recorded checksum, or that cannot be
    read, is skipped too (reported in ``skipped``): an export never launders corruption into
    a clean-looking run. Every file the export wrote or found is in the record it writes,
    also when it fails part-way.

    A dump whose path a record cannot hold (a file named with a control character: the
    destination's readers would refuse it, ``verify`` report it ``outside``) is skipped, and
    so is one whose place in the destination something else holds (a folder, a file where a
    folder goes): the others are exported.

    Raises:
        ConfigurationError: The destination is the source, inside it, or holds it (each
            export would copy itself into the run); nothing is written.
        StorageError: Listing the source or writing the destination failed (nothing is
            created in the destination when the source cannot be listed).
    """
    await source.open()
    _refuse_nested(source.storage, destination)
    dumps = await source.list(glob)  # first: a run that cannot be read leaves nothing behind
    await destination.prepare()
    todo: list[DumpInfo] = []
    skipped: list[tuple[str, str]] = []
    for d in dumps:
        if not (d.present and d.problem is None):
            skipped.append((d.name, d.problem or "missing from the storage"))
        elif not plainly_valid(d.path) and (problem := path_problem(d.path)) is not None:
            skipped.append((d.name, f"{problem}: no record can hold it"))
        else:
            todo.append(d)
    done = [0]
    records: list[DumpRecord] = []  # filled as batches finish: recorded even after a failure

    async def copy(batch: list[DumpInfo]) -> list[_Outcome]:
        outcomes = await _copy_batch(source, destination, batch, overwrite)
        records.extend(_recorded(o) for o in outcomes if isinstance(o, (DumpRecord, _Same)))
        done[0] += len(batch)
        if on_progress is not None:
            on_progress(done[0], len(todo))
        return outcomes

    batches = dump_batches(todo)
    try:
        copied = await gather_bounded(batches, copy, limit=source.concurrency)
    finally:
        await _write_record(destination, records)
    ordered = [info for batch in batches for info in batch]  # the order of the outcomes
    outcomes = list(zip(ordered, [o for out in copied for o in out], strict=True))
    failure = next((o for _, o in outcomes if isinstance(o, StorageError)), None)
    if failure is not None:
        raise failure
    skipped += [(d.name, o) for d, o in outcomes if isinstance(o, str)]
    for name, why in skipped:
        logger.warning("not exported: %s (%s)", name, why)
    written = [o for _, o in outcomes if isinstance(o, DumpRecord)]
    return ExportResult(
        written=len(written),
        skipped=tuple(skipped),
        bytes_written=sum(r.size for r in written),
        unchanged=sum(isinstance(o, _Same) for _, o in outcomes),
        existing=tuple(d.name for d, o in outcomes if o == _EXISTS),
    )


_EXISTS = "the destination holds other bytes under this name; not replaced (overwrite replaces it)"

_CLASH = (
    "the destination holds something else where it goes (a folder, or a file where a folder "
    "goes); not replaced"
)

# How a write fails because the destination holds something else at the dump's place: a
# folder where the file goes (EISDIR, ENOTEMPTY: renaming over a folder), a file where a
# folder goes (ENOTDIR, EEXIST); HDFS's names for the same.
_CLASH_ERRNOS = frozenset({errno.EISDIR, errno.ENOTDIR, errno.EEXIST, errno.ENOTEMPTY})
_CLASH_REMOTE = frozenset({"FileAlreadyExistsException", "ParentNotDirectoryException"})


def _clash(error: BaseException) -> bool:
    """Whether *error* (a write's) says the destination holds something else in the way."""
    if getattr(error, "remote_exception", None) in _CLASH_REMOTE:
        return True
    cause = error if isinstance(error, OSError) and error.errno else error.__cause__
    return isinstance(cause, OSError) and cause.errno in _CLASH_ERRNOS


def _refuse_nested(source: Storage, destination: Storage) -> None:
    """Refuse a destination that is the source, lies inside it or holds it: an export would
    write into the run it reads (a second export copies the first copy along), and the
    run's ``verify`` would then fail on files in no record."""
    where_s, where_d = source.local_path(""), destination.local_path("")
    if where_s is not None and where_d is not None:  # links resolved: the folders themselves
        a, b, sep = os.path.realpath(where_s), os.path.realpath(where_d), os.sep
    else:
        a, b, sep = source.url.rstrip("/"), destination.url.rstrip("/"), "/"
    if a == b:
        how = "is the run itself"
    elif b.startswith(a.rstrip(sep) + sep):
        how = "is inside the run"
    elif a.startswith(b.rstrip(sep) + sep):
        how = "holds the run"
    else:
        return
    raise ConfigurationError(
        f"refusing to export {source.url} to {destination.url}: the destination {how}; "
        "export to a folder outside it"
    )


async def _copy_batch(
    source: Run, destination: Storage, batch: list[DumpInfo], overwrite: bool
) -> list[_Outcome]:
    """Read *batch* together (neighbouring shard members: one read), write it together (a
    local destination: one worker-thread hop); each dump's outcome its own."""
    outcomes: list[_Outcome] = []
    items: list[tuple[str, BytesPayload]] = []
    places: list[int] = []  # the outcome each item's write settles
    for info, data in zip(batch, await source.read_many(batch), strict=True):
        if isinstance(data, Exception):  # a dangling link, a vanished file: this dump only
            outcomes.append(f"not read: {data}")
            continue
        checksum = checksum_of(data)
        if info.checksum is not None and checksum != info.checksum:
            outcomes.append(f"checksum {checksum}, recorded {info.checksum}")
        elif info.size != len(data):
            outcomes.append(f"read {len(data)} bytes, recorded {info.size}")
        else:
            places.append(len(outcomes))
            outcomes.append(_record(info, len(data), checksum))
            items.append((info.path, BytesPayload(data)))
    written = await destination.write_atomic_many(items, overwrite=overwrite)
    for place, result in zip(places, written, strict=True):
        record = outcomes[place]
        assert isinstance(record, DumpRecord)
        if isinstance(result, DumpExistsError):
            outcomes[place] = await _existing(destination, record)
        elif isinstance(result, Exception) and _clash(result):  # this dump only: skipped
            outcomes[place] = f"{_CLASH}: {result}"
        elif isinstance(result, StorageError):
            outcomes[place] = result
        elif isinstance(result, Exception):
            outcomes[place] = StorageError(f"writing {record.path}: {result}")
    return outcomes


async def _existing(destination: Storage, record: DumpRecord) -> _Outcome:
    """What to make of *record*'s path already taken in *destination*: same bytes or not."""
    try:
        held = await destination.read(record.path)
    except StorageError as exc:
        return f"in the destination already, and not readable there: {exc}"
    if len(held) == record.size and checksum_of(held) == record.checksum:
        return _Same(record)
    return _EXISTS


def _recorded(outcome: DumpRecord | _Same) -> DumpRecord:
    return outcome.record if isinstance(outcome, _Same) else outcome


async def _write_record(destination: Storage, records: list[DumpRecord]) -> None:
    """One record segment for *records*, also while the export is being cancelled."""
    if not records:
        return
    writer = new_writer_id(WriterIdentity.current())
    segment = BytesPayload(encode_segment(records))
    with anyio.move_on_after(_RECORD_TIMEOUT, shield=True):
        await destination.write_atomic(segment_path(writer, 0), segment, overwrite=True)
        return
    raise StorageError(  # pragma: no cover - a storage that hangs past its own timeouts
        f"writing the export's record to {destination.url} took over {_RECORD_TIMEOUT:g} s"
    )


_RECORD_TIMEOUT = 60.0  # seconds; a storage's own requests time out well before


def _record(info: DumpInfo, size: int, checksum: str) -> DumpRecord:
    return DumpRecord(
        name=info.name,
        path=info.path,
        size=size,
        checksum=checksum,
        host=info.host,
        pid=info.pid or 0,
        rank=info.rank or 0,
        writer=info.writer,
        time=info.time or 0.0,
    )
