"""The direct channel, the caller's side: a blocking, thread-safe client with a small pool.

:class:`ChannelClient` opens connections to the actor's channel (the Unix socket on the
actor's node, TCP elsewhere), says hello with the actor's secret, and sends requests framed as
:mod:`trajtrack.ray._protocol` says, reading their replies in order. Any failure of the
channel is a :class:`~trajtrack.ray._protocol.ChannelBrokenError`: the caller then falls back
to Ray calls. No Ray import; it runs in any thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Sequence

from trajtrack.ray._protocol import (
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

_forks = 0
"""Forks this process descends from (counted in the child): a connection opened before a fork
belongs to the parent. A counter, not ``os.getpid()``, which is a system call on every dump."""


def _count_fork() -> None:
    global _forks
    _forks += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_count_fork)


class _Connection:
    """One blocking socket to the actor, past the hello."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.forks = _forks  # the process it belongs to
        self.usable = True  # false after a FATAL reply: the server closes it

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
        local: Use the Unix socket (the caller is on the actor's node).
        connect_timeout: Seconds to connect and finish the hello.
        reply_timeout: Seconds to wait for a reply; the actor holds it back while its queue is
            full (backpressure), so this is the acknowledged dump's whole wait.
    """

    def __init__(
        self,
        endpoints: Endpoints,
        who: Who,
        *,
        local: bool,
        connect_timeout: float = 10.0,
        reply_timeout: float = 300.0,
    ) -> None:
        if local and endpoints.unix_path:
            self.family, self.address = socket.AF_UNIX, endpoints.unix_path
        elif endpoints.tcp is not None:
            ipv6 = ":" in endpoints.tcp[0]
            self.family = socket.AF_INET6 if ipv6 else socket.AF_INET
            self.address = endpoints.tcp  # type: ignore[assignment]
        else:
            raise ChannelBrokenError("the tracker actor offers no channel this caller can use")
        self.endpoints = endpoints
        self.who = who
        self.connect_timeout = connect_timeout
        self.reply_timeout = reply_timeout
        self._idle: list[_Connection] = []
        self._lock = threading.Lock()
        self._closed = False

    @property
    def transport(self) -> str:
        """``"unix"`` or ``"tcp"``."""
        return "unix" if self.family == getattr(socket, "AF_UNIX", None) else "tcp"

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
        with self._lock:
            while self._idle:
                connection = self._idle.pop()
                if connection.forks == _forks:
                    return connection
        return self._connect()

    def _release(self, connection: _Connection) -> None:
        with self._lock:
            if (
                connection.usable
                and not self._closed
                and len(self._idle) < MAX_IDLE_CONNECTIONS
                and connection.forks == _forks
            ):
                self._idle.append(connection)
                return
        connection.close()

    def _connect(self) -> _Connection:
        sock = socket.socket(self.family, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.connect_timeout)
            sock.connect(self.address)
            if self.family != getattr(socket, "AF_UNIX", None):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            who = encode_who(self.who)
            sock.sendall(HELLO.pack(MAGIC, VERSION, self.endpoints.secret, len(who)) + who)
            connection = _Connection(sock)
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
                f"cannot open the channel to the tracker actor at {self.address}: {exc}"
            ) from exc
