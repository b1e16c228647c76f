"""Core benchmarks: caller latency, local throughput, event-loop lag, memory bound.

Every figure is measured in one run, side by side with its baseline:

* latency of one dump as the caller sees it: ``await Tracker.dump``, ``trajtrack.dump_data``
  (sync shim) and plain synchronous ``torch.save(obj, path)``;
* the caller's time per dump in a paced stream of 16 MB and 256 MB dumps whose files stay (the
  disk writing back the earlier ones meanwhile, as in training), against ``torch.save(obj,
  path)`` at the same pace;
* end-to-end throughput to local disk (until everything is committed) next to the raw bound of
  the same work done inline: ``torch.save`` to a temp file + rename in a tight loop, and for
  large payloads a ``dd``-style write of the same bytes; for 4 KB and 1 MB also the common
  hand-rolled writer, a ``ThreadPoolExecutor(4)`` fed from the dumping loop whose tasks each
  ``torch.save`` to a temp name + rename (open-instruct's way of saving rollouts); each writer
  three times (``--rounds``), alternated, medians reported (write rates on a VM's disk swing by
  2x within minutes, so one measurement of each, seconds apart, can show any ratio);
* the lag of a 1 ms ticker task while 256 MB payloads are dumped, trajtrack against the naive
  design (``to_thread(torch.save -> BytesIO)`` then a file write);
* peak RSS while 2 GB of dumps are offered to a deliberately slow storage with
  ``max_pending_bytes = 256 MB``.

Run: ``python benchmarks/bench_core.py [--quick]``. Prints tables, writes
``benchmarks/results/core.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import gc
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (
    PAYLOAD_BYTES,
    payload,
    percentiles,
    rss_bytes,
    spread,
    table,
    write_results,
)
from trajtrack import SyncTracker, Tracker

# --------------------------------------------------------------------------- latency


def counts(quick: bool) -> dict[str, int]:
    if quick:
        return {"4KB": 200, "1MB": 20, "16MB": 3, "256MB": 1}
    return {"4KB": 3000, "1MB": 300, "16MB": 30, "256MB": 4}


async def latency_tracker(obj: Any, n: int, root: Path, pause: float = 0.0) -> list[float]:
    samples = []
    async with Tracker(root, max_pending_bytes=2 << 30) as tracker:
        for i in range(n):
            start = time.perf_counter()
            await tracker.dump(obj, f"d{i}")
            samples.append(time.perf_counter() - start)
            if pause or i % 64 == 63:
                await asyncio.sleep(pause)  # a real rollouter yields between dumps
    return samples


def latency_shim(obj: Any, n: int, root: Path) -> list[float]:
    tracker = SyncTracker(str(root), max_pending_bytes=2 << 30)
    samples = []
    try:
        for i in range(n):
            start = time.perf_counter()
            tracker.dump(obj, f"d{i}")
            samples.append(time.perf_counter() - start)
    finally:
        tracker.close(timeout=600)
    return samples


def latency_torch_save(obj: Any, n: int, root: Path, pause: float = 0.0) -> list[float]:
    root.mkdir(parents=True, exist_ok=True)
    samples = []
    for i in range(n):
        start = time.perf_counter()
        torch.save(obj, root / f"d{i}.pth")
        samples.append(time.perf_counter() - start)
        if pause:
            time.sleep(pause)
    return samples


def bench_latency(quick: bool, scratch: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    rows = []
    for size, n in counts(quick).items():
        obj = payload(size)
        measured: dict[str, Any] = {}
        # Alternate the order per size so that page-cache warmth does not favour one side.
        order = ["tracker", "shim", "torch_save"]
        if size in ("1MB", "256MB"):
            order.reverse()
        for kind in order:
            root = scratch / f"lat-{size}-{kind}"
            if kind == "tracker":
                samples = asyncio.run(latency_tracker(obj, n, root))
            elif kind == "shim":
                samples = latency_shim(obj, n, root)
            else:
                samples = latency_torch_save(obj, n, root)
            measured[kind] = percentiles(samples)
            subprocess.run(["rm", "-rf", str(root)], check=True)
        results[size] = measured
        base = measured["torch_save"]["p50_us"]
        for kind in ("tracker", "shim", "torch_save"):
            m = measured[kind]
            rows.append(
                [
                    size,
                    {"tracker": "await Tracker.dump", "shim": "dump_data (shim)"}.get(
                        kind, "torch.save (sync)"
                    ),
                    f"{m['p50_us']:.1f}",
                    f"{m['p99_us']:.1f}",
                    f"{base / m['p50_us']:.1f}x",
                ]
            )
    print("\nCaller-visible latency of one dump (us), local disk")
    print(table(rows, ["payload", "call", "p50", "p99", "p50 vs torch.save"]))
    return results


# --------------------------------------------------------------------------- throughput


async def throughput_tracker(obj: Any, n: int, root: Path, workers: int) -> float:
    start = time.perf_counter()
    async with Tracker(root, workers=workers, max_pending_bytes=1 << 30) as tracker:
        for i in range(n):
            await tracker.dump(obj, f"d{i}")
        await tracker.flush()
    return time.perf_counter() - start


def throughput_inline(obj: Any, n: int, root: Path) -> float:
    """The raw bound of the same work done inline: torch.save to a temp file + rename."""
    root.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    for i in range(n):
        tmp = root / f".d{i}.tmp"
        torch.save(obj, tmp)
        os.replace(tmp, root / f"d{i}.pth")
    return time.perf_counter() - start


def throughput_thread_pool(obj: Any, n: int, root: Path, *, copy: bool = False) -> float:
    """A ``ThreadPoolExecutor(4)`` fed from the loop, each task ``torch.save`` to a temp name +
    rename, timed until every task is done. No snapshot: the loop never mutates *obj*; with
    *copy*, the loop clones the tensors before each submit, as a caller that goes on to
    mutate them must (the tracker's snapshot)."""
    root.mkdir(parents=True, exist_ok=True)

    def save(i: int, item: Any) -> None:
        tmp = root / f".d{i}.tmp"
        torch.save(item, tmp)
        os.replace(tmp, root / f"d{i}.pth")

    def snapshot() -> Any:
        return {key: value.clone() for key, value in obj.items()} if copy else obj

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(save, i, snapshot()) for i in range(n)]
        for future in futures:
            future.result()
    return time.perf_counter() - start


