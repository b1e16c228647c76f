"""The pending queue: a FIFO of snapshotted dumps bounded by bytes and by items.

Producers are coroutines on the tracker's event loop (``await tracker.dump``) *or* plain threads
(the sync shim, which must not pay an event-loop round trip per dump), so the state lives behind
one ``threading.Lock``. Consumers are the upload workers, always on the loop.

"Pending" counts a dump from admission until its upload finished (queued + in flight), so the
byte budget bounds the memory held by snapshots. One item larger than the whole budget is
admitted alone, when nothing else is pending: it could never fit otherwise.
"""

from __future__ import annotations

import asyncio
import enum
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trajtrack._exceptions import QueueFullError, TrackerClosedError

__all__ = ["FullPolicy", "Job", "PendingQueue"]


class FullPolicy(str, enum.Enum):
    """What ``dump()`` does when the pending queue is full."""

    BLOCK = "block"
    """Wait for space (the default; honours the dump's timeout)."""
    DROP_NEWEST = "drop_newest"
    """Discard the new dump (its handle raises :class:`DumpDroppedError`)."""
    DROP_OLDEST = "drop_oldest"
    """Discard the oldest dumps still waiting in the queue to make room."""
    RAISE = "raise"
    """Raise :class:`QueueFullError` from ``dump()``."""


@dataclass(eq=False)
class Job:
    """One admitted dump travelling from the queue to the storage."""

    name: str
    path: str
    payload: Any
    nbytes: int
    future: Any  # DumpFuture (tracker/_future.py)
    enqueued_at: float = field(default_factory=time.monotonic)
    who: Any = None  # WriterIdentity of the process that made the dump, when not this one
    spooled: bool = False  # in a shard being made: its item slot is free, its bytes are not


