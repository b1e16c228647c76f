"""Scale with writers: per-process trackers versus the single Ray actor, into one HDFS directory.

1, 2 and 4 writer processes each dump N small payloads (a 4 KB tensor dict) into the same
WebHDFS directory of the real test cluster, either

* **per-process**: each process runs its own ``trajtrack.Tracker`` (name template ``{pid}``),
  timed until every process has flushed; or
* **ray actor**: each process calls ``trajtrack.ray.dump_data`` (acknowledged), funnelled
  through the single named tracker actor (the original's semantics), timed until the driver's
  ``trajtrack.ray.flush()`` returns.

Aggregate dumps/s = all dumps / wall time from the common start. On 2 cores the curve
flattens early; the script also writes down what the measured per-dump costs imply for 64
writers. Run: ``python benchmarks/bench_scale.py [--quick]``; writes
``benchmarks/results/scale.json``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import cluster_env, table, with_hdfs_cluster, write_results

ROOT = Path(__file__).resolve().parent.parent

PER_PROCESS = """
import asyncio, sys, time, torch
from trajtrack import Tracker
url, n, start = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
obj = {"obs": torch.randn(768), "actions": torch.randint(0, 100, (128,))}
async def main():
    async with Tracker(url, name_template="{name}.p{pid}", record=False) as t:
        while time.time() < start:
            await asyncio.sleep(0.001)
        for i in range(n):
            await t.dump(obj, f"d{i}")
        await t.flush()
asyncio.run(main())
print(time.time())
"""

RAY_WRITER = """
import sys, time, torch, ray
import trajtrack.ray as tr
address, n, start = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
ray.init(address=address, logging_level="ERROR", log_to_driver=False)
obj = {"obs": torch.randn(768), "actions": torch.randint(0, 100, (128,))}
tr.get_trajectory_tracker()
while time.time() < start:
    time.sleep(0.001)
for i in range(n):
    tr.dump_data(obj, f"d{i}")
print(time.time())
"""


def _spawn(code: str, args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(procs: list[subprocess.Popen[str]]) -> list[float]:
    ends = []
    for proc in procs:
        out, err = proc.communicate(timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"writer failed: {err[-2000:]}")
        ends.append(float(out.strip().splitlines()[-1]))
    return ends


def per_process(url: str, writers: int, n: int) -> float:
    start = time.time() + 8.0  # every process imports torch and connects before the start
    procs = [
        _spawn(PER_PROCESS, [f"{url}/pp{writers}", str(n), str(start)], {}) for _ in range(writers)
    ]
    ends = _finish(procs)
    return writers * n / (max(ends) - start)


def through_ray(address: str, url: str, writers: int, n: int) -> float:
    import trajtrack.ray as tr

    env = {
        "VERL_ENABLE_TRACKER": "1",
        "VERL_TRACKER_HDFS_DIR": f"{url}/ray{writers}",
        "TRAJTRACK_RAY_ACTOR": f"bench-scale-{writers}",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    start = time.time() + 12.0
    procs = [_spawn(RAY_WRITER, [address, str(n), str(start)], env) for _ in range(writers)]
    _finish(procs)
    tr.flush(timeout=900, name=f"bench-scale-{writers}")
    end = time.time()
    tr.shutdown(timeout=300, name=f"bench-scale-{writers}")
    return writers * n / (end - start)


def run(cluster_dir: Path, quick: bool) -> dict[str, Any]:
    import ray

    env = cluster_env(cluster_dir)
    url = env["WEBHDFS_URL"] + "/scale"
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    address = ray.get_runtime_context().gcs_address
    n = 50 if quick else 200
    rows = []
    try:
        for writers in (1, 2, 4):
            pp = per_process(url, writers, n)
            actor = through_ray(address, url, writers, n)
            rows.append({"writers": writers, "per_process_dumps_s": pp, "ray_actor_dumps_s": actor})
    finally:
        ray.shutdown()
    one = rows[0]
    ceiling = max(r["ray_actor_dumps_s"] for r in rows)
    projection = {
        "per_process_64_writers_dumps_s": 64 * one["per_process_dumps_s"],
        "ray_actor_ceiling_dumps_s": ceiling,
        "note": (
            "per-process trackers add one writer's rate per process (each process has its own "
            "queue, serializer and connections; the bound becomes the NameNode), while every "
            "dump through the single actor passes one process: its measured best rate is the "
            "ceiling for any number of writers"
        ),
    }
    return {"dumps_per_writer": n, "rows": rows, "projection": projection}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cluster-dir", type=Path, help="reuse a running test cluster")
    args = parser.parse_args(argv)
    result = with_hdfs_cluster(run, args.cluster_dir, args.quick)
    rows = [
        [
            str(r["writers"]),
            f"{r['per_process_dumps_s']:.0f}",
            f"{r['ray_actor_dumps_s']:.0f}",
            f"{r['per_process_dumps_s'] / r['ray_actor_dumps_s']:.1f}x",
        ]
        for r in result["rows"]
    ]
    print("\nAggregate dumps/s into one HDFS directory (4 KB dumps)")
    print(table(rows, ["writers", "per-process trackers", "single Ray actor", "ratio"]))
    p = result["projection"]
    per_process_64 = p["per_process_64_writers_dumps_s"]
    ceiling = p["ray_actor_ceiling_dumps_s"]
    print(
        f"64 writers, from the measured costs: per-process ~{per_process_64:.0f} dumps/s "
        f"(until the NameNode bounds it); single actor <= {ceiling:.0f} dumps/s"
    )
    path = write_results("scale-quick" if args.quick else "scale", result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
