"""The ``trajtrack`` command: ``ls``, ``show``, ``diff``, ``verify``, ``export`` and ``demo``.

Exit codes (all commands): 0 success; 1 the answer is "no" (``diff``: the runs differ, or
there was nothing to compare; ``verify``: problems found, or nothing to verify); 2 usage
error, unreadable storage or undeserializable dump; 130 interrupted; 141 stdout closed by its
reader (``| head``). Results go to stdout (``--json`` for scripts), messages and progress bars
to stderr.

Read the modules in this order::

    __init__.py    main(): the top-level parser, dispatch to a command, exit codes
    _common.py     helpers the commands share: streams, tables, sizes, times, JSON, progress
    _parsers.py    the parsers of the commands whose modules import torch (show, diff, demo)
    _collector.py  garbage collection while a command runs: a full collection every few seconds
    ls.py          ``trajtrack ls URL``: the dumps of a run, in dump order
    show.py        ``trajtrack show URL NAME``: one dump's structure, with tensor statistics
    _text.py       ``--tokenizer`` for show and diff: token ids printed as the text they spell
    diff.py        ``trajtrack diff URL_A URL_B``: two runs compared dump by dump
    verify.py      ``trajtrack verify URL``: every recorded dump present, size and checksum
    export.py      ``trajtrack export URL DEST``: any run written out in the files layout
    demo.py        ``trajtrack demo [DIR]``: two simulated rollouter runs, then ls and diff
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import TextIO

from trajtrack._exceptions import TrajtrackError
from trajtrack.cli import _parsers
from trajtrack.cli._collector import collected_every
from trajtrack.cli._common import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OUTPUT_CLOSED,
    SUMMARIES,
    Streams,
    printable,
)

__all__ = ["build_parser", "main"]

# Imported only when a command is on the line: `trajtrack --help`, `--version` and a missing
# or unknown command answer without importing torch (seconds), which the commands need.
_COMMANDS = ("ls", "show", "diff", "verify", "export", "demo")
_LIGHT_PARSERS = ("show", "diff", "demo")  # parsers in trajtrack.cli._parsers

_EPILOG = """\
exit codes:
  0    success (diff: equal within tolerance; verify: no problem)
  1    diff: the runs differ, or no dumps to compare; verify: problems found, or
       no dumps to verify; export: dumps skipped
  2    usage error, unreadable storage, or a dump that cannot be loaded
  130  interrupted (Ctrl-C)
  141  stdout closed early by its reader (trajtrack ls RUN | head -1), as git does

URLs: a local path, file://PATH, memory://STORE/PATH, webhdfs://HOST:PORT/PATH,
swebhdfs://..., hdfs://NAMESERVICE/PATH (resolved through HADOOP_CONF_DIR).
"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with one subcommand per module in :data:`_COMMANDS`."""
    return _parser(_COMMANDS)


