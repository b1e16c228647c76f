"""Two runs, dump by dump: :func:`diff_runs`.

:func:`diff_runs` pairs two runs' dumps by name, reads them in parallel (each file once), loads
and compares each pair (:func:`trajtrack.reader._compare.compare`), and returns the
comparisons sorted in dump order (run A's order, commit time then name, with each dump that only
run B has placed after the dump before it in run B), so the first divergence is the first entry
that is not equal.

Small pairs (both dumps up to 64 KB) are read in groups, a span of neighbouring shard members
at a time (``Run.read_many``), and compared in one loop (:mod:`trajtrack.reader._pair_checks`);
off a local disk the group is read by the thread that compares it. A larger pair of local files
(both storages give a ``local_path``) is compared in place, through two buffers each thread
reuses (:mod:`trajtrack.reader._files`), and, when the files differ, loaded by ``torch.load``
from their paths; the kernel is told which files come next (:mod:`trajtrack.reader._readahead`).
Other storages' files are read, then loaded from the bytes. The results:
:mod:`trajtrack.reader._diff_result`.
"""

from __future__ import annotations

import logging
import operator
import os
import stat
from collections.abc import Callable, Sequence
from typing import Final

import anyio
import anyio.to_thread

from trajtrack._exceptions import DumpLoadError, TrajtrackError
from trajtrack.reader._batch_reads import SMALL_DUMP, read_batches
from trajtrack.reader._compare import Tolerance
from trajtrack.reader._diff_result import (
    DumpComparison,
    Pair,
    RunDiff,
    Status,
    against_record,
    compared,
    failed,
)
from trajtrack.reader._dumps import DumpInfo
from trajtrack.reader._files import LocalFile, local_file
from trajtrack.reader._gather import both, gather_bounded
from trajtrack.reader._ignore import compile_ignore
from trajtrack.reader._pair_checks import (
    compare_files,
    compare_loaded,
    compare_read,
    compare_unloaded,
    load_and_compare,
)
from trajtrack.reader._readahead import AVAILABLE as readahead_available, ReadAhead
from trajtrack.reader._run import Run

__all__ = ["DumpComparison", "RunDiff", "diff_runs"]

logger = logging.getLogger(__name__)


async def diff_runs(
    run_a: Run,
    run_b: Run,
    *,
    names: str | None = None,
    tolerance: Tolerance | None = None,
    unsafe: bool = False,
    limit_per_dump: int = 20,
    on_progress: Callable[[int, int], None] | None = None,
    ignore: Sequence[str] = (),
) -> RunDiff:
    """Compare two runs dump by dump (paired by name), reading each file once, in parallel.

    Args:
        run_a: The first run.
        run_b: The second run (the reference for relative differences).
        names: Only dump names (or paths) matching this glob.
        tolerance: Numeric tolerance and NaN policy.
        unsafe: Allow full unpickling (runs code from the dumps).
        limit_per_dump: At most this many differences per dump.
        on_progress: Called with ``(done, total)`` as pairs finish.
        ignore: Glob patterns of key paths left out of every comparison (``*`` any run of
            characters, ``?`` one, brackets literal; see :func:`~trajtrack.reader.compare`):
            neither compared nor counted, and listed per dump in
            :attr:`DumpComparison.ignored`. ``VOLATILE_KEYS`` is verl's bookkeeping.

    Raises:
        StorageError: Listing a run failed (per-dump read failures become ``error`` entries).
    """
    listed_a, listed_b = await _list_both(run_a, run_b, names)
    pairs = _pairs(listed_a, listed_b)
    if not pairs:  # a typo in names, two empty runs: not "equal" (RunDiff.no_dumps, exit 1)
        matching = f" matching {names!r}" if names else ""
        logger.warning(
            "nothing to compare: neither run has dumps%s; not 'equal' (exit code 1)", matching
        )
    limit = max(1, min(run_a.concurrency, run_b.concurrency))
    # Loading and comparing is CPU work: more threads than cores only contend for the GIL,
    # the caches and the cores the reads need (``benchmarks/bench_diff.py``).
    cpu = anyio.CapacityLimiter(min(limit, os.cpu_count() or 1))
    total = len(pairs)
    progress = (lambda done: on_progress(done, total)) if on_progress else None
    patterns = tuple(ignore)
    compile_ignore(patterns)  # a bad pattern fails here, before any reading
    comparer = _Comparer(
        run_a, run_b, tolerance or Tolerance(), unsafe, limit_per_dump, cpu, progress, patterns
    )
    comparer.find_local_files(pairs)
    try:
        async with anyio.create_task_group() as group:
            if comparer.local and readahead_available and comparer.reads_ahead:
                group.start_soon(comparer.readahead.run)
            batches = await gather_bounded(
                comparer.batches(pairs), comparer.compare_batch, limit=limit
            )
            group.cancel_scope.cancel()
    finally:  # every worker thread is done: a cancelled hop waits for its thread
        comparer.close()
    results = [comparison for batch in batches for comparison in batch]
    results.sort(key=_ORDER)  # a large pair may come back ahead of a batch
    return RunDiff(run_a.url, run_b.url, comparer.tol, tuple(results), patterns)


