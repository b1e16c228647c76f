"""Waiting with a bound: helpers for the tracker's waits, none of which may hang forever."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from typing import Any

from trajtrack._exceptions import TrajtrackError
from trajtrack.tracker._future import DumpFuture, on_loop

__all__ = ["finished_within", "retrieve", "wait_all"]

logger = logging.getLogger(__name__)


def retrieve(task: asyncio.Task[None]) -> None:
    # The supervisor reports every failure itself; this only keeps asyncio from logging
    # "Task exception was never retrieved" for one that went on (a cancellation).
    if not task.cancelled():
        task.exception()


async def finished_within(
    work: Coroutine[Any, Any, None] | asyncio.Future[None],
    seconds: float | None,
    *,
    abandon: bool = False,
) -> bool:
    """Run *work* (a coroutine, or a task already running) for at most *seconds* (``None``: no
    limit); whether it finished in time (its error is raised).

    Past the limit it is cancelled without waiting for it (that takes effect when a blocked
    thread of it returns, if ever) -- or, with *abandon*, left to run to its end: for work
    that must not be cut off halfway (a shard's upload settles its dumps when it returns), or
    that others wait for too. If the caller is cancelled, so is *work* (unless *abandon*).
    A failure of work that was given up on is logged, not lost.
    """
    task = asyncio.ensure_future(work)
    try:
        done, _ = await asyncio.wait({task}, timeout=seconds)
    except BaseException:
        _give_up(task, abandon)
        raise
    if not done:
        _give_up(task, abandon)
        return False
    task.result()  # re-raise its error
    return True


def _give_up(task: asyncio.Future[None], abandon: bool) -> None:
    if not abandon:
        task.cancel()
    task.add_done_callback(_log_late_failure)


def _log_late_failure(task: asyncio.Future[None]) -> None:
    if task.cancelled():
        return
    error = task.exception()
    if error is not None and not isinstance(error, TrajtrackError | TimeoutError):
        logger.error("work abandoned past its deadline failed later: %r", error, exc_info=error)
    elif error is not None:
        logger.warning("work abandoned past its deadline failed later: %s", error)


async def wait_all(futures: list[DumpFuture]) -> None:
    """Wait for thread-safe futures without wrapping (and so never cancelling) each one."""
    pending = [f for f in futures if not f.done()]
    if not pending:
        return
    loop = asyncio.get_running_loop()
    here = threading.get_ident()
    all_done = asyncio.Event()
    left = [len(pending)]
    lock = threading.Lock()

    def one_done(_future: object) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            on_loop(loop, here, all_done.set)

    for future in pending:
        future.add_done_callback(one_done)
    await all_done.wait()
