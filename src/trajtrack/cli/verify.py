"""``trajtrack verify URL``: every recorded dump present, with its recorded size and checksum."""

from __future__ import annotations

import argparse
import zlib
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import anyio.to_thread

from trajtrack._exceptions import StorageNotFoundError
from trajtrack.backends import checksum_of
from trajtrack.cli._common import (
    EXIT_DIFFERENT,
    EXIT_OK,
    SUMMARIES,
    Streams,
    add_output_options,
    format_size,
    printable,
    progress_callback,
    table,
    write_json,
)

if TYPE_CHECKING:
    from trajtrack.reader import DumpInfo, Run

__all__ = ["Finding", "add_parser", "run", "verify_run"]


Problem = Literal["ok", "missing", "truncated", "oversized", "corrupt", "unrecorded", "outside"]


class Finding(NamedTuple):
    """The verdict on one dump (an immutable named tuple: one per dump of the run)."""

    name: str
    path: str
    problem: Problem
    detail: str

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": self.path,
            "problem": self.problem,
            "detail": self.detail,
        }


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "verify",
        help=SUMMARIES["verify"],
        description=(
            "Check the run against its record: every recorded dump must be present with the "
            "recorded size and CRC-32 checksum (each file with the right size is read once, "
            "in parallel; a shard member with one ranged read of its bytes). Reports missing, "
            "truncated (shorter than recorded), oversized, corrupt (checksum mismatch: the "
            "dump whose bytes changed is named), unrecorded files (present but in no record, "
            "e.g. the last seconds before a crash) and dumps whose path would leave the run "
            "(outside: never read). Unreadable record lines are reported too."
        ),
        epilog="exit codes: 0 no problem, 1 problems found (unrecorded files count unless "
        "--allow-unrecorded; a run with no dumps, nothing verified, counts too), 2 usage or "
        "I/O error.",
    )
    parser.add_argument("url", metavar="URL", help="the run: a local path or a storage URL")
    parser.add_argument(
        "--allow-unrecorded",
        action="store_true",
        help="report files in no record, but do not fail because of them",
    )
    parser.add_argument("-g", "--glob", metavar="G", help="only dumps matching this glob")
    add_output_options(parser, progress=True)
    parser.set_defaults(handler=run)


async def verify_run(
    source: Run, glob: str | None = None, *, on_progress: Any = None
) -> list[Finding]:
    """Verify a run's dumps against its record; one :class:`Finding` per dump, dump order."""
    from trajtrack.reader import dump_batches, gather_bounded  # not at import: no torch

    dumps = await source.list(glob)
    to_read = [
        d
        for d in dumps
        if d.recorded and d.present and d.stored_size == d.size and d.problem is None
    ]

    reader = source.blocking_reader()
    one_thread = anyio.CapacityLimiter(1)

    async def check(batch: list[DumpInfo]) -> list[Finding]:
        if reader is not None and len(batch) > 1:  # local, small: read and checksum in one hop
            found = await anyio.to_thread.run_sync(
                lambda: _findings(batch, reader(batch)), limiter=one_thread
            )
        else:  # read (a span of shard members at a time), checksummed in one thread hop
            data = await source.read_many(batch)
            found = await anyio.to_thread.run_sync(_findings, batch, data)
        done[0] += len(batch)
        if on_progress is not None:
            on_progress(done[0], len(to_read))
        return found

    done = [0]
    try:
        batches = await gather_bounded(dump_batches(to_read), check, limit=source.concurrency)
    finally:  # every worker thread is done: a cancelled hop waits for its thread
        if reader is not None:
            reader.close()
    read = [finding for batch in batches for finding in batch]
    by_path = {f.path: f for f in read}
    findings = []
    for info in dumps:
        if info.path in by_path:
            findings.append(by_path[info.path])
        elif info.problem is not None:
            findings.append(Finding(info.name, info.path, "outside", f"not read: {info.problem}"))
        elif not info.recorded:
            findings.append(
                Finding(
                    info.name, info.path, "unrecorded", f"in no record ({format_size(info.size)})"
                )
            )
        elif not info.present:
            findings.append(
                Finding(info.name, info.path, "missing", f"recorded {info.size} bytes, file absent")
            )
        else:
            findings.append(_size_finding(info, info.stored_size or 0))
    return findings


