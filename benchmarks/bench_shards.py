"""Shards benchmark: per-sample (4 KB) dumping in the shards layout, side by side in one run.

Local disk, 4 KB tensor dicts, every figure in the same process:

* **inline**: ``torch.save`` to a temp file + rename in a tight loop (the files layout's work
  done by the caller); **torch.save alone** into memory (``io.BytesIO``);
* **tracker, files layout** and **tracker, shards layout**: ``await tracker.dump`` for every
  dump, then ``flush()`` (throughput until everything is committed), and the caller's
  ``await dump`` latency (p50) in the same loops;
* **files per 100 dumps**: a steady stream (dumps paced at a fixed rate for a few seconds) at
  default settings, counting the storage files the shards layout created (records aside).

HDFS test cluster (a real NameNode + DataNode, started here unless ``--cluster-dir``), 4 KB:

* **tracker, files layout**, **tracker, shards layout** (until ``flush()``);
* **raw bound**: the same dumps serialized (``torch.save`` each), concatenated and written as
  one file by one raw ``client.write``, serialization included. Shards and raw run three times
  each, interleaved, and the best of each is compared: a shard's flush commits two files where
  the raw bound writes one, and each commit on the test cluster takes either a short or a long
  time (the DataNode client's back-off), so one round's ratio is decided by chance.

Run: ``python benchmarks/bench_shards.py [--quick] [--cluster-dir DIR] [--no-hdfs]``. Prints
tables, writes ``benchmarks/results/shards.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import io
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import anyio
import torch
from hdfs import InsecureClient

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (
    cluster_env,
    payload,
    percentiles,
    table,
    with_hdfs_cluster,
    write_results,
)
from trajtrack import Tracker
from trajtrack.layouts.shards import SHARDS_DIR

# --------------------------------------------------------------------------- local


def inline_loop(obj: Any, n: int, root: Path) -> float:
    root.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    for i in range(n):
        tmp = root / f".d{i}.tmp"
        torch.save(obj, tmp)
        os.replace(tmp, root / f"d{i}.pth")
    return time.perf_counter() - start


def torch_save_memory(obj: Any, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        torch.save(obj, io.BytesIO())
    return time.perf_counter() - start


async def tracked(url: str, obj: Any, n: int, layout: str, **options: Any) -> dict[str, Any]:
    """Dump *n* times then flush; the whole time and each ``await dump``'s."""
    latencies = []
    async with Tracker(url, layout=layout, max_pending_bytes=1 << 30, **options) as tracker:
        start = time.perf_counter()
        for i in range(n):
            began = time.perf_counter()
            await tracker.dump(obj, f"step{i // 512}/sample{i % 512}")
            latencies.append(time.perf_counter() - began)
        await tracker.flush()
        seconds = time.perf_counter() - start
        failed = tracker.statistics().failed
    if failed:
        raise RuntimeError(f"{failed} dumps failed")
    return {"seconds": seconds, "latency": percentiles(latencies)}


async def steady_stream(root: Path, obj: Any, rate: float, seconds: float) -> dict[str, Any]:
    """Dumps paced at *rate* per second for *seconds*, default settings; files created."""
    n = int(rate * seconds)
    async with Tracker(root, layout="shards") as tracker:
        start = time.perf_counter()
        for i in range(n):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await anyio.sleep(delay)
            await tracker.dump(obj, f"s{i}")
        await tracker.flush()
    shards = len(list((root / SHARDS_DIR).glob("*.tar")))
    return {"dumps": n, "rate": rate, "shard_files": shards, "files_per_100": 100 * shards / n}


def _local_round(kind: str, obj: Any, n: int, root: Path) -> dict[str, Any]:
    gc.collect()  # each writer from a just-collected heap (see bench_core._one_throughput)
    if kind == "inline":
        return {"seconds": inline_loop(obj, n, root)}
    if kind == "torch.save alone":
        return {"seconds": torch_save_memory(obj, n)}
    return asyncio.run(tracked(str(root), obj, n, kind))


