"""The writer process's socket, driven from an asyncio event loop instead of a thread.

Why: a batch written through a thread costs that thread five or more takes of the GIL (the
hop into the thread, around ``sendmsg`` and ``recv``, the hop back). While the caller's thread
runs Python -- an ``await dump`` loop -- each take waits for the switch interval (5 ms by
default), and every background thread of the process queues for the same GIL: a batch's round
trip grows to many switch intervals, and most dumps are still uncommitted when the caller's
loop ends and waits in ``flush()`` (``benchmarks/bench_core.py``: 4 KB throughput until
``flush()`` returns, against the inline loop). On the loop the same
batch costs the loop's own thread a non-blocking ``sendmsg`` and one ``recv`` per answer: no
GIL changes hands, and several batches are in the helper's socket at once.

A :class:`Channel` belongs to one :class:`~trajtrack.backends._writer_process.WriterProcess`
and one loop. The process's thread lock is held while batches are in flight (a thread's batch
waits; while a thread waits or writes, the loop sends no new batch and waits its turn), so
that answers never interleave; the helper answers frames in the order they came.
"""

from __future__ import annotations

import asyncio
import collections
import socket
from collections.abc import Callable
from typing import Final

from trajtrack.backends._staging import set_done
from trajtrack.backends._writer_frames import split_answers

__all__ = ["Channel", "Report"]

Report = Callable[[int, int, int, int], None]
"""``report(index, status, operation, errno)`` (:data:`~._writer_child.RESULT`'s fields)."""

_READ: Final = 1 << 16


class _Batch:
    __slots__ = ("count", "done", "report", "reported")

    def __init__(self, count: int, report: Report, done: asyncio.Future[None]) -> None:
        self.count = count
        self.report = report
        self.done = done
        self.reported = 0


class Channel:
    """Sends frames to the helper and dispatches its answers, on *loop*.

    Args:
        loop: The loop that owns the channel (every method runs on it).
        sock: The helper's socket (made non-blocking here; the caller restores it).
        lost: Called once, on the loop, when the helper is gone or misbehaved (with why).
        settled: Called with the channel when its last batch in flight is answered (or failed).
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        lost: Callable[[BaseException], None],
        settled: Callable[[Channel], None],
    ) -> None:
        self.loop = loop
        self._sock = sock
        self._lost = lost
        self._settled = settled
        self._waiting: collections.deque[_Batch] = collections.deque()
        self._sending = asyncio.Lock()
        self._pending = b""
        self._broken: BaseException | None = None
        self._users = 0
        self._idle = asyncio.Event()
        self._idle.set()
        sock.setblocking(False)
        loop.add_reader(sock.fileno(), self._readable)

    @property
    def idle(self) -> bool:
        """No :meth:`write` under way, nothing sent and unanswered."""
        return self._users == 0 and not self._waiting

    @property
    def broken(self) -> BaseException | None:
        """Why the channel cannot be used any more (None while it can)."""
        return self._broken

    def detach(self) -> None:
        """Stop watching the socket (idle, or broken)."""
        if not self.loop.is_closed() and self._sock.fileno() >= 0:
            self.loop.remove_reader(self._sock.fileno())

    def abort(self, exc: BaseException) -> None:
        """Break the channel (a timeout, a close): every batch in flight fails with *exc*."""
        self._break(exc)

    async def wait_idle(self) -> None:
        """Return once :attr:`idle`."""
        while not self.idle:
            await self._idle.wait()

    def forget_users(self) -> None:
        """Its loop closed with writers suspended in :meth:`write`: they will never return."""
        self._users = 0

    async def write(self, frame: bytes, directory: int, count: int, report: Report) -> None:
        """Send *frame* (*count* items) with *directory*; return once every item is answered
        (each reported as its answer comes). Raises what broke the channel; then the items
        not reported were not answered."""
        batch = _Batch(count, report, self.loop.create_future())
        self._users += 1
        self._idle.clear()
        try:
            async with self._sending:
                self._check()
                self._waiting.append(batch)  # first: answers may come before the send returns
                try:
                    await self._send(frame, directory)
                except BaseException as exc:  # a frame perhaps half sent: the stream is lost
                    self._break(exc if isinstance(exc, Exception) else ConnectionAbortedError())
                    raise
            await batch.done
        finally:
            self._users -= 1
            if self.idle:
                self._idle.set()

    async def _send(self, frame: bytes, directory: int) -> None:
        view = memoryview(frame)
        while True:
            try:
                sent = socket.send_fds(self._sock, [view], [directory])
                break
            except BlockingIOError:
                await self._writable()
        if sent < len(view):
            await self.loop.sock_sendall(self._sock, view[sent:])

    async def _writable(self) -> None:
        ready = self.loop.create_future()
        fd = self._sock.fileno()
        self.loop.add_writer(fd, set_done, ready)
        try:
            await ready
        finally:
            self.loop.remove_writer(fd)

    def _readable(self) -> None:
        try:
            data = self._sock.recv(_READ)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._break(exc)
            return
        if not data:
            self._break(ConnectionResetError("the writer process exited"))
            return
        try:
            self._dispatch(data)
        except Exception as exc:  # a report callback raised: its answers cannot be trusted
            self._break(exc)

    def _dispatch(self, data: bytes) -> None:
        answers, self._pending = split_answers(self._pending + data)
        for answer in answers:
            if not self._waiting:
                raise ConnectionError("the writer process answered a file it was not sent")
            batch = self._waiting[0]
            batch.report(batch.reported, *answer)
            batch.reported += 1
            if batch.reported == batch.count:
                self._waiting.popleft()
                set_done(batch.done)
        self._settle_if_idle()  # the writers were cancelled: nobody else gives the socket back

    def _check(self) -> None:
        if self._broken is not None:
            raise self._broken

    def _break(self, exc: BaseException) -> None:
        """The channel is unusable: fail every waiting batch with *exc*, tell the owner."""
        if self._broken is not None:
            return
        self._broken = exc
        self.detach()
        waiting, self._waiting = self._waiting, collections.deque()
        for batch in waiting:
            if not batch.done.done():
                batch.done.set_exception(exc)
                batch.done.exception()  # its writer may have been cancelled: nobody to log it
        self._lost(exc)
        self._settle_if_idle()

    def _settle_if_idle(self) -> None:
        if self.idle:
            self._idle.set()
            self._settled(self)
