"""trajtrack: dump training trajectories to HDFS or local disk without stalling the loop.

The public API is what this module exports; everything in ``trajtrack._*`` is private.
``trajtrack.rollout`` (the fully-async data layer) and ``trajtrack.ray`` (the Ray adapter) are
imported explicitly by the users who want them.

Read the packages in this order (each has its own reading guide)::

    tracker/    the write path: from dump() to the bytes in storage
    backends/   storages by URL scheme: local, WebHDFS, memory
    layouts/    the on-disk format both sides share: names, the record, tar shards
    reader/     the read path: open_run(), safe loading, compare and diff, the report
    cli/        the trajtrack command
    rollout/    verl's fully-async data layer (RolloutSample, RolloutBatch)
    ray/        one tracker actor for a Ray cluster

and the modules of the package itself::

    _exceptions.py       every exception trajtrack raises
    _retry.py            RetryPolicy: backoff with jitter under one deadline
    _environ.py          environment variables read in the per-dump path
    _loop_thread.py      an event loop on a daemon thread (the sync shim's, SyncRun's)
    _numpy_standins.py   numpy's pickle reconstructors re-done from data, for safe loading
    _progress.py         the progress bar on stderr, at a terminal only
    __main__.py          ``python -m trajtrack``
"""

from __future__ import annotations

import importlib as _importlib
import typing as _typing

from trajtrack._exceptions import (
    ConfigurationError as ConfigurationError,
    DumpDroppedError as DumpDroppedError,
    DumpExistsError as DumpExistsError,
    DumpLoadError as DumpLoadError,
    InvalidNameError as InvalidNameError,
    MissingDependencyError as MissingDependencyError,
    QueueFullError as QueueFullError,
    SerializationError as SerializationError,
    StorageError as StorageError,
    StorageNotFoundError as StorageNotFoundError,
    StoragePermissionError as StoragePermissionError,
    StorageUnavailableError as StorageUnavailableError,
    TrackerClosedError as TrackerClosedError,
    TrackerFailedError as TrackerFailedError,
    TrackerStateError as TrackerStateError,
    TrajtrackError as TrajtrackError,
    UnsafeLoadError as UnsafeLoadError,
)

if _typing.TYPE_CHECKING:
    from trajtrack._retry import RetryPolicy as RetryPolicy
    from trajtrack.layouts.records import DumpRecord as DumpRecord
    from trajtrack.reader import (
        DumpInfo as DumpInfo,
        Run as Run,
        RunDiff as RunDiff,
        SyncRun as SyncRun,
        Tolerance as Tolerance,
        compare as compare,
        diff_runs as diff_runs,
        open_run as open_run,
    )
    from trajtrack.tracker import (
        DumpHandle as DumpHandle,
        FullPolicy as FullPolicy,
        SyncTracker as SyncTracker,
        Tracker as Tracker,
        TrackerState as TrackerState,
        TrackerStatistics as TrackerStatistics,
        dump_data as dump_data,
        get_tracker as get_tracker,
        is_enabled as is_enabled,
    )

# Imported on first use (PEP 562), so that `trajtrack --help` and the CLI's usage errors do
# not import torch (seconds). `from trajtrack import Tracker` imports it right there, as
# before: still before any event loop runs.
_LAZY = {
    "RetryPolicy": "trajtrack._retry",
    "DumpRecord": "trajtrack.layouts.records",
    "DumpInfo": "trajtrack.reader",
    "Run": "trajtrack.reader",
    "RunDiff": "trajtrack.reader",
    "SyncRun": "trajtrack.reader",
    "Tolerance": "trajtrack.reader",
    "compare": "trajtrack.reader",
    "diff_runs": "trajtrack.reader",
    "open_run": "trajtrack.reader",
    "DumpHandle": "trajtrack.tracker",
    "FullPolicy": "trajtrack.tracker",
    "SyncTracker": "trajtrack.tracker",
    "Tracker": "trajtrack.tracker",
    "TrackerState": "trajtrack.tracker",
    "TrackerStatistics": "trajtrack.tracker",
    "dump_data": "trajtrack.tracker",
    "get_tracker": "trajtrack.tracker",
    "is_enabled": "trajtrack.tracker",
}


def __getattr__(name: str) -> _typing.Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'trajtrack' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0"

__all__ = (
    "ConfigurationError",
    "DumpDroppedError",
    "DumpExistsError",
    "DumpHandle",
    "DumpInfo",
    "DumpLoadError",
    "DumpRecord",
    "FullPolicy",
    "InvalidNameError",
    "MissingDependencyError",
    "QueueFullError",
    "RetryPolicy",
    "Run",
    "RunDiff",
    "SerializationError",
    "StorageError",
    "StorageNotFoundError",
    "StoragePermissionError",
    "StorageUnavailableError",
    "SyncRun",
    "SyncTracker",
    "Tolerance",
    "Tracker",
    "TrackerClosedError",
    "TrackerFailedError",
    "TrackerState",
    "TrackerStateError",
    "TrackerStatistics",
    "TrajtrackError",
    "UnsafeLoadError",
    "__version__",
    "compare",
    "diff_runs",
    "dump_data",
    "get_tracker",
    "is_enabled",
    "open_run",
)
