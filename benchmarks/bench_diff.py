"""Benchmark: ``trajtrack diff`` of two runs against the raw read bandwidth of the same files.

Two runs of N dumps of ~1 MB each (default 1,000; ``--quick``: 100) are written to local disk
with a real Tracker, with identical content (the worst case for diff: every tensor is compared
in full). Then, in one process, with a WARM page cache (every file is read once first; dropping
the cache needs root and would measure the disk, not the reader):

* raw threads: plain ``open().read()`` of all 2N files with a thread pool (the ceiling);
* raw storage: ``Storage.read`` of all 2N files through the local backend, in parallel;
* diff, identical runs: ``trajtrack.diff_runs`` with the same concurrency (byte-equal pairs:
  A is still loaded safely, B's comparison is skipped);
* diff, every dump differs in one element: both sides loaded and compared in full;
  a counting storage wrapper checks that each file is read exactly once.

The same four measurements are repeated with a COLD page cache (``sync`` and
``/proc/sys/vm/drop_caches`` before each one; needs root, skipped otherwise): there the storage
is the disk itself, which is what "the storage's read bandwidth" means for a real run directory
that is not already in memory. A warm cache measures the reader against memory copies.

Then the same comparison on the real HDFS test cluster (``scripts/hdfs-test-cluster.sh``,
started here unless ``--cluster-dir`` names a running one; ``--no-hdfs`` skips it): three runs
of 200 dumps (``--quick``: 50) of 1 MB written through the WebHDFS backend, the storage's
parallel read of two of them against ``diff`` of identical and of all-different runs.

Then the small-dump case (issue 16): runs of 20,000 dumps of 4 KB (``--quick``: 2,000;
``--small-dumps N``; ``--no-small`` skips it), files and shards layouts, ``diff`` of identical
and of all-different runs and ``verify`` against one thread reading the same files with
``open().read()``, measured by ``bench_small_reads.py``'s code (``--small-data DIR`` keeps the
runs); the process is set up as the ``trajtrack`` command sets up its own.

Prints a table and writes ``benchmarks/results/diff.json`` (``--json`` elsewhere). The goal:
diff >= 50% of the raw storage read bandwidth. ``--data DIR`` and ``--hdfs-data NAME`` keep the
runs written there and reuse them in later calls (``benchmarks/compare_revisions.py`` measures
two revisions of trajtrack on the same files that way). "Read once" counts, per file, the
storage's ``read`` calls plus the local opens of the reader (``counting_local_reads``: a
large pair compared in place, a batch of small dumps read by one thread).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import torch

import trajtrack
from trajtrack.backends import open_storage
from trajtrack.layouts.names import is_internal_path
from trajtrack.reader import _pair_checks as pair_checks, gather_bounded
from trajtrack.reader._files import LocalFile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import bench_small_reads
from benchmarks._common import cluster_env, with_hdfs_cluster

RESULTS = Path(__file__).parent / "results" / "diff.json"
COMPLETE = "bench-data-complete"  # written last into a reusable data directory


class CountingStorage:
    """Wraps a storage and counts, per path, the reads through it (``read``, ``read_range``).

    A reader of a local run opens the files itself (pairs of large files compared in place,
    batches of small ones read by one thread): :func:`counting_local_reads` counts those.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.reads: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def read(self, path: str) -> bytes:
        self.reads[path] += 1
        return await self.inner.read(path)

    async def read_range(self, path: str, offset: int, length: int) -> bytes:
        self.reads[path] += 1
        return await self.inner.read_range(path, offset, length)


