"""Choosing how to snapshot a dump: copy it on the caller's thread, or serialize it in a thread.

* Plain data up to ``inline_bytes`` (and CUDA tensors at any size: a device clone plus an
  asynchronous device-to-host copy) is copied right away on the caller's thread, without
  releasing the GIL for small tensors; the upload worker serializes the copy later. For the
  shards layout, small plain data is serialized right away instead
  (:data:`SERIALIZE_NOW_MAX_BYTES`).
* Larger plain data is serialized straight into a named spool file in a worker thread (faster
  than copying it in memory, and it holds no RAM); a local destination then renames that file
  into place.
* Anything else is serialized once, in a worker thread, into a spooled temporary file.

Serialization (or a big copy) holds the GIL in pieces, so it never runs on the event loop.
"""

from __future__ import annotations

import functools
import os
import tempfile
from typing import Any

import anyio
import anyio.to_thread

from trajtrack.backends import Payload
from trajtrack.layouts.names import WriterIdentity, temp_path_for
from trajtrack.tracker._payloads import serialize_small, serialize_to_file, serialize_to_spool
from trajtrack.tracker._serialize import Serializer, torch_save
from trajtrack.tracker._snapshot import (
    NotPlainError,
    has_cuda_tensor,
    measure_plain,
    snapshot_plain,
)

__all__ = ["SERIALIZE_NOW_MAX_BYTES", "Snapshotter"]

SERIALIZE_NOW_MAX_BYTES = 64 << 10
"""For the shards layout, plain data up to this size is serialized by ``dump()`` itself: the
shard writes ready bytes many members to a ``writev``, where other payloads cost a thread hop
each (``benchmarks/bench_shards.py``: local shards against the inline loop). The files layout
copies instead: a copy of a small dump costs the caller a fraction of its serialization, and
the upload worker serializes it in its batch (``benchmarks/bench_core.py``: 4 KB ``await
dump`` p50)."""


class Snapshotter:
    """Takes the snapshot of one dump, the cheapest safe way for its kind and size.

    Args:
        serializer: ``serializer(obj, binary_file)``.
        inline_bytes: Plain data up to this size is copied on the caller's thread.
        serialize_small: Serialize small plain data at once instead (the shards layout).
        spool_dir: Where large serialized snapshots go (default: the storage's own spool
            directory when it has one, else the system temporary directory).
        who: The writer, for spool file names.
        threads: Snapshots serialized at once in worker threads.
    """

    def __init__(
        self,
        serializer: Serializer,
        *,
        inline_bytes: int,
        serialize_small: bool,
        spool_dir: str | None,
        who: WriterIdentity,
        threads: int,
    ) -> None:
        self._serializer = serializer
        self._inline_bytes = inline_bytes
        self._serialize_small = serialize_small and serializer is torch_save
        self._spool_dir = spool_dir
        self._storage_spool: str | None = None
        self._who = who
        self._threads = threads

    @functools.cached_property
    def _limiter(self) -> anyio.CapacityLimiter:
        # Made on the loop at the first snapshot in a thread, not with the tracker: in a running
        # loop, anyio loads its backend to make it, which the tracker's start does off the loop.
        return anyio.CapacityLimiter(self._threads)

    def use_spool_of(self, storage_spool: str | None) -> None:
        """Spool large snapshots where the storage can rename them from (its filesystem)."""
        self._storage_spool = storage_spool

    async def take(self, obj: Any) -> Payload:
        """The snapshot, from a coroutine: heavy work goes to a worker thread."""
        nbytes = _plain_size(obj)
        if self._copy_inline(obj, nbytes):
            return self._plain(obj, nbytes)
        return await anyio.to_thread.run_sync(self._serialize, obj, nbytes, limiter=self._limiter)

    def take_here(self, obj: Any) -> Payload:
        """The snapshot, all of it on the calling thread (not the event loop's)."""
        nbytes = _plain_size(obj)
        if self._copy_inline(obj, nbytes):
            return self._plain(obj, nbytes)
        return self._serialize(obj, nbytes)

    def _copy_inline(self, obj: Any, nbytes: int | None) -> bool:
        return nbytes is not None and (nbytes <= self._inline_bytes or has_cuda_tensor(obj))

    def _plain(self, obj: Any, nbytes: int | None) -> Payload:
        if (
            self._serialize_small
            and nbytes is not None
            and nbytes <= SERIALIZE_NOW_MAX_BYTES
            and not has_cuda_tensor(obj)  # a CUDA copy must not make the caller wait
        ):
            serialized = serialize_small(obj)
            if serialized is not None:
                return serialized
        payload = snapshot_plain(obj, nbytes)
        payload.serializer = self._serializer
        return payload

    def _serialize(self, obj: Any, nbytes: int | None) -> Payload:
        if nbytes is None:  # not plain data: the serialized bytes are the snapshot
            return serialize_to_spool(obj, self._serializer, self._spool_dir)
        base = self._storage_spool or self._spool_dir or tempfile.gettempdir()
        spool = os.path.join(base, temp_path_for("spool", self._who))
        return serialize_to_file(obj, self._serializer, spool)


def _plain_size(obj: Any) -> int | None:
    try:
        return measure_plain(obj)
    except NotPlainError:
        return None
