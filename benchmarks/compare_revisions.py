"""``bench_diff.py``'s cases on two revisions of trajtrack, interleaved, on the same data.

Usage::

    git worktree add /tmp/base fe7500c                 # the revision to compare against
    python benchmarks/compare_revisions.py --base-src /tmp/base/src [--rounds 8] [--hdfs]

The runs are written once (``--data`` keeps them for the next call; ``--hdfs`` starts the HDFS
test cluster and writes its runs too). One measurement process per revision
(``benchmarks/_revision_server.py``, with ``PYTHONPATH`` set to that revision's ``src``) runs
bench_diff's own measurement functions on request. Round after round, each case is measured
on one revision and then on the other (the order alternating), seconds apart, so that a busy
machine slows both alike; each figure is the best of the rounds. Phases: warm page cache (every
file read first), the HDFS test cluster, then a cold page cache (dropped before each
measurement; root only). Both tables are printed as ``bench_diff.py`` prints them, then the
ratios of the best and of the median of the rounds (on a shared machine one lucky round can
set a best); everything goes to ``benchmarks/results/compare_revisions.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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
ROWS = {  # the server's case names -> bench_diff's row names
    "raw threads": "raw threads (open/read)",
    "raw storage": "raw storage (LocalStorage.read)",
    "diff, identical runs (byte-equal pairs)": "diff, identical runs (byte-equal pairs)",
    "diff, every dump differs (full compare)": "diff, every dump differs (full compare)",
}
HDFS_ROWS = {**ROWS, "raw storage": "raw storage (WebHDFS read)"}
HDFS_DUMPS = bench_diff.HDFS_DUMPS


class Revision:
    """A measurement process for one revision's ``src``."""

    def __init__(self, src: Path, local: tuple[Path, ...], hdfs: tuple[str, ...] | None) -> None:
        command = [sys.executable, str(ROOT / "benchmarks" / "_revision_server.py")]
        command += ["--local", *map(str, local)] + (["--hdfs", *hdfs] if hdfs else [])
        env = {**os.environ, "PYTHONPATH": str(src)}
        self.process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.trajtrack = self._answer()["ready"]

    def measure(self, case: str, where: str, cold: bool = False) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"case": case, "where": where, "cold": cold}) + "\n")
        self.process.stdin.flush()
        return self._answer()

    def _answer(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError("a measurement process exited")
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-src", type=Path, default=Path("/tmp/base/src"))
    parser.add_argument("--base-name", default="fe7500c (before)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--dumps", type=int, default=1000)
    parser.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "tt-diff-data")
    parser.add_argument("--hdfs", action="store_true", help="also on the HDFS test cluster")
    parser.add_argument("--no-cold", action="store_true", help="skip the cold-cache rows")
    args = parser.parse_args()
    if not (args.base_src / "trajtrack" / "__init__.py").exists():
        parser.error(f"no trajtrack under {args.base_src} (git worktree add /tmp/base fe7500c)")
    args.data.mkdir(parents=True, exist_ok=True)
    local = bench_diff.local_runs(args.data, args.dumps, 1 << 20)
    with tempfile.TemporaryDirectory(prefix="tt-compare-") as tmp:
        cluster = Path(tmp) / "cluster"
        if args.hdfs:
            subprocess.run([str(HDFS_SCRIPT), "install"], check=True)
            subprocess.run([str(HDFS_SCRIPT), "start", str(cluster)], check=True)
        try:
            hdfs = bench_diff.hdfs_runs(cluster, HDFS_DUMPS, "compare") if args.hdfs else None
            sources = {args.base_name: args.base_src, "this checkout (after)": ROOT / "src"}
            revisions = {name: Revision(src, local, hdfs) for name, src in sources.items()}
            try:
                measured = _measure(revisions, args, hdfs is not None)
            finally:
                for revision in revisions.values():
                    revision.close()
        finally:
            if args.hdfs:
                subprocess.run([str(HDFS_SCRIPT), "stop", str(cluster)], check=False)
    reports = {name: _report(measured, name, args) for name in revisions}
    for name, report in reports.items():
        print(f"\n=== {name}: {revisions[name].trajtrack}, best of {args.rounds} rounds")
        bench_diff.print_report(report, args.rounds)
    _print_ratios(measured)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"best": reports, "measured": measured}, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    return 0


