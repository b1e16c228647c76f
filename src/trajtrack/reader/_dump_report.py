"""The visual report of one dump (``trajtrack show URL NAME --html FILE``).

One self-contained page (:mod:`trajtrack.reader._html`): where the dump is, a table of every
tensor and numeric array in it (named as :func:`~trajtrack.reader.compare` names them) with
its statistics, and a histogram of the values of each (the first *max_tensors*).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

from trajtrack.reader._dumps import DumpInfo
from trajtrack.reader._html import escape as _e, number, page
from trajtrack.reader._plots import histogram_svg, load_matplotlib
from trajtrack.reader._tensor_path import dtype_name, finite_values, numeric_leaves

__all__ = ["render_dump_report"]


def render_dump_report(obj: Any, info: DumpInfo, *, url: str, max_tensors: int = 32) -> str:
    """The HTML page of one loaded dump (blocking: matplotlib draws a histogram per tensor).

    Args:
        obj: The loaded dump.
        info: Its :class:`~trajtrack.reader.DumpInfo`.
        url: The run it belongs to.
        max_tensors: Tensors drawn (and listed) at most.

    Raises:
        MissingDependencyError: matplotlib is not installed (``trajtrack[report]``).
    """
    load_matplotlib()
    from trajtrack import __version__

    leaves = list(itertools.islice(numeric_leaves(obj), max_tensors + 1))
    rows, plots = [], []
    for i, (path, tensor) in enumerate(leaves[:max_tensors]):
        row, plot = _tensor(i, path, tensor)
        rows.append(row)
        plots.append(plot)
    more = (
        f'<p class="note">Only the first {max_tensors} tensors are listed and drawn.</p>'
        if len(leaves) > max_tensors
        else ""
    )
    head = (
        "<tr><th>key</th><th>dtype</th><th>shape</th><th>min</th><th>max</th><th>mean</th>"
        "<th>NaN/inf</th></tr>"
    )
    table = f'<table id="tensors">{head}{"".join(rows)}</table>{more}' if rows else ""
    none = '<p class="note">No tensor or numeric array in this dump.</p>'
    body = (
        f'<section id="summary"><h2>Dump</h2>{_where(info, url)}</section>'
        f'<section id="tensors-list"><h2>Tensors</h2>{table or none}</section>'
        f'<section id="histograms"><h2>Values</h2>{"".join(plots)}</section>'
    )
    return page(
        title=f"trajtrack show: {url} {info.name}",
        heading="trajtrack show",
        badge=f'<code class="dump-name">{_e(info.name)}</code>',
        body=body,
        footer=f"Written by trajtrack {_e(__version__)}.",
    )


def _where(info: DumpInfo, url: str) -> str:
    items = [
        ("run", url),
        ("dump", info.name),
        ("file", info.path),
        ("size", f"{info.size} bytes"),
        ("checksum", info.checksum or "unrecorded"),
        ("writer", info.writer or "-"),
    ]
    listing = "".join(f"<dt>{key}</dt><dd><code>{_e(value)}</code></dd>" for key, value in items)
    return f"<dl>{listing}</dl>"


def _tensor(i: int, path: str, tensor: Any) -> tuple[str, str]:
    """Its table row and its histogram section."""
    where = path or "<root>"
    shape = [int(n) for n in tensor.shape]
    dtype = dtype_name(tensor)
    found = finite_values(tensor)
    cells = [f'<td class="mono"><a href="#t{i}">{_e(where)}</a></td>']
    cells += [f"<td>{_e(dtype)}</td>", f'<td class="mono">{_e(str(shape))}</td>']
    if found is None:  # a quantized tensor or another kind without plain values
        row = f'<tr>{"".join(cells)}<td colspan="4"></td></tr>'
        return row, f'<h3 id="t{i}">{_e(where)}</h3><p class="note">No plain values.</p>'
    values, non_finite, step = found
    stats = [values.min(), values.max(), values.mean()] if values.size else [None] * 3
    cells += [f'<td class="num">{number(None if v is None else float(v))}</td>' for v in stats]
    cells.append(f'<td class="num">{non_finite}</td>')
    title = f"{where}: {dtype} {shape}, {math.prod(shape)} elements"
    note = f"every {step}th element drawn; statistics of those" if step > 1 else ""
    svg = histogram_svg(values, title, xlabel="|value|" if tensor_is_complex(tensor) else "value")
    notes = f'<p class="note">{_e(note)}</p>' if note else ""
    return f"<tr>{''.join(cells)}</tr>", f'<h3 id="t{i}">{_e(where)}</h3>{svg}{notes}'


def tensor_is_complex(tensor: Any) -> bool:
    """Whether a tensor or array holds complex numbers."""
    return "complex" in dtype_name(tensor)
