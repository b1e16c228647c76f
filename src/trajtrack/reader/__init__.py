"""The read path: from ``open_run()`` back to ``diff``.

Read the modules in this order::

    _run.py        Run / SyncRun / open_run: the list of dumps (record + listing), reading
    _safe_load.py  loading a dump safely (weights-only, trajtrack's allow-list)
    _compare.py    compare(): the structural walk over two objects, with a Tolerance
    _numeric.py    element-wise comparison of two tensors (the hot loop of compare)
    _diff.py       diff_runs(): two runs paired by name, compared dump by dump
    _report.py     write_diff_report(): the diff as one self-contained HTML page
    _dump_report.py  render_dump_report(): one dump's tensors as histograms (``show --html``)
    _plots.py      their plots (matplotlib, inline SVG; the ``report`` extra)
    _html.py       the page shell they share (CSS, escaping, atomic write)
    _tensor_path.py  a Difference.path back to the object, a - b of two tensors

The CLI (:mod:`trajtrack.cli`) is built on these names; so can be any other tool.
"""

from __future__ import annotations

from trajtrack.reader._compare import Difference, Tolerance, compare
from trajtrack.reader._diff import DumpComparison, RunDiff, diff_runs
from trajtrack.reader._dump_report import render_dump_report
from trajtrack.reader._report import (
    DivergentTensor,
    load_divergent_tensor,
    render_diff_report,
    write_diff_report,
)
from trajtrack.reader._run import (
    DumpInfo,
    Run,
    RunListing,
    SyncRun,
    dump_order,
    gather_bounded,
    matches,
    open_run,
)
from trajtrack.reader._safe_load import check_loadable, load_dump_bytes

__all__ = [
    "Difference",
    "DivergentTensor",
    "DumpComparison",
    "DumpInfo",
    "Run",
    "RunDiff",
    "RunListing",
    "SyncRun",
    "Tolerance",
    "check_loadable",
    "compare",
    "diff_runs",
    "dump_order",
    "gather_bounded",
    "load_divergent_tensor",
    "load_dump_bytes",
    "matches",
    "open_run",
    "render_diff_report",
    "render_dump_report",
    "write_diff_report",
]
