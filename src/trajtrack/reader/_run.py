"""Reading a run back: what was dumped, the bytes of a dump, and the objects.

``open_run(url)`` gives a :class:`Run` over any destination a tracker can write to, in either
layout or a mix of both: the list of dumps comes from :func:`~trajtrack.reader._listing.scan_run`,
a dump's bytes from its own file or, in a sharded run, from one ranged read of its shard.
Loading is safe by default (see :mod:`trajtrack.reader._safe_load`). The API is async;
:class:`~trajtrack.reader._syncrun.SyncRun` wraps it for synchronous callers (notebooks).

The storage is opened in a worker thread (opening may read Hadoop configuration files), on
``async with`` or at the first call that needs it; never on the event loop.
"""

from __future__ import annotations

import builtins
import functools
import os
import stat
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any

import anyio
import anyio.to_thread

from trajtrack._exceptions import (
    StorageNotFoundError,
    StoragePermissionError,
)
from trajtrack.backends import Storage, open_storage
from trajtrack.backends.local import translated
from trajtrack.reader._batch_reads import check_held, check_readable, read_remote, whole_member
from trajtrack.reader._dumps import DumpInfo, RunListing, matches
from trajtrack.reader._files import LocalFile, inside_run, local_file
from trajtrack.reader._listing import scan_run
from trajtrack.reader._local_reads import LocalReader, read_local
from trajtrack.reader._replay import Replay
from trajtrack.reader._safe_load import load_dump_bytes, load_dump_file
from trajtrack.rollout import STEP_MANIFEST

__all__ = ["DEFAULT_CONCURRENCY", "Run", "open_run"]

DEFAULT_CONCURRENCY = 16


