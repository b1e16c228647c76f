"""Staging memory shared with the writer process: mid-size dumps serialized once, written there.

Why: a 1 MB dump written by a worker thread costs the tracker's process a copy into fresh
memory at ``dump()`` (a page fault every 4 KiB) and then, in the thread, a dozen GIL hand-offs
with the caller around the file's system calls; each hand-off wakes one thread and parks
another on the cores the caller needs, and 1 MB dumps committed slower than an inline
``torch.save`` loop (``benchmarks/bench_core.py``: 1 MB throughput against the inline loop;
``benchmarks/bench_snapshot.py`` counts the page faults per dump).

Instead, ``dump()`` serializes such a dump straight into a :class:`Block` of an
:class:`Arena`: a ``memfd`` mapped by this process and by the writer process
(:mod:`~trajtrack.backends._writer_process`). The serialized archive *is* the snapshot (one
copy, into memory that was already faulted in by an earlier dump), and the writer process
writes it to its file from the same pages: the tracker's process makes no file system call
for it and takes no GIL hand-off.

* **Bounded.** An arena is :data:`ARENA_BYTES`; pages exist only once used, and blocks are
  taken lowest address first, so a steady stream reuses the same warm pages. The storage's
  ``aclose`` gives the free pages back (:meth:`Arena.trim`). What is pending still counts
  against the tracker's ``max_pending_bytes`` like any snapshot.
* **A short wait, then the old way.** When no block is free, ``await dump`` waits for one
  (the writer process frees one per file written, so a wait ends with the next file) for at
  most ``STAGE_WAIT`` seconds (:mod:`~trajtrack.tracker._snapshotter`); the event loop runs
  meanwhile. After that, or where the platform has no ``memfd``, the dump takes the ordinary
  path (a copy, written by a thread) -- as it does while the writer process is stuck.
* **Same bytes on every retry.** A block is released only when its payload is: after the
  dump's outcome is final, or when the payload is garbage-collected. Until then the thread
  path can write it again (a failed writer process).
* **Fork.** A fork child shares the mapping: it neither takes blocks from the parent's arena
  nor releases them (which would hand the parent's pages to the system); its storage makes a
  new writer process and arena of its own.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import mmap
import os
import threading
from collections.abc import Callable
from typing import Final

import anyio

from trajtrack.backends._protocol import BytesPayload, WriteResult

__all__ = ["ARENA_BYTES", "Arena", "Block", "StagedPayload", "Staging", "make_arena", "set_done"]

ARENA_BYTES: Final = 64 << 20
"""Size of an arena: sixteen 4 MiB dumps in flight (the default ``inline_snapshot_bytes``;
dumps over a quarter of the arena are never staged: :attr:`Staging.max_bytes`)."""
_PAGE: Final = mmap.PAGESIZE


class Arena:
    """Shared memory for staged dumps: blocks taken and released from any thread."""

    def __init__(self, size: int | None = None) -> None:
        self.size = size = ARENA_BYTES if size is None else size
        self.fd = os.memfd_create("trajtrack-staging", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self._map = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self._view = memoryview(self._map)
        self._free: list[tuple[int, int]] = [(0, size)]  # (offset, length), by offset
        self._lock = threading.Lock()
        self._owner = os.getpid()
        self._waiters: list[Callable[[], None]] = []
        self._later: collections.deque[tuple[int, int]] = collections.deque()
        self.releases = 0
        """Blocks given back so far (a waiter that timed out waits again once this moves)."""

    def take(self, nbytes: int) -> Block | None:
        """A block of *nbytes*, the lowest that fits; None when none does (or in a fork child)."""
        length = -(-max(nbytes, 1) // _PAGE) * _PAGE
        with self._lock:
            if os.getpid() != self._owner:
                return None
            self._merge_later()
            for index, (offset, free) in enumerate(self._free):
                if free >= length:
                    if free == length:
                        del self._free[index]
                    else:
                        self._free[index] = (offset + length, free - length)
                    return Block(self, offset, nbytes, length)
        return None

    def view(self, offset: int, nbytes: int) -> memoryview:
        return self._view[offset : offset + nbytes]

    def give_back(self, offset: int, length: int) -> None:
        """Return a block's pages (called by :meth:`Block.release`); wake the waiters."""
        with self._lock:
            if os.getpid() != self._owner:
                return  # a fork child: the pages are the parent's
            self._merge_later()
            self._merge(offset, length)
            waiters, self._waiters = self._waiters, []
        for wake in waiters:
            wake()

    def give_back_later(self, offset: int, length: int) -> None:
        """Return a block's pages at the next :meth:`take` or :meth:`give_back`, taking no
        lock: for a finalizer, which the garbage collector may run in a thread that holds the
        arena's lock already (inside :meth:`take`)."""
        if os.getpid() == self._owner:
            self._later.append((offset, length))  # atomic: no lock

    def _merge_later(self) -> None:
        while self._later:
            self._merge(*self._later.popleft())

    def _merge(self, offset: int, length: int) -> None:
        index = bisect.bisect(self._free, (offset, length))
        start, end = offset, offset + length
        if index < len(self._free) and self._free[index][0] == end:
            end += self._free.pop(index)[1]
        if index > 0 and sum(self._free[index - 1]) == start:
            index -= 1
            start = self._free.pop(index)[0]
        self._free.insert(index, (start, end - start))
        self.releases += 1

    def on_release(self, wake: Callable[[], None], since: int) -> bool:
        """Call *wake* (once, from the releasing thread) when a block is given back; False
        (and no call) if one was given back since :attr:`releases` was *since*."""
        with self._lock:
            if self.releases != since:
                return False
            self._waiters.append(wake)
            return True

    def forget(self, wake: Callable[[], None]) -> None:
        """Unregister *wake* (a waiter that stopped waiting)."""
        with self._lock, contextlib.suppress(ValueError):
            self._waiters.remove(wake)

    def trim(self) -> None:
        """Give every free page back to the system (the next blocks fault in anew)."""
        with self._lock:
            if os.getpid() != self._owner:
                return
            self._merge_later()
            for offset, length in self._free:
                self._map.madvise(mmap.MADV_REMOVE, offset, length)

    def in_use(self) -> int:
        """Bytes of the arena held by blocks."""
        with self._lock:
            self._merge_later()
            return self.size - sum(length for _, length in self._free)

    def close(self) -> None:
        """Close the descriptor (the mapping goes with the last block's view)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def make_arena() -> Arena | None:
    """An arena, or None where the platform has no ``memfd_create`` (or refuses one)."""
    if not hasattr(os, "memfd_create") or not hasattr(mmap, "MADV_REMOVE"):
        return None
    try:
        return Arena()
    except OSError:
        return None


class Staging:
    """What a storage offers the tracker: blocks of its writer process's arena.

    Args:
        arena: The arena.
        usable: Whether the writer process can take files now (blocks are refused if not).
    """

    def __init__(self, arena: Arena, usable: Callable[[], bool]) -> None:
        self._arena = arena
        self._usable = usable
        self._stuck_at = -1
        self.max_bytes = arena.size // 4
        """The largest dump staged (a quarter of the arena); larger ones are copied at once,
        without waiting for room they could never have, or would take from four others."""

    def take(self, nbytes: int) -> Block | None:
        """A block of *nbytes*, or None (none free, or no writer process to write it)."""
        return self._arena.take(nbytes) if self._usable() else None

    async def freed(self, timeout: float) -> bool:
        """Wait up to *timeout* seconds for a block to be given back: True if one was.

        After a wait that timed out (a writer process stuck on a slow disk), later calls
        return False at once until a block is given back.
        """
        since = self._arena.releases
        if since == self._stuck_at:
            return False
        loop = asyncio.get_running_loop()
        woken = loop.create_future()

        def wake() -> None:  # in the thread that released the block
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(set_done, woken)

        if not self._arena.on_release(wake, since):
            return True
        try:
            with anyio.move_on_after(timeout):
                await woken
                return True
        finally:
            self._arena.forget(wake)
        self._stuck_at = since
        return False


def set_done(future: asyncio.Future[None]) -> None:
    """Resolve *future* unless it is done (a waiter woken once, however often it is told)."""
    if not future.done():
        future.set_result(None)


class Block:
    """*nbytes* of an arena at *offset*; :meth:`release` returns them (once)."""

    __slots__ = ("_length", "arena", "nbytes", "offset")

    def __init__(self, arena: Arena, offset: int, nbytes: int, length: int) -> None:
        self.arena = arena
        self.offset = offset
        self.nbytes = nbytes
        self._length = length

    def view(self) -> memoryview:
        return self.arena.view(self.offset, self.nbytes)

    @property
    def held(self) -> bool:
        """True until :meth:`release`."""
        return self._length > 0

    def release(self, *, later: bool = False) -> None:
        """Give the block back (once); *later*: without taking the arena's lock (a finalizer)."""
        length, self._length = self._length, 0
        if length:
            if later:
                self.arena.give_back_later(self.offset, length)
            else:
                self.arena.give_back(self.offset, length)


class StagedPayload(BytesPayload):
    """A dump serialized into a :class:`Block`, with its size and CRC-32.

    The writer process writes it from the shared pages; any other path writes :attr:`data`
    (the same bytes). :meth:`release` once the dump's outcome is final.
    """

    def __init__(self, block: Block, checksum: str) -> None:
        super().__init__(block.view())
        self.block = block
        self._checksum = checksum

    def counted(self) -> WriteResult:
        if not self.block.held:
            raise RuntimeError("a staged dump was written after its block was released")
        return WriteResult(self.data.nbytes, self._checksum)

    def release(self) -> None:
        self.data = memoryview(b"")
        self.block.release()

    def __del__(self) -> None:
        # Possibly run by the garbage collector inside Arena.take, under its lock: no lock.
        with contextlib.suppress(Exception):  # at interpreter exit, the arena may be gone
            self.data = memoryview(b"")
            self.block.release(later=True)
