"""Verdicts remembered by the bytes they depended on: :class:`Remembered`.

A check that reads only some bytes of its input (a pickle's opcodes and lengths, not its
numbers; a zip archive's headers, not its data) gives the same verdict to every input of the
same length that has the same bytes wherever it read. :class:`Remembered` keeps, for each input
checked, which bytes those were and what they held, as two integers, and answers an input
that matches one of them with one ``&`` and one comparison instead of the check.
"""

from __future__ import annotations

import threading
from typing import Final, Generic, TypeVar

__all__ = ["KEPT", "Remembered"]

T = TypeVar("T")

KEPT: Final = 255
"""A byte of a ``kept`` mask that the verdict depended on (the others are 0)."""


class Remembered(Generic[T]):
    """Up to :attr:`LIMIT` verdicts (the first ones given), each with the bytes it depended
    on; thread-safe."""

    LIMIT: Final = 64

    def __init__(self) -> None:
        self._by_length: dict[int, list[tuple[int, int, T]]] = {}
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
        value = int.from_bytes(data, "little")
        for keep, kept_value, verdict in candidates:
            if value & keep == kept_value:
                return verdict
        return None

    def add(self, data: bytes, kept: bytearray, verdict: T) -> None:
        """Remember the *verdict* on *data*, which depended on the bytes *kept* marks."""
        keep = int.from_bytes(kept, "little")
        entry = (keep, int.from_bytes(data, "little") & keep, verdict)
        with self._lock:
            if self._count < self.LIMIT:
                self._by_length.setdefault(len(data), []).append(entry)
                self._count += 1

    def clear(self) -> None:
        with self._lock:
            self._by_length, self._count = {}, 0