class PendingQueue:
    """Thread-safe bounded FIFO; see the module docstring."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        max_bytes: int,
        max_items: int,
        on_drop: Callable[[Job, str], None],
    ) -> None:
        self._loop = loop
        # Made on the loop's thread (the runner starts on its loop). Comparing thread ids is
        # how _in_loop() tells; asyncio.get_running_loop() makes a getpid() system call each
        # time on Python 3.11 (its fork check), and _in_loop() runs twice a dump.
        self._loop_thread = threading.get_ident()
        self._max_bytes = max_bytes
        self._max_items = max_items
        self._on_drop = on_drop
        self._lock = threading.Lock()
        self._space = threading.Condition(self._lock)  # thread producers wait here
        self._jobs: deque[Job] = deque()
        self._pending_bytes = 0
        self._pending_items = 0
        self._closed = False
        self._closed_error: Callable[[], Exception] = _closed_error
        self._idle = 0  # workers waiting in get()
        self._loop_waiters = 0  # producers waiting in put() for space
        self._wake_scheduled = False  # a cross-thread wake-up is on its way to the loop
        self._space_wake_scheduled = False  # the same, for producers waiting for space
        # Loop-side wake-ups; replaced after each set so that waiters see fresh events.
        self._nonempty = asyncio.Event()
        self._space_freed = asyncio.Event()

    # ------------------------------------------------------------------ state

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    @property
    def pending_items(self) -> int:
        return self._pending_items

    @property
    def queued_items(self) -> int:
        return len(self._jobs)

    def _fits(self, nbytes: int) -> bool:
        if self._pending_items == 0 and self._pending_bytes == 0:
            return True  # the oversize rule: alone, anything fits
        return (
            self._pending_items < self._max_items
            and self._pending_bytes + nbytes <= self._max_bytes
        )

    def _admit_locked(self, job: Job) -> None:
        self._jobs.append(job)
        self._pending_bytes += job.nbytes
        self._pending_items += 1

    def _make_room_locked(self, nbytes: int) -> list[Job]:
        dropped: list[Job] = []
        while not self._fits(nbytes) and self._jobs:
            old = self._jobs.popleft()
            self._pending_bytes -= old.nbytes
            self._pending_items -= 1
            dropped.append(old)
        return dropped

    # ------------------------------------------------------------------ producers

    def offer(self, job: Job, policy: FullPolicy) -> bool:
        """Admit *job* without waiting. False means: full, and the policy says wait.

        Callable from any thread. ``drop_newest`` reports the drop and returns True (handled);
        ``raise`` raises :class:`QueueFullError`. Callbacks run outside the lock.
        """
        dropped: list[Job] = []
        outcome = "admitted"
        with self._lock:
            if self._closed:
                raise self._closed_error()
            if not self._fits(job.nbytes):
                if policy is FullPolicy.DROP_OLDEST:
                    dropped = self._make_room_locked(job.nbytes)
                if not self._fits(job.nbytes):
                    outcome = {FullPolicy.RAISE: "raise", FullPolicy.DROP_NEWEST: "drop"}.get(
                        policy, "wait"
                    )
            if outcome == "admitted":
                self._admit_locked(job)
        for old in dropped:
            self._on_drop(old, "drop_oldest")
        if dropped:
            self._wake_space_waiters()
        if outcome == "wait":
            return False
        if outcome == "raise":
            raise QueueFullError(self._full_message(job))
        if outcome == "drop":
            self._on_drop(job, "drop_newest")
        else:
            self._wake_workers()
        return True

    def _full_message(self, job: Job) -> str:
        return (
            f"cannot dump {job.name!r}: {self._pending_items} dumps / {self._pending_bytes} bytes "
            f"pending (limits {self._max_items} / {self._max_bytes})"
        )

    async def put(self, job: Job, policy: FullPolicy, deadline: float | None) -> None:
        """Admit *job*, waiting on the loop for space under ``block``/``drop_oldest``."""
        if self.offer(job, policy):
            return
        while True:
            # Registered (with the event to wait for) before trying again, under the lock that
            # done() takes: a job that ends from now on sees a waiter and wakes it.
            with self._lock:
                self._loop_waiters += 1
                event = self._space_freed
            try:
                if self.offer(job, policy):
                    return
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(self._full_message(job))
                try:
                    await asyncio.wait_for(event.wait(), remaining)
                except asyncio.TimeoutError:
                    raise TimeoutError(self._full_message(job)) from None
            finally:
                with self._lock:
                    self._loop_waiters -= 1

    def put_blocking(self, job: Job, policy: FullPolicy, deadline: float | None) -> None:
        """Admit *job* from a foreign thread, waiting on a condition for space."""
        while not self.offer(job, policy):
            with self._lock:
                if self._fits(job.nbytes) or self._closed:
                    continue
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(self._full_message(job))
                self._space.wait(remaining)

    # ------------------------------------------------------------------ consumers (loop)

    async def get(self) -> Job | None:
        """Next job, waiting; ``None`` once the queue is closed and empty."""
        while True:
            with self._lock:
                if self._jobs:
                    return self._jobs.popleft()
                if self._closed:
                    return None
                event = self._nonempty
                self._idle += 1  # producers wake the loop only when a worker waits
            try:
                await event.wait()
            finally:
                with self._lock:
                    self._idle -= 1

    def done(self, job: Job) -> None:
        """Release *job*'s share of the budget (its upload ended, either way)."""
        with self._lock:
            self._pending_bytes -= job.nbytes
            if not job.spooled:
                self._pending_items -= 1
        self._wake_space_waiters()

    def spooled(self, jobs: list[Job]) -> None:
        """*jobs* are in a shard being made: free their item slots, keep their bytes counted.

        A shard collects thousands of small dumps before it is sealed; the item budget bounds
        the snapshots waiting in memory, the byte budget everything not yet committed.
        """
        with self._lock:
            for job in jobs:
                if not job.spooled:
                    job.spooled = True
                    self._pending_items -= 1
        self._wake_space_waiters()

    async def get_batch(self, max_items: int, max_bytes: int) -> list[Job]:
        """The next job, waiting, plus what is already queued behind it, within the limits.

        Empty once the queue is closed and empty. A batch never waits for more jobs: it takes
        what is there (one thread hop for many small dumps).
        """
        first = await self.get()
        if first is None:
            return []
        batch = [first]
        nbytes = first.nbytes
        with self._lock:
            while (
                self._jobs and len(batch) < max_items and nbytes + self._jobs[0].nbytes <= max_bytes
            ):
                job = self._jobs.popleft()
                batch.append(job)
                nbytes += job.nbytes
        return batch

    def drain_queued(self) -> list[Job]:
        """Remove and return every job still waiting (used when closing times out)."""
        with self._lock:
            jobs = list(self._jobs)
            self._jobs.clear()
            for job in jobs:
                self._pending_bytes -= job.nbytes
                self._pending_items -= 1
        self._wake_space_waiters()
        return jobs

    def close(self, error: Callable[[], Exception] | None = None) -> None:
        """Refuse new jobs; workers finish what is queued, then ``get`` returns ``None``.

        Args:
            error: Makes the exception that refused producers get (default: the tracker is
                closed). Producers waiting for space are woken to get it.
        """
        with self._lock:
            self._closed = True
            if error is not None:
                self._closed_error = error
            self._space.notify_all()
        self._wake_workers(force=True)
        self._wake_space_waiters()

    # ------------------------------------------------------------------ wake-ups

    def _in_loop(self) -> bool:
        return threading.get_ident() == self._loop_thread and not self._loop.is_closed()

    def _wake_workers(self, *, force: bool = False) -> None:
        # Waking the loop from another thread writes to its self-pipe, a syscall that releases
        # the GIL: the producer may then wait a switch interval to get it back. So wake only
        # when a worker actually waits, and at most once until the wake-up has run; busy
        # workers find new jobs when they come back to get().
        in_loop = self._in_loop()
        with self._lock:
            if not force and (self._idle == 0 or self._wake_scheduled):
                return
            if not in_loop:
                self._wake_scheduled = True
        if in_loop:
            self._set_nonempty()
            return
        try:
            self._loop.call_soon_threadsafe(self._set_nonempty)
        except RuntimeError:  # the loop is closed: nobody left to wake
            with self._lock:
                self._wake_scheduled = False

    def _set_nonempty(self) -> None:
        with self._lock:
            self._wake_scheduled = False
        event, self._nonempty = self._nonempty, asyncio.Event()
        event.set()

    def _wake_space_waiters(self) -> None:
        with self._lock:
            self._space.notify_all()
            if self._loop_waiters == 0:
                # Nobody waits on the loop: no wake-up (from a writer thread, each one is a
                # write to the loop's self-pipe, per finished dump).
                return
        if self._in_loop():
            self._set_space_freed()
            return
        with self._lock:
            # A wake-up on its way sets the event current when it runs, which every waiter
            # registered until then holds: one per batch of finished dumps, not one each.
            if self._space_wake_scheduled:
                return
            self._space_wake_scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._set_space_freed)
        except RuntimeError:  # the loop is closed: nobody left to wake
            with self._lock:
                self._space_wake_scheduled = False

    def _set_space_freed(self) -> None:
        with self._lock:
            self._space_wake_scheduled = False
        event, self._space_freed = self._space_freed, asyncio.Event()
        event.set()


def _closed_error() -> Exception:
    return TrackerClosedError("cannot dump: the tracker is closed")
