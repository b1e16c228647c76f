"""The direct channel: callers hand serialized dumps to the tracker actor over a socket.

An acknowledged ``dump_data`` through Ray's task path costs a whole actor call (about 1.5 to 3 ms
on a small machine: task submission, scheduling on the actor's event loop, the reply object),
while the work itself is to move some bytes to another process and hear back that they were
queued. So the actor also listens on a socket of its own — a Unix socket for callers on its
node, TCP on the node's address for the others — and callers that learned its address and
secret through one Ray call send each dump as one frame and read one small reply.

Protocol (all integers little-endian; one connection serves one writer process):

* the client opens with ``HELLO``: ``b"TTRK"``, the protocol version, the actor's 32-byte
  secret and the length of the writer identity, then the identity as JSON
  (``[host, pid, rank, local_rank, world_size]``); the server answers with one reply (status
  ``OK``), or closes the connection after a ``REFUSED`` reply when anything is wrong;
* then any number of requests: kind, name length, payload length, the UTF-8 name, the
  payload: ``DUMP``, the serialized dump (``torch.save`` bytes), or ``PLAIN``, plain data as a
  JSON skeleton plus raw tensor bytes (:mod:`trajtrack.ray._wire`), which the actor rebuilds
  and serializes in its upload workers. The server admits them to the tracker one after the
  other, in the order they arrive, and answers each with one reply: ``OK``, or ``ERROR``
  followed by a JSON ``{"type": ..., "message": ...}`` naming the exception, or ``FATAL`` (the
  same, after which the server hangs up: a request it cannot read past). A client may send
  several requests before reading their replies (the pipelined sender does); replies come in
  order.

The secret travels only inside Ray's own calls (authenticated when the cluster uses Ray's token
authentication), and it is compared in constant time; a connection that does not present it
within :data:`HELLO_TIMEOUT` seconds is closed. The socket carries dumps one way and status
codes the other: nothing received is unpickled or executed, by either side (a ``DUMP`` payload
is stored as it came, never loaded).

This module has no Ray import: the server runs on any asyncio loop, the client in any thread.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import dataclasses
import hmac
import json
import logging
import os
import shutil
import socket
import struct
import tempfile
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import trajtrack._exceptions as _exceptions
from trajtrack._exceptions import TrajtrackError
from trajtrack.ray._wire import Encoded

__all__ = [
    "ChannelBrokenError",
    "ChannelClient",
    "ChannelServer",
    "Endpoints",
    "Who",
]

logger = logging.getLogger("trajtrack")

Who = tuple[str, int, int, int, int]
"""A writer's identity: ``(host, pid, rank, local_rank, world_size)``."""

Payload = bytes | memoryview | Encoded
"""What a request carries: serialized bytes, or plain data encoded by :mod:`._wire`."""

MAGIC = b"TTRK"
VERSION = 1
SECRET_BYTES = 32
KIND_DUMP = 1
KIND_PLAIN = 2
KINDS = (KIND_DUMP, KIND_PLAIN)
OK, ERROR, REFUSED, FATAL = 0, 1, 2, 3
"""Reply statuses; ``FATAL`` is an error after which the server closes the connection."""

_HELLO = struct.Struct("<4sB32sH")  # magic, version, secret, identity length
_REQUEST = struct.Struct("<BHQ")  # kind, name length, payload length
_REPLY = struct.Struct("<BI")  # status, length of the error JSON that follows

MAX_NAME_BYTES = 4096
MAX_WHO_BYTES = 4096
MAX_ERROR_BYTES = 64 << 10
HELLO_TIMEOUT = 10.0
"""Seconds a new connection has to present the secret and its identity."""
INLINE_MAX_BYTES = 256 << 10
"""Payloads up to this size go out in one ``send`` with their header (one copy, one syscall)."""
MAX_IDLE_CONNECTIONS = 8
"""Idle connections a client keeps per actor (one per thread dumping at the same time)."""
_STREAM_LIMIT = 1 << 20
_LINGER_SECONDS = 2.0
_LINGER_MAX_BYTES = 64 << 20


class ChannelBrokenError(TrajtrackError, ConnectionError):
    """The channel to the tracker actor failed (refused, reset, closed, bad reply).

    The caller falls back to Ray's task path, which also finds out whether the actor is alive.

    Attributes:
        replies: In a batch, how many requests had their reply before the channel failed; the
            rest may or may not have reached the actor.
        failures: ``(index, error)`` for the requests among those the actor refused.
    """

    def __init__(
        self,
        message: str,
        *,
        replies: int = 0,
        failures: list[tuple[int, Exception]] | None = None,
    ) -> None:
        super().__init__(message)
        self.replies = replies
        self.failures = failures or []


