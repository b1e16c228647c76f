"""The read path: from ``open_run()`` back to ``diff``.

Read the modules in this order::

    _run.py        Run / SyncRun / open_run: the list of dumps (record + listing), reading
    _safe_load.py  loading a dump safely (weights-only, trajtrack's allow-list)
    _diff.py       compare(): the structural walk; diff_runs(): two runs dump by dump
    _numeric.py    element-wise comparison of two tensors
"""

from __future__ import annotations
