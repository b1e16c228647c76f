"""The record writer: what was committed, appended to the storage in segments.

Committed dumps are collected here and written as one record segment (a JSON-lines file below
``.trajtrack/records/``, see :mod:`trajtrack.layouts.records`) at every ``flush()``, at close,
and every ``record_interval`` seconds while dumps commit (the ticker), so a crash loses at most
the last few seconds of the record, never a dump: the reader lists unrecorded files too.
"""

from __future__ import annotations

import logging
import threading

import anyio

from trajtrack._exceptions import StorageError
from trajtrack.backends import Storage
from trajtrack.layouts.records import DumpRecord, encode_segment, segment_path
from trajtrack.tracker._ledger import Counters
from trajtrack.tracker._payloads import BytesPayload

__all__ = ["Recorder"]

logger = logging.getLogger(__name__)


class Recorder:
    """Collects committed records and writes them as segments of one writer.

    Args:
        storage: Where the segments go.
        writer: The tracker's writer id (segment names carry it).
        counters: Where ``records_written`` is counted.
        interval: Seconds between segments written by :meth:`run_ticker`.
        enabled: When false, records are dropped and nothing is written.
    """

    def __init__(
        self,
        storage: Storage,
        writer: str,
        counters: Counters,
        *,
        interval: float,
        enabled: bool = True,
    ) -> None:
        self._storage = storage
        self._writer = writer
        self._counters = counters
        self._interval = interval
        self.enabled = enabled
        self._pending: list[DumpRecord] = []
        self._pending_lock = threading.Lock()  # add() may run on a producer's thread
        self._write_lock = anyio.Lock()  # one segment at a time, numbered in order
        self._segment = 0

    def add(self, record: DumpRecord) -> None:
        """Remember a committed dump for the next segment."""
        if self.enabled:
            with self._pending_lock:
                self._pending.append(record)

    async def write(self) -> None:
        """Write every pending record as one new segment (nothing when there is none).

        Raises:
            StorageError: The segment could not be written; its records stay pending.
        """
        async with self._write_lock:
            with self._pending_lock:
                batch, self._pending = self._pending, []
            if not batch:
                return
            path = segment_path(self._writer, self._segment)
            try:
                data = BytesPayload(encode_segment(batch))
                await self._storage.write_atomic(path, data, overwrite=True)
            except BaseException:
                with self._pending_lock:  # keep them, in order, for the next attempt
                    self._pending[:0] = batch
                raise
            self._segment += 1
            with self._counters.lock:
                self._counters.records_written += 1

    async def run_ticker(self, stop: anyio.Event) -> None:
        """Write a segment every *interval* seconds while records come in, until *stop*."""
        while not stop.is_set():
            with anyio.move_on_after(self._interval):
                await stop.wait()
            if self._pending and not stop.is_set():
                try:
                    await self.write()
                except StorageError as exc:  # transient: the next tick (or close) tries again
                    logger.warning("could not write a record segment: %s", exc)
