"""Benchmark: do the caller's snapshots and the upload workers overlap? (issue #16, 1 MB dumps)

One tracker per round writes *n* dumps of one payload (``payload("1MB")`` by default) to a
local directory, and the inline loop (``torch.save`` to a temp file + rename) does the same
work; the two alternate, the order reversed every other round. For the tracker it reports:

* **committed while dumping**: dumps already committed when the caller's last ``await dump``
  returned. Near zero means the caller's snapshots kept the upload workers from running (the
  GIL held through a copy into fresh memory); near *n* means they overlapped.
* the caller's time per dump, the time per dump still uncommitted after it (the drain), the
  throughput until ``flush()`` returns, the process CPU and minor page faults per dump.

Usage: ``python benchmarks/bench_snapshot.py [--size 1MB] [--dumps 300] [--rounds 3]
[--scratch DIR]``. Figures are printed, and written to ``results/snapshot.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import PAYLOAD_BYTES, machine, payload, table, write_results
from benchmarks.bench_core import throughput_inline
from trajtrack import Tracker


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


async def _tracker_round(obj: Any, n: int, root: Path) -> dict[str, float]:
    faults, cpu, start = _faults(), time.process_time(), time.perf_counter()
    async with Tracker(root, workers=4, max_pending_bytes=1 << 30) as tracker:
        for i in range(n):
            await tracker.dump(obj, f"d{i}")
        dumped = time.perf_counter()
        pending = tracker.statistics().pending_items
        await tracker.flush()
        flushed = time.perf_counter()
    return {
        "dumps_per_s": n / (flushed - start),
        "committed_while_dumping": n - pending,
        "caller_us_per_dump": (dumped - start) / n * 1e6,
        "drain_us_per_dump": (flushed - dumped) / pending * 1e6 if pending else 0.0,
        "cpu_us_per_dump": (time.process_time() - cpu) / n * 1e6,
        "faults_per_dump": (_faults() - faults) / n,
    }


def _inline_round(obj: Any, n: int, root: Path) -> dict[str, float]:
    faults, cpu = _faults(), time.process_time()
    seconds = throughput_inline(obj, n, root)  # bench_core's inline loop, the same work
    return {
        "dumps_per_s": n / seconds,
        "cpu_us_per_dump": (time.process_time() - cpu) / n * 1e6,
        "faults_per_dump": (_faults() - faults) / n,
    }


def measure(size: str, n: int, rounds: int, scratch: Path) -> dict[str, Any]:
    obj = payload(size)
    measured: dict[str, list[dict[str, float]]] = {"tracker": [], "inline": []}
    for round_ in range(rounds):
        kinds = ("tracker", "inline") if round_ % 2 == 0 else ("inline", "tracker")
        for kind in kinds:
            root = scratch / f"{kind}-{round_}"
            try:
                if kind == "tracker":
                    measured[kind].append(asyncio.run(_tracker_round(obj, n, root)))
                else:
                    measured[kind].append(_inline_round(obj, n, root))
            finally:
                shutil.rmtree(root, ignore_errors=True)
    ratios = [
        t["dumps_per_s"] / i["dumps_per_s"]
        for t, i in zip(measured["tracker"], measured["inline"], strict=True)
    ]
    return {"size": size, "dumps": n, "rounds": measured, "tracker_vs_inline": ratios}


def report(result: dict[str, Any]) -> str:
    rows = []
    for index, (t, i) in enumerate(
        zip(result["rounds"]["tracker"], result["rounds"]["inline"], strict=True)
    ):
        rows.append(
            [
                str(index + 1),
                f"{t['committed_while_dumping']:.0f} of {result['dumps']}",
                f"{t['caller_us_per_dump']:.0f}",
                f"{t['drain_us_per_dump']:.0f}",
                f"{t['dumps_per_s']:.0f}",
                f"{i['dumps_per_s']:.0f}",
                f"{result['tracker_vs_inline'][index]:.2f}x",
                f"{t['cpu_us_per_dump']:.0f} / {i['cpu_us_per_dump']:.0f}",
                f"{t['faults_per_dump']:.0f} / {i['faults_per_dump']:.0f}",
            ]
        )
    header = [
        "round",
        "committed while dumping",
        "caller us/dump",
        "drain us/dump",
        "tracker dumps/s",
        "inline dumps/s",
        "tracker/inline",
        "cpu us/dump t / i",
        "faults/dump t / i",
    ]
    median = statistics.median(result["tracker_vs_inline"])
    return (
        f"{result['dumps']} dumps of {result['size']} per round, local disk, 4 workers\n"
        f"{table(rows, header)}\nmedian tracker/inline: {median:.2f}x"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1MB", choices=sorted(PAYLOAD_BYTES))
    parser.add_argument("--dumps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scratch", help="scratch directory on the disk to measure")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.scratch, prefix="trajtrack-snapshot-") as tmp:
        result = measure(args.size, args.dumps, args.rounds, Path(tmp))
    print(report(result))
    path = write_results("snapshot", {"machine": machine(), **result})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
