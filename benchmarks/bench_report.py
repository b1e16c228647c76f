"""Benchmark: what ``trajtrack diff --html`` costs on top of the diff itself.

Two local runs of N dumps (default 1,000; ``--quick``: 100) of ~1 MB each are written with a
real Tracker; run B differs from run A in one element of every 20th dump, and each run has
two dumps the other lacks. Then, in one process, with a warm page cache and the runs open:

* diff: ``diff_runs`` alone;
* diff + report: ``diff_runs`` and then ``write_diff_report`` (plot of every dump, the table,
  the histogram of the first divergent tensor reloaded from both runs);

alternated, best of ``--repeat`` each (and the median), so both see the same machine; wall
time, and the CPU time of the process (all threads), which other processes' load on a shared
machine disturbs less. The
first report of the process is timed separately: it pays matplotlib's import (what one
``trajtrack diff --html`` command pays once), which the steady-state figures do not. Last,
the whole command as a user runs it, ``trajtrack diff A B`` against
``trajtrack diff A B --html FILE`` (new processes, best of ``--repeat``, alternated).

Prints a table and writes ``benchmarks/results/report.json``. The goal: the report costs at
most 10% on top of the diff (best report time / best diff time, in the same process).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import torch

import trajtrack
from trajtrack.reader import diff_runs, write_diff_report

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._common import RESULTS, machine

GOAL = 0.10  # the report may add at most 10% to the diff's time
EVERY = 20  # one dump in EVERY differs


async def write_run(dest: Path, dumps: int, size: int, *, b: bool) -> None:
    elements = size // 4
    async with trajtrack.Tracker(str(dest), workers=4) as tracker:
        for i in range(dumps):
            x = torch.randn(elements, generator=torch.Generator().manual_seed(i))
            if b and i % EVERY == EVERY // 2:
                x[i % elements] += 1e-3 * (1 + i)  # magnitudes that grow along the run
            await tracker.dump({"x": x, "step": i}, f"step{i // 10:04d}/d{i}")
        for j in range(2):  # dumps in one run only
            await tracker.dump({"x": torch.zeros(4)}, f"only_{'b' if b else 'a'}/{j}")


CPU = "cpu"  # key of the CPU-time samples (all threads of this process)


async def measure(a: Path, b: Path, out: Path, *, report: bool) -> tuple[float, float, Any]:
    """(seconds for the diff, seconds for the report, the diff) with both runs open.

    The diff also carries ``CPU`` times: ``(diff, report)`` CPU seconds of the process (every
    thread), which other processes' load on a shared machine disturbs far less than wall time.
    """
    async with trajtrack.open_run(a) as run_a, trajtrack.open_run(b) as run_b:
        await run_a.scan()  # listing outside the timing: the same for both variants
        await run_b.scan()
        started, cpu_started = time.perf_counter(), time.process_time()
        result = await diff_runs(run_a, run_b)
        diffed, cpu_diffed = time.perf_counter(), time.process_time()
        if report:
            await write_diff_report(result, out, run_a=run_a, run_b=run_b)
        cpu = (cpu_diffed - cpu_started, time.process_time() - cpu_diffed)
        return diffed - started, time.perf_counter() - diffed, (result, cpu)


def cli_seconds(a: Path, b: Path, out: Path, repeat: int) -> tuple[float, float]:
    """Best of *repeat* ``trajtrack diff A B`` and ``... --html FILE`` commands, alternated."""
    base = [sys.executable, "-m", "trajtrack", "diff", str(a), str(b), "-q"]
    plain: list[float] = []
    html: list[float] = []
    for _ in range(repeat):
        for argv, samples in ((base, plain), ([*base, "--html", str(out)], html)):
            started = time.perf_counter()
            done = subprocess.run(argv, capture_output=True, check=False)
            samples.append(time.perf_counter() - started)
            assert done.returncode == 1, done.stderr  # the runs differ
    return min(plain), min(html)


def import_seconds() -> float:
    """matplotlib's import as the report does it, in a fresh interpreter (best of 3)."""
    code = (
        "import time; t = time.perf_counter(); "
        "import matplotlib.figure, matplotlib.backends.backend_svg; "
        "print(time.perf_counter() - t)"
    )
    runs = [
        float(
            subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, check=True
            ).stdout
        )
        for _ in range(3)
    ]
    return min(runs)