@contextlib.contextmanager
def counting_local_reads(roots: dict[str, str]) -> Iterator[Counter[str]]:
    """Counts, as ``"<key>/<path>"`` (*roots*: key -> run root), each local file a diff opens:
    a large pair's two files (``inside_run``), a small batch's dumps (``Run.blocking_reader``)."""
    opened: Counter[str] = Counter()
    keys = {os.path.realpath(root): key for key, root in roots.items()}
    real_inside, real_reader = pair_checks.inside_run, trajtrack.Run.blocking_reader

    def key_of(root: str) -> str:
        return keys.get(os.path.realpath(root), "?")

    def inside_run(file: LocalFile, where: str) -> str:
        opened[f"{key_of(file.root)}/{file.relative}"] += 1
        return real_inside(file, where)

    class Counting:
        """A run's blocking reader, counting what it reads."""

        def __init__(self, read: Any, key: str) -> None:
            self.read, self.key = read, key

        def __call__(self, infos: Any) -> Any:
            opened.update(f"{self.key}/{info.path}" for info in infos)
            return self.read(infos)

        def close(self) -> None:
            self.read.close()

    def blocking_reader(run: trajtrack.Run) -> Any:
        read = real_reader(run)
        return None if read is None else Counting(read, key_of(run.url))

    pair_checks.inside_run = inside_run  # type: ignore[assignment]
    trajtrack.Run.blocking_reader = blocking_reader  # type: ignore[method-assign]
    try:
        yield opened
    finally:
        pair_checks.inside_run = real_inside  # type: ignore[assignment]
        trajtrack.Run.blocking_reader = real_reader  # type: ignore[method-assign]


async def write_run(
    dest: Path | str, dumps: int, size: int, perturb: bool = False, workers: int = 4
) -> None:
    elements = size // 4
    async with trajtrack.Tracker(str(dest), workers=workers) as tracker:
        for i in range(dumps):
            gen = torch.Generator().manual_seed(i)
            x = torch.randn(elements, generator=gen)
            if perturb:  # one element per dump: every pair is loaded and compared in full
                x[i % elements] += 1.0
            await tracker.dump({"x": x}, f"step{i // 10}/d{i}")


def files_of(root: Path) -> list[Path]:
    return [p for p in root.rglob("*.pth") if not any(s.startswith(".") for s in p.parts[-2:])]


def read_file(path: Path) -> int:
    with open(path, "rb") as handle:
        return len(handle.read())


def raw_threads(paths: list[Path], concurrency: int) -> tuple[float, int]:
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        total = sum(pool.map(read_file, paths))
    return time.perf_counter() - started, total


async def read_all(urls: list[str], concurrency: int) -> tuple[float, int]:
    """Every dump of the runs at *urls* (paths or URLs), read through the storage, in parallel."""
    items: list[tuple[Any, str]] = []
    storages = [open_storage(url) for url in urls]
    try:
        for storage in storages:
            infos = await storage.list("")
            items += [
                (storage, info.path)
                for info in infos
                if info.path.endswith(".pth") and not is_internal_path(info.path)
            ]

        async def one(item: tuple[Any, str]) -> int:
            return len(await item[0].read(item[1]))

        started = time.perf_counter()
        sizes = await gather_bounded(items, one, limit=concurrency)
        return time.perf_counter() - started, sum(sizes)
    finally:
        for storage in storages:
            await storage.aclose()


async def diff_urls(a: str, b: str, concurrency: int) -> tuple[float, Any, Counter[str]]:
    sa, sb = CountingStorage(open_storage(a)), CountingStorage(open_storage(b))
    try:
        run_a = trajtrack.Run(a, storage=sa, concurrency=concurrency)
        run_b = trajtrack.Run(b, storage=sb, concurrency=concurrency)
        with counting_local_reads({"a": a, "b": b}) as opened:
            started = time.perf_counter()
            result = await trajtrack.diff_runs(run_a, run_b)
            elapsed = time.perf_counter() - started
    finally:
        await sa.inner.aclose()
        await sb.inner.aclose()
    reads = Counter({f"a/{k}": v for k, v in sa.reads.items() if k.endswith(".pth")})
    reads.update({f"b/{k}": v for k, v in sb.reads.items() if k.endswith(".pth")})
    reads.update({k: v for k, v in opened.items() if k.endswith(".pth")})
    return elapsed, result, reads


# --------------------------------------------------------------------------- on HDFS

HDFS_DUMPS = 200  # per run (--quick: 50): Hadoop 2.7 closes a file in ~300 ms


