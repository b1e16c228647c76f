"""The direct channel, the actor's side: an asyncio server admitting dumps as they arrive.

Listens on a Unix socket (in a fresh ``0700`` directory) and on TCP, checks each connection's
hello (:mod:`trajtrack.ray._protocol`), then reads requests and admits them through the
callback it was given, one after the other, answering each in order. It runs on the loop it
is started on (the actor's, next to its tracker) and has no Ray import.
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
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from trajtrack.ray._protocol import (
    ERROR,
    FATAL,
    HELLO,
    HELLO_TIMEOUT,
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

__all__ = ["Admit", "ChannelCounters", "ChannelServer"]

logger = logging.getLogger(__name__)

_STREAM_LIMIT = 1 << 20
_LINGER_SECONDS = 2.0
_LINGER_MAX_BYTES = 64 << 20

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
                magic, version, secret, who_len = HELLO.unpack(await reader.readexactly(HELLO.size))
                good = (
                    magic == MAGIC
                    and version == VERSION
                    and hmac.compare_digest(secret, self.secret)
                    and who_len <= MAX_WHO_BYTES
                )
                who = decode_who(await reader.readexactly(who_len)) if good else None
        except (TimeoutError, ValueError, asyncio.IncompleteReadError):
            who = None
        if who is None:
            self.counters.refused += 1
            writer.write(REPLY.pack(REFUSED, 0))
            return None
        writer.write(REPLY.pack(OK, 0))
        return who

    async def _requests(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, who: Who
    ) -> None:
        while True:
            try:
                head = await reader.readexactly(REQUEST.size)
            except asyncio.IncompleteReadError as exc:
                if exc.partial:
                    logger.warning("trajtrack channel: a client sent half a request")
                return  # closed between requests: the normal end
            kind, name_len, size = REQUEST.unpack(head)
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
                writer.write(REPLY.pack(OK, 0))
            if writer.transport.get_write_buffer_size() > _STREAM_LIMIT:
                await writer.drain()  # a client that sends without reading: stop reading too

    def _reply_error(
        self, writer: asyncio.StreamWriter, exc: BaseException, status: int = ERROR
    ) -> None:
        raw = encode_error(exc)
        writer.write(REPLY.pack(status, len(raw)) + raw)

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
