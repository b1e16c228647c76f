"""The archive writer against ``torch.save``, side by side in one run.

For each payload (a dict of an int and 1,000 floats, and the 4 KB, 1 MB and 256 MB tensor dicts
of the other benchmarks), best of several interleaved rounds of:

* ``torch.save`` (torch's defaults, per-record CRC-32 on) into a file and into memory;
* ``torch.save`` through trajtrack's ``ChecksumWriter`` into a file: today's upload path
  (torch's CRCs, then trajtrack's CRC-32 of the whole file again);
* the archive writer (``write_archive``, which returns the file's CRC-32 itself) into a file
  and into memory;
* a raw ``write()`` of the archive's bytes into a file: the bound.

Wall time per dump (best round) and the CPU time of all threads (the CRC helper's included).

Files are new ones in a scratch directory (unlinked between dumps, outside the timing), with
no fsync, like the tracker's default.

Run: ``python benchmarks/bench_archive.py [--quick] [--only PAYLOAD ...]``. Prints tables,
writes ``benchmarks/results/archive.json``. ``--loop SECONDS`` only writes the small dump into
memory, over and over, for a sampling profiler (``py-spy record --format raw``).
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import payload, table, write_results
from trajtrack.backends import ChecksumWriter
from trajtrack.tracker._archive import archive_plan, write_archive
from trajtrack.tracker._crc32 import crc32_big

WRITERS = ["torch_file", "torch_crc_file", "torch_memory", "archive_file", "archive_memory", "raw"]
LABELS = {
    "torch_file": "torch.save -> file",
    "torch_crc_file": "torch.save -> ChecksumWriter(file)",
    "torch_memory": "torch.save -> BytesIO",
    "archive_file": "write_archive -> file",
    "archive_memory": "write_archive -> BytesIO",
    "raw": "raw write of the same bytes",
}


def payloads() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    return {
        "int+1000 floats": {"step": 1, "x": torch.randn(1000, generator=generator)},
        "4KB": payload("4KB"),
        "1MB": payload("1MB"),
        "256MB": payload("256MB"),
    }


def plan(quick: bool) -> dict[str, tuple[int, int]]:
    """Dumps per round and rounds, per payload."""
    if quick:
        return {"int+1000 floats": (200, 3), "4KB": (200, 3), "1MB": (20, 3), "256MB": (1, 2)}
    # Many short rounds: on a shared machine the best of them is the one least disturbed.
    return {"int+1000 floats": (200, 40), "4KB": (200, 40), "1MB": (20, 30), "256MB": (1, 9)}


def _one(writer: str, obj: Any, data: bytes, path: Path) -> Callable[[], None]:
    if writer == "torch_memory":
        return lambda: torch.save(obj, io.BytesIO())
    if writer == "archive_memory":

        def to_memory() -> None:
            write_archive(obj, io.BytesIO())

        return to_memory

    def to_file() -> None:
        with open(path, "wb") as handle:
            if writer == "torch_file":
                torch.save(obj, handle)
            elif writer == "torch_crc_file":
                checked = ChecksumWriter(handle)
                torch.save(obj, checked)  # type: ignore[arg-type]  # a minimal BinaryIO
                checked.checksum  # noqa: B018 -- what the upload path reads
            elif writer == "archive_file":
                write_archive(obj, handle)
            else:
                handle.write(data)

    return to_file


def measure(writer: str, obj: Any, data: bytes, n: int, scratch: Path) -> tuple[float, float]:
    """Seconds per dump over *n* dumps, wall and CPU (files unlinked outside the timing)."""
    paths = [scratch / f"{writer}-{i}.pt" for i in range(n)]
    calls = [_one(writer, obj, data, path) for path in paths]
    start, cpu = time.perf_counter(), time.process_time()  # CPU: all threads, the CRC's too
    for call in calls:
        call()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    for path in paths:
        if path.exists():
            path.unlink()
    return elapsed / n, cpu / n


def bench_payload(name: str, obj: Any, n: int, rounds: int, scratch: Path) -> dict[str, Any]:
    data = io.BytesIO()
    size, _ = write_archive(obj, data)
    assert len(data.getvalue()) == size
    samples: dict[str, list[tuple[float, float]]] = {writer: [] for writer in WRITERS}
    measure("raw", obj, data.getvalue(), 1, scratch)  # warm the page cache's free pages
    for round_ in range(rounds):
        # Rotate the order per round, so that no writer always follows the same one.
        order = WRITERS[round_ % len(WRITERS) :] + WRITERS[: round_ % len(WRITERS)]
        for writer in order:
            samples[writer].append(measure(writer, obj, data.getvalue(), n, scratch))
    result: dict[str, Any] = {"bytes": size, "dumps_per_round": n, "rounds": rounds}
    for writer, values in samples.items():
        best = min(wall for wall, _ in values)
        result[writer] = {
            "best_us": best * 1e6,
            "median_us": statistics.median(wall for wall, _ in values) * 1e6,
            "cpu_us": min(cpu for _, cpu in values) * 1e6,
            "dumps_per_s": 1 / best,
            "mb_per_s": size / best / 1e6,
        }
    return result


def bench_plan_and_write(obj: Any, n: int) -> dict[str, float]:
    """The small dump split: pickling + layout, then writing a plan into memory."""
    best_plan = best_write = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        plans = [archive_plan(obj) for _ in range(n)]
        middle = time.perf_counter()
        for each in plans:
            each.write_to(io.BytesIO())
        end = time.perf_counter()
        best_plan = min(best_plan, (middle - start) / n)
        best_write = min(best_write, (end - middle) / n)
    return {"plan_us": best_plan * 1e6, "write_us": best_write * 1e6}


def report(results: dict[str, Any]) -> None:
    rows = []
    for name, result in results["payloads"].items():
        raw = result["raw"]["best_us"]
        for writer in WRITERS:
            m = result[writer]
            same_place = result["torch_memory" if "memory" in writer else "torch_file"]["best_us"]
            rows.append(
                [
                    name,
                    LABELS[writer],
                    f"{m['best_us']:.1f}",
                    f"{m['cpu_us']:.1f}",
                    f"{m['dumps_per_s']:.0f}",
                    f"{m['mb_per_s']:.0f}",
                    f"{same_place / m['best_us']:.2f}x",
                    "" if "memory" in writer else f"{raw / m['best_us']:.0%}",
                ]
            )
    header = [
        "payload",
        "writer",
        "us/dump",
        "cpu us",
        "dumps/s",
        "MB/s",
        "vs torch.save",
        "vs raw",
    ]
    print("\nOne dump, best of the rounds (vs torch.save: to the same kind of destination;")
    print("cpu us: CPU time of all the process's threads per dump, best round)")
    print(table(rows, header))
    split = results["small_dump_split"]
    print(
        f"int+1000 floats, write_archive split: archive_plan {split['plan_us']:.1f} us, "
        f"write_to(BytesIO) {split['write_us']:.1f} us; big CRCs by {results['crc32_big']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--scratch", type=Path, default=None, help="directory for the files")
    parser.add_argument("--only", nargs="+", default=None, help="payloads to measure, by name")
    parser.add_argument(
        "--loop", type=float, default=None, help="only write the small dump for SECONDS (profile)"
    )
    args = parser.parse_args()
    objects = payloads()
    if args.loop is not None:
        # For a sampling profiler: py-spy record --format raw -o p.txt -- python ... --loop 15
        small, end = objects["int+1000 floats"], time.monotonic() + args.loop
        while time.monotonic() < end:
            write_archive(small, io.BytesIO())
        return
    chosen = {name: n for name, n in plan(args.quick).items() if name in (args.only or objects)}
    with tempfile.TemporaryDirectory(dir=args.scratch, prefix="trajtrack-bench-archive-") as tmp:
        scratch = Path(tmp)
        measured = {
            name: bench_payload(name, objects[name], n, rounds, scratch)
            for name, (n, rounds) in chosen.items()
        }
    results = {
        "quick": args.quick,
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "crc32_big": f"{crc32_big.__module__ or 'zlib'}.crc32",
        "payloads": measured,
        "small_dump_split": bench_plan_and_write(objects["int+1000 floats"], 500),
    }
    report(results)
    path = write_results("archive-quick" if args.quick else "archive", results)
    print(f"\nload average during the run: {os.getloadavg()}; wrote {path}")


if __name__ == "__main__":
    main()