def _measure(
    revisions: dict[str, Revision], args: argparse.Namespace, hdfs: bool
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """``{phase/case: {revision: [one answer per round]}}``."""
    measured: dict[str, dict[str, list[dict[str, Any]]]] = {}
    first = next(iter(revisions.values()))
    phases = [("warm", "local", False, list(ROWS))]
    if hdfs:
        phases.append(("hdfs", "hdfs", False, list(ROWS)[1:]))
    if not args.no_cold and bench_diff.drop_caches():
        phases.append(("cold", "local", True, list(ROWS)))
    for phase, where, cold, cases in phases:
        if not cold:
            first.measure("raw storage", where)  # read every file of a and b once: warm cache
            first.measure("diff, every dump differs (full compare)", where)  # ... and of c
        for round_ in range(args.rounds):
            print(f"--- {phase}: round {round_ + 1}/{args.rounds}", flush=True)
            for case in cases:
                names = list(revisions) if round_ % 2 == 0 else list(revisions)[::-1]
                for name in names:
                    answer = revisions[name].measure(case, where, cold)
                    measured.setdefault(f"{phase}/{case}", {}).setdefault(name, []).append(answer)
    return measured


def _report(measured: dict[str, Any], name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One revision's figures, shaped as bench_diff's report (each the best of the rounds)."""

    def best(phase: str, rows: dict[str, str]) -> dict[str, float]:
        return {
            row: min(a["seconds"] for a in measured[f"{phase}/{case}"][name])
            for case, row in rows.items()
            if f"{phase}/{case}" in measured
        }

    diffs = [
        answer
        for case in list(ROWS)[2:]
        for phase in ("warm", "cold")
        for answer in measured.get(f"{phase}/{case}", {}).get(name, [])
    ]
    same = measured["warm/diff, identical runs (byte-equal pairs)"][name][0]
    full = measured["warm/diff, every dump differs (full compare)"][name][0]
    report: dict[str, Any] = {
        "seconds": best("warm", ROWS),
        "total_bytes": measured["warm/raw threads"][name][0]["total_bytes"],
        "files": measured["warm/raw threads"][name][0]["files"],
        "concurrency": 16,
        "dumps_per_run": args.dumps,
        "dump_bytes": 1 << 20,
        "cold_cache": {"seconds": best("cold", ROWS)} if "cold/raw threads" in measured else None,
        "hdfs": None,
        "diff_each_file_read_once": all(a["each_file_read_once"] for a in diffs),
        "diff_files_read": same["files_read"],
        "diff_equal": all(a["equal"] for a in measured["warm/" + list(ROWS)[2]][name]),
        "diff_full_compare_different_dumps": full["different"],
        "diff_full_compare_each_file_read_once": full["each_file_read_once"],
        "machine": {"trajtrack": name},
    }
    if "hdfs/raw storage" in measured:
        hdfs_diffs = [a for c in list(ROWS)[2:] for a in measured[f"hdfs/{c}"][name]]
        report["hdfs"] = {
            "seconds": best("hdfs", {k: v for k, v in HDFS_ROWS.items() if k != "raw threads"}),
            "total_bytes": measured["hdfs/raw storage"][name][0]["total_bytes"],
            "dumps_per_run": HDFS_DUMPS,
            "each_file_read_once": all(a["each_file_read_once"] for a in hdfs_diffs),
        }
    return report


def _print_ratios(measured: dict[str, dict[str, list[dict[str, Any]]]]) -> None:
    """Per row: the best of the rounds and their median, before -> after."""
    print(
        "\nafter vs before: seconds before / seconds after (above 1.00: faster), for the best of "
        "the rounds and for their median"
    )
    print(f"{'':5} {'measurement':<40} {'best':>21} {'':6} {'median':>21}")
    for key, by_revision in measured.items():
        phase, case = key.split("/", 1)
        row = (HDFS_ROWS if phase == "hdfs" else ROWS)[case]
        (before, *_), (after, *_) = (
            [[a["seconds"] for a in answers]] for answers in by_revision.values()
        )
        cells = []
        for pick in (min, statistics.median):
            was, now = pick(before), pick(after)
            cells.append(f"{was:7.3f} s -> {now:7.3f} s {was / now:5.2f}x")
        print(f"{phase:<5} {row:<40} {cells[0]}  {cells[1]}")


if __name__ == "__main__":
    sys.exit(main())
