"""The write path: where a dump goes after ``dump()``.

Read the modules in this order::

    _tracker.py   Tracker: lifecycle and the dump entry points (dump, dump_nowait, ...)
    _snapshot.py  the copy taken on the caller's thread before dump() returns
    _queue.py     PendingQueue: bounded by bytes and items, with a full-policy
    _handle.py    DumpHandle: what dump() returns, resolving to the record or the error
    _stats.py     the counters behind statistics()
    _sync.py      the sync shim: SyncTracker, dump_data, get_tracker (verl's drop-in)

The storage side is :mod:`trajtrack.backends`; the on-disk format :mod:`trajtrack.layouts`.
"""

from __future__ import annotations
