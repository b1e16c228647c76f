"""The layout options of a tracker, and the dump paths a destination already has (what
``on_exists="error"`` refuses)."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from typing import Literal

import anyio

from trajtrack._exceptions import ConfigurationError, StorageNotFoundError, TrackerStateError
from trajtrack.backends import FileInfo, Storage
from trajtrack.layouts.names import RECORDS_DIR, is_internal_path, parse_temp_path
from trajtrack.layouts.records import RECORDS_PREFIX, DumpRecord, decode_segment
from trajtrack.layouts.shards import Member, ShardHeaderError, index_members, is_shard_path
from trajtrack.tracker._queue import PendingQueue
from trajtrack.tracker._worker import Layout, Spawn

__all__ = [
    "DEFAULT_SHARD_MAX_AGE",
    "DEFAULT_SHARD_MAX_BYTES",
    "LayoutName",
    "NOT_STARTED",
    "LayoutOptions",
    "existing_paths",
    "sharded_paths",
]

LayoutName = Literal["files", "shards"]
DEFAULT_SHARD_MAX_BYTES = 64 << 20
DEFAULT_SHARD_MAX_AGE = 2.0


@dataclass(frozen=True, slots=True)
class LayoutOptions:
    """How dumps map onto storage files.

    Attributes:
        kind: ``"files"`` (one file per dump) or ``"shards"`` (tar shards).
        shard_max_bytes: Seal a shard once it holds this many bytes.
        shard_max_age: Seal a shard once its oldest dump is this many seconds old.
        spool_dir: Where shards in the making are kept (default: the storage's own spool
            directory, else the system's temporary directory).
    """

    kind: LayoutName = "files"
    shard_max_bytes: int = DEFAULT_SHARD_MAX_BYTES
    shard_max_age: float = DEFAULT_SHARD_MAX_AGE
    spool_dir: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("files", "shards"):
            raise ConfigurationError(f"layout must be 'files' or 'shards', not {self.kind!r}")
        if self.shard_max_bytes <= 0:
            raise ConfigurationError("shard_max_bytes must be > 0")
        if not self.shard_max_age > 0:
            raise ConfigurationError("shard_max_age must be > 0 seconds")

    def spool_dir_for(self, storage: Storage) -> str:
        """The local directory for spools: next to a local destination, else elsewhere."""
        return storage.spool_dir or self.spool_dir or tempfile.gettempdir()


class _NotStarted(Layout):
    """The layout before start(): there is nothing to write or seal."""

    def start(self, spawn: Spawn, queue: PendingQueue, workers: int, stop: anyio.Event) -> None:
        raise TrackerStateError("the tracker has not been started")


NOT_STARTED = _NotStarted()


async def existing_paths(storage: Storage) -> set[str]:
    """The dump paths the destination already has: files in no record, recorded dumps, and
    the members of shards no record names (a crash between a shard's rename and its record;
    the reader lists them from their tar headers).

    What ``on_exists="error"`` refuses in a sharded run. A snapshot taken at start: a writer
    running at the same time on the same destination is not seen (see docs).
    """
    listed = await _listed(storage, "")
    paths = {info.path for info in listed if not is_internal_path(info.path)}
    return paths | await _stored_in_run(storage, listed, shards_only=False)


async def sharded_paths(storage: Storage) -> set[str]:
    """The dump paths the destination holds in shards, recorded or not.

    What ``on_exists="error"`` refuses in a files-layout run besides the files its atomic
    publish finds taken: the layouts may be mixed in one destination, and the reader would
    show a new file in place of the shard member of the same path.
    """
    listed = await _listed(storage, RECORDS_DIR)
    return await _stored_in_run(storage, listed, shards_only=True)


async def _listed(storage: Storage, prefix: str) -> list[FileInfo]:
    try:
        return await storage.list(prefix)
    except StorageNotFoundError:  # a new destination
        return []


async def _stored_in_run(
    storage: Storage, listed: list[FileInfo], *, shards_only: bool
) -> set[str]:
    """The paths the records of *listed* name (with *shards_only*, those in a shard), and the
    members of the listed shards no record names."""
    paths: set[str] = set()
    recorded_shards: set[str | None] = set()
    shards: dict[str, int] = {}
    for info in listed:
        if parse_temp_path(info.path) is not None:
            continue
        if info.path.startswith(RECORDS_PREFIX + "/"):
            for record in await _records(storage, info.path):
                recorded_shards.add(record.shard)
                if record.shard is not None or not shards_only:
                    paths.add(record.path)
        elif is_shard_path(info.path):
            shards[info.path] = info.size
    for path, size in shards.items():
        if path not in recorded_shards:
            paths.update(member.name for member in await _members(storage, path, size))
    return paths


async def _records(storage: Storage, path: str) -> list[DumpRecord]:
    try:
        records, _bad = decode_segment(await storage.read(path))
    except StorageNotFoundError:
        return []
    return records


async def _members(storage: Storage, path: str, size: int) -> list[Member]:
    """The members of the shard at *path*, from its tar headers (ranged reads, in a thread)."""

    def read(offset: int, length: int) -> bytes:
        return anyio.from_thread.run(storage.read_range, path, offset, length)

    try:
        return await anyio.to_thread.run_sync(index_members, read, size)
    except StorageNotFoundError:
        return []
    except ShardHeaderError as exc:  # the members before the damaged header
        return exc.members
