"""The read path: from ``open_run()`` back to ``diff``.

Read the modules in this order::

    _run.py          Run / SyncRun / open_run: the list of dumps (record + listing), reading
    _safe_load.py    loading a dump safely: torch.load(weights_only=True), public API only
    _load_worker.py  ... in trajtrack's own process, for a dump that needs trajtrack's list
    _portable.py     ... and how that process hands the object back (torch's defaults load it)
    _compare.py      compare(): the structural walk over two objects, with a Tolerance
    _numeric.py      element-wise comparison of two tensors (the hot loop of compare)
    _files.py        two local files compared in place, byte for byte
    _diff.py         diff_runs(): two runs paired by name, compared dump by dump

The CLI (:mod:`trajtrack.cli`) is built on these names; so can be any other tool.
"""

from __future__ import annotations

from trajtrack.reader._compare import Difference, Tolerance, compare
from trajtrack.reader._diff import DumpComparison, RunDiff, diff_runs
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
from trajtrack.reader._safe_load import (
    allow_in_this_process,
    check_loadable,
    load_dump_bytes,
    load_dump_file,
)

__all__ = [
    "Difference",
    "DumpComparison",
    "DumpInfo",
    "Run",
    "RunDiff",
    "RunListing",
    "SyncRun",
    "Tolerance",
    "allow_in_this_process",
    "check_loadable",
    "compare",
    "diff_runs",
    "dump_order",
    "gather_bounded",
    "load_dump_bytes",
    "load_dump_file",
    "matches",
    "open_run",
]