def measure_all(dumps: int, size: int, repeat: int, scratch: str | None) -> dict[str, Any]:
    """Write the two runs, take every measurement, remove the runs."""
    work = Path(tempfile.mkdtemp(prefix="bench-report-", dir=scratch))
    try:
        a, b, out = work / "a", work / "b", work / "report.html"
        anyio.run(lambda: write_run(a, dumps, size, b=False))
        anyio.run(lambda: write_run(b, dumps, size, b=True))
        anyio.run(lambda: measure(a, b, out, report=False))  # warm the page cache
        first_diff, first_report, _ = anyio.run(lambda: measure(a, b, out, report=True))
        diff_only: list[float] = []
        with_report: list[tuple[float, float]] = []
        cpu_diff: list[float] = []
        cpu_report: list[float] = []
        for _ in range(repeat):  # alternated: both variants see the same machine
            t_diff, _, (_, cpu) = anyio.run(lambda: measure(a, b, out, report=False))
            diff_only.append(t_diff)
            cpu_diff.append(cpu[0])
            t_diff, t_report, (result, cpu) = anyio.run(lambda: measure(a, b, out, report=True))
            with_report.append((t_diff, t_report))
            cpu_report.append(cpu[1])
        html_bytes = out.stat().st_size
        cli_plain, cli_html = cli_seconds(a, b, out, repeat)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "counts": result.counts(),
        "diff_only_samples": diff_only,
        "with_report_samples": with_report,
        "first_diff_seconds": first_diff,
        "first_report_seconds": first_report,
        "html_bytes": html_bytes,
        "cli": (cli_plain, cli_html),
        "cpu_diff_samples": cpu_diff,
        "cpu_report_samples": cpu_report,
    }


def figures(raw: dict[str, Any]) -> dict[str, Any]:
    """The table's rows and the ratios, from the samples."""
    diff_only, with_report = raw["diff_only_samples"], raw["with_report_samples"]
    t_diff = min(diff_only)
    t_both = min(d + r for d, r in with_report)
    t_report = min(r for _, r in with_report)
    median_both = statistics.median(d + r for d, r in with_report)
    cli_plain, cli_html = raw["cli"]
    # The goal's figure: the report's own time against the diff's, each the best of its
    # samples (the sum's best also carries the diff's noise; shown too, with the medians).
    overhead = t_report / t_diff
    return {
        "seconds": {
            "diff_runs alone": t_diff,
            "diff_runs + write_diff_report": t_both,
            "write_diff_report alone (in the above)": t_report,
            "first report of the process (+ import)": raw["first_report_seconds"],
            "matplotlib import, fresh interpreter": import_seconds(),
            "CLI: trajtrack diff A B": cli_plain,
            "CLI: trajtrack diff A B --html FILE": cli_html,
        },
        "overhead": overhead,
        "overhead_best_of_sums": t_both / t_diff - 1,
        "overhead_median": median_both / statistics.median(diff_only) - 1,
        "cli_overhead": cli_html / cli_plain - 1,
        "cli_added_seconds": cli_html - cli_plain,
        "cpu_overhead": min(raw["cpu_report_samples"]) / min(raw["cpu_diff_samples"]),
        "cpu_overhead_median": statistics.median(raw["cpu_report_samples"])
        / statistics.median(raw["cpu_diff_samples"]),
        "goal": GOAL,
        "met": overhead <= GOAL,
    }


def print_table(report: dict[str, Any]) -> None:
    counts, rows = report["counts"], report["seconds"]
    print(
        f"report benchmark: 2 runs x {report['dumps_per_run']} dumps x "
        f"{report['dump_bytes'] / 1e6:.2f} MB, {counts['different']} different, "
        f"{counts['only_in_a']}+{counts['only_in_b']} in one run only; warm page cache; "
        f"best of {report['repeat']} (alternated)"
    )
    t_diff = rows["diff_runs alone"]
    print(f"{'measurement':<42} {'seconds':>9} {'vs diff':>8}")
    for name, seconds in rows.items():
        print(f"{name:<42} {seconds:9.3f} {seconds / t_diff:8.1%}")
    verdict = "met" if report["met"] else "MISSED"
    print(
        f"report on top of the diff: {report['overhead']:+.1%} (goal <= +{GOAL:.0%}: "
        f"{verdict}); diff + report vs diff: {report['overhead_best_of_sums']:+.1%} best, "
        f"{report['overhead_median']:+.1%} median; HTML {report['html_bytes'] / 1024:.0f} KiB"
    )
    print(
        f"CPU time (all threads): report {report['cpu_overhead']:+.1%} of the diff's, best; "
        f"{report['cpu_overhead_median']:+.1%}, medians"
    )
    print(
        f"whole command (process start, imports, diff, report): --html adds "
        f"{report['cli_overhead']:+.1%} ({report['cli_added_seconds']:+.3f} s)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100 dumps instead of 1,000")
    parser.add_argument("--dumps", type=int, default=None)
    parser.add_argument("--size-mb", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=5, help="best of N for each variant")
    parser.add_argument("--dir", default=None, help="where to write the runs (default: tmp)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as the trajtrack CLI does
    dumps = args.dumps or (100 if args.quick else 1000)
    size = int(args.size_mb * (1 << 20))
    raw = measure_all(dumps, size, args.repeat, args.dir)
    report = {
        "machine": machine(),
        "dumps_per_run": dumps,
        "dump_bytes": size,
        "repeat": args.repeat,
        "page_cache": "warm (every file read once before measuring)",
        **raw,
        **figures(raw),
    }
    print_table(report)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / ("report-quick.json" if args.quick else "report.json")
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