@dataclass(frozen=True)
class Endpoints:
    """Where an actor's channel listens and the secret it wants.

    Attributes:
        secret: The 32 bytes a client presents in its hello.
        node_id: The Ray node of the actor (the Unix socket only works on that node).
        unix_path: The Unix socket, or ``None``.
        tcp: ``(host, port)`` on the node's address, or ``None``.
    """

    secret: bytes
    node_id: str
    unix_path: str | None
    tcp: tuple[str, int] | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "secret": self.secret.hex(),
            "node_id": self.node_id,
            "unix_path": self.unix_path,
            "tcp": list(self.tcp) if self.tcp else None,
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Endpoints:
        tcp = raw.get("tcp")
        return cls(
            secret=bytes.fromhex(raw["secret"]),
            node_id=str(raw["node_id"]),
            unix_path=raw.get("unix_path"),
            tcp=(str(tcp[0]), int(tcp[1])) if tcp else None,
        )


# --------------------------------------------------------------------------- errors on the wire


def encode_error(exc: BaseException) -> bytes:
    """An exception as the JSON the client rebuilds it from (type name and message only).

    At most :data:`MAX_ERROR_BYTES`: a longer message is shortened (the message, never its
    encoding -- cutting the JSON would leave a reply the client cannot read).
    """
    kind, message = type(exc).__name__, str(exc)
    raw = _error_json(kind, message)
    keep = len(message)
    while len(raw) > MAX_ERROR_BYTES:
        # Escapes make characters longer than one byte: shrink by the ratio, and a bit more.
        keep = max(0, min(keep - 1, int(keep * MAX_ERROR_BYTES / len(raw) * 0.95) - 64))
        raw = _error_json(kind, f"{message[:keep]}... ({len(message) - keep} characters cut)")
    return raw


def _error_json(kind: str, message: str) -> bytes:
    return json.dumps({"type": kind[:200], "message": message}).encode()


_BUILTIN_ERRORS = frozenset(
    {
        "TimeoutError",
        "ValueError",
        "TypeError",
        "RuntimeError",
        "OSError",
        "KeyError",
        "MemoryError",
    }
)


def decode_error(raw: bytes) -> Exception:
    """Rebuild the actor's exception: trajtrack's own types and a few builtins keep their type.

    Anything else becomes a :class:`~trajtrack.TrajtrackError` naming the original type.
    """
    try:
        fields = json.loads(raw)
        kind, message = str(fields["type"]), str(fields["message"])
    except (ValueError, KeyError, TypeError):
        return ChannelBrokenError("the tracker actor sent an unreadable error reply")
    cls = getattr(_exceptions, kind, None) if kind in _exceptions.__all__ else None
    if cls is None and kind in _BUILTIN_ERRORS:
        cls = getattr(builtins, kind)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(message)
        except TypeError:  # a constructor that wants more than a message
            pass
    return TrajtrackError(f"{kind}: {message}")


def _encode_who(who: Who) -> bytes:
    return json.dumps(list(who)).encode()


def _decode_who(raw: bytes) -> Who:
    host, pid, rank, local_rank, world_size = json.loads(raw)
    if not isinstance(host, str) or not all(
        isinstance(v, int) for v in (pid, rank, local_rank, world_size)
    ):
        raise ValueError("bad writer identity")
    return (host, pid, rank, local_rank, world_size)


# --------------------------------------------------------------------------- the actor's side

Admit = Callable[[int, bytearray, str, Who], Awaitable[Any]]
"""``await admit(kind, payload, name, who)``: queue one request's dump (raise to refuse it)."""


@dataclass
class ChannelCounters:
    """What the server has seen (the actor reports it through ``channel_statistics``)."""

    connections: int = 0
    refused: int = 0
    dumps: int = 0
    errors: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclass
