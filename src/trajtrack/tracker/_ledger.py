"""The ledger: every admitted dump until it is settled, and the counters behind statistics().

Each dump's handle wraps a thread-safe future. The ledger keeps the futures still unsettled
(what ``flush()`` waits for), settles them with a record or an error, counts what happened, and
keeps the first failure since the last ``flush()`` for it to raise. Producers are coroutines on
the tracker's loop *and* plain threads (the sync shim), so the state lives behind one lock.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from trajtrack._exceptions import DumpDroppedError, TrajtrackError
from trajtrack.layouts.records import DumpRecord
from trajtrack.tracker._future import DumpFuture
from trajtrack.tracker._handle import DumpHandle
from trajtrack.tracker._queue import Job

__all__ = ["Counters", "Ledger", "add_note"]

logger = logging.getLogger(__name__)


@dataclass
class Counters:
    """Mutable counters, updated from the loop and from producer threads (under ``lock``)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    enqueued: int = 0
    committed: int = 0
    failed: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    retries: int = 0
    bytes_written: int = 0
    records_written: int = 0
    latencies: deque[float] = field(default_factory=lambda: deque(maxlen=1024))

    def percentile(self, q: float) -> float | None:
        with self.lock:
            values = sorted(self.latencies)
        if not values:
            return None
        return values[min(len(values) - 1, int(q * len(values)))]


class Ledger:
    """The unsettled dumps of one tracker, their outcomes, and the failure to re-raise.

    Args:
        destination: For log messages.
    """

    def __init__(self, destination: str) -> None:
        self._destination = destination
        self.counters = Counters()
        self._outstanding: dict[DumpFuture, Job] = {}
        self._failure: BaseException | None = None
        self._failure_count = 0

    def admitted(self, job: Job) -> DumpHandle:
        """Count *job* in and return its handle."""
        with self.counters.lock:
            self.counters.enqueued += 1
            if not job.future.done():  # a drop_newest job is already settled
                self._outstanding[job.future] = job
        return DumpHandle(job.name, job.path, job.future)

    def outstanding(self) -> list[Job]:
        """Every dump admitted and not yet settled."""
        with self.counters.lock:
            return list(self._outstanding.values())

    def committed(self, job: Job, record: DumpRecord, latency: float) -> None:
        """*job* is committed as *record*, *latency* seconds after it was admitted."""
        with self.counters.lock:
            self.counters.committed += 1
            self.counters.bytes_written += record.size
            self.counters.latencies.append(latency)
        self.settle(job.future, record=record)

    def failed(self, job: Job, exc: BaseException) -> None:
        """*job* failed with *exc*: counted, logged, kept for the next ``flush()``."""
        # A typed error says what went wrong in its message (a name refused by on_exists, a
        # storage error): one line. A traceback only for the unexpected (at debug, always).
        expected = isinstance(exc, TrajtrackError)
        logger.error(
            "dump %r to %s failed: %s",
            job.name,
            self._destination,
            exc,
            exc_info=None if expected else exc,
        )
        if expected:
            logger.debug("dump %r failed here", job.name, exc_info=exc)
        with self.counters.lock:
            self.counters.failed += 1
            self._failure_count += 1
            if self._failure is None:
                self._failure = exc
        self.settle(job.future, error=exc)

    def dropped(self, job: Job, reason: str) -> None:
        """*job* was discarded by a drop policy."""
        logger.warning("dropped dump %r (%s): the pending queue is full", job.name, reason)
        with self.counters.lock:
            self.counters.dropped[reason] += 1
        self.settle(job.future, error=DumpDroppedError(f"dump {job.name!r} was dropped ({reason})"))

    def retried(self) -> None:
        with self.counters.lock:
            self.counters.retries += 1

    def settle(
        self,
        future: DumpFuture,
        *,
        record: DumpRecord | None = None,
        error: BaseException | None = None,
    ) -> None:
        """Resolve one dump's future (once; later calls are ignored)."""
        with self.counters.lock:
            self._outstanding.pop(future, None)
        future.settle(record, error)

    def settle_all(self, make_error: Callable[[], BaseException]) -> int:
        """Fail every unsettled dump with an error from *make_error*; returns how many."""
        with self.counters.lock:
            futures, self._outstanding = self._outstanding, {}
        for future in futures:
            if not future.done():
                future.settle(error=make_error())
        return len(futures)

    def take_failure(self) -> BaseException | None:
        """The first failure since the last call (noting how many more), then forget it."""
        with self.counters.lock:
            failure, count = self._failure, self._failure_count
            self._failure, self._failure_count = None, 0
        if failure is not None and count > 1:
            add_note(failure, f"trajtrack: {count - 1} more dumps failed since the last flush")
        return failure


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note`` where Python has it (3.11+)."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
