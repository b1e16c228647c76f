"""The channel server's bounds: what it holds at once, how long it waits, its byte budget.

Every resource a client of the channel can make the actor hold is bounded here: connections
and unfinished hellos (counted, refused at once when full), time (a hello, an idle connection,
a request's body: each has a deadline), and memory (a request's payload is reserved from one
budget shared by all connections before its buffer is allocated). The actor sizes the byte
limits from its tracker's own budget (:meth:`ChannelLimits.for_tracker`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass, replace

from trajtrack.ray._protocol import HELLO_TIMEOUT

__all__ = ["Budget", "ChannelLimits"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChannelLimits:
    """What one :class:`~trajtrack.ray._server.ChannelServer` takes at most.

    Attributes:
        max_connections: Connections past their hello held at once; one more is answered
            ``BUSY`` and closed (its client sends as Ray calls).
        max_pending_hellos: Connections that have not finished their hello; one more is
            answered ``BUSY`` and closed at once.
        hello_timeout: Seconds a new connection has for its hello.
        idle_timeout: Seconds a connection may wait between requests before it is closed.
        progress_timeout: A request's name and payload must arrive within this many seconds
            plus one second per ``min_rate`` bytes; a request that stalls is answered
            ``FATAL`` (``TimeoutError``) and the connection closed.
        min_rate: The slowest transfer (bytes per second) a request's deadline allows for.
        max_payload_bytes: The largest payload a request may announce (a client sends larger
            dumps as Ray calls).
        budget_bytes: Payload bytes of all connections together that are being received or
            waiting to be admitted; a request waits for its share before anything is allocated.
        budget_timeout: Seconds a request waits for its share; then it is answered ``FATAL``
            (``TimeoutError``), its bytes unread.
    """

    max_connections: int = 256
    max_pending_hellos: int = 16
    hello_timeout: float = HELLO_TIMEOUT
    idle_timeout: float = 60.0
    progress_timeout: float = 30.0
    min_rate: int = 1 << 20
    max_payload_bytes: int = 1 << 30
    budget_bytes: int = 1 << 30
    budget_timeout: float = 300.0

    def __post_init__(self) -> None:
        numbers = (
            self.max_connections,
            self.max_pending_hellos,
            self.hello_timeout,
            self.idle_timeout,
            self.progress_timeout,
            self.min_rate,
            self.max_payload_bytes,
            self.budget_bytes,
            self.budget_timeout,
        )
        if not all(value > 0 for value in numbers):
            raise ValueError(f"channel limits must be positive: {self}")
        if self.max_payload_bytes > self.budget_bytes:
            raise ValueError(
                f"max_payload_bytes ({self.max_payload_bytes}) over budget_bytes "
                f"({self.budget_bytes}): such a request could never be read"
            )

    def for_tracker(self, max_pending_bytes: int) -> ChannelLimits:
        """These limits with the byte budget and the largest payload at the tracker's budget.

        What the channel holds before admitting is then at most what the tracker holds after.
        """
        return replace(self, max_payload_bytes=max_pending_bytes, budget_bytes=max_pending_bytes)

    def body_deadline(self, size: int) -> float:
        """Seconds a request of *size* payload bytes has to arrive, name and payload."""
        return self.progress_timeout + size / self.min_rate


class Budget:
    """Bytes shared by every connection of one server, on its event loop.

    A request :meth:`reserve`\\ s its payload's size before its buffer exists and
    :meth:`release`\\ s it once the payload is admitted (or refused): at most ``limit`` bytes
    are received-but-not-admitted at a time, however many connections send at once.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def reserve(self, size: int) -> None:
        """Wait until *size* bytes fit, then take them (wrap it in a timeout).

        Raises:
            ValueError: *size* is over the whole budget: it would never fit.
        """
        if size > self.limit:
            raise ValueError(f"{size} bytes exceed the channel's whole budget ({self.limit})")
        while self.used + size > self.limit:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        self.used += size

    def release(self, size: int) -> None:
        """Give back what :meth:`reserve` took; wake every waiter to try again."""
        self.used -= size
        waiters, self._waiters = self._waiters, collections.deque()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
