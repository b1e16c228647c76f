"""One revision's side of ``compare_revisions.py``: bench_diff's measurements, one per request.

Started with ``PYTHONPATH`` set to a revision's ``src`` (so ``trajtrack`` is that revision) and
the runs ``compare_revisions.py`` wrote; reads one JSON request per line on stdin
(``{"case": ..., "where": "local" | "hdfs", "cold": bool}``), measures that case once with
bench_diff's own functions, and answers one JSON line. Keeping a process per revision lets the
driver alternate the two revisions measurement by measurement, seconds apart, instead of run
by run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import anyio
import torch

import trajtrack

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_diff import diff_urls, drop_caches, files_of, raw_threads, read_all

CASES = (
    "raw threads",
    "raw storage",
    "diff, identical runs (byte-equal pairs)",
    "diff, every dump differs (full compare)",
)


def measure(case: str, runs: tuple[str, str, str], concurrency: int) -> dict[str, Any]:
    a, b, c = runs
    if case == "raw threads":
        paths = files_of(Path(a)) + files_of(Path(b))
        seconds, total = raw_threads(paths, concurrency)
        return {"seconds": seconds, "total_bytes": total, "files": len(paths)}
    if case == "raw storage":
        seconds, total = anyio.run(read_all, [a, b], concurrency)
        return {"seconds": seconds, "total_bytes": total}
    other = b if case.startswith("diff, identical") else c
    seconds, result, reads = anyio.run(diff_urls, a, other, concurrency)
    counts = result.counts()
    return {
        "seconds": seconds,
        "equal": result.equal,
        "different": counts["different"],
        "errors": counts["error"],
        "files_read": sum(reads.values()),
        "files": len(reads),
        "each_file_read_once": set(reads.values()) == {1},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local", nargs=3, required=True, metavar=("A", "B", "C"))
    parser.add_argument("--hdfs", nargs=3, metavar=("A", "B", "C"))
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as the trajtrack CLI does
    runs = {"local": tuple(args.local), "hdfs": tuple(args.hdfs or ())}
    print(json.dumps({"ready": str(Path(trajtrack.__file__).parent)}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("cold") and not drop_caches():
            print(json.dumps({"error": "cannot drop the page cache (needs root)"}), flush=True)
            continue
        answer = measure(request["case"], runs[request["where"]], args.concurrency)
        print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
