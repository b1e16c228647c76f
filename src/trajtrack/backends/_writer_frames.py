"""The writer process's protocol, the parent's side: frames out, answers in.

What a batch looks like on the helper's socket (:mod:`._writer_child` documents the format),
and what each answer becomes for the caller. Used by :class:`._writer_process.WriterProcess`
from a thread and by :mod:`._writer_channel` from the event loop.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence
from typing import Final

from trajtrack.backends import _writer_child as child
from trajtrack.backends._staging import Block

__all__ = [
    "Failure",
    "Report",
    "WriterGone",
    "encode_append",
    "encode_frame",
    "read_results",
    "split_answers",
    "unreported",
]


class Failure:
    """A file the helper could not write: which step failed (``"creating"``...), and ``errno``."""

    __slots__ = ("error", "exists", "operation")

    def __init__(self, operation: int, error: int) -> None:
        self.operation = child.OPERATIONS.get(operation, "writing")
        self.exists = operation == child.OP_EXISTS
        self.error = error

    def oserror(self, where: str) -> OSError:
        return OSError(self.error, os.strerror(self.error), where)


class WriterGone(Exception):
    """The helper could not be started, or exited before reporting a file."""


Report = Callable[[int, "Failure | WriterGone | None"], None]
"""``report(index, outcome)``: None for a file written."""


def encode_frame(
    items: Sequence[tuple[str, str, memoryview | Block]],
    *,
    overwrite: bool,
    fsync: bool,
    mode: int,
) -> bytes:
    parts: list[bytes | memoryview] = [b""]
    pack = child.ITEM.pack
    length = 0
    for temp, name, data in items:
        temp_b, name_b = temp.encode(), name.encode()
        if isinstance(data, Block):  # in the arena: the helper reads it there
            head = pack(len(temp_b), len(name_b), data.nbytes, data.offset)
            parts += (head, temp_b, name_b)
            length += len(head) + len(temp_b) + len(name_b)
            continue
        head = pack(len(temp_b), len(name_b), data.nbytes, child.INLINE)
        parts += (head, temp_b, name_b, data)
        length += len(head) + len(temp_b) + len(name_b) + data.nbytes
    flags = (child.OVERWRITE if overwrite else 0) | (child.FSYNC if fsync else 0)
    parts[0] = child.HEADER.pack(len(items), flags, mode, length, 0)
    return b"".join(parts)


APPEND_MAX: Final = (1 << 32) - 1
"""Bytes one :func:`encode_append` frame can carry (an item's data length is 32 bits)."""


def encode_append(position: int, pieces: Sequence[bytes | memoryview]) -> bytes:
    """A frame that writes *pieces*, in order, into a file from *position* on (one item)."""
    size = sum(memoryview(piece).nbytes for piece in pieces)
    if size > APPEND_MAX:
        raise ValueError(f"{size} bytes are more than one frame carries")
    head = child.HEADER.pack(1, child.APPEND, 0, child.ITEM.size + size, position)
    return b"".join([head, child.ITEM.pack(0, 0, size, child.INLINE), *pieces])


def unreported(report: Report, start: int, count: int, lost: str | None) -> None:
    """The files from *start* on were not answered: each fails as not written (retryable)."""
    for index in range(start, count):
        report(index, WriterGone(f"the writer process did not write this file ({lost})"))


def split_answers(received: bytes) -> tuple[list[tuple[int, int, int]], bytes]:
    """The whole answers in *received* (status, operation, ``errno``), and the bytes of a
    partial one that remain."""
    whole = len(received) - len(received) % child.RESULT.size
    return list(child.RESULT.iter_unpack(received[:whole])), received[whole:]


def read_results(sock: socket.socket, count: int, report: Report) -> None:
    """Read *count* results, reporting each as it comes."""
    pending = b""
    reported = 0
    while reported < count:
        chunk = sock.recv(child.RESULT.size * (count - reported) - len(pending))
        if not chunk:
            raise WriterGone("the writer process exited")
        answers, pending = split_answers(pending + chunk)
        for status, operation, error in answers:
            report(reported, None if status == child.WRITTEN else Failure(operation, error))
            reported += 1
