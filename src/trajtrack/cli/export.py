"""``trajtrack export URL DEST [--glob G]``: any run, written out in the files layout."""

from __future__ import annotations

import argparse
import functools
from typing import TYPE_CHECKING, Any

import anyio.to_thread

from trajtrack._exceptions import TrajtrackError
from trajtrack.backends import open_storage
from trajtrack.cli._common import (
    EXIT_DIFFERENT,
    EXIT_ERROR,
    EXIT_OK,
    SUMMARIES,
    Streams,
    add_output_options,
    format_size,
    printable,
    progress_callback,
    write_json,
)

if TYPE_CHECKING:
    from trajtrack.reader import ExportResult

__all__ = ["add_parser", "run"]


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "export",
        help=SUMMARIES["export"],
        description=(
            "Copy every dump of the run at URL to DEST as <name>.pth files, the files "
            "layout that plain torch.load(path) scripts read, together with a record "
            "(so that ls/show/diff/verify work on the copy). The bytes are copied unchanged; "
            "a dump whose bytes do not match its recorded checksum, or that cannot be read, "
            "is not copied but reported. Exporting again is safe: a dump DEST already holds "
            "with the same bytes is counted as unchanged, one it holds with other bytes is "
            "reported by name and kept (--overwrite replaces it). A file named with a "
            "control character (no record can hold it) and a dump whose place DEST fills "
            "with something else (a folder) are skipped and reported too; the others are "
            "exported. DEST may be a local path or any storage URL, but not the run, a "
            "folder inside it, or one holding it (refused before anything is written)."
        ),
        epilog="exit codes: 0 every dump exported (or already there), 1 some dumps were "
        "skipped (reported), 2 usage or I/O error, or DEST the run, inside it or holding it "
        '(with --json, JSON with an "error" too).',
    )
    parser.add_argument("url", metavar="URL", help="the run to export")
    parser.add_argument("dest", metavar="DEST", help="where to write the files layout")
    parser.add_argument("-g", "--glob", metavar="G", help="only dumps matching this glob")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace files that already exist in DEST"
    )
    add_output_options(parser, progress=True)
    parser.set_defaults(handler=run)


async def run(args: argparse.Namespace, streams: Streams) -> int:
    try:
        result = await _export(args, streams)
    except (TrajtrackError, OSError) as exc:
        if not args.json:
            raise  # the command line's own error line, exit 2
        streams.note(f"trajtrack export: error: {exc}")
        write_json(streams, {"url": args.url, "dest": args.dest, "error": str(exc), "exit_code": 2})
        return EXIT_ERROR
    code = EXIT_DIFFERENT if result.skipped else EXIT_OK
    if args.json:
        write_json(
            streams,
            {
                "url": args.url,
                "dest": args.dest,
                "written": result.written,
                "unchanged": result.unchanged,
                "bytes_written": result.bytes_written,
                "skipped": [{"name": n, "reason": r} for n, r in result.skipped],
                "existing": list(result.existing),
                "exit_code": code,
            },
        )
        return code
    for name, reason in result.skipped:
        streams.line(printable(f"SKIPPED  {name}: {reason}"))
    if result.existing:
        streams.note(
            f"trajtrack export: {len(result.existing)} dumps are in {args.dest} already with "
            f"other bytes (the first: {result.existing[0]}); rerun with --overwrite to replace "
            "them"
        )
    unchanged = f"; {result.unchanged} already there, unchanged" if result.unchanged else ""
    streams.line(
        f"exported {result.written} dumps ({format_size(result.bytes_written)}) to {args.dest}"
        + unchanged
        + (f"; {len(result.skipped)} skipped" if result.skipped else "")
    )
    return code


async def _export(args: argparse.Namespace, streams: Streams) -> ExportResult:
    from trajtrack.reader import export_run, open_run  # not at import: no torch for --help

    update, close = progress_callback(streams, "export", quiet=args.quiet)
    destination = await anyio.to_thread.run_sync(functools.partial(open_storage, args.dest))
    try:
        async with open_run(args.url, concurrency=args.concurrency) as source:
            try:
                return await export_run(
                    source,
                    destination,
                    glob=args.glob,
                    overwrite=args.overwrite,
                    on_progress=update,
                )
            finally:
                close()
    finally:
        await destination.aclose()
