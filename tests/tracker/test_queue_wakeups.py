"""The pending queue wakes the event loop once for many jobs ended in a writer thread."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from trajtrack.tracker._queue import FullPolicy, Job, PendingQueue


def _job(i: int) -> Job:
    return Job(name=f"d{i}", path=f"d{i}.pth", payload=None, nbytes=10, future=None)


async def test_jobs_ended_in_a_thread_wake_a_waiting_producer_once() -> None:
    loop = asyncio.get_running_loop()
    queue = PendingQueue(loop, max_bytes=1 << 20, max_items=20, on_drop=lambda job, why: None)
    admitted = [_job(i) for i in range(20)]
    for job in admitted:
        assert queue.offer(job, FullPolicy.BLOCK)
    waiting = asyncio.ensure_future(queue.put(_job(20), FullPolicy.BLOCK, None))
    for _ in range(1000):  # until the producer waits for space
        if queue._loop_waiters:
            break
        await asyncio.sleep(0)
    assert queue._loop_waiters == 1
    wakes: list[Any] = []
    real = loop.call_soon_threadsafe

    def counting(callback: Any, *args: Any, **kwargs: Any) -> Any:
        wakes.append(callback)
        return real(callback, *args, **kwargs)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    try:
        # Twenty jobs end in a writer thread while the loop is busy (blocked here on purpose).
        writer = threading.Thread(target=lambda: [queue.done(job) for job in admitted])
        writer.start()
        writer.join()
        assert len(wakes) == 1  # one wake-up on its way, not one per job
        await asyncio.wait_for(waiting, 10)  # and it reaches the producer
        assert queue.pending_items == 1
        assert not queue._space_wake_scheduled  # the next job ended wakes again
    finally:
        del loop.call_soon_threadsafe
