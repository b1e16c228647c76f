"""Runs of small files for a local destination's writer process, from a thread or the loop.

A batch of :meth:`~trajtrack.backends.local.LocalStorage.write_atomic_many` is cut into runs:
small bytes payloads (or dumps staged in the writer's arena) of one directory go to the writer
process (:mod:`~trajtrack.backends._writer_process`) as one frame; everything else is written
by a thread, as before. From an asyncio loop a run is sent and answered on the loop itself
(:mod:`~trajtrack.backends._writer_channel`): no thread hop, no GIL changing hands.

On the loop, the run's directory is opened in a thread (never on the loop: a slow disk) and
kept for the next run into it -- per-sample dumps of one step share it -- for at most
:data:`DIRECTORY_REUSE` seconds, and never once it was removed (``st_nlink`` 0): a directory
deleted and made again gets the next files, not the old, unlinked one.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Final

import anyio.to_thread

from trajtrack._exceptions import StorageError, StorageUnavailableError
from trajtrack.backends._local_errors import exists_error, translate, translated
from trajtrack.backends._protocol import BytesPayload, Payload, WriteResult, check_relative
from trajtrack.backends._staging import Block
from trajtrack.backends._writer_process import Failure, WriterGone, WriterProcess
from trajtrack.layouts.names import WriterIdentity, temp_path_for

__all__ = ["DIRECTORY_REUSE", "PROCESS_MAX_BYTES", "HelperRuns"]

PROCESS_MAX_BYTES: Final = 1 << 20
"""Bytes payloads up to this size go to the writer process; larger ones are written by a
thread (their ``write`` releases the GIL for long enough not to contend for it)."""
DIRECTORY_REUSE: Final = 1.0
"""Seconds a directory opened for a run on the loop serves the next runs into it."""

Items = Sequence[tuple[str, Payload]]
Report = Callable[[int, "WriteResult | Exception"], None]
InThread = Callable[[Items, Report], Awaitable[None]]
OpenDir = Callable[[list[str]], int]


class HelperRuns:
    """Cuts batches into runs for *writer* and writes them (thread or loop).

    Args:
        writer: The storage's writer process.
        root: The destination (for messages).
        who: The process identity (temporary names).
        fsync: Whether files are fsynced.
        mode: The files' permission bits.
    """

    def __init__(
        self,
        writer: WriterProcess,
        root: Path,
        who: WriterIdentity,
        *,
        fsync: bool,
        mode: int,
    ) -> None:
        self._writer = writer
        self._root = root
        self._who = who
        self._fsync = fsync
        self._mode = mode
        self._kept: tuple[tuple[str, ...], int, float] | None = None  # key, fd, opened at

    def small_run(self, items: Items, start: int) -> int:
        """The end of the run of small bytes payloads in one directory from *start*, for the
        writer process (*start* itself when it is off or the item is not one)."""
        if not self._writer.usable:
            return start
        directory = items[start][0].rpartition("/")[0]
        end = start
        for path, payload in items[start:]:
            if (
                not isinstance(payload, BytesPayload)
                or (payload.data.nbytes > PROCESS_MAX_BYTES and not self._writer.holds(payload))
                or path.rpartition("/")[0] != directory
            ):
                break
            end += 1
        return end

    def write_run(
        self,
        items: Items,
        start: int,
        end: int,
        overwrite: bool,
        directory_of: Callable[[tuple[str, ...]], int],
        report: Report,
    ) -> None:
        """Items *start* to *end* of a :meth:`small_run`, from a thread (*directory_of* opens
        or reuses the directory; the caller closes it)."""
        first = check_relative(items[start][0])
        try:
            with translated(f"{self._root}/{first}"):
                directory = directory_of(tuple(first.split("/")[:-1]))
        except StorageError as exc:
            _report_all(report, start, end, exc)
            return
        batch, outcome = self._batch(items, start, end, report)
        self._writer.write(directory, batch, **self._how(overwrite), report=outcome)

    async def write_many(
        self, items: Items, overwrite: bool, report: Report, in_thread: InThread, open_dir: OpenDir
    ) -> None:
        """Every item, from the loop: runs on the loop, the rest (or a run the writer cannot
        take now) through ``await in_thread(part, report_of_part)``. *open_dir* opens a
        directory below the root (containment checked); it is called in a thread."""
        index = 0
        while index < len(items):
            end = self.small_run(items, index)
            here = end > index
            if here and await self._write_run_here(items, index, end, overwrite, report, open_dir):
                index = end
                continue
            stop = end if end > index else self._next_run(items, index + 1)
            await in_thread(items[index:stop], _shifted(report, index))
            index = stop

    def on_loop(self) -> bool:
        """Whether the caller runs on an asyncio loop and the writer can be used."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # another async library (trio): threads
            return False
        return self._writer.usable

    def close(self) -> None:
        """Close the kept directory."""
        kept, self._kept = self._kept, None
        if kept is not None:
            os.close(kept[1])

    def __del__(self) -> None:  # a storage dropped without aclose()
        if getattr(self, "_kept", None) is not None:
            self.close()

    def _how(self, overwrite: bool) -> dict[str, Any]:
        """The writer's options for a run."""
        return {"overwrite": overwrite, "fsync": self._fsync, "mode": self._mode}

    def _next_run(self, items: Items, start: int) -> int:
        while start < len(items) and self.small_run(items, start) == start:
            start += 1
        return start

    async def _write_run_here(
        self, items: Items, start: int, end: int, overwrite: bool, report: Report, open_dir: OpenDir
    ) -> bool:
        first = check_relative(items[start][0])
        try:
            with translated(f"{self._root}/{first}"):
                directory = await self._directory(tuple(first.split("/")[:-1]), open_dir)
        except StorageError as exc:
            _report_all(report, start, end, exc)
            return True
        try:
            batch, outcome = self._batch(items, start, end, report)
            how = self._how(overwrite)
            return await self._writer.write_async(directory, batch, **how, report=outcome)
        finally:
            os.close(directory)

    async def _directory(self, key: tuple[str, ...], open_dir: OpenDir) -> int:
        """A descriptor of directory *key* for one run (the caller closes it)."""
        kept = self._kept
        fresh = kept is not None and time.monotonic() - kept[2] < DIRECTORY_REUSE
        if fresh and kept is not None and kept[0] == key and os.fstat(kept[1]).st_nlink > 0:
            return os.dup(kept[1])  # fresh, and not removed since
        fd = await anyio.to_thread.run_sync(open_dir, list(key))
        self.close()
        self._kept = (key, fd, time.monotonic())
        return os.dup(fd)

    def _batch(
        self, items: Items, start: int, end: int, report: Report
    ) -> tuple[list[tuple[str, str, memoryview | Block]], Callable[..., None]]:
        """The writer's items for *start* to *end*, and how its answers become outcomes."""
        batch: list[tuple[str, str, memoryview | Block]] = []
        for path, payload in items[start:end]:
            name = check_relative(path).rpartition("/")[2]
            data = payload.block if self._writer.holds(payload) else payload.data  # type: ignore[attr-defined]
            batch.append((temp_path_for(name, self._who), name, data))

        def outcome(offset: int, failure: Failure | WriterGone | None) -> None:
            path, payload = items[start + offset]
            where = f"{self._root}/{path}"
            result: WriteResult | Exception
            if failure is None:
                result = payload.counted()  # type: ignore[attr-defined]
            elif isinstance(failure, WriterGone):
                result = StorageUnavailableError(f"{where}: {failure}")
            elif failure.exists:
                result = exists_error(path)
            else:
                result = translate(failure.oserror(where), where)
            report(start + offset, result)

        return batch, outcome


def _report_all(report: Report, start: int, end: int, exc: Exception) -> None:
    """Items *start* to *end* all failed with *exc* (their directory could not be opened)."""
    for index in range(start, end):
        report(index, exc)


def _shifted(report: Report, by: int) -> Report:
    def shifted(index: int, outcome: WriteResult | Exception) -> None:
        report(index + by, outcome)

    return shifted
