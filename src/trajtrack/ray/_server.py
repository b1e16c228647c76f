"""The direct channel, the actor's side: an asyncio server admitting dumps as they arrive.

Listens on a Unix socket in a fresh ``0700`` directory (callers on the actor's node; nothing
listens on the network), checks each connection's hello (:mod:`trajtrack.ray._protocol`),
then reads requests and admits them through the callback it was given, one after the other,
answering each in order. Everything a client can make it hold is bounded
(:mod:`trajtrack.ray._bounds`). It runs on the loop it is started on (the actor's, next to its
tracker) and has no Ray import.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import os
import shutil
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from trajtrack.ray._bounds import Budget, ChannelLimits
from trajtrack.ray._protocol import (
    BUSY,
    ERROR,
    FATAL,
    HELLO,
    KINDS,
    MAGIC,
    MAX_NAME_BYTES,
    MAX_WHO_BYTES,
    OK,
    REFUSED,
    REPLY,
    REQUEST,
    SECRET_BYTES,
    VERSION,
    Endpoints,
    Who,
    decode_who,
    encode_error,
)
from trajtrack.ray._socket_dir import fresh_socket_dir

__all__ = ["Admit", "ChannelCounters", "ChannelServer"]

logger = logging.getLogger(__name__)

_STREAM_LIMIT = 1 << 20
_LINGER_SECONDS = 2.0
_LINGER_MAX_BYTES = 64 << 20
_ALLOCATE_INLINE_MAX = 1 << 20
"""A payload buffer up to this size is allocated on the loop; a larger one is zero-filled in a
thread (touching every page of a large buffer would hold up every other connection)."""
Admit = Callable[[int, bytearray, str, Who], Awaitable[Any]]
"""``await admit(kind, payload, name, who)``: queue one request's dump (raise to refuse it)."""


