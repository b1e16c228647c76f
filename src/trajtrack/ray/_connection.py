"""The direct channel, the caller's side: a blocking, thread-safe client with a small pool.

:class:`ChannelClient` opens connections to the actor's channel (its Unix socket: only a
process on the actor's node has one), says hello with the actor's secret, and sends requests
framed as :mod:`trajtrack.ray._protocol` says, reading their replies in order. Any failure of
the channel is a :class:`~trajtrack.ray._protocol.ChannelBrokenError`: the caller then falls
back to Ray calls. No Ray import; it runs in any thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence

from trajtrack.ray._protocol import (
    BUSY,
    ERROR,
    FATAL,
    HELLO,
    KIND_DUMP,
    KIND_PLAIN,
    MAGIC,
    MAX_ERROR_BYTES,
    OK,
    REFUSED,
    REPLY,
    REQUEST,
    VERSION,
    ChannelBrokenError,
    Endpoints,
    Payload,
    Who,
    decode_error,
    encode_who,
)
from trajtrack.ray._wire_encode import Encoded

__all__ = ["ChannelClient"]

logger = logging.getLogger(__name__)

INLINE_MAX_BYTES = 256 << 10
"""Payloads up to this size go out in one ``send`` with their header (one copy, one syscall)."""
MAX_IDLE_CONNECTIONS = 8
"""Idle connections a client keeps per actor (one per thread dumping at the same time)."""


class _Connection:
    """One blocking socket to the actor, past the hello."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pid = os.getpid()  # a connection opened before a fork belongs to the parent
        self.usable = True  # false after a FATAL reply: the server closes it
        self.idle_since = 0.0  # time.monotonic() when it went back to the pool

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def send(self, name: bytes, payload: Payload) -> None:
        if isinstance(payload, Encoded):
            kind, parts, size = KIND_PLAIN, payload.parts, payload.size
        else:
            kind, parts, size = KIND_DUMP, [payload], len(payload)
        head = REQUEST.pack(kind, len(name), size)
        if size <= INLINE_MAX_BYTES:
            self.sock.sendall(b"".join((head, name, *parts)))
            return
        self.sock.sendall(head + name)
        for part in parts:
            self.sock.sendall(part)

    def reply(self) -> Exception | None:
        status, size = REPLY.unpack(self._exactly(REPLY.size))
        if status == OK:
            return None
        if status in (ERROR, FATAL) and size <= MAX_ERROR_BYTES:
            self.usable = self.usable and status == ERROR
            return decode_error(self._exactly(size))
        if status == REFUSED:
            raise ChannelBrokenError(
                "the tracker actor refused the channel (wrong secret or protocol version)"
            )
        if status == BUSY:
            raise ChannelBrokenError("the tracker actor's channel is full (too many connections)")
        raise ChannelBrokenError(f"the tracker actor's channel answered status {status}")

    def _exactly(self, size: int) -> bytes:
        chunks: list[bytes] = []
        while size:
            chunk = self.sock.recv(size)
            if not chunk:
                raise ChannelBrokenError("the tracker actor closed the channel")
            chunks.append(chunk)
            size -= len(chunk)
        return b"".join(chunks)


