"""Asking the kernel to read local dump files before ``diff`` compares them.

``diff`` compares local files in place, as many pairs at once as there are cores. With files
that are not in the page cache, two pairs in flight would keep the disk mostly idle (each read
waits for its own blocks). :class:`ReadAhead` tells the kernel, a few pairs at a time from one
worker thread, which files come next (``posix_fadvise(WILLNEED)``: the kernel starts reading
them and returns); it stays a bounded number of pairs ahead of the comparisons, so a large run
does not push the pairs being compared out of the cache.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence

import anyio
import anyio.to_thread

__all__ = ["AVAILABLE", "ReadAhead"]

_AHEAD_PAIRS = 64  # at most this many pairs advised before the comparisons reach them
_AHEAD_BYTES = 256 << 20  # ... holding at most this much (2 x 16 pairs of 8 MB, say)
_BATCH = 16  # pairs advised per worker-thread hop (each hop costs the event loop)


class ReadAhead:
    """Advises the kernel to read the files of *pairs*, in order, ahead of the comparisons.

    At most :data:`_AHEAD_PAIRS` pairs, and :data:`_AHEAD_BYTES` bytes (but always the next
    pair), are advised and not yet compared (:meth:`finished`).

    Args:
        pairs: The two local files of each pair and their size in bytes, in the order the
            comparisons start.
    """

    def __init__(self, pairs: Sequence[tuple[str, str, int]]) -> None:
        self._pairs = pairs
        self._ends = list(itertools.accumulate(size for _, _, size in pairs))
        self._finished = 0
        self._progress = anyio.Event()

    def finished(self) -> None:
        """A comparison ended (call it once per pair)."""
        self._finished += 1
        self._progress.set()

    async def run(self) -> None:
        """Advise until every pair is (cancel it when the comparisons are done)."""
        advised = 0
        while advised < len(self._pairs):
            advised = max(advised, self._finished)  # pairs compared already need no advice
            end = advised
            while end < min(len(self._pairs), advised + _BATCH) and self._may_advise(end):
                end += 1
            if end == advised:
                self._progress = anyio.Event()  # no await since the check: no wake-up is lost
                await self._progress.wait()
                continue
            await anyio.to_thread.run_sync(_advise, self._pairs[advised:end])
            advised = end

    def _may_advise(self, index: int) -> bool:
        done = self._finished
        if index == done:
            return True
        compared = self._ends[done - 1] if done else 0
        return index - done < _AHEAD_PAIRS and self._ends[index] - compared <= _AHEAD_BYTES


AVAILABLE = hasattr(os, "posix_fadvise")  # not on macOS: diff then reads without advice


def _advise(pairs: Sequence[tuple[str, str, int]]) -> None:
    for path_a, path_b, _ in pairs:
        for path in (path_a, path_b):
            try:
                # O_NONBLOCK: a FIFO planted in a run does not block the advice.
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            except OSError:
                continue  # the comparison reports it
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass  # only advice
            finally:
                os.close(fd)