class ChannelServer:
    """Listens for callers and admits their dumps through *admit*, on the running loop.

    Args:
        admit: ``await admit(kind, payload, name, who)`` queues one dump (raises to refuse it).
        node_id: Reported to clients, who use the Unix socket only on the same node.
        max_payload_bytes: A request announcing more is refused and the connection closed.
    """

    admit: Admit
    node_id: str = ""
    max_payload_bytes: int = 1 << 36
    secret: bytes = field(default_factory=lambda: os.urandom(SECRET_BYTES))
    counters: ChannelCounters = field(default_factory=ChannelCounters)
    _servers: list[asyncio.Server] = field(default_factory=list)
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)
    _unix_dir: str | None = None
    _endpoints: Endpoints | None = None

    async def start(self, *, tcp_host: str | None, unix: bool = True) -> Endpoints:
        """Open the listeners (each one optional; a failing one is logged and skipped)."""
        if self._endpoints is not None:
            return self._endpoints
        unix_path = tcp = None
        if unix and hasattr(socket, "AF_UNIX"):
            try:
                self._unix_dir = tempfile.mkdtemp(prefix="trajtrack-ch-")  # mode 0700
                unix_path = os.path.join(self._unix_dir, "s")
                self._servers.append(
                    await asyncio.start_unix_server(self._serve, unix_path, limit=_STREAM_LIMIT)
                )
            except OSError as exc:
                logger.warning("trajtrack channel: no Unix socket (%s)", exc)
                unix_path = None
        if tcp_host:
            try:
                server = await asyncio.start_server(self._serve, tcp_host, 0, limit=_STREAM_LIMIT)
            except OSError as exc:
                logger.warning("trajtrack channel: cannot listen on %s (%s)", tcp_host, exc)
            else:
                self._servers.append(server)
                tcp = (tcp_host, int(server.sockets[0].getsockname()[1]))
        self._endpoints = Endpoints(self.secret, self.node_id, unix_path, tcp)
        return self._endpoints

    @property
    def endpoints(self) -> Endpoints | None:
        """What :meth:`start` opened (``None`` before it ran)."""
        return self._endpoints

    async def aclose(self) -> None:
        """Stop listening and drop every connection; clients fall back to Ray calls."""
        for server in self._servers:
            server.close()
        for writer in list(self._writers):
            writer.close()
        for server in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 5)
        self._servers.clear()
        if self._unix_dir is not None:
            shutil.rmtree(self._unix_dir, ignore_errors=True)
            self._unix_dir = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            who = await self._hello(reader, writer)
            if who is not None:
                self.counters.connections += 1
                await self._requests(reader, writer, who)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away; what it was sending was not acknowledged
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _hello(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> Who | None:
        try:
            async with asyncio.timeout(HELLO_TIMEOUT):
                magic, version, secret, who_len = _HELLO.unpack(
                    await reader.readexactly(_HELLO.size)
                )
                good = (
                    magic == MAGIC
                    and version == VERSION
                    and hmac.compare_digest(secret, self.secret)
                    and who_len <= MAX_WHO_BYTES
                )
                who = _decode_who(await reader.readexactly(who_len)) if good else None
        except (TimeoutError, ValueError, asyncio.IncompleteReadError):
            who = None
        if who is None:
            self.counters.refused += 1
            writer.write(_REPLY.pack(REFUSED, 0))
            return None
        writer.write(_REPLY.pack(OK, 0))
        return who

    async def _requests(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, who: Who
    ) -> None:
        while True:
            try:
                head = await reader.readexactly(_REQUEST.size)
            except asyncio.IncompleteReadError as exc:
                if exc.partial:
                    logger.warning("trajtrack channel: a client sent half a request")
                return  # closed between requests: the normal end
            kind, name_len, size = _REQUEST.unpack(head)
            if kind not in KINDS or name_len > MAX_NAME_BYTES or size > self.max_payload_bytes:
                self.counters.errors += 1
                error = ValueError(
                    f"bad request (kind {kind}, name {name_len} bytes, payload {size} bytes)"
                )
                await self._hang_up(reader, writer, error)  # cannot resynchronize the stream
                return
            raw_name = await reader.readexactly(name_len)
            try:
                data = await _read_into(reader, size)
            except MemoryError:
                self.counters.errors += 1
                no_memory = MemoryError(f"no memory for a {size}-byte dump")
                await self._hang_up(reader, writer, no_memory)  # its bytes were not read
                return
            try:
                await self.admit(kind, data, raw_name.decode("utf-8"), who)
            except Exception as exc:  # the caller gets it, typed; the connection goes on
                self.counters.errors += 1
                self._reply_error(writer, exc)
            else:
                self.counters.dumps += 1
                writer.write(_REPLY.pack(OK, 0))
            if writer.transport.get_write_buffer_size() > _STREAM_LIMIT:
                await writer.drain()  # a client that sends without reading: stop reading too

    def _reply_error(
        self, writer: asyncio.StreamWriter, exc: BaseException, status: int = ERROR
    ) -> None:
        raw = encode_error(exc)
        writer.write(_REPLY.pack(status, len(raw)) + raw)

    async def _hang_up(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, exc: BaseException
    ) -> None:
        """Send a FATAL reply, then close without resetting the connection.

        Closing with unread bytes in the receive buffer makes the kernel send a reset, and the
        client would lose the reply: so stop writing, discard what the client still sends for a
        little while (bounded), then close.
        """
        self._reply_error(writer, exc, FATAL)
        with contextlib.suppress(Exception):
            await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
            discarded = 0
            async with asyncio.timeout(_LINGER_SECONDS):
                while discarded < _LINGER_MAX_BYTES:
                    chunk = await reader.read(_STREAM_LIMIT)
                    if not chunk:
                        break
                    discarded += len(chunk)


async def _read_into(reader: asyncio.StreamReader, size: int) -> bytearray:
    """Exactly *size* bytes as a (writable) bytearray: tensors are rebuilt on it, not copied."""
    buffer = bytearray(size)
    view = memoryview(buffer)
    position = 0
    while position < size:
        chunk = await reader.read(min(size - position, _STREAM_LIMIT))
        if not chunk:
            raise asyncio.IncompleteReadError(bytes(view[:position]), size)
        view[position : position + len(chunk)] = chunk
        position += len(chunk)
    return buffer


# --------------------------------------------------------------------------- the caller's side


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
        head = _REQUEST.pack(kind, len(name), size)
        if size <= INLINE_MAX_BYTES:
            self.sock.sendall(b"".join((head, name, *parts)))
            return
        self.sock.sendall(head + name)
        for part in parts:
            self.sock.sendall(part)

    def reply(self) -> Exception | None:
        status, size = _REPLY.unpack(self._exactly(_REPLY.size))
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
            who = _encode_who(self.who)
            sock.sendall(_HELLO.pack(MAGIC, VERSION, self.endpoints.secret, len(who)) + who)
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
