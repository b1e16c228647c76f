"""The tracker actor: one asyncio :class:`~trajtrack.Tracker` living in an async Ray actor.

Callers snapshot (serialize) in their own process and send the bytes; the actor queues them on
its tracker without re-serializing, and the tracker's upload workers write them from the
actor's event loop (not one Ray task per file, as verl's original did). Every method is a
coroutine, so Ray runs them all on the actor's single event loop, the one the tracker was
started on.
"""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from typing import Any

from trajtrack._exceptions import TrackerClosedError
from trajtrack._names import WriterIdentity
from trajtrack._stats import TrackerStatistics
from trajtrack._tracker import Tracker, TrackerState

__all__ = ["TrackerActor"]


class TrackerActor:
    """The body of the named, detached tracker actor (wrap it with ``ray.remote``).

    The tracker starts on the first call (an async actor has no event loop in ``__init__``);
    if starting fails (e.g. the destination is unusable) the call raises that error and the
    next call tries again with a fresh tracker.

    Args:
        destination: Where the tracker writes (a path or URL, as seen from the actor's node).
        options: Keyword arguments for :class:`~trajtrack.Tracker`.
    """

    def __init__(self, destination: str, options: dict[str, Any]) -> None:
        self._destination = destination
        self._options = dict(options)
        self._tracker: Tracker | None = None
        self._start_lock = asyncio.Lock()  # binds to the actor's loop on first use
        self._closed = False
        self._token = uuid.uuid4().hex  # tells one actor incarnation from another

    async def _running(self) -> Tracker:
        tracker = self._tracker
        if tracker is not None and tracker.state is TrackerState.RUNNING:
            return tracker
        if self._closed:
            raise TrackerClosedError("the trajtrack tracker actor is closed")
        async with self._start_lock:
            if self._tracker is None:
                fresh = Tracker(self._destination, **self._options)
                await fresh.start()  # on failure nothing is kept: the next call retries
                self._tracker = fresh
            return self._tracker

    async def ready(self) -> dict[str, Any]:
        """Start the tracker if needed; describe this actor (destination, pid, host, token)."""
        await self._running()
        return {
            "destination": self._destination,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "token": self._token,
        }

    async def dump(self, data: bytes, name: str, who: WriterIdentity) -> None:
        """Queue *data* (already serialized by the caller) as *name* for the writer *who*.

        Returns once the dump is admitted to the tracker's queue (it waits for space when the
        queue is full), so a later :meth:`flush` from any process covers it.
        """
        tracker = await self._running()
        await tracker._dump_serialized(data, name, who)

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until every dump the actor has received is written; re-raise a failure.

        The first failure since the previous flush is raised to whoever flushes first.
        """
        tracker = await self._running()
        await tracker.flush(timeout)

    async def wait_for_hdfs(self, timeout: float | None = None) -> None:
        """The original tracker's name for :meth:`flush`."""
        await self.flush(timeout)

    async def statistics(self) -> TrackerStatistics:
        """The tracker's counters (see :meth:`trajtrack.Tracker.statistics`)."""
        return (await self._running()).statistics()

    async def close(self, timeout: float | None = None) -> None:
        """Drain what is pending, write the record and stop accepting dumps; idempotent.

        The actor process stays until it is killed (``trajtrack.ray.shutdown`` does both).
        """
        self._closed = True
        async with self._start_lock:
            tracker = self._tracker
        if tracker is not None:
            await tracker.aclose(timeout)
