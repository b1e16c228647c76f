"""The visual report of a diff: one self-contained HTML file (``trajtrack diff --html``).

The page has the summary (counts, tolerance, first divergence), a plot of how far apart the
runs are dump by dump, a table of the differing dumps and their differences, and a histogram
of the element-wise differences of the first divergent tensor, which
:func:`load_divergent_tensor` reloads (safely) from the two runs. Everything is inline: CSS in
a ``<style>``, plots as ``<svg>`` (:mod:`trajtrack.reader._plots`), no script, and a
Content-Security-Policy that forbids loading anything, so the file opens anywhere after a
copy. Every string that comes from a run (dump names, keys, values, errors, URLs) is escaped.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio.to_thread
import numpy as np

from trajtrack._exceptions import TrajtrackError
from trajtrack.reader._compare import Difference
from trajtrack.reader._diff import DumpComparison, RunDiff
from trajtrack.reader._html import (
    GENERATOR,
    escape as _e,
    number,
    page,
    with_generator,
    write_atomically,
)
from trajtrack.reader._plots import DumpPoint, divergence_svg, histogram_svg, load_matplotlib
from trajtrack.reader._run import Run
from trajtrack.reader._tensor_path import difference_values, find_at_path

__all__ = ["DivergentTensor", "load_divergent_tensor", "render_diff_report", "write_diff_report"]

logger = logging.getLogger(__name__)

_LABELS = {
    "equal": "equal",
    "different": "different",
    "only_in_a": "only in A",
    "only_in_b": "only in B",
    "error": "error",
}


@dataclass(frozen=True, slots=True, eq=False)
class DivergentTensor:
    """The element-wise differences of one tensor that differs between the runs.

    Attributes:
        dump: The dump name.
        path: Where in the dump (a :attr:`~trajtrack.reader.Difference.path`).
        shape: The tensor's shape.
        dtype: Its dtype.
        values: ``a - b`` of the finite pairs (``|a - b|`` for complex tensors), flat, float64;
            every *step*-th element when the tensor is large.
        non_finite: Pairs left out because ``a - b`` is NaN or infinite.
        step: 1, or the sampling stride of a large tensor.
    """

    dump: str
    path: str
    shape: tuple[int, ...]
    dtype: str
    values: np.ndarray[Any, Any]
    non_finite: int = 0
    step: int = 1


def first_divergent_value(result: RunDiff) -> tuple[DumpComparison, Difference] | None:
    """The first dump, in dump order, with a differing tensor, and that difference."""
    for comparison in result.comparisons:
        if comparison.status != "different":
            continue
        for difference in comparison.differences:
            if difference.kind == "value" and difference.index is not None:
                return comparison, difference
    return None


async def load_divergent_tensor(
    result: RunDiff, run_a: Run, run_b: Run, *, unsafe: bool = False
) -> DivergentTensor | None:
    """Reload the first divergent dump pair and compute its tensor's element-wise differences.

    Args:
        result: The diff of *run_a* and *run_b*.
        run_a: Run A, open.
        run_b: Run B, open.
        unsafe: Allow a full unpickle (as for the diff itself).

    Returns:
        ``None`` when no tensor differs in value, or when its path cannot be found again.

    Raises:
        TrajtrackError: A dump cannot be read or loaded again (``OSError`` likewise).
    """
    found = first_divergent_value(result)
    if found is None:
        return None
    comparison, difference = found
    assert comparison.a is not None  # status "different": in both runs
    assert comparison.b is not None
    obj_a = await run_a.load(comparison.a, unsafe=unsafe)
    obj_b = await run_b.load(comparison.b, unsafe=unsafe)
    return await anyio.to_thread.run_sync(
        _divergent, comparison.name, difference.path, obj_a, obj_b
    )


def _divergent(dump: str, path: str, obj_a: Any, obj_b: Any) -> DivergentTensor | None:
    a, b = find_at_path(obj_a, path), find_at_path(obj_b, path)
    computed = difference_values(a, b)
    if computed is None:
        logger.warning("%s: no tensor pair at %s to draw a histogram of", dump, path)
        return None
    values, non_finite, step, shape, dtype = computed
    return DivergentTensor(dump, path, shape, dtype, values, non_finite, step)


async def write_diff_report(
    result: RunDiff,
    path: str | os.PathLike[str],
    *,
    run_a: Run,
    run_b: Run,
    unsafe: bool = False,
    max_dumps: int = 200,
    text: str | None = None,
    generator: str = GENERATOR,
    overwrite: bool = False,
) -> None:
    """Write the HTML report of *result* to *path* (replaced atomically).

    Loading, drawing and writing run in worker threads, never on the event loop. A dump
    that can no longer be read leaves the histogram out (the report says why).

    Args:
        result: The diff of *run_a* and *run_b*.
        path: The HTML file to write.
        run_a: Run A, open (to reload the first divergent dump).
        run_b: Run B, open.
        unsafe: Allow a full unpickle when reloading (as for the diff itself).
        max_dumps: Differing dumps listed in the table.
        text: A section of token text (``diff --tokenizer``), already HTML.
        generator: Who the page says wrote it. An existing *path* is replaced only if it is a
            report that trajtrack wrote (with another *generator*: that one wrote); anything
            else there is refused (:func:`~trajtrack.reader.check_report_target`).
        overwrite: Replace any regular file at *path*, or a symbolic link there (the link
            itself, never its target), whatever it holds (``diff --overwrite``); a directory
            is still refused.

    Raises:
        MissingDependencyError: matplotlib is not installed (``trajtrack[report]``).
        ConfigurationError: *path* holds something that is not such a report (with
            *overwrite*: a directory, or a special file).
        OSError: *path* cannot be written.
    """
    await anyio.to_thread.run_sync(load_matplotlib)  # an import reads files: not on the loop
    note = None
    try:
        divergent = await load_divergent_tensor(result, run_a, run_b, unsafe=unsafe)
    except (TrajtrackError, OSError) as exc:
        logger.warning("diff report: cannot reload the first divergent dump: %s", exc)
        divergent, note = None, f"The dump could not be loaded again: {exc}"
    else:
        if divergent is None and first_divergent_value(result) is not None:
            note = "The differing tensor was not found again in the reloaded dumps."
    page = await anyio.to_thread.run_sync(
        lambda: render_diff_report(result, divergent, max_dumps=max_dumps, note=note, text=text)
    )
    if generator != GENERATOR:
        page = with_generator(page, generator)
    replaces = None if generator == GENERATOR else (generator,)
    write = functools.partial(
        write_atomically, Path(path), page, replaces=replaces, overwrite=overwrite
    )
    await anyio.to_thread.run_sync(write)


def render_diff_report(
    result: RunDiff,
    divergent: DivergentTensor | None = None,
    *,
    max_dumps: int = 200,
    note: str | None = None,
    text: str | None = None,
) -> str:
    """The HTML page of a diff (blocking: matplotlib draws the plots).

    Args:
        result: The diff.
        divergent: The first divergent tensor's differences, for the histogram.
        max_dumps: Differing dumps listed in the table (the plot shows every dump).
        note: Shown in place of the histogram when *divergent* is ``None``.
        text: A section of token text (``diff --tokenizer``), already HTML.
        generator: Who the page says wrote it. An existing *path* is replaced only if it is a
            report that trajtrack wrote (with another *generator*: that one wrote); anything
            else there is refused (:func:`~trajtrack.reader.check_report_target`).

    Raises:
        MissingDependencyError: matplotlib is not installed (``trajtrack[report]``).
    """
    load_matplotlib()
    from trajtrack import __version__

    first = result.first_divergence()
    verdict, verdict_class = _verdict(result)
    sections: tuple[tuple[str, str, str], ...] = (
        ("summary", "Summary", _summary(result, first)),
        ("plot", "How far apart the runs are, dump by dump", _plot(result, first)),
        ("histogram", "First divergent tensor", _histogram(result, divergent, note)),
        ("differing", "Differing dumps", _table(result, max_dumps)),
    )
    if text is not None:
        sections = (*sections, ("text", "Token text of the differing rows", text))
    return page(
        title=f"trajtrack diff: {result.url_a} vs {result.url_b}",
        heading="trajtrack diff",
        badge=f'<span class="verdict {verdict_class}" id="verdict">{_e(verdict)}</span>',
        body="\n".join(f'<section id="{i}"><h2>{h}</h2>{b}</section>' for i, h, b in sections),
        footer=f"Written by trajtrack {_e(__version__)}. Every value is as the diff "
        "collected it (at most the per-dump limit of differences); "
        "<code>trajtrack diff --json</code> has them all.",
    )


def _verdict(result: RunDiff) -> tuple[str, str]:
    """The headline and its class: dumps that could not be compared are never reported as
    the runs differing (they are errors, counted apart)."""
    errors = len(result.errors())
    not_compared = f"{errors} dumps could not be compared"
    if result.equal:
        return "equal within tolerance (exit 0)", "ok"
    if result.no_dumps:
        return f"nothing to compare: no dumps (exit {result.exit_code})", "bad"
    if result.differ:
        tail = f"; {not_compared}" if errors else ""
        return f"the runs differ (exit {result.exit_code}){tail}", "bad"
    return f"{not_compared} (exit {result.exit_code}); no difference found", "bad"


def _summary(result: RunDiff, first: DumpComparison | None) -> str:
    counts = result.counts()
    boxes = "".join(
        f'<span class="count s-{status}"><b id="count-{status}">{counts[status]}</b> '
        f"{_LABELS[status]}</span>"
        for status in _LABELS
    )
    tol = result.tolerance
    nan = "NaN == NaN" if tol.equal_nan else "NaN != NaN"
    items = [
        ("A", f"<code>{_e(result.url_a)}</code>"),
        ("B", f"<code>{_e(result.url_b)}</code>"),
        ("tolerance", f"<code>|a-b| &lt;= {tol.atol:g} + {tol.rtol:g}*|b|</code>, {nan}"),
        ("dumps", str(len(result.comparisons))),
    ]
    if first is None:
        items.append(("first divergence", "none"))
    else:
        where = f' class="s-{first.status}"'
        text = f'<strong{where} id="first-divergence">{_e(first.name)}</strong>'
        text += f" ({_LABELS[first.status]})"
        if first.differences:
            text += f"<br><code>{_e(_difference_text(first.differences[0]))}</code>"
        elif first.error:
            text += f"<br><code>{_e(first.error)}</code>"
        items.append(("first divergence", text))
    items.extend(_apart(result))
    listing = "".join(f"<dt>{key}</dt><dd>{value}</dd>" for key, value in items)
    return f'<div class="counts">{boxes}</div><dl>{listing}</dl>'


def _apart(result: RunDiff) -> list[tuple[str, str]]:
    """The summary's items beside the divergence: errors, ignored keys, notes."""
    items = []
    errors = result.errors()
    if errors:
        names = ", ".join(f"<code>{_e(c.name)}</code>" for c in errors[:_LISTED])
        more = f" and {len(errors) - _LISTED} more" if len(errors) > _LISTED else ""
        text = f"{len(errors)} dumps (errors, not divergences): {names}{more}"
        items.append(("not compared", f'<span id="errors">{text}</span>'))
    if result.ignore:
        ignored = [p for c in result.comparisons for p in c.ignored]
        patterns = " ".join(f"<code>{_e(p)}</code>" for p in result.ignore)
        items.append(("ignored", f'<span id="ignored">{patterns}: {len(ignored)} keys</span>'))
    notes: dict[str, int] = {}
    for c in result.comparisons:
        for note in c.notes:
            notes[note] = notes.get(note, 0) + 1
    if notes:
        listed = "".join(
            f"<li>{_e(note)}{f' ({n} dumps)' if n > 1 else ''}</li>"
            for note, n in list(notes.items())[:_LISTED]
        )
        items.append(("notes", f'<ul id="notes">{listed}</ul>'))
    return items


