"""The plots of a diff report, drawn by matplotlib as inline SVG (the ``report`` extra).

Nothing here touches pyplot or its global state: each plot is a fresh
:class:`matplotlib.figure.Figure` saved to a string with the SVG backend. The SVG is
deterministic (a fixed hash salt for its ids, no date) and made to sit inside an HTML page:
no XML prolog, DOCTYPE or namespace URLs, text kept as ``<text>`` (no embedded glyphs), and
dump names never parsed as mathtext. Everything here is blocking CPU work: callers on an event
loop run it in a worker thread.
"""

from __future__ import annotations

import html
import importlib.util
import io
import math
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from trajtrack._exceptions import MissingDependencyError
from trajtrack.reader._html import visible

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["DumpPoint", "divergence_svg", "histogram_svg", "load_matplotlib", "require_matplotlib"]

INSTALL_HINT = "the HTML report needs matplotlib: pip install 'trajtrack[report]'"

# Every text that shows a dump name or a path is drawn with parse_math=False: a "$" in it is
# text, not a formula (and cannot make the mathtext parser fail); the log axes' own tick
# labels are mathtext. Such text goes through visible() first: a lone surrogate (a name's
# non-UTF-8 byte, as os.fsdecode reads it) is drawn as its \udcXX escape (no font has it).
_NO_METADATA = {"Date": None, "Creator": None, "Format": None, "Type": None}
# rcParams are process-wide: rc_context() swaps them for the duration of a save, so two of our
# saves must not interleave (a user's own plotting in another thread is not our business).
_SAVE_LOCK = threading.Lock()
_MAX_NAMED_TICKS = 40  # up to this many dumps, the x axis is labelled with their names
# Beyond this many differing dumps the magnitudes are dashes in one path, not markers: each
# marker is an SVG element of its own (tens of microseconds each to write, and to display).
_MAX_MARKERS = 2_000
_NAME_CHARS = 32
_GLYPHS = {"o": "\u25cf", "^": "\u25b2", "<": "\u25c0", ">": "\u25b6", "s": "\u25a0", "X": "\u2716"}
_COLORS = {
    "abs": "#c0392b",
    "rel": "#e67e22",
    "equal": "#95a5a6",
    "highlight": "#f5b7b1",
    "only_in_a": "#2471a3",
    "only_in_b": "#7d3c98",
    "error": "#000000",
    "structural": "#c0392b",
}


@dataclass(frozen=True, slots=True)
class DumpPoint:
    """One dump on the divergence plot.

    Attributes:
        name: The dump name.
        status: The :class:`~trajtrack.reader.DumpComparison` status.
        max_abs: Largest absolute difference over its differences (``None``: none numeric).
        max_rel: Largest relative difference (``None``: none numeric).
    """

    name: str
    status: str
    max_abs: float | None = None
    max_rel: float | None = None


def require_matplotlib() -> None:
    """Fail fast, with the install hint, when matplotlib is not installed (no import).

    Raises:
        MissingDependencyError: matplotlib cannot be found.
    """
    try:
        found = importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):  # a parent package missing, or a module set to None
        found = False
    if not found:
        raise MissingDependencyError(INSTALL_HINT)


def load_matplotlib() -> None:
    """Import what the plots use (blocking: about half a second the first time).

    Raises:
        MissingDependencyError: matplotlib cannot be imported.
    """
    try:
        import matplotlib.backends.backend_svg
        import matplotlib.figure  # noqa: F401  (imported for later use)
    except ImportError as exc:
        raise MissingDependencyError(INSTALL_HINT) from exc


