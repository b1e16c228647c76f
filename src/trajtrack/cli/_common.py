"""Helpers shared by the commands: streams, tables, sizes, times, JSON, progress, errors."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from trajtrack._progress import Progress

__all__ = [
    "EXIT_DIFFERENT",
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_OUTPUT_CLOSED",
    "SUMMARIES",
    "Streams",
    "add_output_options",
    "format_size",
    "format_time",
    "progress_callback",
    "table",
    "write_json",
]

SUMMARIES = {
    "ls": "list the dumps of a run",
    "show": "show the structure of one dump",
    "diff": "compare two runs dump by dump",
    "verify": "check every recorded dump's presence, size and checksum",
    "export": "write any run (sharded, files, or a mix) in the files layout",
    "demo": "simulate two rollouter runs, then list and diff them",
}
"""Each command's one line in ``trajtrack --help`` (known without importing the command)."""

EXIT_OK = 0
EXIT_DIFFERENT = 1  # diff: the runs differ; verify: problems found
EXIT_ERROR = 2  # usage error, unreadable storage, undeserializable dump
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT, as a shell reports a process it killed)
EXIT_OUTPUT_CLOSED = 141  # stdout closed early (`| head`): 128 + SIGPIPE, as git and coreutils


@dataclass(frozen=True, slots=True)
class Streams:
    """Where a command writes: results to *out*, messages and progress bars to *err*."""

    out: TextIO
    err: TextIO

    def line(self, text: str = "") -> None:
        self.out.write(text + "\n")

    def note(self, text: str) -> None:
        self.err.write(text + "\n")


def add_output_options(parser: argparse.ArgumentParser, *, progress: bool = False) -> None:
    """``--json`` (and, for commands reading many files, ``--quiet`` and ``--concurrency``)."""
    parser.add_argument(
        "--json", action="store_true", help="print machine-readable JSON on stdout instead"
    )
    if progress:
        parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar on stderr")
        parser.add_argument(
            "--concurrency",
            type=positive_int,
            default=16,
            metavar="N",
            help="files read in parallel (default: %(default)s)",
        )


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a float >= 0 (no NaN)."""
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def progress_callback(
    streams: Streams, label: str, *, quiet: bool
) -> tuple[Callable[[int, int], None], Callable[[], None]]:
    """A ``(done, total)`` callback drawing a bar on stderr, and a function closing it."""
    bars: dict[str, Progress] = {}

    def update(done: int, total: int) -> None:
        bar = bars.get("bar")
        if bar is None:
            bar = bars["bar"] = Progress(
                total, label, enabled=False if quiet else None, stream=streams.err
            )
        bar.update(done)

    def close() -> None:
        bar = bars.pop("bar", None)
        if bar is not None:
            bar.close()

    return update, close


def write_json(streams: Streams, data: Any) -> None:
    """Strict JSON on stdout (non-finite floats written as strings)."""
    streams.out.write(json.dumps(_finite(data), indent=2, sort_keys=False) + "\n")


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def format_size(size: int | None) -> str:
    """``1.5 MiB``-style sizes (bytes below 1 KiB)."""
    if size is None:
        return "-"
    if size < 1024:
        return f"{size} B"
    value = float(size)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}"
    return f"{size} B"  # pragma: no cover - the loop always returns


def format_time(timestamp: float | None) -> str:
    """UTC ISO time with milliseconds, ``-`` when unknown."""
    if timestamp is None:
        return "-"
    moment = dt.datetime.fromtimestamp(timestamp, tz=dt.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def printable(text: str) -> str:
    """*text* with every character a terminal would act on shown as a visible escape.

    A run's names, writers, paths and problems are run-supplied: printed raw, an ESC sequence
    would recolour or rewrite the terminal, a BEL ring it, a CR or LF forge an output line.
    Each character that is not printable (``str.isprintable``: control characters, line and
    paragraph separators, bidirectional overrides and other format characters) is written as
    ``\\xNN``, ``\\uNNNN`` or ``\\UNNNNNNNN``; printable text is returned as it is.
    """
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else _escaped(char) for char in text)


def _escaped(char: str) -> str:
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], *, right: Sequence[int] = ()
) -> list[str]:
    """Fixed-width columns; the indices in *right* are right-aligned."""
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def fmt(row: Sequence[str]) -> str:
        cells = [
            cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ]
        return "  ".join(cells).rstrip()

    return [fmt(headers), *(fmt(row) for row in rows)]