def _findings(batch: list[DumpInfo], data: list[bytes | Exception]) -> list[Finding]:
    """The verdicts on the bytes read for each dump of *batch* (blocking: checksums them)."""
    found: list[Finding] = []
    append = found.append
    crc32 = zlib.crc32
    for info, read in zip(batch, data, strict=True):
        # Written out for the common case (a run's every dump: no call but the checksum).
        if (
            type(read) is bytes
            and len(read) == info.size
            and info.checksum == f"crc32:{crc32(read):08x}"  # as checksum_of writes it
        ):
            append(Finding(info.name, info.path, "ok", ""))
        else:
            append(_finding(info, read))
    return found


def _finding(info: DumpInfo, data: bytes | Exception) -> Finding:
    """The verdict on the bytes read for *info* (blocking: computes their checksum)."""
    if isinstance(data, StorageNotFoundError):
        return Finding(info.name, info.path, "missing", "deleted while verifying")
    if isinstance(data, Exception):
        raise data
    if len(data) != info.size:
        return _size_finding(info, len(data))
    actual = checksum_of(data)
    if actual != info.checksum:
        return Finding(
            info.name, info.path, "corrupt", f"checksum {actual}, recorded {info.checksum}"
        )
    return Finding(info.name, info.path, "ok", "")


def _size_finding(info: DumpInfo, actual: int) -> Finding:
    if actual < info.size:
        return Finding(
            info.name, info.path, "truncated", f"{actual} bytes stored, {info.size} recorded"
        )
    return Finding(
        info.name, info.path, "oversized", f"{actual} bytes stored, {info.size} recorded"
    )


async def run(args: argparse.Namespace, streams: Streams) -> int:
    from trajtrack.reader import open_run  # not at import: `trajtrack --help` needs no torch

    update, close = progress_callback(streams, "verify", quiet=args.quiet)
    async with open_run(args.url, concurrency=args.concurrency) as source:
        listing = await source.scan()
        try:
            findings = await verify_run(source, args.glob, on_progress=update)
        finally:
            close()
    counts: dict[str, int] = dict.fromkeys(
        ("ok", "missing", "truncated", "oversized", "corrupt", "unrecorded", "outside"), 0
    )
    for finding in findings:
        counts[finding.problem] += 1
    failing = {"missing", "truncated", "oversized", "corrupt", "outside"}
    if not args.allow_unrecorded:
        failing.add("unrecorded")
    # A run with no dumps (an empty folder, a mistyped --glob) verified nothing: not "OK".
    empty = not findings
    failed = empty or any(f.problem in failing for f in findings) or listing.bad_record_lines > 0
    code = EXIT_DIFFERENT if failed else EXIT_OK
    if args.json:
        write_json(
            streams,
            {
                "url": args.url,
                "ok": not failed,
                "exit_code": code,
                "no_dumps": empty,
                "counts": counts,
                "bad_record_lines": listing.bad_record_lines,
                "problems": [f.to_json() for f in findings if f.problem != "ok"],
            },
        )
        return code
    problems = [f for f in findings if f.problem != "ok"]
    if problems:
        for line in table(
            ["PROBLEM", "NAME", "DETAIL"],
            [[f.problem, printable(f.name), printable(f.detail)] for f in problems],
        ):
            streams.line(line)
    if listing.bad_record_lines:
        streams.line(f"{listing.bad_record_lines} unreadable record lines were skipped")
    if empty:
        matching = f" matching {args.glob!r}" if args.glob else ""
        streams.line(f"FAILED: the run has no dumps{matching}: nothing to verify")
        return code
    summary = ", ".join(f"{n} {k}" for k, n in counts.items() if n or k == "ok")
    verdict = "FAILED" if failed else "OK"
    streams.line(f"{verdict}: {len(findings)} dumps checked: {summary}")
    return code
