"""Benchmark: reading runs of small dumps -- ``diff`` and ``verify`` against plain reads.

Runs of N dumps of 4 KB each (default 20,000; ``--quick``: 2,000) are written to local disk by a
real Tracker, in the files layout and in the shards layout: two identical runs and one whose
every dump differs in one element, per layout. Then, in one process, with a warm page cache
(every file read once first), best of ``--repeat``:

* **one thread, open().read()**: every file of the runs read by one thread, nothing else (the
  files of both runs for a diff, of one run for verify; for shards: the shard files);
* **diff, identical runs** and **diff, every dump differs**: ``trajtrack.reader.diff_runs``
  with the CLI's defaults (what ``trajtrack diff A B`` does, less the printing);
* **verify**: ``trajtrack.cli.verify.verify_run`` (what ``trajtrack verify RUN`` does).

Both run as the CLI runs them: one thread for torch, the allow-list widened, the garbage
collector set as the command sets it (:func:`as_the_cli`).

The ratios are the baseline's time over the command's (100% = as fast as one thread only
reading the bytes). Issue 16's targets (files layout): diff of identical runs >= 50%, of
different runs >= 20%, verify >= 50%; issue 14's (shards): diff of two sharded runs >= 50% of
the storage's read bandwidth.

Run: ``python benchmarks/bench_small_reads.py [--quick] [--dumps N] [--data DIR]``; ``--data``
keeps the runs there and reuses them. Writes ``benchmarks/results/small_reads.json``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import table, write_results
from trajtrack import Tracker
from trajtrack.cli._collector import collected_every
from trajtrack.cli.verify import verify_run
from trajtrack.reader import allow_in_this_process, diff_runs, open_run

LAYOUTS = ("files", "shards")
T = TypeVar("T")


def sample(i: int, differ: bool) -> dict[str, Any]:
    """A 4 KB dump: 1,000 float32 values and the sample's index."""
    values = torch.arange(1000, dtype=torch.float32) + i
    if differ:
        values[i % 1000] += 1.0
    return {"index": i, "values": values}


async def _write(root: Path, dumps: int, layout: str, differ: bool) -> None:
    async with Tracker(root, layout=layout) as tracker:  # type: ignore[arg-type]
        for i in range(dumps):
            await tracker.dump(sample(i, differ), f"step{i // 512}/sample{i % 512}")
        await tracker.flush(timeout=600)
    (root / ".complete").write_text(str(dumps))


def runs(data: Path, dumps: int, layout: str) -> tuple[Path, Path, Path]:
    """Runs a, b (identical) and c (every dump differs) of *layout*, written once in *data*."""
    made = []
    for name, differ in (("a", False), ("b", False), ("c", True)):
        root = data / f"{layout}-{dumps}-{name}"
        marker = root / ".complete"
        if not (marker.exists() and marker.read_text() == str(dumps)):
            shutil.rmtree(root, ignore_errors=True)
            start = time.perf_counter()
            anyio.run(_write, root, dumps, layout, differ)
            print(f"wrote {root} in {time.perf_counter() - start:.1f} s", flush=True)
        made.append(root)
    return made[0], made[1], made[2]


def data_files(root: Path) -> list[Path]:
    """The files that hold a run's dumps (records and markers aside)."""
    found = []
    for directory, _dirs, files in os.walk(root):
        for name in files:
            if name.endswith((".pth", ".tar")):
                found.append(Path(directory, name))
    return sorted(found)


def read_one_thread(paths: list[Path]) -> float:
    start = time.perf_counter()
    for path in paths:
        with open(path, "rb") as handle:
            handle.read()
    return time.perf_counter() - start


async def _diff(a: Path, b: Path) -> tuple[float, dict[str, int]]:
    start = time.perf_counter()
    async with open_run(a) as run_a, open_run(b) as run_b:
        result = await diff_runs(run_a, run_b)
    return time.perf_counter() - start, result.counts()


async def _verify(a: Path) -> tuple[float, dict[str, int]]:
    start = time.perf_counter()
    async with open_run(a) as run:
        findings = await verify_run(run)
    counts: dict[str, int] = {}
    for finding in findings:
        counts[finding.problem] = counts.get(finding.problem, 0) + 1
    return time.perf_counter() - start, counts