def throughput_raw_bytes(data: bytes, n: int, root: Path) -> float:
    """dd-style sequential write of already-serialized bytes (no fsync, like the tracker)."""
    root.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    for i in range(n):
        with open(root / f"d{i}.bin", "wb", buffering=0) as handle:
            view = memoryview(data)
            for offset in range(0, len(view), 1 << 20):
                handle.write(view[offset : offset + (1 << 20)])
    return time.perf_counter() - start


_OURS = ("tracker",)  # the rows that get ratios against the baselines
_WRITER_LABELS = {
    "tracker": "trajtrack (4 workers)",
    "inline": "inline torch.save+rename",
    "pool": "thread pool (4) torch.save+rename",
    "pool_copy": "thread pool (4), loop clones first",
    "raw": "raw write of same bytes",
}


# The writers measured per payload; the first is measured first in even rounds, last in odd.
_KINDS = {
    "4KB": ("tracker", "inline", "pool"),
    "1MB": ("inline", "tracker", "raw", "pool", "pool_copy"),
}


def bench_throughput(quick: bool, scratch: Path, rounds: int = 3) -> dict[str, Any]:
    """Each writer *rounds* times, alternated (the order reversed every other round), so that
    the disk's state on this VM, which swings write rates by 2x within minutes, reaches every
    writer alike; medians are reported, with each round's tracker ratio."""
    plan = {"4KB": 3000, "1MB": 300, "16MB": 40, "256MB": 4}
    if quick:
        plan = {"4KB": 300, "1MB": 30, "16MB": 4, "256MB": 1}
    results: dict[str, Any] = {}
    rows = []
    for size, n in plan.items():
        obj = payload(size)
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        data = buffer.getvalue()
        mb = len(data) * n / 1e6
        kinds = _KINDS.get(size, ("inline", "tracker", "raw"))
        measured: dict[str, list[float]] = {kind: [] for kind in kinds}
        # One unmeasured round of each writer first: on a VM the first touch of memory the
        # guest has not used for a while (page cache, allocator arenas) costs several times a
        # later one, whichever writer it is. A training process dumps in steady state.
        for kind in kinds:
            root = scratch / f"tp-{size}-{kind}-warm"
            _one_throughput(kind, obj, data, n, root)
            if len(data) > 64 << 10:  # small files stay until the end (see below)
                subprocess.run(["rm", "-rf", str(root)], check=True)
                os.sync()
        for round_ in range(rounds):
            for kind in kinds if round_ % 2 == 0 else kinds[::-1]:
                root = scratch / f"tp-{size}-{kind}-{round_}"
                measured[kind].append(_one_throughput(kind, obj, data, n, root))
                if len(data) > 64 << 10:  # larger files: their dirty pages go at once
                    subprocess.run(["rm", "-rf", str(root)], check=True)
                    # ... and the deletion settles before the next writer: otherwise the
                    # writeback of the deleted files slows whichever writer comes next.
                    os.sync()
        # Many small files are deleted only now: ext4 scans the inode table for recently
        # deleted inodes when it allocates new ones, so thousands of files deleted between two
        # writers' rounds make the next writer's file creations dearer (perf:
        # recently_deleted), whichever writer comes next.
        subprocess.run(["rm", "-rf", *map(str, scratch.glob(f"tp-{size}-*"))], check=True)
        os.sync()
        times = {kind: statistics.median(seconds) for kind, seconds in measured.items()}
        entry = {
            k: {"seconds": v, "dumps_per_s": n / v, "mb_per_s": mb / v, "rounds": measured[k]}
            for k, v in times.items()
        }
        per_round = [i / t for i, t in zip(measured["inline"], measured["tracker"], strict=True)]
        results[size] = {
            "n": n,
            "bytes_per_dump": len(data),
            "rounds": rounds,
            "tracker_vs_inline_per_round": per_round,
            **_vs_pool(measured),
            **entry,
        }
        bound = times.get("raw", times["inline"])
        for kind, seconds in times.items():
            spread = min(n / t for t in measured[kind]), max(n / t for t in measured[kind])
            rows.append(
                [
                    size,
                    _WRITER_LABELS[kind],
                    f"{n / seconds:.0f}",
                    f"{spread[0]:.0f}-{spread[1]:.0f}",
                    f"{mb / seconds:.0f}",
                    f"{bound / seconds * 100:.0f}%" if kind in _OURS else "",
                    f"{times['inline'] / seconds:.2f}x" if kind in _OURS else "",
                    f"{times['pool'] / seconds:.2f}x" if kind in _OURS and "pool" in times else "",
                ]
            )
    print(f"\nEnd-to-end throughput to local disk (until committed), median of {rounds} rounds")
    headers = ["payload", "writer", "dumps/s", "rounds", "MB/s", "tracker vs bound", "vs inline"]
    headers.append("vs thread pool")
    print(table(rows, headers))
    return results


