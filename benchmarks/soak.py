"""Soak run (issue 8, case 4): many random-size dumps from many tasks, with random flushes.

Checks, and exits non-zero when one fails:

* every dump is committed, and verified against the record (``.trajtrack/records``): each
  recorded file has the recorded size and CRC-32, every dumped name is recorded exactly once,
  and a sample of dumps loads back equal to its source;
* the process's RSS, sampled every 20 ms, stays within ``baseline + budget + in-flight sources``
  (each task holds at most one source object, plus one being generated, plus slack);
* the tracker's pending bytes never exceed the byte budget (one oversize item aside);
* no file-descriptor or thread growth: the maxima over the second half of the run do not exceed
  those of the first half (plus a small margin for idle worker-thread churn).

Verified files are deleted as the run goes (``--keep`` keeps them), so the long form needs disk
for the budget only. Long form (the issue's numbers, the defaults)::

    python benchmarks/soak.py            # 20,000 dumps, 1 KB-8 MB, 32 tasks
    python benchmarks/soak.py --dumps 400 --max-size 1MiB --budget 16MiB   # the CI short form
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import random
import sys
import tempfile
import threading
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import torch

import trajtrack
from trajtrack.layouts.records import RECORDS_PREFIX, decode_segment

_PAGE = os.sysconf("SC_PAGE_SIZE")
_SLACK = 192 << 20  # allocator and interpreter noise on top of what the run holds on purpose
_THREAD_MARGIN = 4
_FD_MARGIN = 4


def parse_size(text: str) -> int:
    units = {"kib": 1 << 10, "kb": 1 << 10, "mib": 1 << 20, "mb": 1 << 20, "gib": 1 << 30}
    lowered = text.strip().lower()
    for unit, factor in units.items():
        if lowered.endswith(unit):
            return int(float(lowered[: -len(unit)]) * factor)
    return int(lowered)


def rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * _PAGE


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def payload(name: str, size: int) -> dict[str, Any]:
    seed = zlib.crc32(name.encode())
    data = bytearray(np.random.default_rng(seed).bytes(size))
    return {"name": name, "data": torch.frombuffer(data, dtype=torch.uint8)}


@dataclass
class Samples:
    max_rss: int = 0
    max_pending_bytes: int = 0
    oversize_seen: bool = False
    threads: list[int] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)


class Sampler:
    """Samples RSS, pending bytes, threads and fds from a thread every 20 ms."""

    def __init__(self, tracker: trajtrack.Tracker, budget: int) -> None:
        self.samples = Samples()
        self._tracker = tracker
        self._budget = budget
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def __enter__(self) -> Samples:
        self._thread.start()
        return self.samples

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        s = self.samples
        while not self._stop.wait(0.02):
            s.max_rss = max(s.max_rss, rss())
            stats = self._tracker.statistics()
            s.max_pending_bytes = max(s.max_pending_bytes, stats.pending_bytes)
            if stats.pending_items == 1 and stats.pending_bytes > self._budget:
                s.oversize_seen = True
            s.threads.append(threading.active_count())
            s.fds.append(open_fds())


class Verifier:
    """Checks committed dumps against the record segments, then deletes them (disk bound)."""

    def __init__(self, dest: Path, keep: bool, sample_every: int) -> None:
        self.dest = dest
        self.keep = keep
        self.sample_every = sample_every
        self.seen_segments: set[str] = set()
        self.verified: dict[str, int] = {}
        self.errors: list[str] = []
        self.loaded = 0

    def run(self) -> None:
        folder = self.dest / RECORDS_PREFIX
        for segment in sorted(folder.glob("*.jsonl")) if folder.exists() else []:
            if segment.name in self.seen_segments:
                continue
            self.seen_segments.add(segment.name)
            records, bad = decode_segment(segment.read_bytes())
            if bad:
                self.errors.append(f"{segment.name}: {bad} unreadable lines")
            for record in records:
                self._check(record)

    def _check(self, record: Any) -> None:
        self.verified[record.name] = self.verified.get(record.name, 0) + 1
        path = self.dest / record.path
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            self.errors.append(f"{record.path}: recorded but missing")
            return
        if len(data) != record.size or f"crc32:{zlib.crc32(data):08x}" != record.checksum:
            self.errors.append(f"{record.path}: size/checksum differ from the record")
        elif len(self.verified) % self.sample_every == 0:
            loaded = torch.load(io.BytesIO(data), weights_only=True)
            expected = payload(record.name, loaded["data"].numel())
            if loaded["name"] != record.name or not torch.equal(loaded["data"], expected["data"]):
                self.errors.append(f"{record.path}: content differs from its source")
            self.loaded += 1
        if not self.keep:
            path.unlink()


@dataclass
class Report:
    dumps: int
    tasks: int
    min_size: int
    max_size: int
    budget: int
    seed: int
    committed: int = 0
    failed: int = 0
    verified: int = 0
    loaded_and_compared: int = 0
    bytes_dumped: int = 0
    flushes: int = 0
    seconds: float = 0.0
    baseline_rss: int = 0
    max_rss: int = 0
    rss_limit: int = 0
    max_pending_bytes: int = 0
    threads_first_half: int = 0
    threads_second_half: int = 0
    fds_first_half: int = 0
    fds_second_half: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


async def soak(args: argparse.Namespace, dest: Path) -> Report:
    report = Report(args.dumps, args.tasks, args.min_size, args.max_size, args.budget, args.seed)
    rng = random.Random(args.seed)
    verifier = Verifier(dest, args.keep, sample_every=max(1, args.dumps // 50))
    tracker = trajtrack.Tracker(dest, max_pending_bytes=args.budget, workers=4, record_interval=1.0)
    await tracker.start()
    report.baseline_rss = rss()
    # each task holds one source and generates the next: 2 x max_size each, at most
    report.rss_limit = report.baseline_rss + args.budget + 2 * args.tasks * args.max_size + _SLACK
    counter = iter(range(args.dumps))
    log_low, log_high = math.log(args.min_size), math.log(args.max_size)
    verify_lock = anyio.Lock()
    started = time.monotonic()

    async def verify() -> None:
        async with verify_lock:
            await anyio.to_thread.run_sync(verifier.run)

    async def task(number: int) -> None:
        local = random.Random(rng.random())
        for index in counter:
            size = int(math.exp(local.uniform(log_low, log_high)))
            name = f"task{number}/d{index}"
            obj = await anyio.to_thread.run_sync(payload, name, size)
            report.bytes_dumped += size
            await tracker.dump(obj, name)
            del obj
            if local.random() < args.flush_probability:
                await tracker.flush(timeout=600)
                report.flushes += 1
                await verify()

    with Sampler(tracker, args.budget) as samples:
        async with anyio.create_task_group() as group:
            for number in range(args.tasks):
                group.start_soon(task, number)
        await tracker.flush(timeout=600)
        await verify()
    stats = tracker.statistics()
    await tracker.aclose(timeout=600)
    await verify()  # the final segment, written at close
    report.seconds = time.monotonic() - started
    report.committed, report.failed = stats.committed, stats.failed
    report.verified, report.loaded_and_compared = len(verifier.verified), verifier.loaded
    report.max_rss, report.max_pending_bytes = samples.max_rss, samples.max_pending_bytes
    half = len(samples.threads) // 2
    report.threads_first_half = max(samples.threads[:half] or [0])
    report.threads_second_half = max(samples.threads[half:] or [0])
    report.fds_first_half = max(samples.fds[:half] or [0])
    report.fds_second_half = max(samples.fds[half:] or [0])
    report.errors = verifier.errors + _judge(report, verifier, samples)
    return report


def _judge(report: Report, verifier: Verifier, samples: Samples) -> list[str]:
    errors = []
    if report.committed != report.dumps or report.failed:
        errors.append(f"committed {report.committed} of {report.dumps}, {report.failed} failed")
    expected = {f"task{t}/d{i}" for t in range(report.tasks) for i in range(report.dumps)}
    recorded = set(verifier.verified)
    if len(recorded) != report.dumps or not recorded <= expected:
        errors.append(f"{len(recorded)} names recorded for {report.dumps} dumps")
    twice = [name for name, count in verifier.verified.items() if count != 1]
    if twice:
        errors.append(f"{len(twice)} names recorded more than once, e.g. {twice[:3]}")
    if report.max_rss > report.rss_limit:
        errors.append(f"RSS reached {report.max_rss} bytes; the limit is {report.rss_limit}")
    if report.max_pending_bytes > report.budget and not samples.oversize_seen:
        errors.append(f"pending bytes reached {report.max_pending_bytes} > {report.budget}")
    if report.threads_second_half > report.threads_first_half + _THREAD_MARGIN:
        errors.append(f"threads grew: {report.threads_first_half} -> {report.threads_second_half}")
    if report.fds_second_half > report.fds_first_half + _FD_MARGIN:
        errors.append(f"file descriptors grew: {report.fds_first_half} -> {report.fds_second_half}")
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dumps", type=int, default=20_000)
    parser.add_argument("--tasks", type=int, default=32)
    parser.add_argument("--min-size", type=parse_size, default=1 << 10)
    parser.add_argument("--max-size", type=parse_size, default=8 << 20)
    parser.add_argument("--budget", type=parse_size, default=256 << 20, help="max pending bytes")
    parser.add_argument("--flush-probability", type=float, default=0.005)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--dest", type=Path, default=None, help="default: a temporary directory")
    parser.add_argument("--keep", action="store_true", help="keep the verified files")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    args = parser.parse_args(argv)
    if args.seed is None:
        args.seed = random.randrange(1 << 30)
    with tempfile.TemporaryDirectory(prefix="trajtrack-soak-") as scratch:
        dest = args.dest or Path(scratch) / "run"
        report = anyio.run(soak, args, dest)
    result = {**asdict(report), "ok": report.ok}
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.write_text(text)
    sys.stdout.write(text + "\n")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
