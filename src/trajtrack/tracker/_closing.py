"""The last steps of closing a tracker, each bounded: seal, record, release the storage.

A storage that hangs must not hang ``close()``: ``fail_after`` cannot interrupt a blocking call
in a worker thread, so each step is abandoned (not awaited) past its budget, and logged.
"""

from __future__ import annotations

import logging
import time

import anyio

from trajtrack.backends import Storage
from trajtrack.tracker._recorder import Recorder
from trajtrack.tracker._waits import finished_within
from trajtrack.tracker._worker import Layout

__all__ = ["GRACE", "close_bound", "final_steps", "not_written", "release", "when"]

logger = logging.getLogger(__name__)

#: Seconds close() still gives cancelled workers, the final record and the storage's aclose
#: once its budget is spent (each bounded: a hanging storage costs at most 3 x this).
GRACE = 1.0


def close_bound(timeout: float | None) -> float:
    """How long a cancelled close still waits for its work: the drain's budget (when it has
    one), then at most one grace period for the workers and for each final step (a few more
    for the steps' own overheads)."""
    return (0.0 if timeout is None else timeout) + 8 * GRACE


async def final_steps(
    url: str,
    recorder: Recorder,
    layout: Layout,
    storage: Storage | None,
    deadline: float | None,
    *,
    seal: bool,
) -> None:
    """Seal the open shard (with *seal*; else discard the spool), write the final record
    segment, release *storage*; each within what is left of *deadline* (at least
    :data:`GRACE`; 30 s each without one)."""
    left = 30.0 if deadline is None else max(GRACE, deadline - time.monotonic())
    steps = [(recorder.write, "write the final record segment")]
    if seal:
        steps.insert(0, (layout.seal, "seal the last shard"))
    else:  # the drain gave up (or the tracker failed): those dumps already failed
        await anyio.to_thread.run_sync(layout.discard)  # unlinks spool files
    for step, what in steps:
        try:
            if not await finished_within(step(), left):
                logger.error("could not %s of %s in time", what, url)
        except Exception as exc:
            logger.error("could not %s of %s: %s", what, url, exc)
    if storage is not None:
        await release(url, storage, 30.0 if deadline is None else GRACE)
    logger.debug("tracker closed: %s", url)


async def release(url: str, storage: Storage, seconds: float = 30.0) -> None:
    """Close *storage*, abandoning the wait past *seconds* (it is logged)."""
    try:
        if not await finished_within(storage.aclose(), seconds):
            logger.error("closing the storage of %s did not finish in time", url)
    except Exception as exc:
        logger.error("closing the storage of %s failed: %s", url, exc)


def when(timeout: float | None) -> str:
    """Why dumps were not written: the drain's budget ran out, or the close was cut short."""
    # Without a budget, a drain ends unfinished only when a cancelled close cut it short.
    return "before the close was cancelled" if timeout is None else f"within {timeout} s"


def not_written() -> TimeoutError:
    return TimeoutError("not written before the close deadline")