async def _list_both(
    run_a: Run, run_b: Run, names: str | None
) -> tuple[list[DumpInfo], list[DumpInfo]]:
    """Both runs' listings: one after the other when both are on this machine (listing is
    CPU work there: two threads listing at once only queue for the GIL at each system call,
    so listing them at once is slower; ``benchmarks/bench_small_reads.py``), else at the
    same time (the first failure cancels the other and raises as it is)."""
    await run_a.open()
    await run_b.open()
    if run_a.storage.local_path("") is not None and run_b.storage.local_path("") is not None:
        return await run_a.list(names), await run_b.list(names)
    return await both(lambda: run_a.list(names), lambda: run_b.list(names))


_ORDER: Final = operator.itemgetter(6)  # DumpComparison.order

_SMALL = SMALL_DUMP  # a pair with a larger dump is compared on its own
_AHEAD_MIN = 256 << 10  # read ahead only when local pairs hold this much on average


def _pairs(listed_a: list[DumpInfo], listed_b: list[DumpInfo]) -> list[Pair]:
    """``(name, a, b, order)`` per dump name in either run, in dump order; *order* is the
    pair's place in it. Dump order across two runs: run A's (each listing is in dump order,
    commit time then name), each dump of run B only right after the dump before it in run B
    that run A has too. Places, not times: each run goes at its own pace (a slow first step in
    one), so two runs' commit times do not interleave their dumps faithfully."""
    dumps_a = {d.name: d for d in listed_a}
    dumps_b = {d.name: d for d in listed_b}
    place_a = {name: i for i, name in enumerate(dumps_a)}
    get_b = dumps_b.get
    keyed: list[tuple[tuple[int, int], str, DumpInfo | None, DumpInfo | None]] = [
        ((i, 0), name, a, get_b(name)) for i, (name, a) in enumerate(dumps_a.items())
    ]
    after = -1  # the place in run A of the last dump of run B that run A has
    for j, (name, b) in enumerate(dumps_b.items(), 1):
        i = place_a.get(name)
        if i is None:
            keyed.append(((after, j), name, None, b))
        else:
            after = i
    # In dump order, which is mostly the order of the files in their directories and of the
    # members in their shards: a batch then reads neighbours (one directory opened, members
    # fetched together), not names in a set's order, which scatters the reads
    # (``benchmarks/bench_small_reads.py``).
    keyed.sort(key=_KEY)
    return [(name, a, b, place) for place, (_, name, a, b) in enumerate(keyed)]


_KEY: Final = operator.itemgetter(0)


