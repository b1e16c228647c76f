"""The layout options of a tracker, and what the shards layout needs to know at start."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from typing import Any, Literal

import anyio

from trajtrack._exceptions import ConfigurationError, StorageNotFoundError, TrackerStateError
from trajtrack.backends import Storage
from trajtrack.layouts.names import is_internal_path, parse_temp_path
from trajtrack.layouts.records import RECORDS_PREFIX, decode_segment
from trajtrack.tracker._queue import PendingQueue
from trajtrack.tracker._worker import Spawn

__all__ = [
    "DEFAULT_SHARD_MAX_AGE",
    "DEFAULT_SHARD_MAX_BYTES",
    "LayoutName",
    "NOT_STARTED",
    "LayoutOptions",
    "existing_paths",
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


class _NotStarted:
    """The layout before start(): there is nothing to write or seal."""

    def start(self, spawn: Spawn, queue: PendingQueue, workers: int, stop: anyio.Event) -> None:
        raise TrackerStateError("the tracker has not been started")

    async def seal_after(self, jobs: list[Any]) -> None:
        return None

    async def seal(self) -> None:
        return None

    def discard(self) -> None:
        return None

    async def aclose(self) -> None:
        return None


NOT_STARTED = _NotStarted()


async def existing_paths(storage: Storage) -> set[str]:
    """The dump paths the destination already has: its record, and files in no record.

    What ``on_exists="error"`` refuses in a sharded run. A snapshot taken at start: a writer
    running at the same time on the same destination is not seen (see docs).
    """
    paths = set()
    for info in await storage.list(""):
        if not is_internal_path(info.path):
            paths.add(info.path)
        elif info.path.startswith(RECORDS_PREFIX + "/") and parse_temp_path(info.path) is None:
            try:
                records, _bad = decode_segment(await storage.read(info.path))
            except StorageNotFoundError:
                continue
            paths.update(record.path for record in records)
    return paths
