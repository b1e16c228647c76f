"""``trajtrack diff URL_A URL_B``: compare two runs dump by dump."""

from __future__ import annotations

import argparse
from typing import Any

import anyio.to_thread

from trajtrack.cli._common import (
    Streams,
    add_output_options,
    non_negative_float,
    positive_int,
    printable,
    progress_callback,
    write_json,
)
from trajtrack.reader import (
    Difference,
    DumpComparison,
    RunDiff,
    Tolerance,
    diff_runs,
    open_run,
    require_matplotlib,
    write_diff_report,
)

__all__ = ["add_parser", "render", "run"]

_LABELS = {
    "different": "DIFFERENT",
    "only_in_a": "ONLY IN A",
    "only_in_b": "ONLY IN B",
    "error": "ERROR",
    "equal": "equal",
}


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "diff",
        help="compare two runs dump by dump",
        description=(
            "Pair the dumps of two runs by name and compare them structurally: missing and "
            "extra dumps and keys, type/length/shape/dtype mismatches, and for numbers the "
            "max absolute and relative difference and the index of the first element outside "
            "tolerance. Dumps are listed in dump order (commit time relative to each run's "
            "first dump, then name), so the first divergence is at the top. "
            "An element is equal when |a - b| <= atol + rtol * |b| (b from URL_B); the "
            "default is exact equality. NaN equals NaN at the same position unless "
            "--nan-unequal. Each file is read once, in parallel. Loading is safe "
            "(weights_only) unless --unsafe."
        ),
        epilog="exit codes: 0 equal within tolerance, 1 the runs differ (values, keys, "
        "or dumps present in only one run), 2 usage or I/O error, or a dump that cannot be "
        "loaded (refused as unsafe, corrupt).",
    )
    parser.add_argument("url_a", metavar="URL_A", help="run A")
    parser.add_argument("url_b", metavar="URL_B", help="run B (the reference for rtol)")
    parser.add_argument("--names", metavar="GLOB", help="only dumps whose name matches")
    parser.add_argument(
        "--rtol", type=non_negative_float, default=0.0, metavar="R", help="relative tolerance"
    )
    parser.add_argument(
        "--atol", type=non_negative_float, default=0.0, metavar="A", help="absolute tolerance"
    )
    parser.add_argument(
        "--nan-unequal", action="store_true", help="count NaN == NaN as a difference"
    )
    parser.add_argument(
        "--unsafe",
        action="store_true",
        help="allow a full unpickle: RUNS CODE from the dumps; only for runs you trust",
    )
    parser.add_argument(
        "--max-dumps",
        type=positive_int,
        default=20,
        metavar="N",
        help="differing dumps printed in full (default: %(default)s)",
    )
    parser.add_argument(
        "--max-differences",
        type=positive_int,
        default=5,
        metavar="N",
        help="differences printed per dump (default: %(default)s)",
    )
    parser.add_argument(
        "--html",
        metavar="FILE",
        help="also write a self-contained HTML report (summary, a plot of the differences "
        "dump by dump, the differing dumps, a histogram of the first divergent tensor); "
        "needs pip install 'trajtrack[report]'",
    )
    add_output_options(parser, progress=True)
    parser.set_defaults(handler=run)


async def run(args: argparse.Namespace, streams: Streams) -> int:
    tolerance = Tolerance(rtol=args.rtol, atol=args.atol, equal_nan=not args.nan_unequal)
    if args.html:  # fail before a long diff, not after it (a file system look-up: off the loop)
        await anyio.to_thread.run_sync(require_matplotlib)
    update, close = progress_callback(streams, "diff", quiet=args.quiet)
    async with (
        open_run(args.url_a, concurrency=args.concurrency) as run_a,
        open_run(args.url_b, concurrency=args.concurrency) as run_b,
    ):
        try:
            result = await diff_runs(
                run_a,
                run_b,
                names=args.names,
                tolerance=tolerance,
                unsafe=args.unsafe,
                limit_per_dump=max(20, args.max_differences),
                on_progress=update,
            )
        finally:
            close()
        if args.json:
            write_json(streams, result.to_json())
        else:
            for line in render(result, max_dumps=args.max_dumps, per_dump=args.max_differences):
                streams.line(printable(line))
        if args.html:  # the runs are still open: the report reloads the first divergent pair
            await write_diff_report(result, args.html, run_a=run_a, run_b=run_b, unsafe=args.unsafe)
            streams.note(f"trajtrack diff: HTML report written to {args.html}")
    return result.exit_code


def render(result: RunDiff, *, max_dumps: int = 20, per_dump: int = 5) -> list[str]:
    """The human report: header, non-equal dumps in dump order, summary."""
    tol = result.tolerance
    nan = "NaN == NaN" if tol.equal_nan else "NaN != NaN"
    lines = [
        f"A: {result.url_a}",
        f"B: {result.url_b}",
        f"tolerance: |a-b| <= {tol.atol:g} + {tol.rtol:g}*|b|, {nan}",
    ]
    first = result.first_divergence()
    if first is None:
        lines.append("")
    else:
        lines.append(f"first divergence: {first.name}")
        lines.append("")
    shown = 0
    for comparison in result.comparisons:
        if comparison.status == "equal":
            continue
        if shown >= max_dumps:
            break
        shown += 1
        lines.extend(_dump_lines(comparison, per_dump))
    hidden = sum(c.status != "equal" for c in result.comparisons) - shown
    if hidden > 0:
        lines.append(f"... {hidden} more differing dumps (--max-dumps, or --json for all)")
    counts = result.counts()
    lines.append(
        f"{len(result.comparisons)} dumps: {counts['equal']} equal, "
        f"{counts['different']} different, {counts['only_in_a']} only in A, "
        f"{counts['only_in_b']} only in B, {counts['error']} errors"
    )
    return lines


def _dump_lines(comparison: DumpComparison, per_dump: int) -> list[str]:
    label = _LABELS[comparison.status]
    lines = [f"{label:<10} {comparison.name}"]
    if comparison.error:
        lines.append(f"    {comparison.error}")
    for difference in comparison.differences[:per_dump]:
        lines.append(f"    {_difference_line(difference)}")
    more = len(comparison.differences) - per_dump
    if more > 0:
        lines.append(f"    ... {more} more differences")
    return lines


def _difference_line(d: Difference) -> str:
    where = d.path or "<root>"
    text = f"{where}: {d.detail}"
    if d.index is not None:
        text += f"; first at index {list(d.index)}: A={d.a} B={d.b}"
    elif d.kind in ("value", "type"):
        text += f": A={d.a} B={d.b}"
    elif d.kind == "missing":
        text += f": {d.a}"
    elif d.kind == "extra":
        text += f": {d.b}"
    return text