class _Comparer:
    """Compares one pair of dumps: in place for local files, else from the bytes read."""

    def __init__(
        self,
        run_a: Run,
        run_b: Run,
        tol: Tolerance,
        unsafe: bool,
        limit: int,
        cpu: anyio.CapacityLimiter,
        progress: Callable[[int], None] | None,
        ignore: tuple[str, ...] = (),
    ) -> None:
        self.run_a, self.run_b, self.tol = run_a, run_b, tol
        self.unsafe, self.limit, self.cpu, self.ignore = unsafe, limit, cpu, ignore
        self.local: dict[str, tuple[LocalFile, LocalFile]] = {}
        self.small: set[str] = set()  # the names of the small pairs (read in groups)
        self.readahead = ReadAhead([])
        self.reads_ahead = False  # worth it for large files only (each advice opens them)
        self.progress = progress
        self.done = 0
        # Small dumps: one loading thread. torch.load of a 4 KB dump releases and retakes the
        # GIL many times; two such threads queue for it, so a second thread only adds
        # contention (``benchmarks/bench_small_reads.py``).
        self.small_cpu = anyio.CapacityLimiter(1)
        # Batches of shard members: read and byte-compared by two threads (see
        # _compare_members; files are read by the comparing thread: three system calls a file,
        # two threads would queue for the GIL at each).
        self.members_io = anyio.CapacityLimiter(2)
        # Batches of small pairs in flight (each reads many members, up to 16 requests at
        # once): 4, not the run's concurrency. Each batch in flight holds its bytes, and more
        # than a few in flight no longer shortens a sharded diff (the requests already overlap),
        # so 4 keeps the memory low at the same speed
        # (``benchmarks/bench_hdfs_small_reads.py``).
        self.small_batches = anyio.CapacityLimiter(4)
        self._options = (tol, unsafe, limit, ignore)
        # Two local runs: small batches are read by the thread that compares them.
        reader_a, reader_b = run_a.blocking_reader(), run_b.blocking_reader()
        self.readers = None if reader_a is None or reader_b is None else (reader_a, reader_b)

    def close(self) -> None:
        """Close what the local readers keep open (once no thread reads any more)."""
        for reader in self.readers or ():
            reader.close()

    def find_local_files(self, pairs: list[Pair]) -> None:
        """The small pairs, read in batches (:meth:`batches`); the large pairs of files both
        on this machine (both present: compared in place), and their read-ahead."""
        sized = []
        small = self.small
        for name, a, b, _ in pairs:
            if a is None or b is None:
                continue
            if _small_pair(a, b):
                small.add(name)
                continue
            if _readable(a) and _readable(b):
                paths = _local_paths(self.run_a, self.run_b, a, b)
                if paths is not None:
                    self.local[name] = paths
                    size = (a.stored_size or 0) + (b.stored_size or 0)
                    sized.append((paths[0].path, paths[1].path, size))
        self.readahead = ReadAhead(sized)  # in the order compare() takes the pairs
        self.reads_ahead = bool(sized) and sum(size for *_, size in sized) >= _AHEAD_MIN * len(
            sized
        )

    def batches(self, pairs: list[Pair]) -> list[list[Pair]]:
        """*pairs* in order, small pairs in groups (:func:`read_batches`): read with
        ``read_many`` (a local storage: in the hop that compares them), then loaded and
        compared in one hop. For small files, loading from the bytes is faster than torch
        opening each file (one read per file, no zip seeks; ``benchmarks/bench_small_reads.py``).
        Small: as
        :meth:`find_local_files` found them."""
        small = self.small
        return read_batches(pairs, lambda pair: pair[0] in small, _pair_bytes)

    async def compare_batch(self, batch: list[Pair]) -> list[DumpComparison]:
        """Compare the pairs of one batch (see :meth:`batches`)."""
        if len(batch) == 1:
            results = [await self.compare(batch[0])]
        else:
            async with self.small_batches:
                results = await self._compare_small(batch)
        self.done += len(batch)
        if self.progress is not None:
            self.progress(self.done)
        return results

    async def _compare_small(self, batch: list[Pair]) -> list[DumpComparison]:
        if self.readers is not None and _members(batch):
            results = await self._compare_members(batch)
        elif self.readers is not None:  # both local: read, load and compare in one hop
            results = await anyio.to_thread.run_sync(
                self._read_and_compare, batch, limiter=self.small_cpu
            )
        else:
            data_a, data_b = await both(  # each run its own storage: read at the same time
                lambda: self.run_a.read_many([a for _, a, _, _ in batch]),  # type: ignore[misc]
                lambda: self.run_b.read_many([b for _, _, b, _ in batch]),  # type: ignore[misc]
            )
            results = await anyio.to_thread.run_sync(
                self._compare_read, batch, data_a, data_b, limiter=self.small_cpu
            )
        return results

    async def _compare_members(self, batch: list[Pair]) -> list[DumpComparison]:
        """A batch of local shard members: read, and the pairs that need no loading compared,
        by either of two threads (a few ``pread`` calls a batch, which release the GIL, and
        byte comparisons: two such threads overlap the reads with the checks); the pairs that
        need loading, then, in the one loading thread."""
        found, data_a, data_b = await anyio.to_thread.run_sync(
            self._read_and_compare_unloaded, batch, limiter=self.members_io
        )
        rest = [i for i, done in enumerate(found) if done is None]
        if rest:
            loaded = await anyio.to_thread.run_sync(
                lambda: [
                    compare_loaded(batch[i], data_a[i], data_b[i], *self._options) for i in rest
                ],
                limiter=self.small_cpu,
            )
            for i, comparison in zip(rest, loaded, strict=True):
                found[i] = comparison
        return _against_records(found, data_a, data_b)  # type: ignore[arg-type]  # all filled

    def _read_and_compare_unloaded(
        self, batch: list[Pair]
    ) -> tuple[list[DumpComparison | None], list[bytes | Exception], list[bytes | Exception]]:
        data_a, data_b = self._read_both(batch)
        found = compare_unloaded(batch, data_a, data_b, self.tol, self.unsafe)
        return found, data_a, data_b

    def _read_and_compare(self, batch: list[Pair]) -> list[DumpComparison]:
        return self._compare_read(batch, *self._read_both(batch))

    def _read_both(
        self, batch: list[Pair]
    ) -> tuple[list[bytes | Exception], list[bytes | Exception]]:
        """Both runs' dumps of *batch*, read off the local disk (blocking)."""
        assert self.readers is not None  # the caller checked
        read_a, read_b = self.readers
        data_a = read_a([a for _, a, _, _ in batch])  # type: ignore[misc]  # small: both there
        data_b = read_b([b for _, _, b, _ in batch])  # type: ignore[misc]
        return data_a, data_b

    def _compare_read(
        self, batch: list[Pair], data_a: list[bytes | Exception], data_b: list[bytes | Exception]
    ) -> list[DumpComparison]:
        found = compare_read(batch, data_a, data_b, *self._options)
        return _against_records(found, data_a, data_b)

    async def compare(self, pair: Pair) -> DumpComparison:
        name, a, b, rank = pair
        if a is None or b is None:
            status: Status = "only_in_b" if a is None else "only_in_a"
            return DumpComparison(name, status, a, b, order=rank)
        options = self._options
        data_a: bytes | None = None
        data_b: bytes | None = None
        paths = self.local.get(name)
        try:
            if paths is not None:  # compared and loaded from the files themselves
                path_a, path_b = paths
                try:
                    found = await anyio.to_thread.run_sync(
                        compare_files, path_a, path_b, name, *options, limiter=self.cpu
                    )
                finally:
                    self.readahead.finished()
            else:
                _check_present(a, b)
                data_a, data_b = await _read_pair(self.run_a, self.run_b, a, b)
                found = await anyio.to_thread.run_sync(
                    load_and_compare, data_a, data_b, name, *options, limiter=self.cpu
                )
        except (TrajtrackError, OSError) as exc:
            if paths is not None:  # large local files: their sizes (a stat, not a read)
                sizes = await anyio.to_thread.run_sync(_stored_sizes, paths)
                return against_record(failed(pair, exc), *sizes)
            return against_record(failed(pair, exc), data_a, data_b)
        return compared(pair, found)


