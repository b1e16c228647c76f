"""A dependency-free progress bar on stderr, shown only to a person at a terminal."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """``Progress(total, label)``; ``update(done)``; ``close()``.

    Disabled (prints nothing) when *enabled* is False, or when it is None and the stream is not
    a terminal. Redraws at most ten times a second.
    """

    def __init__(
        self,
        total: int,
        label: str,
        *,
        enabled: bool | None = None,
        stream: TextIO | None = None,
    ) -> None:
        self._stream = stream if stream is not None else sys.stderr
        if enabled is None:
            enabled = bool(getattr(self._stream, "isatty", lambda: False)())
        self._enabled = enabled
        self._total = max(total, 0)
        self._label = label
        self._done = 0
        self._last_draw = 0.0
        self._started = time.monotonic()

    def update(self, done: int, *, force: bool = False) -> None:
        self._done = min(max(done, 0), self._total) if self._total else max(done, 0)
        now = time.monotonic()
        if self._enabled and (force or now - self._last_draw >= 0.1):
            self._last_draw = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        elapsed = now - self._started
        if self._total:
            fraction = self._done / self._total
            filled = int(fraction * 30)
            bar = "#" * filled + "-" * (30 - filled)
            text = f"\r{self._label} [{bar}] {self._done}/{self._total} {elapsed:5.1f}s"
        else:
            text = f"\r{self._label} {self._done} {elapsed:5.1f}s"
        self._stream.write(text)
        self._stream.flush()

    def close(self) -> None:
        if self._enabled:
            self._draw(time.monotonic())
            self._stream.write("\n")
            self._stream.flush()
