"""``bench_diff.py`` on two revisions of trajtrack, interleaved, on the same data, in one run.

Usage::

    git worktree add /tmp/base fe7500c                 # the revision to compare against
    python benchmarks/compare_revisions.py --base-src /tmp/base/src [--rounds 3] [--hdfs]

The runs are written once (``--data``, kept for the next call). Then, round after round, this
checkout's ``benchmarks/bench_diff.py`` measures once with ``PYTHONPATH`` set to the base's
``src`` and once with this checkout's ``src`` (the order alternating between rounds), each in
its own process: same script, same files, same machine state, so what differs is the library.
Each figure is the best of the rounds; both tables are printed as ``bench_diff.py`` prints
them, then the ratios. Cold-cache rows are measured when this process may drop the page cache
(root); with ``--hdfs`` a test cluster is started once and the HDFS rows are measured too.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import bench_diff
from benchmarks._common import HDFS_SCRIPT

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "compare_revisions.json"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-src", type=Path, default=Path("/tmp/base/src"))
    parser.add_argument("--base-name", default="fe7500c (before)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dumps", type=int, default=1000)
    parser.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "tt-diff-data")
    parser.add_argument("--hdfs", action="store_true", help="also on the HDFS test cluster")
    parser.add_argument("--no-cold", action="store_true", help="skip the cold-cache rows")
    args = parser.parse_args()
    if not (args.base_src / "trajtrack" / "__init__.py").exists():
        parser.error(f"no trajtrack under {args.base_src} (git worktree add /tmp/base fe7500c)")
    revisions = {args.base_name: args.base_src, "this checkout (after)": ROOT / "src"}
    extra = ["--dumps", str(args.dumps), "--data", str(args.data), "--repeat", "1"]
    extra += ["--no-cold"] if args.no_cold else []
    with tempfile.TemporaryDirectory(prefix="tt-compare-") as tmp:
        cluster = _start_cluster(Path(tmp) / "cluster") if args.hdfs else None
        try:
            if cluster is None:
                extra.append("--no-hdfs")
            else:
                extra += ["--cluster-dir", str(cluster), "--hdfs-data", "compare-revisions"]
            reports = _rounds(revisions, extra, args.rounds, Path(tmp))
        finally:
            if cluster is not None:
                subprocess.run([str(HDFS_SCRIPT), "stop", str(cluster)], check=False)
    best = {name: _best(runs) for name, runs in reports.items()}
    for name, report in best.items():
        print(f"\n=== {name}: {report['machine']['trajtrack']}, best of {args.rounds} rounds")
        bench_diff.print_report(report, args.rounds)
    _print_ratios(best)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"best": best, "rounds": reports}, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    return 0


def _start_cluster(directory: Path) -> Path:
    subprocess.run([str(HDFS_SCRIPT), "install"], check=True)
    subprocess.run([str(HDFS_SCRIPT), "start", str(directory)], check=True)
    return directory


def _rounds(
    revisions: dict[str, Path], extra: list[str], rounds: int, tmp: Path
) -> dict[str, list[dict[str, Any]]]:
    reports: dict[str, list[dict[str, Any]]] = {name: [] for name in revisions}
    names = list(revisions)
    for round_ in range(rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            out = tmp / f"round{round_}.json"
            env = {**os.environ, "PYTHONPATH": str(revisions[name])}
            command = [sys.executable, str(ROOT / "benchmarks" / "bench_diff.py"), *extra]
            command += ["--json", str(out)]
            print(f"--- round {round_ + 1}/{rounds}: {name}", flush=True)
            subprocess.run(command, cwd=ROOT, env=env, check=True)
            reports[name].append(json.loads(out.read_text()))
    return reports


def _best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The first run's report with every time the best of the runs, every check all runs'."""
    best = copy.deepcopy(runs[0])
    best["seconds"] = _min_rows(r["seconds"] for r in runs)
    if best.get("cold_cache"):
        best["cold_cache"]["seconds"] = _min_rows(r["cold_cache"]["seconds"] for r in runs)
    if best.get("hdfs"):
        best["hdfs"]["seconds"] = _min_rows(r["hdfs"]["seconds"] for r in runs)
        best["hdfs"]["each_file_read_once"] = all(r["hdfs"]["each_file_read_once"] for r in runs)
    for key in ("diff_each_file_read_once", "diff_full_compare_each_file_read_once", "diff_equal"):
        best[key] = all(r[key] for r in runs)
    return best


def _min_rows(rows: Any) -> dict[str, float]:
    rows = list(rows)
    return {name: min(r[name] for r in rows) for name in rows[0]}


def _print_ratios(best: dict[str, dict[str, Any]]) -> None:
    before, after = best.values()
    print("\nafter vs before (seconds before / seconds after: above 1.00 is faster)")
    sections = [("warm", "seconds"), ("cold", "cold_cache"), ("HDFS", "hdfs")]
    for label, key in sections:
        rows_before = before.get(key) if key != "seconds" else before
        rows_after = after.get(key) if key != "seconds" else after
        if not rows_before or not rows_after:
            continue
        for name, seconds in rows_after["seconds"].items():
            ratio = rows_before["seconds"][name] / seconds
            print(
                f"{label:<5} {name:<40} {rows_before['seconds'][name]:7.3f} s -> "
                f"{seconds:7.3f} s  {ratio:5.2f}x"
            )


if __name__ == "__main__":
    sys.exit(main())
