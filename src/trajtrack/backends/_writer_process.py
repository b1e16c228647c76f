"""A writer process for batches of small files, so that writing them takes no GIL from the caller.

Why: a 4 KB dump costs a local disk four system calls (create, write, close, rename), and a
worker thread releases and takes back the GIL around each of them. While the caller's thread
runs Python (an ``await dump`` loop, a rollouter), every take-back waits for that thread to let
go, so the caller and a worker thread together are slower than the caller writing inline
alone (``benchmarks/bench_core.py``: the 4 KB rows "trajtrack" and "trajtrack, no writer
process" against the inline loop). Background *threads* contending with the trainer for
the GIL is what moved PyTorch's async checkpointing to a process too.

So a :class:`~trajtrack.backends.local.LocalStorage` hands a batch of small files (bytes
already serialized) to one helper process, started on first use: ``python -I -S
_writer_child.py`` (the standard library only; no torch, no trajtrack import, started in
milliseconds; :mod:`._writer_spawn` starts and reaps it). A batch costs the tracker's process
one ``sendmsg`` and a few ``recv``\\ s; the helper does the system calls on the other core.
The shards layout writes its spool files through a helper of its own the same way
(:meth:`WriterProcess.append_async`, :mod:`trajtrack.tracker._spool_writer`).

What stays as it was:

* Containment: the parent opens each directory (:func:`open_directory`: never through a link
  leading out of the destination) and passes the descriptor with the batch (``SCM_RIGHTS``);
  the helper creates files only relative to it, with ``O_EXCL | O_NOFOLLOW``.
* Atomicity and errors: the helper writes each file exactly as the thread path does
  (temporary name, then rename or link); each file's outcome comes back as soon as it is
  known, with the ``errno`` of what failed, and becomes the same typed error.
* Failure of the helper itself: a helper that cannot start, or exits, fails only the files it
  had not reported (as a retryable :class:`StorageUnavailableError`: the tracker retries them,
  one by one, on the thread path); the next batch starts a new helper. After
  :data:`MAX_STARTS` failed or lost helpers the storage writes on threads only.
* Lifetime: the helper exits when its socket closes: the storage closed (``aclose``), the
  process exited or was killed. A fork child does not inherit the helper (it starts its own).

Mid-size dumps (above 64 KiB, up to the tracker's ``inline_snapshot_bytes``) reach it
without being copied into the socket: ``dump()`` serializes them into the staging arena, shared
memory the helper maps (:mod:`~trajtrack.backends._staging`), and a batch names their offsets.
Large files (their writes release the GIL for long) and every other payload kind go through
threads, as before. ``TRAJTRACK_WRITER_PROCESS=0`` (or
``LocalStorage(..., writer_process=False)``) turns it off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Final

import anyio

from trajtrack.backends import _writer_child as child
from trajtrack.backends._staging import Arena, Block, StagedPayload, Staging, make_arena
from trajtrack.backends._writer_channel import Channel
from trajtrack.backends._writer_frames import (
    Failure,
    Report,
    WriterGone,
    encode_append,
    encode_frame,
    read_results,
    unreported,
)
from trajtrack.backends._writer_spawn import Helper, orphan, spawn, stop

__all__ = [
    "MAX_STARTS",
    "REPLY_TIMEOUT",
    "Failure",
    "WriterGone",
    "WriterProcess",
    "enabled_by_default",
]

logger = logging.getLogger("trajtrack")

MAX_STARTS: Final = 3
"""Helpers started (or found gone) before a storage gives up on them and uses threads only."""
REPLY_TIMEOUT: Final = 300.0
"""Seconds a batch may wait for the helper to take it or to answer; then the helper is killed
and its unreported files fail as retryable (the tracker retries them on threads)."""
STOP_TIMEOUT: Final = 10.0
"""Seconds :meth:`WriterProcess.close` waits for the helper to finish before killing it."""


def enabled_by_default() -> bool:
    """Whether writer processes are used when not said: yes, unless
    ``TRAJTRACK_WRITER_PROCESS=0``."""
    return os.environ.get("TRAJTRACK_WRITER_PROCESS", "1").strip() != "0"


class WriterProcess:
    """One helper process, shared by a storage's worker threads (one batch at a time) and an
    event loop (batches in flight together, :mod:`._writer_channel`), never both at once."""

    def __init__(self, *, arena: bool = True) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._process: Helper | None = None
        self._starts = 0
        self._closed = False
        self._arena: Arena | None = make_arena() if arena else None
        self._channel: Channel | None = None  # while batches from a loop are in flight
        self._threads_waiting = 0  # threads waiting for the socket: the loop lets them in
        self._count_lock = threading.Lock()
        _LIVE.add(self)

    @property
    def usable(self) -> bool:
        """False once closed, or after :data:`MAX_STARTS` helpers failed."""
        return not self._closed and self._starts < MAX_STARTS

    @property
    def running(self) -> bool:
        """Whether a helper is started (and not known to be lost)."""
        return self._sock is not None

    def staging(self) -> Staging | None:
        """Blocks of this process's staging arena for the tracker; None without an arena."""
        if self._arena is None:
            return None
        return Staging(self._arena, lambda: self.usable)

    def holds(self, payload: object) -> bool:
        """Whether *payload* is staged in this process's arena (the helper can read it)."""
        return (
            isinstance(payload, StagedPayload)
            and payload.block.arena is self._arena
            and payload.block.held
        )

    def write(
        self,
        directory: int,
        items: Sequence[tuple[str, str, memoryview | Block]],
        *,
        overwrite: bool,
        fsync: bool,
        mode: int,
        report: Report,
    ) -> None:
        """Write *items* (``(temporary name, final name, data)``; data: bytes, or a block of
        the arena) in *directory* (a descriptor, which stays the caller's);
        ``report(index, outcome)`` for each, in order, as it ends."""
        frame = encode_frame(items, overwrite=overwrite, fsync=fsync, mode=mode)
        reported = [0]

        def counted(index: int, outcome: Failure | WriterGone | None) -> None:
            reported[0] = index + 1
            report(index, outcome)

        with self._thread_turn():
            lost: str | None = None
            try:
                sock = self._connected()
                sent = socket.send_fds(sock, [frame], [directory])
                if sent < len(frame):
                    sock.sendall(memoryview(frame)[sent:])
                read_results(sock, len(items), counted)
            except (OSError, WriterGone) as exc:  # TimeoutError included: REPLY_TIMEOUT
                lost = str(exc) or type(exc).__name__
                if not self._closed:  # a batch that raced close(): no helper failed
                    self._lost(exc)
            except BaseException:
                # A report callback raised: the helper's answers to this batch may be unread,
                # so it cannot serve the next one.
                self._drop(kill=True)
                raise
            unreported(report, reported[0], len(items), lost)

    async def write_async(
        self,
        directory: int,
        items: Sequence[tuple[str, str, memoryview | Block]],
        *,
        overwrite: bool,
        fsync: bool,
        mode: int,
        report: Report,
    ) -> bool:
        """:meth:`write` from an asyncio loop, on the loop (:mod:`._writer_channel`).

        Returns False, having written nothing, when the socket is not free for this loop now
        (no helper started yet, a thread's batch, another loop's): write through a thread.
        """
        channel = await self._channel_here()
        if channel is None:
            return False
        frame = encode_frame(items, overwrite=overwrite, fsync=fsync, mode=mode)
        await self._write_frame(channel, frame, directory, len(items), report)
        return True

    async def append_async(
        self, file: int, position: int, pieces: Sequence[bytes | memoryview]
    ) -> Failure | WriterGone | None:
        """Write *pieces* into *file* (a descriptor of a regular file, which stays the
        caller's) from *position* on, from an asyncio loop, on the loop.

        Returns None once written; a :class:`Failure` (the ``errno`` of the failed write:
        part of the bytes may be in the file); a :class:`WriterGone` when the socket is not
        free for this loop now or the helper was lost (written or not, unknown).
        """
        frame = encode_append(position, pieces)  # first: the channel, once bound, is ours
        channel = await self._channel_here()
        if channel is None:
            return WriterGone("the writer process is not free for this loop")
        outcome: list[Failure | WriterGone | None] = []
        await self._write_frame(channel, frame, file, 1, lambda _, result: outcome.append(result))
        return outcome[0]

    def start(self) -> bool:
        """Start the helper unless it runs (blocking: in a thread); whether one runs now.
        :meth:`write_async` and :meth:`append_async` only use a helper already started."""
        with self._thread_turn():
            try:
                self._connected()
            except (OSError, WriterGone) as exc:
                if not self._closed:
                    _log_lost(exc, self._starts)
                return False
        return True

    async def _write_frame(
        self, channel: Channel, frame: bytes, fd: int, count: int, report: Report
    ) -> None:
        """Send *frame* through *channel*; every item is reported (unanswered: lost)."""
        reported = 0

        def answer(index: int, status: int, operation: int, error: int) -> None:
            nonlocal reported
            reported = index + 1
            report(index, None if status == child.WRITTEN else Failure(operation, error))

        lost: str | None = None
        try:
            with anyio.fail_after(REPLY_TIMEOUT):
                await channel.write(frame, fd, count, answer)
        except OSError as exc:  # TimeoutError included: REPLY_TIMEOUT
            if isinstance(exc, TimeoutError) and not str(exc):
                exc = TimeoutError(f"no answer within {REPLY_TIMEOUT} s: timed out")
            channel.abort(exc)  # a no-op when the channel broke first
            lost = str(exc) or type(exc).__name__
        finally:
            self._after_channel(channel)
        unreported(report, reported, count, lost)

    async def _channel_here(self) -> Channel | None:
        """This loop's channel (bound now if the socket is free), or None: write through a
        thread. While a thread has the socket (or waits for it), this waits its turn."""
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + REPLY_TIMEOUT
        delay = 0.001
        while True:
            channel = self._channel
            if channel is not None and channel.loop is not loop:
                return None  # another loop's
            if channel is None:
                if self._closed or self._sock is None:
                    return None  # starting a helper blocks: a thread does it
                if not self._threads_waiting and self._lock.acquire(blocking=False):
                    return self._bind(loop)
            elif channel.broken is None and not self._threads_waiting:
                return channel
            if time.monotonic() >= deadline:
                return None
            await anyio.sleep(delay)  # a thread's batch, or a broken channel's last writers
            delay = min(2 * delay, 0.02)

    def _bind(self, loop: asyncio.AbstractEventLoop) -> Channel | None:
        # Holding the lock.
        if self._sock is None or self._closed:
            self._lock.release()
            return None
        self._channel = Channel(loop, self._sock, self._channel_lost, self._after_channel)
        return self._channel

    def _after_channel(self, channel: Channel) -> None:
        """Unbind *channel* once it is idle: the socket goes back to threads (or, broken,
        is closed and its helper reaped later)."""
        if channel is not self._channel or not channel.idle:
            return
        self._channel = None
        channel.detach()
        if channel.broken is not None:
            sock, process = self._sock, self._process
            self._sock = self._process = None
            if sock is not None:
                sock.close()
            if process is not None:  # killed when the channel broke; no wait on the loop
                orphan(process)
        elif self._sock is not None:
            self._sock.settimeout(REPLY_TIMEOUT)
        self._lock.release()

    def _channel_lost(self, exc: BaseException) -> None:
        if self._process is not None:
            self._process.kill()  # whatever it was doing: its answers are not read any more
        if not self._closed:
            _log_lost(exc, self._starts)

    async def settle_channel(self, timeout: float | None = None) -> None:
        """Wait (up to *timeout* seconds, default :data:`STOP_TIMEOUT`) for this loop's
        batches in flight, then give the socket back to threads; past it, kill the helper."""
        timeout = STOP_TIMEOUT if timeout is None else timeout
        channel = self._channel
        if channel is None or channel.loop is not asyncio.get_running_loop():
            return
        with anyio.move_on_after(timeout):
            await channel.wait_idle()
        if not channel.idle:
            channel.abort(TimeoutError(f"batches still in flight after {timeout} s"))
            with anyio.move_on_after(STOP_TIMEOUT):  # their writers wake with the error
                await channel.wait_idle()
            channel.forget_users()
        self._after_channel(channel)

    @contextlib.contextmanager
    def _thread_turn(self) -> Iterator[None]:
        """The socket for a thread: waits for the loop's batches in flight (the loop sends no
        new ones meanwhile), reclaims it from a loop that closed with batches unanswered."""
        with self._count_lock:
            self._threads_waiting += 1
        try:
            while not self._lock.acquire(timeout=0.05):
                channel = self._channel
                if channel is not None and channel.loop.is_closed():
                    channel.abort(ConnectionAbortedError("its event loop was closed"))
                    self._after_channel_forced(channel)
        finally:
            with self._count_lock:
                self._threads_waiting -= 1
        try:
            yield
        finally:
            self._lock.release()

    def _after_channel_forced(self, channel: Channel) -> None:
        # Its loop is closed: no writer of it will ever run again to give the socket back.
        channel.forget_users()
        self._after_channel(channel)

    def _connected(self) -> socket.socket:
        if self._closed:
            raise WriterGone("the storage is closed")
        if self._sock is not None:
            return self._sock
        if self._starts >= MAX_STARTS:
            raise WriterGone("the writer process failed too often")
        self._starts += 1
        self._sock, self._process = spawn(self._arena, REPLY_TIMEOUT)
        return self._sock

    def _lost(self, exc: BaseException) -> None:
        _log_lost(exc, self._starts)
        self._drop(kill=True)

    def _drop(self, *, kill: bool, timeout: float = STOP_TIMEOUT) -> None:
        sock, process = self._sock, self._process
        self._sock = self._process = None
        if sock is not None:
            sock.close()  # the helper sees the end and exits
        if process is not None:
            stop(process, kill=kill, timeout=timeout)

    def close(self, timeout: float = STOP_TIMEOUT) -> None:
        """Let the helper finish and exit (killed after *timeout* seconds); later writes fail.
        From a thread: an event loop's batches in flight are waited for
        (:meth:`settle_channel` on the loop first)."""
        with self._thread_turn():
            self._closed = True
            self._drop(kill=False, timeout=timeout)
            if self._arena is not None:
                self._arena.trim()  # blocks still held (failed dumps) keep their pages
                self._arena.close()
        _LIVE.discard(self)

    def __del__(self) -> None:
        # A storage dropped without aclose(): the helper sees its socket close and exits
        # (nothing is in flight: a batch holds a reference). Reaped later, without waiting
        # here: this may run on an event loop's thread.
        sock, process = getattr(self, "_sock", None), getattr(self, "_process", None)
        if sock is not None:
            sock.close()
        if process is not None:
            orphan(process)

    def _forget_after_fork(self) -> None:
        # In a fork child: the socket is the parent's helper's; close our copy, start anew.
        self._lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._channel = None  # the parent's loop's
        self._threads_waiting = 0
        if self._sock is not None:
            self._sock.close()
        self._sock = self._process = None
        # The arena's pages are shared with the parent: this process gets its own.
        if self._arena is not None:
            self._arena.close()
            self._arena = make_arena()


def _log_lost(exc: BaseException, starts: int) -> None:
    logger.warning("trajtrack: the writer process failed (%s); files go through threads", exc)
    if starts >= MAX_STARTS:
        logger.warning("trajtrack: writer process given up after %d starts", MAX_STARTS)


_LIVE: Final[weakref.WeakSet[WriterProcess]] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for writer in list(_LIVE):
        writer._forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)