def _vs_pool(measured: dict[str, list[float]]) -> dict[str, list[float]]:
    """Each round's tracker rate over the thread pool's, where the pool was measured."""
    if "pool" not in measured:
        return {}
    pairs = zip(measured["pool"], measured["tracker"], strict=True)
    return {"tracker_vs_pool_per_round": [pool / tracker for pool, tracker in pairs]}


def _one_throughput(kind: str, obj: Any, data: bytes, n: int, root: Path) -> float:
    # Every writer starts from a just-collected heap: torch leaves ~170,000 objects tracked by
    # the garbage collector, and a full collection of them would otherwise land in whichever
    # round crosses the collector's threshold (a third of a 1 MB round, seen with gc.callbacks).
    gc.collect()
    if kind == "tracker":
        return asyncio.run(throughput_tracker(obj, n, root, 4))
    if kind == "inline":
        return throughput_inline(obj, n, root)
    if kind in ("pool", "pool_copy"):
        return throughput_thread_pool(obj, n, root, copy=kind == "pool_copy")
    return throughput_raw_bytes(data, n, root)


# --------------------------------------------------------------------------- event-loop lag


async def _lag_during(work: Any) -> list[float]:
    lags: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            start = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - start - 0.001)

    task = asyncio.ensure_future(ticker())
    await asyncio.sleep(0.05)
    try:
        await work()
    finally:
        done.set()
        await task
    return lags


async def lag_tracker(obj: Any, n: int, root: Path) -> list[float]:
    async def work() -> None:
        async with Tracker(root, workers=2, max_pending_bytes=1 << 30) as tracker:
            for i in range(n):
                await tracker.dump(obj, f"d{i}")
            await tracker.flush()

    return await _lag_during(work)


async def lag_naive(obj: Any, n: int, root: Path) -> list[float]:
    await anyio.to_thread.run_sync(lambda: root.mkdir(parents=True, exist_ok=True))

    def serialize() -> bytes:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        return buffer.getvalue()

    def write(path: Path, data: bytes) -> None:
        path.write_bytes(data)

    async def work() -> None:
        for i in range(n):
            data = await anyio.to_thread.run_sync(serialize)
            await anyio.to_thread.run_sync(write, root / f"d{i}.pth", data)

    return await _lag_during(work)


