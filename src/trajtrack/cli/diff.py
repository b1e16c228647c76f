"""``trajtrack diff URL_A URL_B``: compare two runs dump by dump."""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import anyio.to_thread

from trajtrack.cli._common import (
    Streams,
    printable,
    progress_callback,
    write_json,
)
from trajtrack.cli._text import diff_text, diff_text_lines, tokenizer_of
from trajtrack.reader import (
    VOLATILE_KEYS,
    Difference,
    DumpComparison,
    RunDiff,
    Tolerance,
    check_report_target,
    diff_runs,
    open_run,
    render_text_section,
    require_matplotlib,
    write_diff_report,
)

__all__ = ["render", "run"]

_LABELS = {
    "different": "DIFFERENT",
    "only_in_a": "ONLY IN A",
    "only_in_b": "ONLY IN B",
    "error": "ERROR",
    "equal": "equal",
}


async def run(args: argparse.Namespace, streams: Streams) -> int:
    tolerance = Tolerance(rtol=args.rtol, atol=args.atol, equal_nan=not args.nan_unequal)
    if args.html:  # fail before a long diff, not after it (file system look-ups: off the loop)
        await anyio.to_thread.run_sync(require_matplotlib)
        # Its folder exists; the file is absent or a report trajtrack wrote, never the user's
        # (with --overwrite: any file, or a link, replaced as a link; never a directory).
        target = functools.partial(check_report_target, overwrite=args.overwrite)
        await anyio.to_thread.run_sync(target, Path(args.html))
    tokenizer = await tokenizer_of(args)  # a missing extra or file fails before the diff
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
                ignore=[*args.ignore, *(VOLATILE_KEYS if args.ignore_volatile else ())],
            )
        finally:
            close()
        texts = []
        if tokenizer is not None:  # the rows of differing token tensors, as text
            texts = await diff_text(
                result,
                run_a,
                run_b,
                tokenizer,
                keys=args.text_keys,
                unsafe=args.unsafe,
                max_dumps=args.max_dumps,
                max_rows=args.max_differences,
            )

        async def report() -> None:  # the runs are still open: it reloads the first divergent pair
            await write_diff_report(
                result,
                args.html,
                run_a=run_a,
                run_b=run_b,
                unsafe=args.unsafe,
                text=render_text_section(texts) if texts else None,
                overwrite=args.overwrite,
            )

        if args.html and args.json:  # a report that fails leaves no JSON saying exit 0 or 1
            await report()
        if args.json:
            extra = {"text": {n: [d.to_json() for d in ds] for n, ds in texts}} if texts else {}
            write_json(streams, {**result.to_json(), **extra})
        else:
            for line in render(result, max_dumps=args.max_dumps, per_dump=args.max_differences):
                streams.line(printable(line))
            for line in diff_text_lines(texts):
                streams.line(line)
            if args.html:
                await report()
        if args.html:
            streams.note(printable(f"trajtrack diff: HTML report written to {args.html}"))
    return result.exit_code


def render(result: RunDiff, *, max_dumps: int = 20, per_dump: int = 5) -> list[str]:
    """The human report: header, non-equal dumps in dump order, notes, summary."""
    tol = result.tolerance
    nan = "NaN == NaN" if tol.equal_nan else "NaN != NaN"
    lines = [
        f"A: {result.url_a}",
        f"B: {result.url_b}",
        f"tolerance: |a-b| <= {tol.atol:g} + {tol.rtol:g}*|b|, {nan}",
    ]
    lines.extend(_ignored_lines(result))
    counts = result.counts()
    for side, other in (("A", "only_in_b"), ("B", "only_in_a")):  # an empty run, said once
        if not result.comparisons or counts[other] == len(result.comparisons):
            lines.append(f"{side} has no dumps")
    first = result.first_divergence()
    if first is not None:
        lines.append(f"first divergence: {first.name}")
    errors = len(result.errors())
    if errors:
        lines.append(f"not compared: {errors} dumps (errors, below; not divergences)")
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
    lines.extend(_note_lines(result))
    lines.append(
        f"{len(result.comparisons)} dumps: {counts['equal']} equal, "
        f"{counts['different']} different, {counts['only_in_a']} only in A, "
        f"{counts['only_in_b']} only in B, {counts['error']} errors"
    )
    if result.no_dumps:  # a glob that matched nothing must not read as a pass
        lines.append("nothing to compare: not 'equal'")
    return lines


_NOTES_SHOWN = 10
_ROWS_SHOWN = 10


def _ignored_lines(result: RunDiff) -> list[str]:
    if not result.ignore:
        return []
    paths = [p for c in result.comparisons for p in c.ignored]
    dumps = sum(bool(c.ignored) for c in result.comparisons)
    patterns = " ".join(repr(p) for p in result.ignore)
    line = f"ignored: {patterns}: {len(paths)} keys in {dumps} dumps"
    if paths:
        line += f" (e.g. {paths[0]})"
    return [line]


def _note_lines(result: RunDiff) -> list[str]:
    """Each distinct note once, with the number of dumps it was made for."""
    counted: dict[str, int] = {}
    for comparison in result.comparisons:
        for note in comparison.notes:
            counted[note] = counted.get(note, 0) + 1
    lines = [
        f"note: {note}" + (f" ({n} dumps)" if n > 1 else "")
        for note, n in list(counted.items())[:_NOTES_SHOWN]
    ]
    if len(counted) > _NOTES_SHOWN:
        lines.append(f"... {len(counted) - _NOTES_SHOWN} more notes (--json for all)")
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
        text += _rows_text(d)
    elif d.kind in ("value", "type"):
        text += f": A={d.a} B={d.b}"
    elif d.kind == "missing":
        text += f": {d.a}"
    elif d.kind == "extra":
        text += f": {d.b}"
    return text


def _rows_text(d: Difference) -> str:
    """``; 2 rows differ: 1 (uid u1), 5 (uid u5)``: the first rows, with their ids."""
    if not d.rows:
        return ""
    word = "row differs" if len(d.rows) == 1 else "rows differ"
    return f"; {len(d.rows)} {word}: {d.rows_text(_ROWS_SHOWN)}"
