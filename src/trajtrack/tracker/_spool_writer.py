"""Shard spools written by a helper process, so that writing them takes no GIL from the caller.

Why: a worker thread that writes a spool needs the GIL back after its ``writev``, and on the
way in and out of the thread. While the caller's thread runs Python (an ``await dump`` loop),
every take waits out the switch interval (5 ms by default), and *while a thread waits for the
GIL*, each release of it by the caller's thread (every ``epoll`` of the event loop) wakes that
thread in vain: the hop lasts many switch intervals, every ``await dump`` during it pays for the
futile wake-ups, and even a thread that wakes only now and then raises the loop's p50
(``benchmarks/bench_shards.py``: the shards layout's ``await dump`` p50 and rate).

So the members laid out on the loop go to the helper of
:mod:`~trajtrack.backends._writer_process` (the one a local storage uses for small files; a
process of its own here, without a staging arena): the spool file's descriptor and the bytes
go over its socket from the loop (non-blocking ``sendmsg``), the helper ``pwrite``\\ s them at
the shard's offset and answers. Starting the helper blocks, so the first write starts it in a
thread. When the helper is not free, cannot start or is lost, the same members are written by
a thread, as before (from the same offset: whatever the helper wrote is overwritten); a write
the helper reports failed (a full disk) fails those dumps, typed, and the shard goes on
without them. ``TRAJTRACK_WRITER_PROCESS=0`` turns it off, as for local storage.
"""

from __future__ import annotations

import anyio
import anyio.to_thread

from trajtrack.backends._writer_frames import APPEND_MAX, Failure
from trajtrack.backends._writer_process import WriterProcess
from trajtrack.tracker._shard_spool import Shard

__all__ = ["SpoolWriter"]


class SpoolWriter:
    """Writes the members laid out in shards into their spool files (see the module docs).

    Args:
        enabled: False: every write goes through a worker thread.
    """

    def __init__(self, *, enabled: bool) -> None:
        self._process = WriterProcess(arena=False) if enabled else None
        self.written = 0
        """Writes done by the helper (the others went through threads)."""

    async def write(self, shard: Shard) -> None:
        """Write the members laid out in *shard* (raises what failed: then nothing of them
        stays in the file, and they are still pending)."""
        if not await self._by_helper(shard):
            await anyio.to_thread.run_sync(shard.write_pending)

    async def _by_helper(self, shard: Shard) -> bool:
        """Whether the helper wrote them; False: not written (for sure or perhaps)."""
        process = self._process
        if process is None or not process.usable or shard.pending_bytes > APPEND_MAX:
            return False
        if not process.running and not await anyio.to_thread.run_sync(process.start):
            return False
        position, pieces = shard.pending_write()
        outcome = await process.append_async(shard.file.fileno(), position, pieces)
        if isinstance(outcome, Failure):
            await anyio.to_thread.run_sync(shard.undo_pending)
            raise outcome.oserror(shard.spool)
        if outcome is not None:  # the helper is busy or was lost: a thread writes them again
            return False
        shard.pending_written()
        self.written += 1
        return True

    async def aclose(self) -> None:
        """Let the helper finish and exit (in a thread; past its timeout it is killed)."""
        process, self._process = self._process, None
        if process is not None:
            await process.settle_channel()
            await anyio.to_thread.run_sync(process.close)