def bench_lag(quick: bool, scratch: Path) -> dict[str, Any]:
    obj = payload("256MB")
    reps = 1 if quick else 3
    n = 1 if quick else 3
    results: dict[str, Any] = {"naive": [], "tracker": []}
    for rep in range(reps):
        for kind in ("naive", "tracker") if rep % 2 == 0 else ("tracker", "naive"):
            root = scratch / f"lag-{kind}-{rep}"
            runner = lag_tracker if kind == "tracker" else lag_naive
            lags = asyncio.run(runner(obj, n, root))
            stats = percentiles(lags)
            results[kind].append({"max_ms": stats["max_us"] / 1e3, "p99_ms": stats["p99_us"] / 1e3})
            subprocess.run(["rm", "-rf", str(root)], check=True)
    rows = []
    for kind in ("tracker", "naive"):
        maxes = [r["max_ms"] for r in results[kind]]
        p99s = [r["p99_ms"] for r in results[kind]]
        results[kind + "_summary"] = {"max_ms": spread(maxes), "p99_ms": spread(p99s)}
        rows.append(
            [
                "trajtrack" if kind == "tracker" else "naive: to_thread(torch.save->BytesIO)+write",
                f"{min(maxes):.1f} / {max(maxes):.1f}",
                f"{min(p99s):.2f} / {max(p99s):.2f}",
            ]
        )
    print(f"\nEvent-loop lag of a 1 ms ticker while dumping {n} x 256 MB ({reps} repetitions)")
    print(table(rows, ["design", "max lag ms (best / worst)", "p99 lag ms (best / worst)"]))
    return results


# --------------------------------------------------------------------------- paced stream

PACED = {"16MB": (30, 0.05), "256MB": (6, 0.5)}  # dumps, and seconds between two of them


def bench_paced(quick: bool, scratch: Path) -> dict[str, Any]:
    """The caller's time per dump in a steady stream of large dumps whose files stay, as in
    training: the disk writes back the earlier files meanwhile (a run's dumps stay under the
    kernel's dirty-page limits, so that the disk keeps up), which the back-to-back latency
    above (its files deleted between writers) mostly misses. Against ``torch.save(obj, path)``
    at the same pace; the two alternate over two rounds, p50 of all their dumps."""
    results: dict[str, Any] = {}
    rows = []
    for size, (n, pause) in PACED.items():
        n = 2 if quick else n
        obj = payload(size)
        measured: dict[str, list[float]] = {"tracker": [], "torch_save": []}
        for round_ in range(1 if quick else 2):
            for kind in ("tracker", "torch_save")[:: 1 if round_ % 2 == 0 else -1]:
                root = scratch / f"paced-{size}-{kind}-{round_}"
                os.sync()  # each run from a disk that wrote back the runs before it
                if kind == "tracker":
                    measured[kind] += asyncio.run(latency_tracker(obj, n, root, pause))
                else:
                    measured[kind] += latency_torch_save(obj, n, root, pause)
        subprocess.run(["rm", "-rf", *map(str, scratch.glob(f"paced-{size}-*"))], check=True)
        os.sync()
        stats = {kind: percentiles(samples) for kind, samples in measured.items()}
        results[size] = {"dumps": n, "pause_s": pause, **stats}
        ours, base = stats["tracker"]["p50_us"] / 1e3, stats["torch_save"]["p50_us"] / 1e3
        rows.append([size, f"{pause}", f"{ours:.1f}", f"{base:.1f}", f"{base / ours:.1f}x"])
    print("\nCaller's time per dump in a paced stream of large dumps, files kept (ms, p50)")
    print(table(rows, ["payload", "pause s", "await Tracker.dump", "torch.save", "ratio"]))
    return results


# --------------------------------------------------------------------------- memory bound


