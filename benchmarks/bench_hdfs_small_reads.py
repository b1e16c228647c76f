"""Benchmark: reading sharded runs of small dumps on the real HDFS test cluster.

Three runs of N dumps of 4 KB each (default 20,000; ``--quick``: 500) in the shards layout are
written through WebHDFS by a real Tracker (``bench_small_reads.sample``): two identical runs
and one whose every dump differs in one element. Then, in one process, best of ``--repeat``,
16 requests in flight (the reader's default concurrency):

* **raw storage read**: every shard file of runs a and b read whole by ``storage.read``;
* **one ranged read per member**: ``read_range`` of each of the first 2,000 members of runs a
  and b (what ``Run.read_many`` did before it read neighbouring members as one span; all
  40,000 took 283-312 s, and such a run once met a 120 s read timeout), next to
  ``Run.read_many`` of the same members;
* **Run.read_many, in batches**: the members of runs a and b in dump order, in the groups
  ``diff``, ``verify`` and ``export`` use off a local disk (``reader._batch_reads.read_batches``,
  ``trajtrack.reader.dump_batches``: up to 1,024 dumps, 4 MiB);
  and in groups of 64, what they used before;
* **diff, identical runs**, **diff, every dump differs** and **verify** (``diff_runs`` and
  ``verify_run`` with the CLI's defaults).

Ratios are the raw read's time over each one's (100% = the storage's read bandwidth; issue
14's target for a diff of two sharded runs: >= 50%). The raw read is measured first and again
after the commands, and the faster of the two counts: the test cluster's JVMs serve faster once
warm, and measured first only, the baseline was slower than the commands' storage.

Run: ``python benchmarks/bench_hdfs_small_reads.py [--quick] [--dumps N] [--cluster-dir D]
[--data NAME]``: starts a cluster (``scripts/hdfs-test-cluster.sh``) unless ``--cluster-dir``
names a running one; ``--data`` keeps the runs in that folder on the cluster and reuses them.
Writes ``benchmarks/results/hdfs_small_reads.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import cluster_env, table, with_hdfs_cluster, write_results
from benchmarks.bench_small_reads import as_the_cli, prepare_process, sample
from trajtrack import Tracker
from trajtrack.backends import BytesPayload, open_storage
from trajtrack.cli.verify import verify_run
from trajtrack.layouts.shards import is_shard_path
from trajtrack.reader import diff_runs, dump_batches, gather_bounded, open_run

CONCURRENCY = 16
SUBSET = 2000  # members of each run read one by one (all of them take minutes)
COMPLETE = ".bench-complete"  # hidden: not listed as a dump


async def _write(url: str, dumps: int, differ: bool) -> None:
    async with Tracker(url, layout="shards") as tracker:
        for i in range(dumps):
            await tracker.dump(sample(i, differ), f"step{i // 512}/sample{i % 512}")
        await tracker.flush(timeout=600)
    storage = open_storage(url)
    try:
        await storage.write_atomic(COMPLETE, BytesPayload(str(dumps).encode()), overwrite=True)
    finally:
        await storage.aclose()


async def _complete(url: str, dumps: int) -> bool:
    storage = open_storage(url)
    try:
        return await storage.read(COMPLETE) == str(dumps).encode()
    except Exception:  # not there yet (or not readable): written again
        return False
    finally:
        await storage.aclose()


def runs(cluster_dir: Path, dumps: int, data: str | None) -> tuple[str, str, str]:
    env = cluster_env(cluster_dir)
    base = f"{env['WEBHDFS_URL']}/{data or f'bench-hdfs-small-{os.getpid()}'}"
    made = []
    for name, differ in (("a", False), ("b", False), ("c", True)):
        url = f"{base}/shards-{dumps}-{name}"
        if not anyio.run(_complete, url, dumps):
            start = time.perf_counter()
            anyio.run(_write, url, dumps, differ)
            print(f"wrote {url} in {time.perf_counter() - start:.1f} s", flush=True)
        made.append(url)
    return made[0], made[1], made[2]


async def _timed(work: Callable[[], Awaitable[Any]]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = await work()
    return time.perf_counter() - start, result


async def raw_read(urls: list[str]) -> tuple[float, int]:
    """Every shard of the runs read whole, CONCURRENCY at a time: (seconds, bytes)."""
    storages = [open_storage(url) for url in urls]
    try:
        items = [
            (storage, f.path)
            for storage in storages
            for f in await storage.list("")
            if is_shard_path(f.path)
        ]

        async def one(item: tuple[Any, str]) -> int:
            return len(await item[0].read(item[1]))

        seconds, sizes = await _timed(lambda: gather_bounded(items, one, limit=CONCURRENCY))
        return seconds, sum(sizes)
    finally:
        for storage in storages:
            await storage.aclose()


async def member_reads(urls: list[str], batch: int | None, first: int | None = None) -> float:
    """The members of the runs (the *first* of each): one ranged read each (*batch*
    ``None``), or ``Run.read_many`` of *batch* at a time (0: in ``dump_batches``' groups)."""
    runs_ = [open_run(url, concurrency=CONCURRENCY) for url in urls]
    try:
        jobs: list[tuple[Any, Any]] = []
        for run in runs_:
            infos = (await run.list())[:first]
            if batch == 0:
                jobs += [(run, g) for g in dump_batches(infos)]
            elif batch is not None:
                jobs += [(run, infos[i : i + batch]) for i in range(0, len(infos), batch)]
            else:
                jobs += [(run, info) for info in infos]

        async def one(job: tuple[Any, Any]) -> None:
            run, what = job
            await (run.read_bytes(what) if batch is None else run.read_many(what))

        seconds, _ = await _timed(lambda: gather_bounded(jobs, one, limit=CONCURRENCY))
        return seconds
    finally:
        for run in runs_:
            await run.aclose()


async def diff(a: str, b: str) -> tuple[float, dict[str, int]]:
    async with open_run(a) as run_a, open_run(b) as run_b:
        seconds, result = await _timed(lambda: diff_runs(run_a, run_b))
    return seconds, result.counts()


async def verify(a: str) -> tuple[float, dict[str, int]]:
    async with open_run(a) as run:
        seconds, findings = await _timed(lambda: verify_run(run))
    counts: dict[str, int] = {}
    for finding in findings:
        counts[finding.problem] = counts.get(finding.problem, 0) + 1
    return seconds, counts


def _best(repeat: int, measure: Callable[[], Any]) -> Any:
    results = [measure() for _ in range(repeat)]
    return min(results, key=lambda r: r[0] if isinstance(r, tuple) else r)


def measure(cluster_dir: Path, dumps: int, repeat: int, data: str | None) -> dict[str, Any]:
    a, b, c = runs(cluster_dir, dumps, data)
    anyio.run(raw_read, [a, b, c])  # warm the DataNode's page cache
    t_raw, total = _best(repeat, lambda: anyio.run(raw_read, [a, b]))
    seconds = {
        "raw storage read (shards whole), runs a+b": t_raw,
        f"one ranged read per member, first {SUBSET} of runs a+b": _best(
            repeat, lambda: anyio.run(member_reads, [a, b], None, SUBSET)
        ),
        f"Run.read_many, dump_batches groups, first {SUBSET} of runs a+b": _best(
            repeat, lambda: anyio.run(member_reads, [a, b], 0, SUBSET)
        ),
        "Run.read_many, 64 at a time, runs a+b": _best(
            repeat, lambda: anyio.run(member_reads, [a, b], 64)
        ),
        "Run.read_many, dump_batches groups, runs a+b": _best(
            repeat, lambda: anyio.run(member_reads, [a, b], 0)
        ),
    }
    t_same, same = _best(repeat, lambda: as_the_cli(diff, a, b))
    t_differ, differ = _best(repeat, lambda: as_the_cli(diff, a, c))
    t_verify, verified = _best(repeat, lambda: as_the_cli(verify, a))
    # The raw read once more, now that the cluster's JVMs have served thousands of requests
    # (measured first only, it ran on colder JVMs than the commands: 0.40 s then, 0.32 s
    # warm). The storage's read bandwidth is the best of both.
    t_raw_after, _ = _best(repeat, lambda: anyio.run(raw_read, [a, b]))
    t_raw = min(t_raw, t_raw_after)
    seconds |= {
        "diff, identical runs": t_same,
        "diff, every dump differs": t_differ,
        "verify (run a)": t_verify,
        "raw storage read, measured first": seconds["raw storage read (shards whole), runs a+b"],
        "raw storage read, again after the commands": t_raw_after,
        "raw storage read (shards whole), runs a+b": t_raw,  # the faster of the two
    }
    half = t_raw / 2  # verify reads one run
    return {
        "dumps_per_run": dumps,
        "bytes_read_raw": total,
        "seconds": seconds,
        "vs_raw_read": {
            k: (half if k.startswith("verify") else t_raw) / v
            for k, v in seconds.items()
            if "first" not in k
        },
        "counts": {"identical": same, "different": differ, "verify": verified},
    }


def print_report(result: dict[str, Any], repeat: int) -> None:
    print(
        f"\nshards on HDFS: {result['dumps_per_run']} dumps of 4 KB per run, "
        f"{result['bytes_read_raw'] / 2**20:.0f} MiB in runs a+b, {CONCURRENCY} requests in "
        f"flight, best of {repeat}"
    )
    ratios = result["vs_raw_read"]
    rows = [
        [name, f"{s:.3f}", f"{ratios[name]:.0%}" if name in ratios else ""]
        for name, s in result["seconds"].items()
    ]
    print(table(rows, ["measurement", "seconds", "vs raw read"]))
    print(f"counts: {result['counts']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="500 dumps instead of 20,000")
    parser.add_argument("--dumps", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=3, help="best of N for each figure")
    parser.add_argument("--cluster-dir", type=Path, default=None, help="a running cluster")
    parser.add_argument("--data", default=None, help="keep (and reuse) the runs in this folder")
    args = parser.parse_args()
    prepare_process()
    dumps = args.dumps or (500 if args.quick else 20000)
    result = with_hdfs_cluster(
        lambda directory, _quick: measure(directory, dumps, args.repeat, args.data),
        args.cluster_dir,
        args.quick,
    )
    print_report(result, args.repeat)
    name = "hdfs_small_reads-quick" if args.quick else "hdfs_small_reads"
    print(f"wrote {write_results(name, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
