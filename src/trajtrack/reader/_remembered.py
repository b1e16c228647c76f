"""Verdicts remembered by the bytes they depended on: :class:`Remembered`.

A check that reads only some bytes of its input (a pickle's opcodes and lengths, not its
numbers; a zip archive's headers, not its data) gives the same verdict to every input of the
same length that has the same bytes wherever it read. :class:`Remembered` keeps, for each input
checked, which bytes those were and what they held, and answers an input that matches one of
them with a few comparisons instead of the check.

The bytes read are kept as *windows*: the stretches of the input that hold them, split where
more than :data:`GAP` bytes in a row were not read (an archive's tensor data between its
headers and its directory). Each window is two integers, a mask of the bytes read and what
they held, and a match converts only the windows' bytes to integers: for a 4 KB dump's
archive, about a thousand bytes of headers instead of all of them
(``benchmarks/bench_small_reads.py``).
"""

from __future__ import annotations

import threading
from typing import Final, Generic, TypeVar

__all__ = ["GAP", "KEPT", "Remembered"]

T = TypeVar("T")

KEPT: Final = 255
"""A byte of a ``kept`` mask that the verdict depended on (the others are 0)."""

GAP: Final = 256
"""Unread bytes in a row that split the bytes read into two windows."""

_Window = tuple[int, int, int, int]  # (start, end, mask, masked value) of data[start:end]


class Remembered(Generic[T]):
    """Up to :attr:`LIMIT` verdicts (the first ones given), each with the bytes it depended
    on; thread-safe."""

    LIMIT: Final = 64

    def __init__(self) -> None:
        self._by_length: dict[int, list[tuple[tuple[_Window, ...], T]]] = {}
        self._count = 0
        self._lock = threading.Lock()

    @property
    def full(self) -> bool:
        return self._count >= self.LIMIT

    def match(self, data: bytes) -> T | None:
        """The verdict of a remembered input that *data* matches wherever it was read."""
        candidates = self._by_length.get(len(data))
        if not candidates:
            return None
        from_bytes = int.from_bytes
        for windows, verdict in candidates:
            for start, end, keep, kept_value in windows:
                if from_bytes(data[start:end], "little") & keep != kept_value:
                    break
            else:
                return verdict
        return None

    def add(self, data: bytes, kept: bytearray, verdict: T) -> None:
        """Remember the *verdict* on *data*, which depended on the bytes *kept* marks."""
        windows = tuple(
            (start, end, keep := int.from_bytes(kept[start:end], "little"),
             int.from_bytes(data[start:end], "little") & keep)
            for start, end in windows_of(kept)
        )  # fmt: skip
        with self._lock:
            if self._count < self.LIMIT:
                self._by_length.setdefault(len(data), []).append((windows, verdict))
                self._count += 1

    def clear(self) -> None:
        with self._lock:
            self._by_length, self._count = {}, 0


def windows_of(kept: bytes | bytearray) -> list[tuple[int, int]]:
    """``(start, end)`` of each stretch of *kept* that holds its read bytes (non-zero), split
    where more than :data:`GAP` zero bytes lie in a row; every read byte is in one of them."""
    windows: list[tuple[int, int]] = []
    size = len(kept)
    gap = bytes(GAP + 1)
    at = _next_read(kept, 0)
    while at < size:
        hole = kept.find(gap, at)  # the next run of more than GAP unread bytes
        end = size if hole < 0 else hole
        windows.append((at, end))
        at = size if hole < 0 else _next_read(kept, hole)
    return windows


def _next_read(kept: bytes | bytearray, at: int) -> int:
    """Where the first read byte at or after *at* is (``len(kept)`` when there is none)."""
    stripped = kept[at:].lstrip(b"\x00")
    return len(kept) - len(stripped)