class SlowNullStorage:
    """A storage that takes its time and keeps nothing: what is pending stays in the tracker."""

    url = "slow-null://"
    spool_dir = None  # large payloads spool in the system's temporary directory

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def local_path(self, path: str) -> None:
        return None

    async def prepare(self) -> None:
        return None

    async def write_atomic_many(
        self, items: Any, *, overwrite: bool, done: Any = None
    ) -> list[Any]:
        from trajtrack.backends._protocol import write_each_concurrently

        return await write_each_concurrently(self, items, overwrite=overwrite, done=done)

    async def write_atomic(self, path: str, payload: Any, *, overwrite: bool) -> Any:
        from trajtrack.backends._protocol import ChecksumWriter

        class Sink:
            def write(self, data: Any) -> int:
                return len(memoryview(data))

            def flush(self) -> None:
                pass

        def run() -> Any:
            time.sleep(self.seconds)
            writer = ChecksumWriter(Sink())  # type: ignore[arg-type]
            payload.write_to(writer)
            return writer.result()

        return await anyio.to_thread.run_sync(run)

    async def read(self, path: str) -> bytes:
        raise FileNotFoundError(path)

    async def list(self, prefix: str = "") -> list[Any]:
        return []

    async def stat(self, path: str) -> Any:
        return None

    async def delete(self, path: str) -> None:
        return None

    async def aclose(self) -> None:
        return None


def memory_child(total_mb: int, item_mb: int, budget_mb: int) -> None:
    obj = {"x": torch.randn(item_mb << 18)}  # item_mb MiB of float32
    baseline = rss_bytes()
    peak = baseline
    stop = False

    async def main() -> None:
        nonlocal peak, stop

        async def sampler() -> None:
            nonlocal peak
            while not stop:
                peak = max(peak, rss_bytes())
                await asyncio.sleep(0.01)

        task = asyncio.ensure_future(sampler())
        storage = SlowNullStorage(0.05)
        async with Tracker(
            "slow-null://", storage=storage, max_pending_bytes=budget_mb << 20, record=False
        ) as tracker:
            for i in range(total_mb // item_mb):
                await tracker.dump(obj, f"d{i}")
            await tracker.flush()
        stop = True
        await task

    asyncio.run(main())
    print(f"{baseline} {peak}")


def bench_memory(quick: bool) -> dict[str, Any]:
    total, item, budget = (512, 32, 128) if quick else (2048, 64, 256)
    out = subprocess.run(
        [sys.executable, __file__, "--memory-child", str(total), str(item), str(budget)],
        capture_output=True,
        text=True,
        check=True,
        timeout=900,
    )
    baseline, peak = (int(x) for x in out.stdout.split())
    bound = baseline + (budget << 20) + (item << 20) + (100 << 20)
    result = {
        "offered_mb": total,
        "payload_mb": item,
        "max_pending_mb": budget,
        "baseline_mb": baseline / 2**20,
        "peak_mb": peak / 2**20,
        "bound_mb": bound / 2**20,
        "within_bound": peak <= bound,
    }
    print(f"\nPeak RSS offering {total} MB in {item} MB dumps to a slow storage")
    print(
        table(
            [
                [
                    f"{budget} MB",
                    f"{result['baseline_mb']:.0f}",
                    f"{result['peak_mb']:.0f}",
                    f"{result['bound_mb']:.0f}",
                    "yes" if result["within_bound"] else "NO",
                ]
            ],
            ["max_pending_bytes", "baseline MB", "peak MB", "bound MB", "within"],
        )
    )
    return result


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--only", nargs="*", help="latency, paced, throughput, lag, memory")
    parser.add_argument("--scratch", help="scratch directory on the disk to measure")
    parser.add_argument(
        "--rounds", type=int, default=None, help="throughput rounds per writer (default 3, quick 1)"
    )
    parser.add_argument("--memory-child", nargs=3, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_child:
        memory_child(*args.memory_child)
        return 0
    chosen = set(args.only or ["latency", "paced", "throughput", "lag", "memory"])
    results: dict[str, Any] = {"quick": args.quick, "payload_bytes": PAYLOAD_BYTES}
    with tempfile.TemporaryDirectory(dir=args.scratch, prefix="trajtrack-bench-") as tmp:
        scratch = Path(tmp)
        if "latency" in chosen:
            results["latency"] = bench_latency(args.quick, scratch)
        if "paced" in chosen:
            results["paced"] = bench_paced(args.quick, scratch)
        if "throughput" in chosen:
            rounds = args.rounds or (1 if args.quick else 3)
            results["throughput"] = bench_throughput(args.quick, scratch, rounds)
        if "lag" in chosen:
            results["event_loop_lag"] = bench_lag(args.quick, scratch)
        if "memory" in chosen:
            results["memory"] = bench_memory(args.quick)
    path = write_results("core-quick" if args.quick else "core", results)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
