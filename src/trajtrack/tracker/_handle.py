"""Dump handles: what ``dump()`` returns, resolving to the committed record or the dump's error."""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import anyio

from trajtrack.layouts.records import DumpRecord
from trajtrack.tracker._future import DumpFuture, outcome_of

__all__ = ["DumpHandle"]


class DumpHandle:
    """The outcome of one dump, usable from async and sync code.

    ``await handle`` (or ``await handle.wait(timeout)``) gives the :class:`DumpRecord` once the
    dump is committed, or raises its error (a :class:`StorageError`, :class:`DumpDroppedError`,
    ...). From threads, ``handle.result(timeout)`` does the same. Cancelling an ``await`` of the
    handle does not cancel the dump.
    """

    __slots__ = ("_future", "name", "path")

    def __init__(self, name: str, path: str, future: DumpFuture) -> None:
        self.name = name
        self.path = path
        self._future = future

    def done(self) -> bool:
        """True once the dump is committed, failed or dropped."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> DumpRecord:
        """Block the calling thread until the outcome; raises ``TimeoutError`` after *timeout*."""
        try:
            return self._future.result(timeout)
        except TimeoutError:
            raise TimeoutError(f"dump {self.name!r} not finished after {timeout} s") from None

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The dump's error (``None`` when committed), waiting like :meth:`result`."""
        try:
            return self._future.exception(timeout)
        except TimeoutError:
            raise TimeoutError(f"dump {self.name!r} not finished after {timeout} s") from None

    def add_done_callback(self, callback: Callable[[DumpHandle], Any]) -> None:
        """Call ``callback(handle)`` when the outcome is known (in whichever thread sets it)."""
        self._future.add_done_callback(lambda _f: callback(self))

    async def wait(self, timeout: float | None = None) -> DumpRecord:
        """Await the outcome, raising ``TimeoutError`` after *timeout* seconds."""
        with anyio.fail_after(timeout):
            return await self

    def __await__(self) -> Generator[Any, None, DumpRecord]:
        # A caller cancelling its await cancels only its own wait, never the dump.
        return outcome_of(self._future).__await__()

    def __repr__(self) -> str:
        state = "pending"
        if self._future.done():
            state = "failed" if self._future.exception() else "committed"
        return f"<DumpHandle {self.name!r} {state}>"
