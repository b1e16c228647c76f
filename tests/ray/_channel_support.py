"""Helpers for the channel's tests without a Ray cluster: a real server on a loop thread.

The server admits into a list, or raises what a tracker would raise, so that every reply the
client can get is exercised. Imported by the ``loop``/``serve``/``served`` fixtures
(conftest.py) and by the test modules; the module itself needs Ray installed (the package
does), so the test modules check for it first.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from trajtrack.ray._bounds import ChannelLimits
from trajtrack.ray._connection import ChannelClient
from trajtrack.ray._protocol import Endpoints
from trajtrack.ray._server import ChannelServer

WHO = ("host-a", 1234, 3, 1, 8)
WAIT = 30.0  # seconds for any wait on the loop thread
WHO_JSON = b'["h", 1, 0, 0, 1]'


@dataclass
class Admitted:
    """What the server admitted, and what it should raise next (by name)."""

    dumps: list[tuple[bytes, str, tuple[Any, ...]]] = field(default_factory=list)
    kinds: list[int] = field(default_factory=list)
    fail: dict[str, BaseException] = field(default_factory=dict)
    hold: dict[str, asyncio.Event] = field(default_factory=dict)

    async def __call__(self, kind: int, data: bytearray, name: str, who: tuple[Any, ...]) -> None:
        if name in self.hold:
            await self.hold[name].wait()
        if name in self.fail:
            raise self.fail[name]
        self.kinds.append(kind)
        self.dumps.append((bytes(data), name, who))


class Loop:
    """An asyncio loop in a thread, like the actor's."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, factory: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
        return asyncio.run_coroutine_threadsafe(factory(), self.loop).result(WAIT)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(WAIT)
        self.loop.close()


@dataclass
class Served:
    server: ChannelServer
    admitted: Admitted
    endpoints: Endpoints
    clients: list[ChannelClient]

    def client(self, **options: Any) -> ChannelClient:
        client = ChannelClient(self.endpoints, WHO, **options)
        self.clients.append(client)
        return client

    def connect(self) -> socket.socket:
        """A raw socket to the server, for crafted bytes."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(WAIT)
        sock.connect(self.endpoints.unix_path)
        return sock

    def hello(self, secret: bytes | None = None, who: bytes = WHO_JSON) -> bytes:
        """A hello's bytes (the right secret unless told otherwise)."""
        secret = self.server.secret if secret is None else secret
        return struct.pack("<4sB32sH", b"TTRK", 1, secret, len(who)) + who


def start_served(loop: Loop, limits: ChannelLimits | None = None) -> Served:
    admitted = Admitted()
    server = ChannelServer(admitted, node_id="node-1", limits=limits)
    endpoints = loop.run(server.start)
    assert endpoints is not None
    return Served(server, admitted, endpoints, [])


def stop_served(loop: Loop, served: Served) -> None:
    for client in served.clients:
        client.close()
    loop.run(served.server.aclose)


def read_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise AssertionError(f"connection closed after {len(data)} of {size} bytes")
        data += chunk
    return data


def reply_of(sock: socket.socket) -> tuple[int, bytes]:
    """One reply: its status and its error JSON (empty for OK)."""
    status, size = struct.unpack("<BI", read_exactly(sock, 5))
    return status, read_exactly(sock, size)


async def make_event() -> asyncio.Event:
    return asyncio.Event()
