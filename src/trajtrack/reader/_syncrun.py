"""A blocking facade over :class:`~trajtrack.reader._run.Run`, for synchronous code."""

from __future__ import annotations

import builtins
import concurrent.futures
import os
import weakref
from collections.abc import Awaitable, Callable, Iterable, Iterator
from types import TracebackType
from typing import Any, TypeVar

from anyio.from_thread import BlockingPortal

from trajtrack._loop_thread import LoopThread
from trajtrack.reader._dumps import DumpInfo, RunListing
from trajtrack.reader._replay import Replay
from trajtrack.reader._run import Run
from trajtrack.rollout import STEP_MANIFEST

__all__ = ["CLOSE_TIMEOUT", "SyncRun"]

R = TypeVar("R")

CLOSE_TIMEOUT = 30.0
"""Seconds :meth:`SyncRun.close` waits for the storage to close before it gives up on it."""


class SyncRun:
    """A blocking facade over :class:`Run`, for synchronous code.

    ``with SyncRun(url) as run: run.list(); run.load(name)``. It runs the async reader in an
    event loop on a daemon thread of its own (an anyio blocking portal). A facade that is
    never closed (a script that raised) holds up nothing: at interpreter exit, or when it is
    garbage-collected, its storage is closed within :data:`CLOSE_TIMEOUT` seconds and its
    thread stops.
    """

    def __init__(self, url: str | os.PathLike[str], **options: Any) -> None:
        self._loop = LoopThread("trajtrack-reader")
        self._portal: BlockingPortal = self._loop.portal
        try:
            self._run: Run = self._portal.call(_make_run, os.fspath(url), options)
        except BaseException:
            self._loop.stop(CLOSE_TIMEOUT)
            raise
        # Not a method of self (the finalizer must not keep the facade alive); also runs at
        # exit (atexit), while the loop's thread still runs.
        self._closer = weakref.finalize(self, _close, self._loop, self._run)

    @property
    def run(self) -> Run:
        """The async :class:`Run` behind this facade."""
        return self._run

    def call(self, fn: Callable[..., Awaitable[R]], *args: Any) -> R:
        """Run ``await fn(*args)`` on the reader's event loop and return its result."""
        return self._portal.call(fn, *args)

    def scan(self, *, refresh: bool = False) -> RunListing:
        """See :meth:`Run.scan`."""
        listing: RunListing = self._portal.call(lambda: self._run.scan(refresh=refresh))
        return listing

    def list(self, glob: str | None = None, *, refresh: bool = False) -> builtins.list[DumpInfo]:
        """See :meth:`Run.list`."""
        return self._portal.call(lambda: self._run.list(glob, refresh=refresh))

    def info(self, name: str) -> DumpInfo:
        """See :meth:`Run.info`."""
        info: DumpInfo = self._portal.call(self._run.info, name)
        return info

    def read_bytes(self, name: str | DumpInfo) -> bytes:
        """See :meth:`Run.read_bytes`."""
        data: bytes = self._portal.call(self._run.read_bytes, name)
        return data

    def load(self, name: str | DumpInfo, *, unsafe: bool = False) -> Any:
        """See :meth:`Run.load`. The dump is deserialized in this thread (it waits anyway)."""
        load = self._portal.call(lambda: self._run.loader(name, unsafe=unsafe))
        return load()

    def replay(
        self,
        pattern: str,
        *,
        steps: Iterable[int] | None = None,
        prefetch: int = 2,
        manifest: str | None = STEP_MANIFEST,
        unsafe: bool = False,
    ) -> Iterator[tuple[int, builtins.list[Any]]]:
        """See :meth:`Run.replay`: ``for step, objects in run.replay("step{step}/sample{i}")``.

        The loads ahead stop when the loop ends or is left (``break`` closes the generator).
        """
        replay = self._run.replay(  # a bad pattern fails here, not at the first step
            pattern, steps=steps, prefetch=prefetch, manifest=manifest, unsafe=unsafe
        )
        return self._replayed(replay)

    def _replayed(self, replay: Replay) -> Iterator[tuple[int, builtins.list[Any]]]:
        block = self._portal.wrap_async_context_manager(replay)
        entered = block.__enter__()
        try:
            while (item := self._portal.call(_next_step, entered)) is not None:
                yield item
        finally:
            # Not 'with': a GeneratorExit (a loop left early) must not reach the portal's loop;
            # the block ends as if it ran out (a load error has been raised to the caller).
            block.__exit__(None, None, None)

    def __iter__(self) -> Iterator[tuple[DumpInfo, Any]]:
        for info in self.list():
            if info.present:
                yield info, self.load(info)

    def close(self) -> None:
        """Close the storage and stop the background event loop; idempotent.

        Raises:
            TimeoutError: Closing took over :data:`CLOSE_TIMEOUT` seconds (the loop is stopped
                anyway).
        """
        self._closer()

    def __enter__(self) -> SyncRun:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


async def _next_step(replay: Replay) -> tuple[int, builtins.list[Any]] | None:
    try:
        return await replay.__anext__()
    except StopAsyncIteration:
        return None


async def _make_run(url: str, options: dict[str, Any]) -> Run:
    # Opened on the portal's loop (the storage itself in a worker thread), so a backend that
    # binds to the running loop binds there.
    return await Run(url, **options).open()


def _close(loop: LoopThread, run: Run) -> None:
    """Close *run* on *loop* within :data:`CLOSE_TIMEOUT`, then stop the loop."""
    try:
        future = loop.portal.start_task_soon(run.aclose)
        try:
            future.result(timeout=CLOSE_TIMEOUT)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(
                f"closing the run {run.url}: the storage did not close within {CLOSE_TIMEOUT:g} s"
            ) from None
    finally:
        loop.stop(CLOSE_TIMEOUT)
