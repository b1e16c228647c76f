"""Counters behind ``Tracker.statistics()``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trajtrack.tracker._ledger import Counters
    from trajtrack.tracker._queue import PendingQueue

__all__ = ["TrackerStatistics", "statistics_of"]


@dataclass(frozen=True, slots=True)
class TrackerStatistics:
    """A snapshot of a tracker's counters.

    Attributes:
        pending_items: Dumps admitted and not yet finished (queued + uploading).
        pending_bytes: Their snapshot bytes (what the memory budget bounds).
        queued_items: Dumps waiting for an upload worker.
        enqueued: Dumps admitted since start.
        committed: Dumps written and published under their final name.
        failed: Dumps that ended with an error.
        dropped: Dumps discarded, by reason (``drop_newest``, ``drop_oldest``, ``closed``).
        retries: Storage retries after transient failures.
        bytes_written: Bytes of committed dumps.
        records_written: Record segments written.
        commit_latency_p50: Median seconds from admission to commit (last 1024 dumps).
        commit_latency_p99: 99th percentile of the same.
        state: The tracker's lifecycle state (``"running"``, ``"failed"``, ...).
        failure: Why the tracker failed (its background task's error), when it did.
    """

    pending_items: int
    pending_bytes: int
    queued_items: int
    enqueued: int
    committed: int
    failed: int
    dropped: dict[str, int]
    retries: int
    bytes_written: int
    records_written: int
    commit_latency_p50: float | None
    commit_latency_p99: float | None
    state: str = "running"
    failure: str | None = None

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())


def statistics_of(
    queue: PendingQueue | None, counters: Counters, state: str, failure: str | None
) -> TrackerStatistics:
    """A :class:`TrackerStatistics` of a tracker's queue and counters, now."""
    p50, p99 = counters.percentile(0.5), counters.percentile(0.99)
    with counters.lock:
        return TrackerStatistics(
            pending_items=queue.pending_items if queue else 0,
            pending_bytes=queue.pending_bytes if queue else 0,
            queued_items=queue.queued_items if queue else 0,
            enqueued=counters.enqueued,
            committed=counters.committed,
            failed=counters.failed,
            dropped=dict(counters.dropped),
            retries=counters.retries,
            bytes_written=counters.bytes_written,
            records_written=counters.records_written,
            commit_latency_p50=p50,
            commit_latency_p99=p99,
            state=state,
            failure=failure,
        )