def best(repeat: int, measure: Callable[[], Any]) -> Any:
    results = [measure() for _ in range(repeat)]
    return min(results, key=lambda r: r[0] if isinstance(r, tuple) else r)


def measure_layout(data: Path, dumps: int, layout: str, repeat: int) -> dict[str, Any]:
    a, b, c = runs(data, dumps, layout)
    files_ab, files_a = data_files(a) + data_files(b), data_files(a)
    files_ac = files_a + data_files(c)
    read_one_thread(files_ab + data_files(c))  # warm the page cache
    t_read_ab = best(repeat, lambda: read_one_thread(files_ab))
    t_read_ac = best(repeat, lambda: read_one_thread(files_ac))
    t_read_a = best(repeat, lambda: read_one_thread(files_a))
    t_same, same = best(repeat, lambda: as_the_cli(_diff, a, b))
    t_differ, differ = best(repeat, lambda: as_the_cli(_diff, a, c))
    t_verify, verified = best(repeat, lambda: as_the_cli(_verify, a))
    return {
        "files_per_run": len(files_a),
        "bytes_per_run": sum(p.stat().st_size for p in files_a),
        "seconds": {
            "one thread, open().read(), runs a+b": t_read_ab,
            "one thread, open().read(), runs a+c": t_read_ac,
            "one thread, open().read(), run a": t_read_a,
            "diff, identical runs": t_same,
            "diff, every dump differs": t_differ,
            "verify": t_verify,
        },
        "ratios": {
            "diff, identical runs": t_read_ab / t_same,
            "diff, every dump differs": t_read_ac / t_differ,
            "verify": t_read_a / t_verify,
        },
        "counts": {"identical": same, "different": differ, "verify": verified},
    }


def print_report(report: dict[str, Any]) -> None:
    for layout in (layout for layout in LAYOUTS if layout in report):
        result = report[layout]
        print(
            f"\n{layout} layout: {report['dumps']} dumps of 4 KB per run, "
            f"{result['files_per_run']} files per run, "
            f"{result['bytes_per_run'] / 2**20:.0f} MiB per run, warm page cache, "
            f"best of {report['repeat']}"
        )
        rows = [[name, f"{seconds:.3f}", ""] for name, seconds in result["seconds"].items()]
        for row in rows:
            ratio = result["ratios"].get(row[0])
            row[2] = f"{ratio:.0%}" if ratio is not None else ""
        print(table(rows, ["measurement", "seconds", "vs one-thread read"]))
        print(f"counts: {result['counts']}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2,000 dumps instead of 20,000")
    parser.add_argument("--dumps", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=3, help="best of N for each figure")
    parser.add_argument("--data", type=Path, default=None, help="keep (and reuse) runs here")
    parser.add_argument("--layout", choices=LAYOUTS, action="append", help="only this layout")
    return parser.parse_args()


def as_the_cli(command: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``anyio.run(command, *args)`` as the ``trajtrack`` command runs its handler: with the
    garbage collector as the CLI sets it (``trajtrack.cli._collector``)."""
    with collected_every():
        return anyio.run(command, *args)


def prepare_process() -> None:
    """What the ``trajtrack`` command does to its process before it reads runs."""
    torch.set_num_threads(1)
    allow_in_this_process()


def main() -> int:
    args = parse_args()
    prepare_process()
    dumps = args.dumps or (2000 if args.quick else 20000)
    data = args.data or Path(tempfile.mkdtemp(prefix="bench-small-reads-"))
    data.mkdir(parents=True, exist_ok=True)
    try:
        report: dict[str, Any] = {"dumps": dumps, "repeat": args.repeat}
        for layout in args.layout or LAYOUTS:
            report[layout] = measure_layout(data, dumps, layout, args.repeat)
    finally:
        if args.data is None:
            shutil.rmtree(data, ignore_errors=True)
    print_report(report)
    name = "small_reads-quick" if args.quick else "small_reads"
    print(f"wrote {write_results(name, report)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
