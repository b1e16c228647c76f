"""Exporting a run into the files layout: one ``<name>.pth`` per dump, with its record.

Whatever layout the source has (files, shards or a mix), the destination gets each dump's
bytes unchanged under the file name the files layout gives it, written atomically, plus a
record segment describing them (size and CRC-32 as the source recorded them, the original
writer and commit time), so that ``trajtrack verify``, ``diff`` and plain
``torch.load(path)`` scripts work on the copy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from trajtrack._exceptions import DumpLoadError
from trajtrack.backends import BytesPayload, Storage, checksum_of
from trajtrack.layouts.names import WriterIdentity
from trajtrack.layouts.records import DumpRecord, encode_segment, new_writer_id, segment_path
from trajtrack.reader._batch_reads import dump_batches
from trajtrack.reader._dumps import DumpInfo
from trajtrack.reader._gather import gather_bounded
from trajtrack.reader._run import Run

__all__ = ["ExportResult", "export_run"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ExportResult:
    """What an export wrote.

    Attributes:
        written: Dumps written to the destination.
        skipped: Dumps not written, with the reason (missing, refused, corrupt).
        bytes_written: Their bytes.
    """

    written: int
    skipped: tuple[tuple[str, str], ...]
    bytes_written: int


async def export_run(
    source: Run,
    destination: Storage,
    *,
    glob: str | None = None,
    overwrite: bool = False,
    on_progress: Callable[[int, int], None] | None = None,
) -> ExportResult:
    """Copy every present dump of *source* (matching *glob*) into *destination* as files.

    A dump whose bytes do not match its recorded checksum is not copied (it is reported in
    ``skipped``): an export never launders corruption into a clean-looking run.

    Raises:
        StorageError: Listing the source or writing the destination failed.
    """
    await destination.prepare()
    dumps = await source.list(glob)
    todo = [d for d in dumps if d.present and d.problem is None]
    skipped = [
        (d.name, d.problem or "missing from the storage")
        for d in dumps
        if not (d.present and d.problem is None)  # not a search of todo: one pass
    ]

    async def copy(batch: list[DumpInfo]) -> list[DumpRecord | str]:
        # Read together (a span of neighbouring shard members: one read), written together
        # (a local destination: one worker-thread hop), each dump's outcome its own.
        outcomes: list[DumpRecord | str] = []
        items: list[tuple[str, BytesPayload]] = []
        for info, data in zip(batch, await source.read_many(batch), strict=True):
            if isinstance(data, Exception):
                raise data
            checksum = checksum_of(data)
            if info.checksum is not None and checksum != info.checksum:
                outcomes.append(f"checksum {checksum}, recorded {info.checksum}")
                continue
            outcomes.append(_record(info, len(data), checksum))
            items.append((info.path, BytesPayload(data)))
        for result in await destination.write_atomic_many(items, overwrite=overwrite):
            if isinstance(result, Exception):
                raise result
        done[0] += len(batch)
        if on_progress is not None:
            on_progress(done[0], len(todo))
        return outcomes

    done = [0]
    batches = dump_batches(todo)
    copied = await gather_bounded(batches, copy, limit=source.concurrency)
    ordered = [info for batch in batches for info in batch]  # the order of the outcomes
    copies = list(zip(ordered, [r for out in copied for r in out], strict=True))
    records = [r for _, r in copies if isinstance(r, DumpRecord)]
    skipped += [(d.name, r) for d, r in copies if isinstance(r, str)]
    if records:
        writer = new_writer_id(WriterIdentity.current())
        segment = BytesPayload(encode_segment(records))
        await destination.write_atomic(segment_path(writer, 0), segment, overwrite=True)
    for name, why in skipped:
        logger.warning("not exported: %s (%s)", name, why)
    return ExportResult(len(records), tuple(skipped), sum(r.size for r in records))


def _record(info: DumpInfo, size: int, checksum: str) -> DumpRecord:
    if info.size != size:
        raise DumpLoadError(f"{info.name}: read {size} bytes, recorded {info.size}")
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
