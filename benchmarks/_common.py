"""Shared helpers for the benchmarks: payloads, statistics, machine info, result files."""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

# TRAJTRACK_BENCH_RESULTS redirects the result files (the smoke test writes into its tmp dir).
RESULTS = Path(os.environ.get("TRAJTRACK_BENCH_RESULTS") or Path(__file__).parent / "results")

PAYLOAD_BYTES = {"4KB": 4 << 10, "1MB": 1 << 20, "16MB": 16 << 20, "256MB": 256 << 20}


def payload(size: str) -> dict[str, torch.Tensor]:
    """A trajectory-like tensor dict of about *size* bytes (float32 observations + ints)."""
    total = PAYLOAD_BYTES[size]
    floats = total * 3 // 4 // 4
    ints = total // 4 // 8
    generator = torch.Generator().manual_seed(0)
    return {
        "obs": torch.randn(floats, generator=generator),
        "actions": torch.randint(0, 100, (ints,), generator=generator),
    }


def percentiles(samples: Sequence[float]) -> dict[str, float]:
    """p50/p99/mean/max of *samples* (seconds) in microseconds."""
    ordered = sorted(samples)
    n = len(ordered)
    return {
        "n": n,
        "p50_us": ordered[n // 2] * 1e6,
        "p99_us": ordered[min(n - 1, int(n * 0.99))] * 1e6,
        "mean_us": statistics.fmean(ordered) * 1e6,
        "max_us": ordered[-1] * 1e6,
    }


def spread(values: Sequence[float]) -> dict[str, float]:
    """min/median/max of repeated measurements."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def machine() -> dict[str, Any]:
    import anyio

    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "anyio": anyio.__version__ if hasattr(anyio, "__version__") else "?",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        with open("/proc/meminfo") as handle:
            info["mem_total"] = handle.readline().split(":")[1].strip()
    except OSError:
        pass
    return info


def write_results(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **data}, indent=2, sort_keys=True) + "\n")
    return path


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=False)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=False))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=False)) for row in rows]
    return "\n".join(out)


def rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


HDFS_SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "hdfs-test-cluster.sh"


def cluster_env(directory: Path) -> dict[str, str]:
    """Ports, URLs and users of a test cluster started by ``scripts/hdfs-test-cluster.sh``."""
    text = (directory / "cluster.env").read_text()
    return dict(re.findall(r"^(\w+)=(.*)$", text, re.MULTILINE))


def with_hdfs_cluster(
    run: Callable[[Path, bool], dict[str, Any]], cluster_dir: Path | None, quick: bool
) -> dict[str, Any]:
    """``run(cluster_dir, quick)`` on a running cluster, or on one started (and stopped) here."""
    if cluster_dir is not None:
        return run(cluster_dir, quick)
    subprocess.run([str(HDFS_SCRIPT), "install"], check=True)
    with tempfile.TemporaryDirectory(prefix="trajtrack-bench-hdfs-") as tmp:
        subprocess.run([str(HDFS_SCRIPT), "start", tmp], check=True)
        try:
            return run(Path(tmp), quick)
        finally:
            subprocess.run([str(HDFS_SCRIPT), "stop", tmp], check=False)