@dataclass
class ChannelCounters:
    """What the server has seen (the actor reports it through ``channel_statistics``).

    ``refused``: hellos refused (bad secret, protocol or identity, or too slow); ``busy``:
    connections closed at once because the server was full; ``errors``: requests answered
    with an error.
    """

    connections: int = 0
    refused: int = 0
    busy: int = 0
    dumps: int = 0
    errors: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class ChannelServer:
    """Listens for callers on a Unix socket and admits their dumps through *admit*.

    Args:
        admit: ``await admit(kind, payload, name, who)`` queues one dump (raises to refuse it).
        node_id: Reported to clients, who use the socket only on the same node.
        limits: What the server holds at most (:class:`~trajtrack.ray._bounds.ChannelLimits`).
    """

    def __init__(
        self, admit: Admit, *, node_id: str = "", limits: ChannelLimits | None = None
    ) -> None:
        self.admit = admit
        self.node_id = node_id
        self.limits = limits or ChannelLimits()
        self.secret = os.urandom(SECRET_BYTES)
        self.counters = ChannelCounters()
        self._budget = Budget(self.limits.budget_bytes)
        self._servers: list[asyncio.Server] = []
        self._writers: set[asyncio.StreamWriter] = set()
        self._hellos = 0
        self._connections = 0
        self._unix_dir: str | None = None
        self._endpoints: Endpoints | None = None

    def __repr__(self) -> str:  # never the secret
        path = self._endpoints.unix_path if self._endpoints else None
        return f"ChannelServer(node_id={self.node_id!r}, unix_path={path!r})"

    async def start(self) -> Endpoints | None:
        """Open the Unix socket; ``None`` (logged) when it cannot be opened.

        Removes first the socket directories of this node's dead actors.
        """
        if self._endpoints is not None:
            return self._endpoints
        if not hasattr(socket, "AF_UNIX"):
            return None
        try:
            # Off the loop: it scans the temp dir, and makes a directory.
            self._unix_dir = await asyncio.to_thread(fresh_socket_dir)
            unix_path = os.path.join(self._unix_dir, "s")
            self._servers.append(
                await asyncio.start_unix_server(self._serve, unix_path, limit=_STREAM_LIMIT)
            )
        except OSError as exc:
            logger.warning("trajtrack channel: no Unix socket (%s)", exc)
            self._remove_dir()
            return None
        limits = self.limits
        self._endpoints = Endpoints(
            self.secret, self.node_id, unix_path, limits.max_payload_bytes, limits.idle_timeout
        )
        return self._endpoints

    @property
    def endpoints(self) -> Endpoints | None:
        """What :meth:`start` opened (``None`` before it ran, or when it could not)."""
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
        self._remove_dir()

    def _remove_dir(self) -> None:
        if self._unix_dir is not None:
            shutil.rmtree(self._unix_dir, ignore_errors=True)
            self._unix_dir = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            limits = self.limits
            if self._hellos >= limits.max_pending_hellos or self._full():
                self._busy(writer)
                return
            self._hellos += 1
            try:
                who = await self._hello(reader)
            finally:
                self._hellos -= 1
            if who is None:
                self.counters.refused += 1
                writer.write(REPLY.pack(REFUSED, 0))
            elif self._full():  # others finished their hellos meanwhile
                self._busy(writer)
            else:
                writer.write(REPLY.pack(OK, 0))
                self.counters.connections += 1
                self._connections += 1
                try:
                    await self._requests(reader, writer, who)
                finally:
                    self._connections -= 1
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away; what it was sending was not acknowledged
        finally:
            self._writers.discard(writer)
            writer.close()

    def _full(self) -> bool:
        return self._connections >= self.limits.max_connections

    def _busy(self, writer: asyncio.StreamWriter) -> None:
        self.counters.busy += 1
        writer.write(REPLY.pack(BUSY, 0))

    async def _hello(self, reader: asyncio.StreamReader) -> Who | None:
        """The client's identity, or ``None``: wrong secret or protocol, bad identity, too slow.

        Whatever goes wrong here ends this connection only, with a refusal.
        """
        try:
            async with asyncio.timeout(self.limits.hello_timeout):
                magic, version, secret, who_len = HELLO.unpack(await reader.readexactly(HELLO.size))
                good = (
                    magic == MAGIC
                    and version == VERSION
                    and hmac.compare_digest(secret, self.secret)
                    and who_len <= MAX_WHO_BYTES
                )
                return decode_who(await reader.readexactly(who_len)) if good else None
        except Exception:  # a timeout, a short read, a bad identity: refused, this one only
            return None

    async def _requests(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, who: Who
    ) -> None:
        while True:
            try:
                async with asyncio.timeout(self.limits.idle_timeout):
                    head = await reader.readexactly(REQUEST.size)
            except TimeoutError:
                return  # idle too long: clients do not reuse a connection idle half as long
            except asyncio.IncompleteReadError as exc:
                if exc.partial:
                    logger.warning("trajtrack channel: a client sent half a request")
                return  # closed between requests: the normal end
            kind, name_len, size = REQUEST.unpack(head)
            if (
                kind not in KINDS
                or name_len > MAX_NAME_BYTES
                or size > self.limits.max_payload_bytes
            ):
                await self._fatal(
                    reader,
                    writer,
                    ValueError(
                        f"bad request (kind {kind}, name {name_len} bytes, payload {size} bytes; "
                        f"payloads up to {self.limits.max_payload_bytes} bytes)"
                    ),
                )  # cannot resynchronize the stream
                return
            if not await self._request(reader, writer, who, (kind, name_len, size)):
                return
            if writer.transport.get_write_buffer_size() > _STREAM_LIMIT:
                await writer.drain()  # a client that sends without reading: stop reading too

    async def _request(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        who: Who,
        header: tuple[int, int, int],
    ) -> bool:
        """Receive and admit one request past its header; ``False``: the connection is over."""
        kind, name_len, size = header
        limits = self.limits
        try:
            async with asyncio.timeout(limits.budget_timeout):
                await self._budget.reserve(size)
        except TimeoutError:
            await self._fatal(
                reader,
                writer,
                TimeoutError(
                    f"the tracker actor's channel had no room for a {size}-byte dump within "
                    f"{limits.budget_timeout:g} s"
                ),
            )
            return False
        try:
            try:
                async with asyncio.timeout(limits.body_deadline(size)):
                    raw_name = await reader.readexactly(name_len)
                    data = await _read_payload(reader, size)
            except TimeoutError:
                await self._fatal(
                    reader,
                    writer,
                    TimeoutError(
                        f"a {size}-byte request did not arrive within "
                        f"{limits.body_deadline(size):g} s"
                    ),
                )
                return False
            except MemoryError:
                await self._fatal(reader, writer, MemoryError(f"no memory for a {size}-byte dump"))
                return False
            try:
                await self.admit(kind, data, raw_name.decode("utf-8"), who)
            except Exception as exc:  # the caller gets it, typed; the connection goes on
                self.counters.errors += 1
                self._reply_error(writer, exc)
            else:
                self.counters.dumps += 1
                writer.write(REPLY.pack(OK, 0))
        finally:
            self._budget.release(size)
        return True

    def _reply_error(
        self, writer: asyncio.StreamWriter, exc: BaseException, status: int = ERROR
    ) -> None:
        raw = encode_error(exc)
        writer.write(REPLY.pack(status, len(raw)) + raw)

    async def _fatal(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, exc: BaseException
    ) -> None:
        """Count an error, send a FATAL reply, then close without resetting the connection.

        Closing with unread bytes in the receive buffer makes the kernel send a reset, and the
        client would lose the reply: so stop writing, discard what the client still sends for a
        little while (bounded), then close.
        """
        self.counters.errors += 1
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


async def _read_payload(reader: asyncio.StreamReader, size: int) -> bytearray:
    """Exactly *size* bytes as a (writable) bytearray: tensors are rebuilt on it, not copied.

    The buffer is allocated once the first bytes are there (a header alone makes the server
    allocate nothing), a large one in a thread.
    """
    if size == 0:
        return bytearray()
    first = await reader.read(min(size, _STREAM_LIMIT))
    if not first:
        raise asyncio.IncompleteReadError(b"", size)
    if size <= _ALLOCATE_INLINE_MAX:
        buffer = bytearray(size)
    else:
        buffer = await asyncio.to_thread(bytearray, size)
    view = memoryview(buffer)
    view[: len(first)] = first
    position = len(first)
    while position < size:
        chunk = await reader.read(min(size - position, _STREAM_LIMIT))
        if not chunk:
            raise asyncio.IncompleteReadError(bytes(view[:position]), size)
        view[position : position + len(chunk)] = chunk
        position += len(chunk)
    return buffer