_LISTED = 20  # errors and notes named in the summary
_ROWS_LISTED = 50  # differing rows named per difference


def _plot(result: RunDiff, first: DumpComparison | None) -> str:
    points = [DumpPoint(c.name, c.status, *_magnitude(c.differences)) for c in result.comparisons]
    index = None if first is None else result.comparisons.index(first)
    if not points:
        return '<p class="note">Neither run has any dump.</p>'
    caption = (
        "Each dump of either run, in dump order (run A's commit order, each dump of run B only "
        "after the dump before it in run B). Differing dumps are shaded; equal ones are ticks "
        "along the bottom; dumps in one run only, errors and differences without a magnitude "
        "are marked along the top."
    )
    svg, legend = divergence_svg(points, index)
    keys = "".join(
        f'<li><span class="mark" style="color:{_e(color)}">{_e(glyph)}</span> {_e(label)}</li>'
        for glyph, color, label in legend
    )
    return f'{svg}<ul class="legend" id="legend">{keys}</ul><p class="note">{caption}</p>'


def _magnitude(differences: tuple[Difference, ...]) -> tuple[float | None, float | None]:
    abs_values = [d.max_abs for d in differences if d.max_abs is not None]
    rel_values = [d.max_rel for d in differences if d.max_rel is not None]
    return (max(abs_values, default=None), max(rel_values, default=None))