class ChannelClient:
    """A process's way to the actor's channel: a small pool of connections, thread-safe.

    Args:
        endpoints: What the actor's ``ready`` call reported.
        who: This process's identity (sent once per connection).
        connect_timeout: Seconds to connect and finish the hello.
        reply_timeout: Seconds to wait for a reply; the actor holds it back while its queue is
            full (backpressure), so this is the acknowledged dump's whole wait.
    """

    def __init__(
        self,
        endpoints: Endpoints,
        who: Who,
        *,
        connect_timeout: float = 10.0,
        reply_timeout: float = 300.0,
    ) -> None:
        self.endpoints = endpoints
        self.who = who
        self.connect_timeout = connect_timeout
        self.reply_timeout = reply_timeout
        self._idle: list[_Connection] = []
        self._lock = threading.Lock()
        self._closed = False

    def __repr__(self) -> str:  # never the secret
        return f"ChannelClient(unix_path={self.endpoints.unix_path!r})"

    def carries(self, size: int) -> bool:
        """Whether a payload of *size* bytes may go on the channel (larger: a Ray call)."""
        return size <= self.endpoints.max_payload_bytes

    def dump(self, data: Payload, name: str) -> None:
        """Send one dump (serialized bytes or encoded plain data); wait until it is admitted.

        Raises:
            TimeoutError: No reply within ``reply_timeout`` (the dump may still be admitted).
            ChannelBrokenError: The channel failed before the reply (the dump may or may not
                have reached the actor).
            Exception: The actor's error for this dump, rebuilt (e.g. ``TrackerClosedError``).
        """
        error = self.dump_many([(data, name)])
        if error:
            raise error[0][1]

    def dump_many(self, items: Sequence[tuple[Payload, str]]) -> list[tuple[int, Exception]]:
        """Send several dumps on one connection, then read their replies (in order).

        Returns:
            ``(index, error)`` for each dump the actor refused.

        Raises:
            TimeoutError: A reply did not come within ``reply_timeout``.
            ChannelBrokenError: The channel failed; ``replies`` says how many came before.
        """
        connection = self._acquire()
        failures: list[tuple[int, Exception]] = []
        replies = 0
        try:
            for data, name in items:
                connection.send(name.encode("utf-8"), data)
            for index in range(len(items)):
                error = connection.reply()
                replies += 1
                if error is not None:
                    failures.append((index, error))
        except TimeoutError:
            connection.close()
            raise TimeoutError(
                f"the trajtrack tracker actor did not acknowledge a dump within "
                f"{self.reply_timeout:g} s (it may still be admitted)"
            ) from None
        except ChannelBrokenError as exc:
            connection.close()
            raise ChannelBrokenError(str(exc), replies=replies, failures=failures) from None
        except OSError as exc:
            connection.close()
            raise ChannelBrokenError(
                f"channel to the tracker actor: {exc}", replies=replies, failures=failures
            ) from exc
        self._release(connection)
        return failures

    def close(self) -> None:
        """Close the idle connections; those in use close when their call ends."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()

    def abandon_after_fork(self) -> None:
        """In a forked child: close the inherited idle sockets (the parent's stay open).

        Takes no lock: a thread of the parent may have held it at the fork.
        """
        self._closed = True
        idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()

    def _acquire(self) -> _Connection:
        # The server closes a connection idle for idle_timeout: reuse only those idle for less
        # than half of it (older ones may be closed already, and a dump sent on one is lost).
        fresh_since = time.monotonic() - self.endpoints.idle_timeout / 2
        stale: list[_Connection] = []
        found = None
        with self._lock:
            while self._idle:
                connection = self._idle.pop()
                if connection.pid != os.getpid():
                    continue  # the parent's: never closed here
                if connection.idle_since >= fresh_since:
                    found = connection
                    break
                stale.append(connection)
        for connection in stale:
            connection.close()
        return found if found is not None else self._connect()

    def _release(self, connection: _Connection) -> None:
        with self._lock:
            if (
                connection.usable
                and not self._closed
                and len(self._idle) < MAX_IDLE_CONNECTIONS
                and connection.pid == os.getpid()
            ):
                connection.idle_since = time.monotonic()
                self._idle.append(connection)
                return
        connection.close()

    def _connect(self) -> _Connection:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.connect_timeout)
            sock.connect(self.endpoints.unix_path)
            who = encode_who(self.who)
            connection = _Connection(sock)
            try:
                sock.sendall(HELLO.pack(MAGIC, VERSION, self.endpoints.secret, len(who)) + who)
            except (BrokenPipeError, ConnectionResetError):
                # A full server answers BUSY and closes without reading the hello, so the send
                # can fail before the answer is read: the answer, still queued, says why.
                connection.reply()
                raise
            if connection.reply() is not None:  # the hello has no error replies
                raise ChannelBrokenError("the tracker actor answered the hello with an error")
            sock.settimeout(self.reply_timeout)
            return connection
        except ChannelBrokenError:
            sock.close()
            raise
        except OSError as exc:
            sock.close()
            raise ChannelBrokenError(
                f"cannot open the channel to the tracker actor at {self.endpoints.unix_path}: {exc}"
            ) from exc
