"""The read path: from ``open_run()`` back to ``diff``.

Read the modules in this order::

    _run.py        Run / open_run: a run's dumps, their bytes (file or shard range), objects
    _listing.py    the list of dumps: record segments + storage listing (+ shard headers)
    _record_set.py  RecordSet: what a run's record says, and the recorded dumps it gives
    _dumps.py      DumpInfo, RunListing: what the reader knows about each dump
    _syncrun.py    SyncRun: the blocking facade (notebooks, scripts)
    _replay.py     Run.replay: a recorded run step by step, whole steps loaded ahead
    _text.py       token ids as text (a tokenizer.json, verl's masks)
    _text_report.py  ... the diff report's token-text section (``diff --tokenizer --html``)
    _safe_load.py  loading a dump safely: one route, torch's decision, public API only
    _fast_load.py  ... its fast path: the C unpickler, accepted only where it provably agrees
    _torch_archive.py  ... torch's zip container and the pickle's opcodes, checked first
    _standins.py   ... verl's objects read as data: allow-listed stand-ins
    ../_numpy_standins.py  ... numpy's pickle reconstructors, re-done from data only (shared
                   with trajtrack.rollout's allow-list)
    _tensordict_standins.py  ... tensordict's pickle reductions, re-done from data only
    _load_worker.py  ... in trajtrack's own process, for a dump that needs trajtrack's list
    _portable.py   ... and how that process hands the object back (torch's defaults load it)
    _main_module.py  ... started only if spawning it would not re-run the caller's script
    _archive_diff.py  two dumps of the same pickle compared without building tensors
    _compare.py    compare(): the structural walk over two objects, with a Tolerance
    _kinds.py      what kind of container a loaded object is; bounded repr and element budget
    _rows.py       the differing rows of two batch tensors and their ids (uid)
    _ignore.py     --ignore glob patterns over key paths, and the volatile-keys preset
    _same_archive.py  two torch archives equal apart from their per-save serialization id
    _remembered.py  Remembered: verdicts remembered by the bytes they depended on
    _numeric.py    element-wise comparison of two tensors (the hot loop of compare)
    _files.py      two local files compared in place, byte for byte
    _readahead.py  a bounded read-ahead of the files diff is about to compare
    _gather.py     bounded concurrency for the read path: many reads in flight, not all
    _batch_reads.py  a batch of dumps read from a remote store (read_remote), grouped
    _local_reads.py  ... and off a local disk, in one worker thread (read_local)
    _pair_checks.py  comparing a pair of dumps once their bytes are read (diff's per-pair work)
    _diff_result.py  DumpComparison, RunDiff: what diff_runs returns; the record hint (show too)
    _diff.py       diff_runs(): two runs paired by name, compared dump by dump
    _export.py     export_run(): any run written out in the files layout
    _report.py     write_diff_report(): the diff as one self-contained HTML page
    _dump_report.py  render_dump_report(): one dump's tensors as histograms (``show --html``)
    _plots.py      their plots (matplotlib, inline SVG; the ``report`` extra)
    _html.py       the page shell they share (CSS, escaping, atomic write)
    _tensor_path.py  a Difference.path back to the object, a - b of two tensors

The CLI (:mod:`trajtrack.cli`) is built on these names; so can be any other tool.
"""

from __future__ import annotations

from trajtrack.reader._batch_reads import dump_batches
from trajtrack.reader._compare import Difference, Differences, Tolerance, compare
from trajtrack.reader._diff import DumpComparison, RunDiff, diff_runs
from trajtrack.reader._diff_result import record_disagreement
from trajtrack.reader._dump_report import render_dump_report
from trajtrack.reader._dumps import DumpInfo, RunListing, dump_order, matches
from trajtrack.reader._export import ExportResult, export_run
from trajtrack.reader._gather import gather_bounded, group_small
from trajtrack.reader._html import check_report_target, write_atomically
from trajtrack.reader._ignore import VOLATILE as VOLATILE_KEYS
from trajtrack.reader._kinds import abbreviate, within_budget
from trajtrack.reader._plots import require_matplotlib
from trajtrack.reader._replay import Replay
from trajtrack.reader._report import (
    DivergentTensor,
    load_divergent_tensor,
    render_diff_report,
    write_diff_report,
)
from trajtrack.reader._run import Run, open_run
from trajtrack.reader._safe_load import (
    allow_in_this_process,
    check_loadable,
    load_dump_bytes,
    load_dump_file,
)
from trajtrack.reader._syncrun import SyncRun
from trajtrack.reader._text import (
    TextRow,
    TokenDifference,
    load_tokenizer,
    parse_rows,
    text_differences,
    text_rows,
    token_keys,
)
from trajtrack.reader._text_report import render_text_section

__all__ = [
    "VOLATILE_KEYS",
    "Difference",
    "Differences",
    "DivergentTensor",
    "DumpComparison",
    "DumpInfo",
    "ExportResult",
    "Replay",
    "Run",
    "RunDiff",
    "RunListing",
    "SyncRun",
    "TextRow",
    "TokenDifference",
    "Tolerance",
    "abbreviate",
    "allow_in_this_process",
    "check_loadable",
    "check_report_target",
    "compare",
    "diff_runs",
    "dump_batches",
    "dump_order",
    "export_run",
    "gather_bounded",
    "group_small",
    "load_divergent_tensor",
    "load_dump_bytes",
    "load_dump_file",
    "load_tokenizer",
    "matches",
    "open_run",
    "parse_rows",
    "record_disagreement",
    "render_diff_report",
    "require_matplotlib",
    "render_dump_report",
    "render_text_section",
    "text_differences",
    "text_rows",
    "token_keys",
    "within_budget",
    "write_atomically",
    "write_diff_report",
]