def _against_records(
    found: list[DumpComparison],
    data_a: Sequence[bytes | Exception],
    data_b: Sequence[bytes | Exception],
) -> list[DumpComparison]:
    """*found*, each error with what its dumps' bytes say against their record first."""
    if all(comparison.status != "error" for comparison in found):  # the common case
        return found
    return [
        against_record(
            comparison,
            x if isinstance(x, bytes) else None,
            y if isinstance(y, bytes) else None,
        )
        for comparison, x, y in zip(found, data_a, data_b, strict=True)
    ]


def _stored_sizes(paths: tuple[LocalFile, LocalFile]) -> tuple[int | None, int | None]:
    """The sizes of two local files (``None``: not a regular file, or gone)."""
    sizes: list[int | None] = []
    for file in paths:
        try:
            info = os.stat(file.path)
        except OSError:
            sizes.append(None)
            continue
        sizes.append(info.st_size if stat.S_ISREG(info.st_mode) else None)
    return sizes[0], sizes[1]


def _members(batch: list[Pair]) -> bool:
    """Whether the pairs of *batch* are all shard members in both runs (a batch in dump order
    is mostly of one kind; a mixed one is read as files are)."""
    return all(a.shard is not None and b.shard is not None for _, a, b, _ in batch)  # type: ignore[union-attr]


def _small_pair(a: DumpInfo, b: DumpInfo) -> bool:
    """Both readable (:func:`_readable`) and no larger than :data:`_SMALL`, recorded and
    stored (written out: asked of every pair)."""
    stored_a, stored_b = a.stored_size, b.stored_size
    return (
        stored_a is not None
        and stored_b is not None
        and a.problem is None
        and b.problem is None
        and a.size <= _SMALL
        and b.size <= _SMALL
        and stored_a <= _SMALL
        and stored_b <= _SMALL
    )


def _pair_bytes(pair: Pair) -> int:
    _, a, b, _ = pair
    return (a.size if a is not None else 0) + (b.size if b is not None else 0)


def _readable(info: DumpInfo) -> bool:
    return info.present and info.problem is None


def _check_present(*infos: DumpInfo) -> None:
    for info in infos:
        if not info.present:
            raise DumpLoadError(f"{info.path} is recorded but missing from the storage")


def _local_paths(
    run_a: Run, run_b: Run, a: DumpInfo, b: DumpInfo
) -> tuple[LocalFile, LocalFile] | None:
    file_a, file_b = local_file(run_a.storage, a), local_file(run_b.storage, b)
    return None if file_a is None or file_b is None else (file_a, file_b)


async def _read_pair(run_a: Run, run_b: Run, a: DumpInfo, b: DumpInfo) -> tuple[bytes, bytes]:
    # One after the other: the parallelism is across pairs (a task group per pair would cost
    # more than it saves when every pair is in flight at once).
    return await run_a.read_bytes(a), await run_b.read_bytes(b)
