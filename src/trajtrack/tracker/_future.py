"""A dump's outcome: a small thread-safe future that its :class:`DumpHandle` resolves through.

Why not :class:`concurrent.futures.Future`: each one carries a ``Condition`` with its
``RLock``, a deque, two lists and five bound methods -- eleven objects the garbage collector
tracks, made and kept for every dump until it is committed. With shards, thousands of dumps
wait for their shard at once, and most of the tracked objects of a pending dump would be its
future's. They survive the young generations, so every few thousand dumps the collector runs
a full collection of the process's heap -- in a process that imported torch, a long pause of
the caller's thread (``benchmarks/bench_shards.py``: the shards layout's rate and ``await
dump`` p50 for 4 KB dumps).

:class:`DumpFuture` keeps its state in three slots. All futures share one lock, held for a few
instructions per change of state; a thread that waits gets a :class:`threading.Event` made
then, and callbacks a list made then. The API is the part of ``concurrent.futures.Future``
that the tracker uses, with :meth:`~DumpFuture.settle` for ``set_result``/``set_exception``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any, Final

from trajtrack.layouts.records import DumpRecord

__all__ = ["DumpFuture", "on_loop", "outcome_of"]

logger = logging.getLogger(__name__)

_LOCK: Final = threading.Lock()
_PENDING: Final = object()


class DumpFuture:
    """One dump's outcome: a :class:`DumpRecord`, or its error. Thread-safe."""

    __slots__ = ("_callbacks", "_event", "_outcome")

    def __init__(self) -> None:
        self._outcome: Any = _PENDING  # the record, or the error
        self._callbacks: list[Callable[[DumpFuture], Any]] | None = None
        self._event: threading.Event | None = None

    def done(self) -> bool:
        """True once settled."""
        return self._outcome is not _PENDING

    def settle(self, record: DumpRecord | None = None, error: BaseException | None = None) -> bool:
        """Resolve to *error*, else *record*; False (and nothing changes) if already done.
        Callbacks run here, in the calling thread."""
        with _LOCK:
            if self._outcome is not _PENDING:
                return False
            self._outcome = error if error is not None else record
            callbacks, self._callbacks = self._callbacks, None
            event = self._event
        if event is not None:
            event.set()
        for callback in callbacks or ():
            _call(callback, self)
        return True

    def add_done_callback(self, callback: Callable[[DumpFuture], Any]) -> None:
        """Call ``callback(future)`` once done: now if it is, else in the settling thread."""
        with _LOCK:
            if self._outcome is _PENDING:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(callback)
                return
        _call(callback, self)

    def result(self, timeout: float | None = None) -> DumpRecord:
        """The record, waiting up to *timeout* seconds; raises the dump's error."""
        outcome = self._wait(timeout)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome  # type: ignore[no-any-return]

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The dump's error (None when committed), waiting like :meth:`result`."""
        outcome = self._wait(timeout)
        return outcome if isinstance(outcome, BaseException) else None

    def _wait(self, timeout: float | None) -> Any:
        outcome = self._outcome
        if outcome is not _PENDING:
            return outcome
        with _LOCK:
            if self._outcome is not _PENDING:
                return self._outcome
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        if not event.wait(timeout):
            raise TimeoutError(f"not done after {timeout} s")
        return self._outcome


async def outcome_of(future: DumpFuture) -> DumpRecord:
    """Await *future* from a coroutine (settled from any thread). Cancelling this await
    leaves the future as it is."""
    if not future.done():
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        here = threading.get_ident()
        future.add_done_callback(lambda _f: on_loop(loop, here, lambda: _wake(waiter)))
        await waiter
    return future.result()


def on_loop(loop: asyncio.AbstractEventLoop, thread: int, callback: Callable[[], None]) -> None:
    """Run *callback* on *loop*, whose thread is *thread*: at once when called there, else
    scheduled from this thread; not at all once the loop is closed (nobody waits any more)."""
    if threading.get_ident() == thread:
        callback()
    elif not loop.is_closed():
        with contextlib.suppress(RuntimeError):  # closed meanwhile
            loop.call_soon_threadsafe(callback)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _call(callback: Callable[[DumpFuture], Any], future: DumpFuture) -> None:
    try:
        callback(future)
    except Exception:  # as concurrent.futures does: one bad callback does not stop the rest
        logger.exception("exception calling callback for %r", future)
