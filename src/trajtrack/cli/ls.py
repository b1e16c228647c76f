"""``trajtrack ls URL [--glob G]``: the dumps of a run, in dump order."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from trajtrack.cli._common import (
    EXIT_OK,
    SUMMARIES,
    Streams,
    add_output_options,
    format_size,
    format_time,
    printable,
    table,
    write_json,
)

if TYPE_CHECKING:
    from trajtrack.reader import DumpInfo

__all__ = ["add_parser", "run"]


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "ls",
        help=SUMMARIES["ls"],
        description=(
            "List the dumps of a run in dump order (commit time, then name), from the record "
            "the trackers wrote; files in no record are listed too and flagged 'unrecorded', "
            "recorded files absent from the storage are flagged 'missing', and dumps whose "
            "path would leave the run (a hostile record, a symbolic link leading elsewhere) "
            "'refused'. Sharded and files runs alike. Temporary files are never listed. "
            "Exit 0, or 2 when the run cannot be read."
        ),
    )
    parser.add_argument("url", metavar="URL", help="the run: a local path or a storage URL")
    parser.add_argument(
        "-g", "--glob", metavar="G", help="only names (or paths) matching this fnmatch glob"
    )
    add_output_options(parser)
    parser.set_defaults(handler=run)


async def run(args: argparse.Namespace, streams: Streams) -> int:
    from trajtrack.reader import open_run  # not at import: `trajtrack --help` needs no torch

    async with open_run(args.url) as source:
        listing = await source.scan()
        dumps = await source.list(args.glob)
    if args.json:
        write_json(
            streams,
            {
                "url": args.url,
                "dumps": [d.to_json() for d in dumps],
                "record_segments": listing.segments,
                "bad_record_lines": listing.bad_record_lines,
            },
        )
        return EXIT_OK
    headers = ["NAME", "SIZE", "WRITER", "TIME"]
    rows = [
        [printable(d.name), format_size(d.size), printable(d.writer) or "-", format_time(d.time)]
        for d in dumps
    ]
    notes = [printable(_note(d)) for d in dumps]
    if any(notes):
        headers.append("NOTE")
        for row, note in zip(rows, notes, strict=True):
            row.append(note)
    for text in table(headers, rows, right=(1,)):
        streams.line(text)
    total = sum(d.size for d in dumps)
    streams.line(f"{len(dumps)} dumps, {format_size(total)}")
    return EXIT_OK


def _note(info: DumpInfo) -> str:
    if info.problem is not None:
        return f"refused: {info.problem}"
    if not info.recorded:
        return "unrecorded"
    if not info.present:
        return "missing"
    return ""
