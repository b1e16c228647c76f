"""The ``trajtrack`` command: ``ls``, ``show``, ``diff``, ``verify``, ``export`` and ``demo``.

Exit codes (all commands): 0 success; 1 the answer is "no" (``diff``: the runs differ,
``verify``: problems found); 2 usage error, unreadable storage or undeserializable dump;
130 interrupted. Results go to stdout (``--json`` for scripts), messages and progress bars to
stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import TextIO

import anyio
import torch

import trajtrack.cli.demo as demo
import trajtrack.cli.diff as diff
import trajtrack.cli.export as export
import trajtrack.cli.ls as ls
import trajtrack.cli.show as show
import trajtrack.cli.verify as verify
from trajtrack._exceptions import TrajtrackError
from trajtrack.cli._collector import collected_every
from trajtrack.cli._common import EXIT_ERROR, Streams, printable
from trajtrack.reader import allow_in_this_process

__all__ = ["build_parser", "main"]

_COMMANDS = (ls, show, diff, verify, export, demo)

_EPILOG = """\
exit codes:
  0    success (diff: equal within tolerance; verify: no problem)
  1    diff: the runs differ; verify: problems found; export: dumps skipped
  2    usage error, unreadable storage, or a dump that cannot be loaded
  130  interrupted

URLs: a local path, file://PATH, memory://STORE/PATH, webhdfs://HOST:PORT/PATH,
swebhdfs://..., hdfs://NAMESERVICE/PATH (resolved through HADOOP_CONF_DIR).
"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with one subcommand per module in :data:`_COMMANDS`."""
    from trajtrack import __version__

    parser = argparse.ArgumentParser(
        prog="trajtrack",
        description="Inspect, compare and verify the dumps trajtrack wrote.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"trajtrack {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="log more on stderr (-vv: debug)"
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in _COMMANDS:
        module.add_parser(commands)
    return parser


def main(
    argv: Sequence[str] | None = None,
    *,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """Run the ``trajtrack`` command line; returns the exit code.

    It runs as the owner of its process: it adds trajtrack's allow-list to torch's
    process-wide one (:func:`trajtrack.reader.allow_in_this_process`), so that dumps load in
    the process, in parallel, and sets torch's intra-op threads to one.

    Args:
        argv: Arguments without the program name (default: ``sys.argv[1:]``).
        stdout: Where results go (default: ``sys.stdout`` at call time).
        stderr: Where messages and progress bars go (default: ``sys.stderr``).
    """
    streams = Streams(stdout or sys.stdout, stderr or sys.stderr)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error already printed
        return exc.code if isinstance(exc.code, int) else EXIT_ERROR
    _configure_logging(args.verbose, streams.err)
    # The commands parallelize across files (threads); torch's own intra-op threads on top of
    # that oversubscribe the cores (measured: a 1 MB compare 5x slower with 2 threads on 2
    # cores under load). This is the CLI's own process, so it may set this globally.
    torch.set_num_threads(1)
    # Loads need trajtrack's allow-list: widened once, here, for this process only (a library
    # call never widens it; it loads such dumps in trajtrack's worker process instead).
    allow_in_this_process()
    try:
        with collected_every():  # not every 700 allocations (see trajtrack.cli._collector)
            code: int = anyio.run(args.handler, args, streams)
    except KeyboardInterrupt:
        streams.note("trajtrack: interrupted")
        return 130
    except (TrajtrackError, OSError) as exc:
        streams.note(printable(f"trajtrack {args.command}: error: {exc}"))
        return EXIT_ERROR
    return code


def _configure_logging(verbosity: int, stream: TextIO) -> None:
    level = logging.WARNING if verbosity == 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    logger = logging.getLogger("trajtrack")  # the package root: every module logs below it
    # One handler of our own, replaced on each call so that tests capturing stderr see it.
    for handler in list(logger.handlers):
        if getattr(handler, "_trajtrack_cli", False):
            logger.removeHandler(handler)
    handler = logging.StreamHandler(stream)
    handler._trajtrack_cli = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter("trajtrack: %(levelname)s: %(message)s"))
    handler.setLevel(level)
    logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > level:
        logger.setLevel(level)