def _histogram(result: RunDiff, divergent: DivergentTensor | None, note: str | None) -> str:
    if divergent is None:
        if note is not None:
            return f'<p class="note">{_e(note)}</p>'
        if first_divergent_value(result) is None:
            return '<p class="note">No tensor differs in value.</p>'
        return (
            '<p class="note">Not drawn: the dumps were not reloaded (write_diff_report and '
            "<code>trajtrack diff --html</code> do).</p>"
        )
    total = math.prod(divergent.shape)
    title = (
        f"{divergent.dump} {divergent.path or '<root>'}: {divergent.dtype} "
        f"{list(divergent.shape)}, a - b of {total} elements"
    )
    notes = []
    if divergent.step > 1:
        notes.append(f"every {divergent.step}th element drawn ({divergent.values.size} of {total})")
    if divergent.non_finite:
        notes.append(f"{divergent.non_finite} NaN or infinite differences left out")
    svg = histogram_svg(divergent.values, title)
    extra = f'<p class="note">{_e("; ".join(notes))}</p>' if notes else ""
    return svg + extra


def _table(result: RunDiff, max_dumps: int) -> str:
    shown = [c for c in result.comparisons if c.status != "equal"]
    if result.no_dumps:
        return '<p class="note">None: neither run has a dump to compare.</p>'
    if not shown:
        return '<p class="note">None: every dump is equal within tolerance.</p>'
    hidden = max(0, len(shown) - max_dumps)
    head = (
        "<tr><th>dump</th><th>status</th><th>key</th><th>what differs</th>"
        "<th>elements differing</th><th>max abs</th><th>max rel</th><th>first index</th>"
        "<th>A</th><th>B</th><th>rows differing</th></tr>"
    )
    rows = [_rows(c) for c in shown[:max_dumps]]
    more = f'<p class="note">... {hidden} more differing dumps not listed.</p>' if hidden else ""
    return f'<table id="differing-dumps">{head}{"".join(rows)}</table>{more}'