def hdfs_diff(
    cluster_dir: Path, quick: bool, concurrency: int, repeat: int, data: str | None = None
) -> dict[str, Any]:
    """The same comparison on the real HDFS test cluster, through the WebHDFS backend.

    With *data* (a directory name on the cluster), the runs written there by an earlier call
    are reused (written the first time): several revisions measure the same files.
    """
    dumps = 50 if quick else HDFS_DUMPS
    a, b, c = hdfs_runs(cluster_dir, dumps, data)
    anyio.run(read_all, [a, b, c], concurrency)  # warm the DataNode's page cache
    t_read, total = min(anyio.run(read_all, [a, b], concurrency) for _ in range(repeat))
    same = [anyio.run(diff_urls, a, b, concurrency) for _ in range(repeat)]
    t_same, result_same, reads_same = min(same, key=lambda d: d[0])
    other = [anyio.run(diff_urls, a, c, concurrency) for _ in range(repeat)]
    t_other, result_other, reads_other = min(other, key=lambda d: d[0])
    mb = total / 1e6
    rows = {
        "raw storage (WebHDFS read)": t_read,
        "diff, identical runs (byte-equal pairs)": t_same,
        "diff, every dump differs (full compare)": t_other,
    }
    return {
        "dumps_per_run": dumps,
        "total_bytes": total,
        "seconds": rows,
        "mb_per_s": {k: mb / v for k, v in rows.items()},
        "diff_vs_raw_storage": t_read / t_same,
        "diff_full_compare_vs_raw_storage": t_read / t_other,
        "equal": result_same.equal,
        "different_dumps": result_other.counts()["different"],
        "each_file_read_once": all(
            set(r.values()) == {1} and len(r) == 2 * dumps for r in (reads_same, reads_other)
        ),
    }


def hdfs_runs(cluster_dir: Path, dumps: int, data: str | None) -> tuple[str, str, str]:
    """Runs a, b (identical) and c (different) of 1 MB dumps on the cluster, written unless
    the directory *data* already holds them (a fresh directory when *data* is None)."""
    env = cluster_env(cluster_dir)
    base = f"{env['WEBHDFS_URL']}/{data or f'bench-diff-{os.getpid()}'}"
    a, b, c = f"{base}/a", f"{base}/b", f"{base}/c"
    if data is None or not anyio.run(_complete, base):
        for url, perturb in ((a, False), (b, False), (c, True)):
            anyio.run(write_run, url, dumps, 1 << 20, perturb, 16)
        anyio.run(_mark_complete, base)
    return a, b, c


async def _complete(url: str) -> bool:
    storage = open_storage(url)
    try:
        return await storage.stat(COMPLETE) is not None
    finally:
        await storage.aclose()


async def _mark_complete(url: str) -> None:
    storage = open_storage(url)
    try:
        await storage.write_atomic(COMPLETE, _Bytes(b"ok\n"), overwrite=True)
    finally:
        await storage.aclose()


class _Bytes:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.nbytes = len(data)

    def write_to(self, out: Any) -> None:
        out.write(self.data)


def local_runs(directory: Path | None, dumps: int, size: int) -> tuple[Path, Path, Path]:
    """Runs a and b (identical) and c (one element differs per dump) under *directory*.

    Written unless *directory* already holds them (``--data``: several revisions measure the
    same files); a fresh temporary directory otherwise.
    """
    work = directory or Path(tempfile.mkdtemp(prefix="bench-diff-"))
    a, b, c = work / "a", work / "b", work / "c"
    if not (work / COMPLETE).exists():
        for dest in (a, b, c):
            shutil.rmtree(dest, ignore_errors=True)
        for dest in (a, b):
            anyio.run(write_run, dest, dumps, size)
        anyio.run(write_run, c, dumps, size, True)
        (work / COMPLETE).write_text(f"{dumps} dumps of {size} bytes\n")
    return a, b, c


