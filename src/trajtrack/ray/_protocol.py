"""The direct channel's protocol: frames, status codes, errors on the wire, endpoints.

An acknowledged ``dump_data`` through Ray's task path costs a whole actor call (task
submission, scheduling on the actor's event loop, the reply object), while the work itself is
to move some bytes to another process and hear back that they were queued. So the actor also
listens on a Unix socket of its own, in a fresh ``0700`` directory on its node: callers on that
node that learned its path and secret through one Ray call send each dump as one frame and read
one small reply. Callers on other nodes use Ray's own calls, which carry Ray's TLS and
authentication where the cluster turns them on; trajtrack opens no network port.

Protocol (all integers little-endian; one connection serves one writer process):

* the client opens with ``HELLO``: ``b"TTRK"``, the protocol version, the actor's 32-byte
  secret and the length of the writer identity, then the identity as JSON
  (``[host, pid, rank, local_rank, world_size]``); the server answers with one reply (status
  ``OK``), or closes the connection after a ``REFUSED`` reply when anything is wrong, or a
  ``BUSY`` one when it holds as many connections (or unfinished hellos) as it takes;
* then any number of requests: kind, name length, payload length, the UTF-8 name, the
  payload: ``DUMP``, the serialized dump (``torch.save`` bytes), or ``PLAIN``, plain data as a
  JSON skeleton plus raw tensor bytes (:mod:`trajtrack.ray._wire`), which the actor rebuilds
  and serializes in its upload workers. The server admits them to the tracker one after the
  other, in the order they arrive, and answers each with one reply: ``OK``, or ``ERROR``
  followed by a JSON ``{"type": ..., "message": ...}`` naming the exception, or ``FATAL`` (the
  same, after which the server hangs up: a request it cannot read past). A client may send
  several requests before reading their replies (the pipelined sender does); replies come in
  order.

The secret travels only inside Ray's own calls and is compared in constant time; the socket's
directory already keeps out other users (the secret keeps out the actor's own user's processes
that did not ask Ray). The writer identity a client sends is not checked: any process that
has the secret may claim any host, pid or rank, and records and name templates show what it
claimed. The socket carries dumps one way and status codes the other: nothing received is
unpickled or executed, by either side (a ``DUMP`` payload is stored as it came, never loaded).

The actor's side is :mod:`trajtrack.ray._server` (:class:`~trajtrack.ray._server.ChannelServer`,
on any asyncio loop), the caller's :mod:`trajtrack.ray._connection`
(:class:`~trajtrack.ray._connection.ChannelClient`, in any thread). None of the three imports
Ray.
"""

from __future__ import annotations

import builtins
import json
import logging
import struct
from dataclasses import dataclass, field
from typing import Any, Final

import trajtrack._exceptions as _exceptions
from trajtrack._exceptions import TrajtrackError
from trajtrack.ray._wire_encode import Encoded

__all__ = [
    "BUSY",
    "ERROR",
    "FATAL",
    "HELLO",
    "HELLO_TIMEOUT",
    "KINDS",
    "KIND_DUMP",
    "KIND_PLAIN",
    "MAGIC",
    "MAX_ERROR_BYTES",
    "MAX_NAME_BYTES",
    "MAX_WHO_BYTES",
    "OK",
    "REFUSED",
    "REPLY",
    "REQUEST",
    "SECRET_BYTES",
    "VERSION",
    "ChannelBrokenError",
    "Endpoints",
    "Payload",
    "Who",
    "decode_error",
    "decode_who",
    "encode_error",
    "encode_who",
    "payload_size",
]

logger = logging.getLogger(__name__)

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
OK, ERROR, REFUSED, FATAL, BUSY = 0, 1, 2, 3, 4
"""Reply statuses; ``FATAL`` is an error after which the server closes the connection;
``BUSY``: the server holds as many connections as it takes (it closes this one)."""


HELLO: Final = struct.Struct("<4sB32sH")  # magic, version, secret, identity length
REQUEST: Final = struct.Struct("<BHQ")  # kind, name length, payload length
REPLY: Final = struct.Struct("<BI")  # status, length of the error JSON that follows

MAX_NAME_BYTES = 4096
MAX_WHO_BYTES = 4096
MAX_ERROR_BYTES = 64 << 10
HELLO_TIMEOUT = 2.0
"""Seconds a new connection has to present the secret and its identity (a local socket: a
well-behaved client sends its hello at once)."""
_INT64 = 1 << 63


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
    """Where an actor's channel listens, the secret it wants, and its limits.

    Attributes:
        secret: The 32 bytes a client presents in its hello (kept out of ``repr``).
        node_id: The Ray node of the actor (the Unix socket only works on that node).
        unix_path: The Unix socket.
        max_payload_bytes: The largest payload the server reads; a client sends larger dumps
            as Ray calls.
        idle_timeout: Seconds the server keeps a connection with no request open; a client
            does not reuse a connection idle for half as long.
    """

    secret: bytes = field(repr=False)
    node_id: str
    unix_path: str
    max_payload_bytes: int
    idle_timeout: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "secret": self.secret.hex(),
            "node_id": self.node_id,
            "unix_path": self.unix_path,
            "max_payload_bytes": self.max_payload_bytes,
            "idle_timeout": self.idle_timeout,
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Endpoints:
        return cls(
            secret=bytes.fromhex(raw["secret"]),
            node_id=str(raw["node_id"]),
            unix_path=str(raw["unix_path"]),
            max_payload_bytes=int(raw["max_payload_bytes"]),
            idle_timeout=float(raw["idle_timeout"]),
        )


def payload_size(payload: Payload) -> int:
    """The bytes *payload* puts on the wire."""
    return payload.size if isinstance(payload, Encoded) else len(payload)


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


def encode_who(who: Who) -> bytes:
    return json.dumps(list(who)).encode()


def decode_who(raw: bytes) -> Who:
    """The writer identity of a hello, checked for shape only (it is not authenticated).

    Raises:
        ValueError: Not ``[str, int, int, int, int]`` with 64-bit integers.
    """
    try:
        fields = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting in 4 KiB of JSON
        raise ValueError(f"bad writer identity: {type(exc).__name__}") from None
    if (
        type(fields) is not list
        or len(fields) != 5
        or type(fields[0]) is not str
        or not all(type(v) is int and -_INT64 <= v < _INT64 for v in fields[1:])
    ):
        raise ValueError("bad writer identity")
    host, pid, rank, local_rank, world_size = fields
    return (host, pid, rank, local_rank, world_size)
