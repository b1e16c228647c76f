"""WebHDFS benchmark: end-to-end MB/s through the tracker next to a raw ``client.write``.

For 1 MB, 16 MB and 128 MB dumps (tensor dicts), in the same run against the same cluster:

* **raw**: the bytes ``torch.save`` makes of the payload, written with one HdfsCLI
  ``client.write(path, data=bytes, overwrite=True)`` per dump, one after another (serialization
  done beforehand and not timed: the most favourable baseline);
* **tracker**: ``await tracker.dump(obj, name)`` for every dump, then ``flush()``; timed from
  the first dump to the end of the flush, so it includes snapshotting, serialization, the
  temp-file upload, the length check and the rename, with the tracker's upload workers in
  parallel.

Run: ``python benchmarks/bench_webhdfs.py [--quick] [--cluster-dir DIR]``. Without
``--cluster-dir`` (a directory where ``scripts/hdfs-test-cluster.sh start`` ran) it starts its
own cluster in a temporary directory and stops it afterwards. Prints a table, writes
``benchmarks/results/webhdfs.json`` (``webhdfs-quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import torch
from hdfs import InsecureClient

from trajtrack import Tracker

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import cluster_env, with_hdfs_cluster

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MB = 1 << 20
# size in MB -> number of dumps (full, quick)
PLAN = {1: (128, 32), 16: (24, 8), 128: (4, 2)}
WORKERS = 4


def _payload(size_mb: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(size_mb)
    return {"obs": torch.randn(size_mb * MB // 4, generator=generator)}


def _serialized(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _raw(client: InsecureClient, base: str, data: bytes, count: int) -> float:
    start = time.perf_counter()
    for i in range(count):
        client.write(f"{base}/{i}.pth", data=data, overwrite=True)
    return time.perf_counter() - start


async def _tracked(url: str, obj: object, count: int) -> float:
    async with Tracker(url, workers=WORKERS, record=False) as tracker:
        start = time.perf_counter()
        for i in range(count):
            await tracker.dump(obj, f"{i}")
        await tracker.flush()
        elapsed = time.perf_counter() - start
        failed = tracker.statistics().failed
    if failed:
        raise RuntimeError(f"{failed} dumps failed")
    return elapsed


def run(cluster_dir: Path, quick: bool) -> dict[str, Any]:
    env = cluster_env(cluster_dir)
    http = f"http://127.0.0.1:{env['NN_HTTP_PORT']}"
    client = InsecureClient(http, user=env["HDFS_SUPERUSER"], timeout=(10, 300))
    rows = []
    for size_mb, (full, short) in PLAN.items():
        count = short if quick else full
        obj = _payload(size_mb)
        data = _serialized(obj)
        base = f"/bench/{size_mb}mb-{os.getpid()}"
        client.write(f"{base}/warmup", data=data[: 1 << 16], overwrite=True)
        raw_s = _raw(client, f"{base}/raw", data, count)
        tracker_s = anyio.run(_tracked, f"{env['WEBHDFS_URL']}{base}/tracker", obj, count)
        client.delete(base, recursive=True)
        total_mb = len(data) * count / MB
        rows.append(
            {
                "size_mb": size_mb,
                "dumps": count,
                "bytes_per_dump": len(data),
                "raw_mb_s": total_mb / raw_s,
                "tracker_mb_s": total_mb / tracker_s,
                "ratio": raw_s / tracker_s,
                "raw_s": raw_s,
                "tracker_s": tracker_s,
            }
        )
    return {
        "benchmark": "webhdfs",
        "quick": quick,
        "tracker_workers": WORKERS,
        "cluster": "Hadoop 2.7.3 NameNode + DataNode on 127.0.0.1 (scripts/hdfs-test-cluster.sh)",
        "machine": {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
        },
        "rows": rows,
    }


def _print(result: dict[str, Any]) -> None:
    print(f"WebHDFS end to end ({result['tracker_workers']} tracker workers), MB/s")
    print(f"{'dump':>8} {'count':>6} {'raw write':>10} {'tracker':>10} {'tracker/raw':>12}")
    for row in result["rows"]:
        print(
            f"{row['size_mb']:>6}MB {row['dumps']:>6} {row['raw_mb_s']:>10.1f} "
            f"{row['tracker_mb_s']:>10.1f} {row['ratio']:>11.0%}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer dumps per size")
    parser.add_argument("--cluster-dir", type=Path, help="reuse a running test cluster")
    args = parser.parse_args()
    result = with_hdfs_cluster(run, args.cluster_dir, args.quick)
    _print(result)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / ("webhdfs-quick.json" if args.quick else "webhdfs.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
