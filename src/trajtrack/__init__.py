"""trajtrack: dump training trajectories to HDFS or local disk without stalling the loop.

The public API is what this module exports; everything in ``trajtrack._*`` is private.
``trajtrack.rollout`` (the fully-async data layer) and ``trajtrack.ray`` (the Ray adapter) are
imported explicitly by the users who want them.
"""

from __future__ import annotations

import trajtrack._warm  # noqa: F401  (before any event loop runs: see the module)
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