class Run:
    """Read access to the dumps of one destination.

    Use it as ``async with trajtrack.open_run(url) as run: ...``.

    Args:
        url: A local path, ``file://``, ``memory://``, ``webhdfs://``, ``swebhdfs://`` or
            ``hdfs://`` URL, as given to the tracker.
        storage: An already-open storage to read instead of opening *url*.
        suffix: The tracker's file suffix, stripped from unrecorded files to name them.
        concurrency: Reads in flight at once in bulk operations (``diff``, ``verify``).
        storage_options: Keyword arguments for the storage backend.
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        storage: Storage | None = None,
        suffix: str = ".pth",
        concurrency: int = DEFAULT_CONCURRENCY,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self._url = os.fspath(url)
        self._owns_storage = storage is None
        self._storage = storage
        self._storage_options = dict(storage_options or {})
        self._suffix = suffix
        self._concurrency = max(1, concurrency)
        self._listing: RunListing | None = None
        self._closed = False

    @property
    def url(self) -> str:
        """The destination, as given."""
        return self._url

    @property
    def storage(self) -> Storage:
        """The storage backend being read (once the run is open)."""
        if self._storage is None:
            raise StorageNotFoundError(
                f"{self._url}: the run is not open yet (use 'async with open_run(url)')"
            )
        return self._storage

    @property
    def concurrency(self) -> int:
        """How many reads run at once in bulk operations."""
        return self._concurrency

    async def open(self) -> Run:
        """Open the storage (in a worker thread); done by ``async with`` and on first use."""
        if self._storage is None:
            self._storage = await anyio.to_thread.run_sync(
                functools.partial(open_storage, self._url, **self._storage_options)
            )
        return self

    async def _opened(self) -> Storage:
        if self._storage is None:
            await self.open()
        return self.storage

    # ------------------------------------------------------------------ listing

    async def scan(self, *, refresh: bool = False) -> RunListing:
        """Read the record segments and the listing once (cached; ``refresh`` re-reads).

        Raises:
            StorageNotFoundError: The destination does not exist.
            StorageError: The storage failed.
        """
        if self._listing is None or refresh:
            storage = await self._opened()
            self._listing = await scan_run(
                storage, suffix=self._suffix, concurrency=self._concurrency
            )
        return self._listing

    async def list(
        self, glob: str | None = None, *, refresh: bool = False
    ) -> builtins.list[DumpInfo]:
        """The dumps of the run in dump order (commit time, then name).

        Args:
            glob: Only dumps whose name or path matches this ``fnmatch`` pattern (``*``
                matches across ``/``).
            refresh: Re-read the record and the listing instead of using the cached scan.
        """
        listing = await self.scan(refresh=refresh)
        return [d for d in listing.dumps if glob is None or matches(d, glob)]

    async def info(self, name: str) -> DumpInfo:
        """The dump called *name* (a dump name, or a path relative to the destination).

        Raises:
            StorageNotFoundError: No such dump in the record or the listing.
        """
        dumps = (await self.scan()).dumps
        for candidate in dumps:
            if candidate.name == name:
                return candidate
        for candidate in dumps:
            if candidate.path in (name, name + self._suffix):
                return candidate
        raise StorageNotFoundError(f"{self._url}: no dump named {name!r}")

    # ------------------------------------------------------------------ reading

    async def read_bytes(self, name: str | DumpInfo) -> bytes:
        """The stored bytes of one dump (by name, path or :class:`DumpInfo`).

        A dump in a shard costs one ranged read of exactly its bytes.

        Raises:
            StoragePermissionError: The dump's path would leave the run (``info.problem``).
            StorageNotFoundError: No such dump, or its file or shard is gone.
            DumpLoadError: Its shard holds fewer bytes than the record says.
        """
        info = name if isinstance(name, DumpInfo) else await self.info(name)
        check_readable(self._url, info)
        check_held(info)
        storage = await self._opened()
        if info.shard is None:
            return await storage.read(info.path)
        return whole_member(info, await storage.read_range(info.shard, info.offset or 0, info.size))

    async def read_many(self, infos: Sequence[DumpInfo]) -> builtins.list[bytes | Exception]:
        """The stored bytes of several dumps, or the error each read raised, in order.

        Neighbouring members of one shard (dumps in dump order) are fetched with one read of
        the span that holds them: one ranged request on HDFS instead of one per member. On a
        local storage every read is done in one worker-thread hop (for small dumps the hop
        costs more than the read); elsewhere up to 16 requests (files, spans) are in flight.
        """
        storage = await self._opened()
        root = storage.local_path("")
        if root is not None and len(infos) > 1:
            return await anyio.to_thread.run_sync(read_local, self._url, root, infos)
        return await read_remote(storage, self._url, infos)

    def blocking_reader(self) -> LocalReader | None:
        """On an opened local storage, :meth:`read_many` as a blocking function, else ``None``.

        For a caller that does more with the bytes in the same worker thread (``diff`` loads
        and compares them, ``verify`` checksums them): one thread hop per batch instead of
        two or more, and no worker thread reading while another computes (on two cores such
        threads queue for the GIL at every system call). The reader keeps the run's shards
        open from one call to the next: ``close()`` it once done.
        """
        root = self.storage.local_path("")
        if root is None:
            return None
        return LocalReader(self._url, root)

    async def load(self, name: str | DumpInfo, *, unsafe: bool = False) -> Any:
        """Read and deserialize one dump; tensors come back on the CPU.

        Args:
            name: A dump name, a path, or a :class:`DumpInfo` from :meth:`list`.
            unsafe: Allow a full unpickle (runs code from the dump; logs a warning).

        Raises:
            UnsafeLoadError: The dump needs a global outside the allow-list.
            DumpLoadError: The bytes are not a loadable dump.
            StorageNotFoundError: No such dump.
            StoragePermissionError: The dump's path would leave the run.
        """
        return await anyio.to_thread.run_sync(await self.loader(name, unsafe=unsafe))

    async def loader(self, name: str | DumpInfo, *, unsafe: bool = False) -> Callable[[], Any]:
        """What :meth:`load` runs in a worker thread: the dump's load, as a blocking call.

        The dump is looked up (and, for a remote storage, read) here; the call deserializes
        it. :class:`SyncRun` runs it in its caller's thread, which waits anyway: one thread
        hop less per dump than :meth:`load` (``benchmarks/bench_rollout_load.py``).

        Raises:
            StorageNotFoundError: No such dump.
            StoragePermissionError: The dump's path would leave the run.
        """
        info = name if isinstance(name, DumpInfo) else await self.info(name)
        check_readable(self._url, info)
        path = local_file(await self._opened(), info)
        if path is not None:  # torch reads the file itself: no copy of its bytes in between
            return functools.partial(_load_file_sync, path, unsafe, info.name)
        data = await self.read_bytes(info)
        return functools.partial(load_dump_bytes, data, unsafe=unsafe, where=info.name)

    async def iter_loaded(
        self, glob: str | None = None, *, unsafe: bool = False
    ) -> AsyncIterator[tuple[DumpInfo, Any]]:
        """Yield ``(info, object)`` for each present dump, in dump order, one at a time."""
        for info in await self.list(glob):
            if info.present and info.problem is None:
                yield info, await self.load(info, unsafe=unsafe)

    def __aiter__(self) -> AsyncIterator[tuple[DumpInfo, Any]]:
        return self.iter_loaded()

    def replay(
        self,
        pattern: str,
        *,
        steps: Iterable[int] | None = None,
        prefetch: int = 2,
        manifest: str | None = STEP_MANIFEST,
        unsafe: bool = False,
    ) -> Replay:
        """The run's steps, loaded ahead: ``async with run.replay("step{step}/sample{i}") as
        steps: async for step, objects in steps: ...``.

        Steps come in ascending numeric order, a step's dumps in ascending order of the
        pattern's other field; a step with a manifest (:func:`trajtrack.rollout.
        record_step_manifest`) yields the dumps it names, in its order. At most *prefetch* whole
        steps load ahead of the consumer: memory holds at most ``prefetch + 1`` steps. Rollout
        records load in this process once a process you own calls
        :func:`~trajtrack.reader.allow_in_this_process` (a trainer does); otherwise in
        trajtrack's load worker, a process of its own, at a cost per record.

        Args:
            pattern: A dump-name template with a ``{step}`` field and at most one other
                integer field.
            steps: Only these steps (each must exist); all by default.
            prefetch: Steps loading or loaded ahead of the one the consumer holds (>= 1).
            manifest: The template step manifests are dumped under; ``None`` ignores them.
            unsafe: Allow a full unpickle (runs code from the dumps; logs a warning).

        Raises:
            ConfigurationError: A bad pattern or *prefetch* (at once).
            StorageNotFoundError: A step in *steps* has no dumps (on entering the block).
        """
        return Replay(
            self, pattern, steps=steps, prefetch=prefetch, manifest=manifest, unsafe=unsafe
        )

    # ------------------------------------------------------------------ lifecycle

    async def aclose(self) -> None:
        """Close the storage (when this run opened it)."""
        if not self._closed:
            self._closed = True
            if self._owns_storage and self._storage is not None:
                await self._storage.aclose()

    async def __aenter__(self) -> Run:
        return await self.open()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"Run({self._url!r})"


def _load_file_sync(file: LocalFile, unsafe: bool, where: str) -> Any:
    with translated(f"{where}: {file.path}"):
        path = inside_run(file, where)
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO planted since the listing
            raise StoragePermissionError(f"{where}: refusing to read {path}: not a regular file")
        return load_dump_file(path, unsafe=unsafe, where=where)


def open_run(url: str | os.PathLike[str], **options: Any) -> Run:
    """A run to read: ``async with trajtrack.open_run(url) as run: ...``.

    Nothing is opened until ``async with`` (or the first call that reads).

    Args:
        url: The destination a tracker wrote to (local path or any supported URL).
        **options: See :class:`Run`.
    """
    return Run(url, **options)