def drop_caches() -> bool:
    """Empty the page cache (root only); False when this process may not."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as handle:
            handle.write("3\n")
    except OSError:
        return False
    return True


def cold(measure: Any, repeat: int) -> Any:
    """Best of *repeat* runs of *measure*, each after dropping the page cache."""
    results = []
    for _ in range(repeat):
        drop_caches()
        results.append(measure())
    return min(results, key=lambda r: r[0])


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100 dumps instead of 1,000")
    parser.add_argument("--dumps", type=int, default=None)
    parser.add_argument("--size-mb", type=float, default=1.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3, help="best of N for each measurement")
    parser.add_argument("--dir", default=None, help="where to write the runs (default: tmp)")
    parser.add_argument(
        "--data", type=Path, help="reuse (or write once and keep) the local runs in this folder"
    )
    parser.add_argument(
        "--no-hdfs", action="store_true", help="skip the comparison on the HDFS test cluster"
    )
    parser.add_argument("--cluster-dir", type=Path, help="reuse a running HDFS test cluster")
    parser.add_argument("--hdfs-data", help="reuse (or write once) the HDFS runs in this folder")
    parser.add_argument("--no-cold", action="store_true", help="skip the cold-cache figures")
    parser.add_argument(
        "--small-dumps", type=int, default=None, help="4 KB dumps per run (default 20,000)"
    )
    parser.add_argument("--no-small", action="store_true", help="skip the small-dump case")
    parser.add_argument("--small-data", type=Path, help="keep (and reuse) the small runs here")
    parser.add_argument("--json", type=Path, default=RESULTS, help="where to write the results")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)  # as the trajtrack CLI does: parallel across files, not inside ops
    dumps = args.dumps or (100 if args.quick else 1000)
    size = int(args.size_mb * (1 << 20))
    if args.data is None:
        args.data = Path(tempfile.mkdtemp(prefix="bench-diff-", dir=args.dir))
        keep = False
    else:
        args.data.mkdir(parents=True, exist_ok=True)
        keep = True
    try:
        measured = measure_local(*local_runs(args.data, dumps, size), args)
    finally:
        if not keep:
            shutil.rmtree(args.data, ignore_errors=True)
    hdfs = None
    if not args.no_hdfs:
        hdfs = with_hdfs_cluster(
            lambda directory, quick: hdfs_diff(
                directory, quick, args.concurrency, args.repeat, args.hdfs_data
            ),
            args.cluster_dir,
            args.quick,
        )
    small = None if args.no_small else measure_small(args)
    report = {**measured, "hdfs": hdfs, "dumps_per_run": dumps, "dump_bytes": size}
    report["small_dumps"] = small
    print_report(report, args.repeat)
    if small is not None:
        bench_small_reads.print_report(small)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


def measure_small(args: argparse.Namespace) -> dict[str, Any]:
    """The small-dump rows of both layouts (``bench_small_reads.py``'s measurements)."""
    bench_small_reads.prepare_process()
    dumps = args.small_dumps or (2000 if args.quick else 20000)
    data = args.small_data or Path(tempfile.mkdtemp(prefix="bench-diff-small-", dir=args.dir))
    data.mkdir(parents=True, exist_ok=True)
    try:
        report: dict[str, Any] = {"dumps": dumps, "repeat": args.repeat}
        for layout in bench_small_reads.LAYOUTS:
            report[layout] = bench_small_reads.measure_layout(data, dumps, layout, args.repeat)
    finally:
        if args.small_data is None:
            shutil.rmtree(data, ignore_errors=True)
    return report


def measure_local(a: Path, b: Path, c: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The warm-cache rows (and the cold ones, as root) on the local runs a, b, c."""
    paths = files_of(a) + files_of(b)
    raw_threads(paths, args.concurrency)  # warm the page cache
    t_raw = min(raw_threads(paths, args.concurrency)[0] for _ in range(args.repeat))
    total = sum(p.stat().st_size for p in paths)
    t_storage = min(
        anyio.run(read_all, [str(a), str(b)], args.concurrency)[0] for _ in range(args.repeat)
    )
    diffs = [anyio.run(diff_urls, str(a), str(b), args.concurrency) for _ in range(args.repeat)]
    t_diff, result, reads = min(diffs, key=lambda d: d[0])
    raw_threads(files_of(c), args.concurrency)  # warm
    diffs_c = [anyio.run(diff_urls, str(a), str(c), args.concurrency) for _ in range(args.repeat)]
    t_diff_c, result_c, reads_c = min(diffs_c, key=lambda d: d[0])
    cold_rows: dict[str, float] = {}
    if not args.no_cold and drop_caches():
        cold_rows = {
            "raw threads (open/read)": cold(
                lambda: raw_threads(paths, args.concurrency), args.repeat
            )[0],
            "raw storage (LocalStorage.read)": cold(
                lambda: anyio.run(read_all, [str(a), str(b)], args.concurrency), args.repeat
            )[0],
            "diff, identical runs (byte-equal pairs)": cold(
                lambda: anyio.run(diff_urls, str(a), str(b), args.concurrency), args.repeat
            )[0],
            "diff, every dump differs (full compare)": cold(
                lambda: anyio.run(diff_urls, str(a), str(c), args.concurrency), args.repeat
            )[0],
        }
    mb = total / 1e6
    rows = {
        "raw threads (open/read)": t_raw,
        "raw storage (LocalStorage.read)": t_storage,
        "diff, identical runs (byte-equal pairs)": t_diff,
        "diff, every dump differs (full compare)": t_diff_c,
    }
    return {
        "files": len(paths),
        "total_bytes": total,
        "concurrency": args.concurrency,
        "page_cache": "warm (every file read once before measuring)",
        "repeat": args.repeat,
        "seconds": rows,
        "mb_per_s": {k: mb / v for k, v in rows.items()},
        "diff_vs_raw_storage": t_storage / t_diff,
        "diff_vs_raw_threads": t_raw / t_diff,
        "diff_full_compare_vs_raw_storage": t_storage / t_diff_c,
        "diff_full_compare_vs_raw_threads": t_raw / t_diff_c,
        "diff_full_compare_different_dumps": result_c.counts()["different"],
        "diff_full_compare_each_file_read_once": set(reads_c.values()) == {1}
        and len(reads_c) == len(paths),
        "cold_cache": {
            "seconds": cold_rows,
            "mb_per_s": {k: mb / v for k, v in cold_rows.items()},
            "diff_vs_raw_storage": _ratio(cold_rows, "diff, identical runs (byte-equal pairs)"),
            "diff_full_compare_vs_raw_storage": _ratio(
                cold_rows, "diff, every dump differs (full compare)"
            ),
        }
        if cold_rows
        else None,
        "diff_equal": result.equal,
        "diff_files_read": sum(reads.values()),
        "diff_each_file_read_once": len(reads) == len(paths) and set(reads.values()) == {1},
        "machine": {
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "torch": torch.__version__,
            "trajtrack": str(Path(trajtrack.__file__).parent),
        },
    }


def print_report(report: dict[str, Any], repeat: int) -> None:
    """The tables, as the README shows them."""
    rows, mb = report["seconds"], report["total_bytes"] / 1e6
    t_storage = rows["raw storage (LocalStorage.read)"]
    print(
        f"diff benchmark: 2 runs x {report['dumps_per_run']} dumps x "
        f"{report['dump_bytes'] / 1e6:.2f} MB = {mb:.0f} MB, "
        f"concurrency {report['concurrency']}, warm page cache, best of {repeat}"
    )
    print(f"{'measurement':<38} {'seconds':>9} {'MB/s':>9} {'vs raw storage':>15}")
    for name, seconds in rows.items():
        print(f"{name:<38} {seconds:9.3f} {mb / seconds:9.0f} {t_storage / seconds:14.0%}")
    cold_rows = (report["cold_cache"] or {}).get("seconds")
    if cold_rows:
        print(f"cold page cache (dropped before each measurement), best of {repeat}")
        t_cold = cold_rows["raw storage (LocalStorage.read)"]
        for name, seconds in cold_rows.items():
            print(f"{name:<38} {seconds:9.3f} {mb / seconds:9.0f} {t_cold / seconds:14.0%}")
    else:
        print("cold page cache: not measured (--no-cold, or dropping the page cache needs root)")
    hdfs = report["hdfs"]
    if hdfs is not None:
        hdfs_mb = hdfs["total_bytes"] / 1e6
        t_read = hdfs["seconds"]["raw storage (WebHDFS read)"]
        print(
            f"HDFS test cluster (WebHDFS, 1 DataNode), 2 runs x {hdfs['dumps_per_run']} dumps, "
            f"{hdfs_mb:.0f} MB, best of {repeat}; each file read once: "
            f"{hdfs['each_file_read_once']}"
        )
        for name, seconds in hdfs["seconds"].items():
            print(f"{name:<38} {seconds:9.3f} {hdfs_mb / seconds:9.0f} {t_read / seconds:14.0%}")
    print(
        f"diff read each file once: {report['diff_each_file_read_once']} "
        f"({report['diff_files_read']} reads of {report['files']} files); "
        f"equal: {report['diff_equal']}"
    )
    print(
        f"full-compare diff: {report['diff_full_compare_different_dumps']} different dumps, "
        f"each file read once: {report['diff_full_compare_each_file_read_once']}"
    )


def _ratio(rows: dict[str, float], name: str) -> float | None:
    if not rows:
        return None
    return rows["raw storage (LocalStorage.read)"] / rows[name]


if __name__ == "__main__":
    sys.exit(main())
