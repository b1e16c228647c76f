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
import io
import math
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from trajtrack._exceptions import MissingDependencyError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["DumpPoint", "divergence_svg", "histogram_svg", "require_matplotlib"]

INSTALL_HINT = "the HTML report needs matplotlib: pip install 'trajtrack[report]'"

# Every text that shows a dump name or a path is drawn with parse_math=False: a "$" in it is
# text, not a formula (and cannot make the mathtext parser fail); the log axes' own tick
# labels are mathtext.
_NO_METADATA = {"Date": None, "Creator": None, "Format": None, "Type": None}
# rcParams are process-wide: rc_context() swaps them for the duration of a save, so two of our
# saves must not interleave (a user's own plotting in another thread is not our business).
_SAVE_LOCK = threading.Lock()
_MAX_NAMED_TICKS = 40  # up to this many dumps, the x axis is labelled with their names
_NAME_CHARS = 32
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
    """Fail with the install hint when matplotlib is missing.

    Raises:
        MissingDependencyError: matplotlib cannot be imported.
    """
    try:
        import matplotlib  # noqa: F401  (only whether it imports)
    except ImportError as exc:
        raise MissingDependencyError(INSTALL_HINT) from exc


def divergence_svg(points: Sequence[DumpPoint], first: int | None) -> str:
    """How far apart two runs are, dump by dump: max abs / max rel difference on a log scale.

    Args:
        points: The dumps, in dump order.
        first: Index in *points* of the first divergence (marked), if any.
    """
    figure, ax = _figure(11.0, 4.6 if len(points) <= _MAX_NAMED_TICKS else 3.8)
    x = np.arange(len(points))
    by_status: dict[str, list[int]] = {}
    for i, point in enumerate(points):
        by_status.setdefault(point.status, []).append(i)
    differing = by_status.get("different", [])
    if differing:  # the highlight: one LineCollection, however many dumps differ
        ax.vlines(
            differing,
            0,
            1,
            transform=ax.get_xaxis_transform(),
            colors=_COLORS["highlight"],
            label=f"different ({len(differing)})",
        )
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
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    return _svg(figure, "difference between the runs, dump by dump", "divergence")


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
        ax.set_yscale("log")
        ax.grid(True, axis="y", which="major", color="#e5e5e5", linewidth=0.6)
    return plotted


def _markers(ax: Axes, points: Sequence[DumpPoint], by_status: dict[str, list[int]]) -> None:
    """Equal dumps as a rug at the bottom; only-in-A/B, errors and structural ones on top."""
    band = ax.get_xaxis_transform()  # x in data, y in axes fractions
    structural = [
        i
        for i in by_status.get("different", [])
        if math.isnan(_positive(points[i].max_abs)) and math.isnan(_positive(points[i].max_rel))
    ]
    for key, indices, y, marker, label in (
        ("equal", by_status.get("equal", []), 0.02, "|", "equal"),
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


def _x_axis(ax: Axes, points: Sequence[DumpPoint]) -> None:
    if 0 < len(points) <= _MAX_NAMED_TICKS:
        labels = [_short(p.name) for p in points]
        ax.set_xticks(range(len(points)), labels, rotation=90, fontsize=7, parse_math=False)
        ax.set_xlabel("dump, in dump order")
    else:
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(nbins=12, integer=True))
        ax.set_xlabel("dump number, in dump order (commit time, then name)")


def histogram_svg(values: np.ndarray[Any, Any], title: str, *, xlabel: str = "a - b") -> str:
    """A histogram of element-wise differences (counts on a log scale).

    Args:
        values: Finite differences (any shape; flattened).
        title: The plot's title (plain text, shown as is).
        xlabel: The quantity on the x axis.
    """
    figure, ax = _figure(7.5, 3.0)
    flat = np.asarray(values, dtype=np.float64).reshape(-1)
    if flat.size:
        counts, edges = np.histogram(flat, bins=60)
        ax.stairs(counts, edges, fill=True, color=_COLORS["abs"], alpha=0.8)
        ax.set_yscale("log")
        ax.set_ylim(0.5, max(1.0, float(counts.max())) * 2)
    else:
        ax.text(0.5, 0.5, "no finite differences", transform=ax.transAxes, ha="center")
    ax.set_title(title, fontsize=9, loc="left", parse_math=False)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("elements (log scale)")
    ax.grid(True, axis="y", color="#e5e5e5", linewidth=0.6)
    return _svg(figure, title, "histogram")


def _figure(width: float, height: float) -> tuple[Figure, Axes]:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=100, layout="constrained")
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
    return name if len(name) <= _NAME_CHARS else name[: _NAME_CHARS - 3] + "..."