def _rows(c: DumpComparison) -> str:
    status = f'<td class="s-{c.status}">{_LABELS[c.status]}</td>'
    name = f'<td class="mono">{_e(c.name)}</td>'
    if not c.differences:
        detail = c.error or {"only_in_a": "only in run A", "only_in_b": "only in run B"}.get(
            c.status, ""
        )
        return f'<tr class="dump">{name}{status}<td colspan="9">{_e(detail)}</td></tr>'
    cells = []
    for i, d in enumerate(c.differences):
        lead = f"{name}{status}" if i == 0 else "<td></td><td></td>"
        counted = f"{d.mismatched} of {d.total}" if d.mismatched is not None else ""
        index = str(list(d.index)) if d.index is not None else ""
        cells.append(
            f'<tr class="{"dump" if i == 0 else "more"}">{lead}'
            f'<td class="mono">{_e(d.path or "<root>")}</td><td>{_e(_what(d))}</td>'
            f'<td class="num">{counted}</td><td class="num">{number(d.max_abs)}</td>'
            f'<td class="num">{number(d.max_rel)}</td><td class="mono">{index}</td>'
            f'<td class="mono">{_e(d.a or "")}</td><td class="mono">{_e(d.b or "")}</td>'
            f'<td class="mono rows">{_e(d.rows_text(_ROWS_LISTED))}</td></tr>'
        )
    return "".join(cells)


def _what(d: Difference) -> str:
    """The kind of difference, with the shapes or dtypes when those differ."""
    if d.kind in ("shape", "dtype", "length", "type"):
        return d.detail
    return {"missing": "key only in A", "extra": "key only in B"}.get(d.kind, "values")


def _difference_text(d: Difference) -> str:
    text = f"{d.path or '<root>'}: {d.detail}"
    if d.index is not None:
        text += f"; first at index {list(d.index)}: A={d.a} B={d.b}"
    return text