def _delete(paths: Iterable[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
    os.sync()  # the deletions settle before what is measured next


def bench_local(quick: bool, scratch: Path) -> dict[str, Any]:
    n = 1500 if quick else 5000
    obj = payload("4KB")
    times: dict[str, float] = {}
    latency: dict[str, Any] = {}
    kinds = ("inline", "torch.save alone", "files", "shards")
    # One unmeasured round of each first, and no small files deleted between measured rounds,
    # for the reasons given in bench_core.py: the first touch of memory costs more, and ext4
    # makes file creations dearer right after thousands of files were deleted.
    for kind in kinds:
        _local_round(kind, obj, n // 5, scratch / f"warm-{kind.replace(' ', '_')}")
    _delete(scratch.glob("warm-*"))
    for rep in range(2):  # interleaved twice, in turn reversed: the better of two
        for kind in kinds if rep == 0 else kinds[::-1]:
            root = scratch / f"local-{kind.replace(' ', '_')}-{rep}"
            result = _local_round(kind, obj, n, root)
            seconds = result["seconds"]
            p50 = result.get("latency", {}).get("p50_us")
            if p50 is not None and (kind not in latency or p50 < latency[kind]["p50_us"]):
                latency[kind] = result["latency"]
            times[kind] = min(times.get(kind, seconds), seconds)
    _delete(scratch.glob("local-*"))
    stream = asyncio.run(
        steady_stream(
            scratch / "stream", obj, rate=500 if quick else 1000, seconds=3 if quick else 6
        )
    )
    rates = {kind: n / seconds for kind, seconds in times.items()}
    return {"n": n, "dumps_per_s": rates, "latency": latency, "steady_stream": stream}


# --------------------------------------------------------------------------- HDFS


def raw_bound(client: InsecureClient, path: str, obj: Any, n: int) -> float:
    """The same dumps serialized, concatenated and written as one file: one raw write."""
    start = time.perf_counter()
    buffer = io.BytesIO()
    for _ in range(n):
        torch.save(obj, buffer)
    client.write(path, data=buffer.getvalue(), overwrite=True)
    return time.perf_counter() - start


def bench_hdfs(cluster_dir: Path, quick: bool) -> dict[str, Any]:
    env = cluster_env(cluster_dir)
    client = InsecureClient(
        f"http://127.0.0.1:{env['NN_HTTP_PORT']}", user=env["HDFS_SUPERUSER"], timeout=(10, 300)
    )
    obj = payload("4KB")
    base = f"/bench/shards-{os.getpid()}"
    url = f"{env['WEBHDFS_URL']}{base}"
    n_files, n_shards = (30, 2000) if quick else (100, 20000)
    client.write(f"{base}/warmup", data=b"x", overwrite=True)
    files = anyio.run(tracked, f"{url}/files", obj, n_files, "files")
    shards_s: list[float] = []
    raw_s: list[float] = []
    for rep in range(3):  # interleaved: the best of three, each kind alike
        result = anyio.run(tracked, f"{url}/shards-{rep}", obj, n_shards, "shards")
        shards_s.append(result["seconds"])
        raw_s.append(raw_bound(client, f"{base}/raw-{rep}.bin", obj, n_shards))
    client.delete(base, recursive=True)
    return {
        "files": {"n": n_files, "dumps_per_s": n_files / files["seconds"]},
        "shards": {"n": n_shards, "dumps_per_s": n_shards / min(shards_s), "rounds": shards_s},
        "raw": {"n": n_shards, "dumps_per_s": n_shards / min(raw_s), "rounds": raw_s},
    }


# --------------------------------------------------------------------------- report


def print_tables(local: dict[str, Any], hdfs: dict[str, Any] | None) -> None:
    rates = local["dumps_per_s"]
    rows = [[kind, f"{rate:,.0f}"] for kind, rate in rates.items()]
    print(f"\nLocal disk, 4 KB dumps ({local['n']} each, best of 2, interleaved)")
    print(table(rows, ["writer", "dumps/s"]))
    print(
        f"shards vs inline: {rates['shards'] / rates['inline']:.2f}x (target >= 1.5x); "
        f"vs torch.save alone: {rates['shards'] / rates['torch.save alone']:.0%} (target >= 70%)"
    )
    lat = local["latency"]
    print(
        f"await dump p50: files {lat['files']['p50_us']:.0f} us, shards "
        f"{lat['shards']['p50_us']:.0f} us (target: shards no worse)"
    )
    stream = local["steady_stream"]
    print(
        f"steady stream {stream['rate']:.0f}/s for {stream['dumps']} dumps: "
        f"{stream['shard_files']} shard files, {stream['files_per_100']:.2f} per 100 dumps "
        "(target <= 1)"
    )
    if hdfs is None:
        return
    rows = [
        [kind, str(v["n"]), f"{v['dumps_per_s']:,.1f}", _rounds(v["n"], v.get("rounds"))]
        for kind, v in hdfs.items()
    ]
    print("\nHDFS test cluster, 4 KB dumps (shards and raw: best of 3, interleaved)")
    print(table(rows, ["writer", "dumps", "dumps/s", "each round"]))
    ratio = hdfs["shards"]["dumps_per_s"] / hdfs["files"]["dumps_per_s"]
    bound = hdfs["shards"]["dumps_per_s"] / hdfs["raw"]["dumps_per_s"]
    print(f"shards vs files: {ratio:.0f}x (target >= 100x); vs raw bound: {bound:.0%} (>= 70%)")


def _rounds(n: int, seconds: list[float] | None) -> str:
    return " / ".join(f"{n / each:,.0f}" for each in seconds) if seconds else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--cluster-dir", type=Path, help="reuse a running test cluster")
    parser.add_argument("--no-hdfs", action="store_true", help="the local part only")
    parser.add_argument("--scratch", help="scratch directory on the disk to measure")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="trajtrack-bench-shards-", dir=args.scratch) as tmp:
        local = bench_local(args.quick, Path(tmp))
    hdfs = None if args.no_hdfs else with_hdfs_cluster(bench_hdfs, args.cluster_dir, args.quick)
    print_tables(local, hdfs)
    name = "shards-quick" if args.quick else "shards"
    path = write_results(name, {"quick": args.quick, "local": local, "hdfs": hdfs})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