def divergence_svg(
    points: Sequence[DumpPoint], first: int | None
) -> tuple[str, list[tuple[str, str, str]]]:
    """How far apart two runs are, dump by dump: max abs / max rel difference on a log scale.

    Args:
        points: The dumps, in dump order.
        first: Index in *points* of the first divergence (marked), if any.

    Returns:
        The SVG, and its legend: ``(symbol, color, label)`` for each kind of mark drawn.
    """
    named = 0 < len(points) <= _MAX_NAMED_TICKS
    longest = max((len(_short(p.name)) for p in points), default=0) if named else 0
    # Fixed margins in inches (a layout engine would draw the figure twice): room for the
    # y labels and, below, for the rotated dump names when shown. The legend is the page's
    # (HTML): matplotlib's costs as much as a plot of a few hundred points.
    bottom = 0.55 + 0.055 * longest if named else 0.6
    figure, ax = _figure(11.0, 3.0 + bottom, margins=(0.8, 0.25, bottom, 0.35))
    x = np.arange(len(points))
    by_status: dict[str, list[int]] = {}
    for i, point in enumerate(points):
        by_status.setdefault(point.status, []).append(i)
    differing = by_status.get("different", [])
    if differing:
        _ticks(ax, differing, 1.0, _COLORS["highlight"], f"different ({len(differing)})")
    plotted = _magnitudes(ax, points, x)
    _markers(ax, points, by_status)
    if first is not None:
        ax.axvline(first, color=_COLORS["abs"], linestyle="--", linewidth=1)
        ax.annotate(
            f"first divergence: {_short(points[first].name)}",
            (first, 1.0),
            xycoords=ax.get_xaxis_transform(),
            xytext=(4, 4),
            textcoords="offset points",
            fontsize=8,
            color=_COLORS["abs"],
            parse_math=False,
        )
    if not plotted:
        ax.set_yticks([])
        ax.text(0.5, 0.5, "no numeric differences", transform=ax.transAxes, ha="center")
    ax.set_xlim(-0.5, max(len(points), 1) - 0.5)
    _x_axis(ax, points)
    ax.set_ylabel("difference (log scale)" if plotted else "")
    handles, labels = ax.get_legend_handles_labels()
    legend = [
        (_GLYPHS.get(str(h.get_marker()), "|"), str(h.get_color()), label)  # type: ignore[attr-defined]
        for h, label in zip(handles, labels, strict=True)
    ]
    return _svg(figure, "difference between the runs, dump by dump", "divergence"), legend


def _magnitudes(ax: Axes, points: Sequence[DumpPoint], x: np.ndarray[Any, Any]) -> bool:
    """The max abs / max rel markers of differing dumps; False when there is none."""
    plotted = False
    for key, marker, label in (("abs", "o", "max abs |a-b|"), ("rel", "^", "max rel |a-b|/|b|")):
        values = np.array(
            [_positive(p.max_abs if key == "abs" else p.max_rel) for p in points], dtype=float
        )
        shown = ~np.isnan(values)
        if not shown.any():
            continue
        plotted = True
        if shown.sum() > _MAX_MARKERS:  # one short dash per dump, all in one path
            xs = np.repeat(x[shown].astype(float), 3) + np.tile([-0.45, 0.45, 0.0], shown.sum())
            xs[2::3] = np.nan
            ys = np.repeat(values[shown], 3)
            ax.plot(xs, ys, color=_COLORS[key], linewidth=2, label=label)
            continue
        ax.plot(
            x[shown],
            values[shown],
            linestyle="none",
            marker=marker,
            markersize=5,
            color=_COLORS[key],
            label=label,
        )
    if plotted:
        _log_axis(ax)
    return plotted


def _markers(ax: Axes, points: Sequence[DumpPoint], by_status: dict[str, list[int]]) -> None:
    """Equal dumps as a rug at the bottom; only-in-A/B, errors and structural ones on top."""
    band = ax.get_xaxis_transform()  # x in data, y in axes fractions
    structural = [
        i
        for i in by_status.get("different", [])
        if math.isnan(_positive(points[i].max_abs)) and math.isnan(_positive(points[i].max_rel))
    ]
    equal = by_status.get("equal", [])
    if equal:
        _ticks(ax, equal, 0.04, _COLORS["equal"], f"equal ({len(equal)})")
    for key, indices, y, marker, label in (
        ("structural", structural, 0.93, "s", "different (no numeric magnitude)"),
        ("only_in_a", by_status.get("only_in_a", []), 0.93, "<", "only in A"),
        ("only_in_b", by_status.get("only_in_b", []), 0.93, ">", "only in B"),
        ("error", by_status.get("error", []), 0.93, "X", "error"),
    ):
        if indices:
            ax.plot(
                indices,
                [y] * len(indices),
                transform=band,
                linestyle="none",
                marker=marker,
                markersize=7,
                color=_COLORS[key],
                label=f"{label} ({len(indices)})",
                clip_on=False,
            )


def _ticks(ax: Axes, indices: Sequence[int], height: float, color: str, label: str) -> None:
    """Vertical strokes from the bottom at *indices* (up to *height*, in axes fractions).

    One path with NaN breaks, however many dumps: a marker or a line per dump would be an SVG
    element each, and the per-element cost would grow with the run
    (``benchmarks/bench_report.py``).
    """
    xs = np.repeat(np.asarray(indices, dtype=float), 3)
    xs[2::3] = np.nan
    ys = np.tile([0.0, height, np.nan], len(indices))
    ax.plot(xs, ys, transform=ax.get_xaxis_transform(), color=color, linewidth=1.2, label=label)


