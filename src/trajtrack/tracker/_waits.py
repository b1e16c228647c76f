"""Waiting with a bound: helpers for the tracker's waits, none of which may hang forever."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any

from trajtrack.tracker._future import DumpFuture, on_loop

__all__ = ["finished_within", "retrieve", "wait_all"]


def retrieve(task: asyncio.Task[None]) -> None:
    # The supervisor reports every failure itself; this only keeps asyncio from logging
    # "Task exception was never retrieved" for one that went on (a cancellation).
    if not task.cancelled():
        task.exception()


async def finished_within(coro: Coroutine[Any, Any, None], seconds: float) -> bool:
    """Run *coro* for at most *seconds*; past that, cancel it without waiting for it."""
    task = asyncio.ensure_future(coro)
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if not done:
        task.cancel()  # takes effect when its blocked thread returns, if ever
        return False
    task.result()  # re-raise its error
    return True


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