def _parser(load: Sequence[str]) -> argparse.ArgumentParser:
    """The parser; commands not in *load* are only their name and summary (not imported)."""
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
    for name in _COMMANDS:
        if name in _LIGHT_PARSERS and name in load:  # the command's module imports torch
            getattr(_parsers, f"add_{name}")(commands)
        elif name in load:
            importlib.import_module(f"trajtrack.cli.{name}").add_parser(commands)
        else:
            commands.add_parser(name, help=SUMMARIES[name])
    for command in commands.choices.values():  # -v after the subcommand too (ls RUN -v)
        command.add_argument(
            "-v",
            "--verbose",
            action="count",
            default=argparse.SUPPRESS,  # not given here: the count before the subcommand
            help="log more on stderr (-vv: debug)",
        )
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

    Ctrl-C at any moment (parsing, importing torch, running) ends it with ``trajtrack:
    interrupted`` and 130; stdout closed by its reader (``trajtrack ls RUN | head -1``) ends it
    quietly with 141 (128 + SIGPIPE, what a shell reports for git or coreutils there: never 0,
    which would read as "equal" from ``diff``).

    Args:
        argv: Arguments without the program name (default: ``sys.argv[1:]``).
        stdout: Where results go (default: ``sys.stdout`` at call time).
        stderr: Where messages and progress bars go (default: ``sys.stderr``).
    """
    streams = Streams(stdout or sys.stdout, stderr or sys.stderr)
    try:
        code = _main(sys.argv[1:] if argv is None else list(argv), streams)
        streams.out.flush()  # a closed pipe shows here, not in the interpreter's exit
    except KeyboardInterrupt:
        with contextlib.suppress(Exception):
            streams.note("trajtrack: interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # stdout (or stderr) closed by its reader: no more to say
        _output_closed(streams)
        return EXIT_OUTPUT_CLOSED
    return code


def _main(argv: list[str], streams: Streams) -> int:
    parser = _parser([arg for arg in argv if arg in _COMMANDS])  # the command's own, only
    try:
        args = parser.parse_args(argv)
        if hasattr(args, "check"):  # a command's rule across its options (exits 2 as usage)
            args.check(args)
    except SystemExit as exc:  # --help, --version, or a usage error already printed
        return exc.code if isinstance(exc.code, int) else EXIT_ERROR
    _configure_logging(args.verbose, streams.err)
    import anyio  # the commands' own imports (torch) are done by now
    import torch

    from trajtrack.reader import allow_in_this_process

    # The commands parallelize across files (threads); torch's own intra-op threads on top of
    # that oversubscribe the cores (threads x intra-op threads > cores; see
    # ``benchmarks/bench_diff.py``). This is the CLI's own process, so it may set this globally.
    torch.set_num_threads(1)
    # Loads need trajtrack's allow-list: widened once, here, for this process only (a library
    # call never widens it; it loads such dumps in trajtrack's worker process instead).
    allow_in_this_process()
    try:
        with collected_every():  # not every 700 allocations (see trajtrack.cli._collector)
            code: int = anyio.run(args.handler, args, streams)
    except BrokenPipeError:
        raise  # not the command's error: main() ends quietly
    except (TrajtrackError, OSError) as exc:
        streams.note(printable(f"trajtrack {args.command}: error: {exc}"))
        return EXIT_ERROR
    return code


def _output_closed(streams: Streams) -> None:
    """Point the closed standard streams at ``/dev/null``: Python flushes them as it exits,
    which would fail again, print "Exception ignored" and exit 120 (the recipe of the
    ``signal`` module's docs, "Note on SIGPIPE")."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not streams.out and stream is not streams.err:
            continue  # a caller's own stream (tests): its file descriptor is not ours
        try:
            fd = stream.fileno()
            devnull = os.open(os.devnull, os.O_WRONLY)
        except (OSError, ValueError):  # no file descriptor (io.UnsupportedOperation)
            continue
        try:
            os.dup2(devnull, fd)
        finally:
            os.close(devnull)


class _PrintableFormatter(logging.Formatter):
    """Each message line as :func:`printable` makes it: the library's warnings quote
    run-supplied names (a dump ``export`` skipped, a report's tensor path), which must not
    reach the terminal raw. A traceback (``-vv``) keeps its lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return printable(super().formatMessage(record))


def _configure_logging(verbosity: int, stream: TextIO) -> None:
    level = logging.WARNING if verbosity == 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    logger = logging.getLogger("trajtrack")  # the package root: every module logs below it
    # One handler of our own, replaced on each call so that tests capturing stderr see it.
    for handler in list(logger.handlers):
        if getattr(handler, "_trajtrack_cli", False):
            logger.removeHandler(handler)
    handler = logging.StreamHandler(stream)
    handler._trajtrack_cli = True  # type: ignore[attr-defined]
    handler.setFormatter(_PrintableFormatter("trajtrack: %(levelname)s: %(message)s"))
    handler.setLevel(level)
    logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > level:
        logger.setLevel(level)