def _log_axis(ax: Axes) -> None:
    """A log y axis with plain-text labels (mathtext ones are parsed at every draw: slow)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, numticks=8))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(FuncFormatter(_power_of_ten))
    ax.grid(True, axis="y", which="major", color="#e5e5e5", linewidth=0.6)


def _power_of_ten(value: float, _position: Any = None) -> str:
    if value <= 0 or not math.isfinite(value):
        return ""
    exponent = round(math.log10(value))
    if math.isclose(value, 10.0**exponent, rel_tol=1e-9):
        return {0: "1", 1: "10", 2: "100"}.get(exponent, f"1e{exponent}")
    return f"{value:g}"


def _x_axis(ax: Axes, points: Sequence[DumpPoint]) -> None:
    if 0 < len(points) <= _MAX_NAMED_TICKS:
        labels = [_short(p.name) for p in points]
        ax.set_xticks(range(len(points)), labels, rotation=90, fontsize=7, parse_math=False)
        ax.set_xlabel("dump, in dump order")
    else:
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(nbins=8, integer=True))
        ax.set_xlabel("dump number, in dump order")


def histogram_svg(values: np.ndarray[Any, Any], title: str, *, xlabel: str = "a - b") -> str:
    """A histogram of element-wise values or differences (counts on a log scale beyond 20).

    Args:
        values: Finite differences (any shape; flattened).
        title: The plot's title (plain text, shown as is).
        xlabel: The quantity on the x axis.
    """
    from matplotlib.ticker import MaxNLocator

    title, xlabel = visible(title), visible(xlabel)
    figure, ax = _figure(7.5, 3.0, margins=(0.75, 0.2, 0.55, 0.35))
    flat = np.asarray(values, dtype=np.float64).reshape(-1)
    log = False
    if flat.size:
        counts, edges = np.histogram(flat, bins=60)
        ax.stairs(counts, edges, fill=True, color=_COLORS["abs"], alpha=0.8)
        log = bool(counts.max() > 20)  # a log scale shows the lone outliers next to a tall bar
        if log:
            _log_axis(ax)
            ax.set_ylim(0.5, float(counts.max()) * 2)
        else:
            ax.yaxis.set_major_locator(MaxNLocator(nbins=4, integer=True))
            ax.grid(True, axis="y", color="#e5e5e5", linewidth=0.6)
        ax.xaxis.set_major_locator(MaxNLocator(nbins=6))
    else:
        ax.text(0.5, 0.5, "nothing finite to draw", transform=ax.transAxes, ha="center")
    ax.set_title(title, fontsize=9, loc="left", parse_math=False)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("elements (log scale)" if log else "elements")
    return _svg(figure, title, "histogram")


def _figure(
    width: float, height: float, *, margins: tuple[float, float, float, float]
) -> tuple[Figure, Axes]:
    """A figure with one axes; *margins* (left, right, bottom, top) in inches."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=100)
    left, right, bottom, top = margins
    figure.subplots_adjust(
        left=left / width, right=1 - right / width, bottom=bottom / height, top=1 - top / height
    )
    ax = figure.add_subplot()
    ax.spines[["top", "right"]].set_visible(False)
    return figure, ax


def _svg(figure: Figure, label: str, kind: str) -> str:
    import matplotlib

    out = io.StringIO()
    # svg.hashsalt: the ids of clip paths and markers are a hash of their content (uuid4
    # otherwise), so the same diff gives the same bytes; fonttype "none": text as <text>.
    with _SAVE_LOCK, matplotlib.rc_context({"svg.hashsalt": "trajtrack", "svg.fonttype": "none"}):
        figure.savefig(out, format="svg", metadata=_NO_METADATA)
    return _inline(out.getvalue(), label, kind)


def _inline(svg: str, label: str, kind: str) -> str:
    """matplotlib's standalone SVG as an element of an HTML page."""
    start = svg.index("<svg")
    end = svg.index(">", start)
    root = svg[start:end]
    root = re.sub(r'\s(?:xmlns(?::\w+)?|width|height)="[^"]*"', "", root)
    attributes = f'class="plot {kind}" role="img" aria-label="{html.escape(label)}"'
    return f"{root} {attributes}{svg[end:].rstrip()}"


def _positive(value: float | None) -> float:
    """*value* when it can sit on a log axis (finite, > 0), else NaN."""
    if value is None or not math.isfinite(value) or value <= 0:
        return math.nan
    return float(value)


def _short(name: str) -> str:
    name = visible(name)
    return name if len(name) <= _NAME_CHARS else name[: _NAME_CHARS - 3] + "..."
