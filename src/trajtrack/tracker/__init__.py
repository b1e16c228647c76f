"""The write path: where a dump goes after ``dump()``.

Read the modules in this order::

    _tracker.py      Tracker: the dump entry points (dump, dump_nowait, dump_threadsafe, ...)
    _runner.py       its lifecycle: start, the supervised workers, flush, drain, close
    _closing.py      ... close's last steps, each bounded: seal, record, release the storage
    _intake.py       admitting snapshots into the queue; the ways in from another process
    _snapshotter.py  which snapshot a dump gets: copied now, or serialized in a thread
    _snapshot.py     the copy of plain data (CPU and CUDA tensors) taken before dump() returns
    _payloads.py     the snapshot as the upload worker writes it
    _serialize.py    the serializer (torch.save, tensors moved to the CPU)
    _archive.py      the archive writer: torch.save's bytes for tensor data, CRC-32 included
    _torchzip.py     ... its zip container, written in one pass
    _crc32.py        ... a file's CRC-32 from its pieces' (isal's combine, where installed)
    _queue.py        PendingQueue: bounded by bytes and items, with a full-policy
    _worker.py       the layout interface, and what happens once a write ended (Outcomes)
    _files.py        the files layout: one file per dump, retried (trajtrack._retry)
    _handle.py       DumpHandle: what dump() returns
    _future.py       ... the small thread-safe future it resolves through
    _ledger.py       handles, counters and the failure to re-raise
    _stats.py        the counters behind Tracker.statistics()
    _recorder.py     the record of what was written (layouts/records.py)
    _sweep.py        the temporary files dead writers left behind
    _shards.py       the shards layout: dumps packed into tar shards (layouts/shards.py)
    _shard_spool.py  ... a shard in the making: its local spool file and members
    _layouts.py      the layout options
    _forkgate.py     no fork() while a trajtrack thread is inside torch
    _waits.py        bounded waits: none of the tracker's waits may hang forever
    _environment.py  what the environment configures (the shim's and Ray adapter's switches)
    _sync.py         the sync shim: SyncTracker, dump_data, get_tracker (verl's drop-in)

The storage side is :mod:`trajtrack.backends`; the on-disk format :mod:`trajtrack.layouts`.
The names below are what the rest of trajtrack (the Ray adapter, the CLI) builds on.
"""

from __future__ import annotations

from trajtrack.tracker._environment import (
    destination_from_env,
    exit_timeout_from_env,
    is_enabled,
    tracker_options_from_env,
)
from trajtrack.tracker._handle import DumpHandle
from trajtrack.tracker._ledger import add_note
from trajtrack.tracker._payloads import ObjectPayload
from trajtrack.tracker._queue import FullPolicy
from trajtrack.tracker._runner import TrackerState
from trajtrack.tracker._serialize import Serializer, torch_save
from trajtrack.tracker._snapshot import NUMPY_DTYPES, NotPlainError, measure_plain, snapshot_plain
from trajtrack.tracker._stats import TrackerStatistics
from trajtrack.tracker._sync import DisabledTracker, SyncTracker, dump_data, get_tracker
from trajtrack.tracker._tracker import Tracker

__all__ = [
    "NUMPY_DTYPES",
    "DisabledTracker",
    "DumpHandle",
    "FullPolicy",
    "NotPlainError",
    "ObjectPayload",
    "Serializer",
    "SyncTracker",
    "Tracker",
    "TrackerState",
    "TrackerStatistics",
    "add_note",
    "destination_from_env",
    "dump_data",
    "exit_timeout_from_env",
    "get_tracker",
    "is_enabled",
    "measure_plain",
    "snapshot_plain",
    "torch_save",
    "tracker_options_from_env",
]
