"""Ray adapter benchmark: caller-visible ``dump_data`` latency and end-to-end dumps/s.

Side by side in one run, in one process, on one local Ray instance, for a 4 KB tensor dict,
1 MB, 16 MB and 256 MB payloads (scenario 1 of the benchmark plan):

* **verl original** — verl 0.9.1's own ``trajectory_tracker.py`` (+ ``hdfs_io.py``), loaded
  from the wheel by path (``pip download verl==0.9.1 --no-deps`` into a cache outside the
  repository; nothing of verl is copied here). It writes through ``shutil.copy`` for local
  paths; ``wait_for_hdfs`` is its flush.
* **trajtrack.ray acknowledged** — ``trajtrack.ray.dump_data(obj, name)`` (the default), over
  the actor's direct channel (a Unix socket here: one Ray node).
* **trajtrack.ray pipelined** — ``dump_data(obj, name, wait=False)`` (64 in flight), same
  channel.
* **trajtrack.ray acknowledged, Ray calls** — the acknowledged mode with
  ``TRAJTRACK_RAY_CHANNEL=off`` (a second actor): every dump is an actor call, which is what a
  process on another node than the actor's gets (the channel is a Unix socket).
* **trajtrack.dump_data** — the per-process sync shim (no Ray in the path), for scale.
* **await Tracker.dump** — the per-process async tracker on an event loop in its own thread,
  each call timed inside that loop (what an async rollouter's coroutine waits).
* **copy only** — what a dump must do at least, alone: a dict comprehension cloning the
  payload's tensors (a dump must copy what the caller may mutate once the call returns), timed
  in the same event loop. It runs right after ``await Tracker.dump``, whose copy takes another
  route (numpy's), so the clone's code is cold in it.
* **least dump** — what any dump that keeps that promise does at the least, in the same loop:
  the name checked (trajtrack's one-call check), the tensors cloned, and the copy queued with
  a future for the caller's handle; nothing measures, bounds, logs or writes it. It runs right
  after "copy only", as ``await Tracker.dump`` runs right after the shim's dump, which takes
  the same snapshot route.
* **torch.save(obj, path)** — plain synchronous serialization to a file.
* **bare actor call** — the floor of any acknowledged dump: ``ray.get`` of a no-op method of an
  async actor (same options as the tracker actor) given the already serialized 4 KB bytes, a
  name and the writer tuple. Nothing is written.
* **serialize only** — the caller's ``torch.save`` of the dict: what any dump of an object that
  is not plain data costs the caller at least (plain data skips it).

Latency: each call timed alone, with a 2 ms pause between calls (a loop that does other work
between dumps), the variants interleaved call by call so that all of them see the same machine
load. Throughput: per variant, a tight loop of dumps, then the variant's flush; dumps/s over
the whole. Every file is checked to exist after the flush.

Run: ``python benchmarks/bench_ray.py [--quick]``. Prints a table with ratios against the
original, writes ``benchmarks/results/ray.json`` (``ray-quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
import types
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import payload, percentiles, table, write_results

VERL_VERSION = "0.9.1"
VERL_CACHE = Path(os.environ.get("TRAJTRACK_VERL_CACHE", "~/.cache/trajtrack/verl")).expanduser()
VERL_FILES = ("verl/utils/hdfs_io.py", "verl/utils/debug/trajectory_tracker.py")
PAUSE = float(
    os.environ.get("BENCH_PAUSE", "0.002")
)  # seconds between timed calls in the latency loop


# --------------------------------------------------------------------------- the original


def _verl_wheel() -> Path:
    wheels = sorted(VERL_CACHE.glob(f"verl-{VERL_VERSION}-*.whl"))
    if not wheels:
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "-q"]
        subprocess.run([*pip, "-d", str(VERL_CACHE), f"verl=={VERL_VERSION}"], check=True)
        wheels = sorted(VERL_CACHE.glob(f"verl-{VERL_VERSION}-*.whl"))
    return wheels[0]


def load_original() -> types.ModuleType:
    """verl's ``trajectory_tracker`` module, run from the wheel's own files.

    The two files are unpacked into the cache and loaded by path under their real module
    names, inside a minimal ``verl``/``verl.utils`` package tree of empty modules (the real
    package ``__init__`` files import all of verl). They are registered to be pickled by value,
    so Ray's workers (which have no verl) receive the actor class and the upload task.
    """
    import ray.cloudpickle

    wheel = _verl_wheel()
    root = VERL_CACHE / f"verl-{VERL_VERSION}-files"
    with zipfile.ZipFile(wheel) as archive:
        for member in VERL_FILES:
            target = root / member
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(archive.read(member))
    for package in ("verl", "verl.utils", "verl.utils.debug"):
        module = types.ModuleType(package)
        module.__path__ = []
        sys.modules[package] = module
    ray.cloudpickle.register_pickle_by_value(sys.modules["verl"])
    loaded = None
    for member in VERL_FILES:
        name = member[: -len(".py")].replace("/", ".")
        spec = importlib.util.spec_from_file_location(name, root / member)
        assert spec is not None
        assert spec.loader is not None
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[name] = loaded
        ray.cloudpickle.register_pickle_by_value(loaded)
        spec.loader.exec_module(loaded)
    assert loaded is not None
    return loaded


# --------------------------------------------------------------------------- measuring


@dataclass
class Variant:
    """One way of dumping: its call, its flush, and where its files land (None: no files)."""

    label: str
    dump: Callable[[Any, str], Any]
    flush: Callable[[], Any]
    dest: Path | None
    prefix: str


def interleaved_latency(
    variants: list[Variant], obj: Any, count: int, tag: str = ""
) -> dict[str, list[float]]:
    """Time each call alone, round-robin over the variants, with a pause between calls.

    Interleaving makes every variant see the same machine load (this benchmark runs on shared
    machines where load moves by 2x within a minute); the order rotates every round.
    """
    samples: dict[str, list[float]] = {v.label: [] for v in variants}
    for i in range(count):
        shift = i % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            name = f"{variant.prefix}{tag}lat_{i}"
            start = time.perf_counter()
            result = variant.dump(obj, name)
            elapsed = time.perf_counter() - start
            # A variant timed where it runs (the async tracker, inside its event loop) returns
            # its own measurement.
            samples[variant.label].append(result if isinstance(result, float) else elapsed)
            time.sleep(PAUSE)
    return samples


def throughput(variant: Variant, obj: Any, count: int, tag: str = "") -> float:
    start = time.perf_counter()
    for i in range(count):
        variant.dump(obj, f"{variant.prefix}{tag}tput_{i}")
    variant.flush()
    return count / (time.perf_counter() - start)


def check_files(variant: Variant, kind: str, count: int, tag: str = "") -> None:
    if variant.dest is None:
        return
    names = [f"{variant.prefix}{tag}{kind}_{i}.pth" for i in range(count)]
    missing = [n for n in names if not (variant.dest / n).exists()]
    if missing:
        raise SystemExit(f"{variant.label}: {len(missing)} of {count} dumps missing after flush")


class _AsyncTracker:
    """``await Tracker.dump`` on an event loop in its own thread, timed inside that loop."""

    def __init__(self, dest: Path) -> None:
        import asyncio
        import threading

        from trajtrack import Tracker
        from trajtrack.layouts.names import plainly_valid

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._tracker = Tracker(dest, max_pending_bytes=2 << 30)
        self._least_queue: collections.deque[Any] = collections.deque()
        self._plainly_valid = plainly_valid  # one C call for a short ASCII name
        self._call(self._tracker.start())

    def _call(self, coro: Any) -> Any:
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(600)

    async def _timed(self, obj: Any, name: str) -> float:
        start = time.perf_counter()
        await self._tracker.dump(obj, name)
        return time.perf_counter() - start

    def dump(self, obj: Any, name: str) -> float:
        return float(self._call(self._timed(obj, name)))

    @staticmethod
    async def _copy_timed(obj: dict[str, Any]) -> float:
        start = time.perf_counter()
        {key: tensor.clone() for key, tensor in obj.items()}
        return time.perf_counter() - start

    def copy_only(self, obj: Any, name: str) -> float:
        """The tensors cloned in the same loop as :meth:`dump`, nothing kept."""
        return float(self._call(self._copy_timed(obj)))

    async def _least_timed(self, obj: dict[str, Any], name: str) -> float:
        start = time.perf_counter()
        if not self._plainly_valid(name):
            raise ValueError(name)
        copy = {key: tensor.clone() for key, tensor in obj.items()}
        self._least_queue.append((name, copy, self._loop.create_future()))
        elapsed = time.perf_counter() - start
        self._least_queue.clear()
        return elapsed

    def least_dump(self, obj: Any, name: str) -> float:
        """The least any dump does: check the name, copy the tensors, queue them with a future
        for the caller's handle (nothing measures, bounds or writes them)."""
        return float(self._call(self._least_timed(obj, name)))

    def flush(self) -> None:
        self._call(self._tracker.flush())

    def close(self) -> None:
        self._call(self._tracker.aclose(60))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


class _Noop:
    """The bare actor: the same shape of call as ``TrackerActor.dump``, doing nothing."""

    async def dump(self, data: bytes, name: str, who: Any) -> None:
        return None


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer dumps (a smoke run)")
    parser.add_argument("--sizes", nargs="*", default=None, help="payloads (default: all)")
    args = parser.parse_args()
    plan = {"4KB": 400, "1MB": 60, "16MB": 12, "256MB": 3}
    if args.quick:
        plan = {"4KB": 60, "1MB": 10, "16MB": 3, "256MB": 1}
    if args.sizes:
        plan = {size: plan[size] for size in args.sizes}

    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ["VERL_ENABLE_TRACKER"] = "1"
    import ray
    import torch

    import trajtrack
    import trajtrack.ray as tr

    original = load_original()
    work = Path(tempfile.mkdtemp(prefix="trajtrack-bench-ray-"))
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        _temp_dir=str(work / "ray"),
    )
    by_size: dict[str, dict[str, Any]] = {}
    try:
        print(f"dumps per measurement {plan}, Ray {ray.__version__}")
        from trajtrack.ray import _client, _config, _discovery

        verl_dest = work / "verl"  # must not exist: the original's makedirs has exist_ok=False
        os.environ["VERL_TRACKER_HDFS_DIR"] = str(verl_dest)
        verl_tracker = original.get_trajectory_tracker()

        ray_dest = work / "trajtrack-ray"  # one actor for both modes, as in real use
        os.environ["TRAJTRACK_DIR"] = str(ray_dest)
        os.environ["TRAJTRACK_RAY_ACTOR"] = "bench-trajtrack"
        ray.get(tr.get_trajectory_tracker().ready.remote())

        # A second actor without the channel: acknowledged dumps as Ray calls.
        calls_dest, calls_actor = work / "trajtrack-ray-calls", "bench-trajtrack-calls"
        os.environ.update(
            TRAJTRACK_DIR=str(calls_dest),
            TRAJTRACK_RAY_ACTOR=calls_actor,
            TRAJTRACK_RAY_CHANNEL="off",
        )
        assert _discovery.current().channel is None
        os.environ.update(TRAJTRACK_DIR=str(ray_dest), TRAJTRACK_RAY_ACTOR="bench-trajtrack")
        del os.environ["TRAJTRACK_RAY_CHANNEL"]
        assert _discovery.current().channel is not None

        def ray_calls(obj: Any, name: str) -> None:
            os.environ["TRAJTRACK_RAY_ACTOR"] = calls_actor  # ~1 us; the cache is per name
            try:
                tr.dump_data(obj, name, wait=True)
            finally:
                os.environ["TRAJTRACK_RAY_ACTOR"] = "bench-trajtrack"

        shim_dest = work / "shim"
        os.environ["TRAJTRACK_DIR"] = str(shim_dest)
        shim = trajtrack.get_tracker()
        os.environ["TRAJTRACK_DIR"] = str(ray_dest)

        bare = ray.remote(_Noop).options(**_config.ACTOR_DEFAULTS).remote()
        who = _discovery.process_identity()
        serialized: dict[str, bytes] = {}
        ray.get(bare.dump.remote(b"warm", "warm", who))
        async_dest = work / "async"
        async_tracker = _AsyncTracker(async_dest)
        save_dest = work / "torch-save"
        save_dest.mkdir()

        variants = [
            Variant(
                "verl original",
                original.dump_data,
                lambda: ray.get(verl_tracker.wait_for_hdfs.remote()),
                verl_dest,
                "",
            ),
            Variant(
                "trajtrack.ray acknowledged",
                lambda o, n: tr.dump_data(o, n, wait=True),
                tr.flush,
                ray_dest,
                "ack_",
            ),
            Variant(
                "trajtrack.ray pipelined",
                lambda o, n: tr.dump_data(o, n, wait=False),
                tr.flush,
                ray_dest,
                "pipe_",
            ),
            Variant(
                "trajtrack.ray acknowledged, Ray calls",
                ray_calls,
                lambda: tr.flush(name=calls_actor),
                calls_dest,
                "calls_",
            ),
            Variant(
                "trajtrack.dump_data (per process)", trajtrack.dump_data, shim.flush, shim_dest, ""
            ),
            Variant(
                "await Tracker.dump (per process)",
                async_tracker.dump,
                async_tracker.flush,
                async_dest,
                "",
            ),
            Variant(
                "copy only (the tensors cloned, in the loop)",
                async_tracker.copy_only,
                lambda: None,
                None,
                "",
            ),
            Variant(
                "least dump (name, copy, queue; in the loop)",
                async_tracker.least_dump,
                lambda: None,
                None,
                "",
            ),
            Variant(
                "torch.save(obj, path) (sync)",
                lambda o, n: torch.save(o, save_dest / f"{n}.pth"),
                lambda: None,
                save_dest,
                "",
            ),
            Variant(
                "bare actor call (no-op, same bytes)",
                lambda o, n: ray.get(bare.dump.remote(serialized["data"], n, who)),
                lambda: None,
                None,
                "",
            ),
            Variant(
                "serialize only (torch.save in the caller)",
                lambda o, n: _client._serialize(o),
                lambda: None,
                None,
                "",
            ),
        ]
        for size, count in plan.items():
            obj = payload(size)
            serialized["data"] = _client._serialize(obj)
            tag = f"{size}_"
            warmup = max(1, min(30, count // 4))
            for variant in variants:
                for i in range(warmup):
                    variant.dump(obj, f"{variant.prefix}{tag}warm_{i}")
                variant.flush()
            lat = interleaved_latency(variants, obj, count, tag)
            for variant in variants:
                variant.flush()
                check_files(variant, "lat", count, tag)
            results: dict[str, Any] = {}
            for variant in variants:
                rate = throughput(variant, obj, count, tag)
                check_files(variant, "tput", count, tag)
                p50 = percentiles(lat[variant.label])["p50_us"]
                print(f"  {size} {variant.label}: p50 {p50:.0f} us, {rate:.1f} dumps/s", flush=True)
                results[variant.label] = {
                    "latency": percentiles(lat[variant.label]),
                    "dumps_per_s": rate,
                }
            by_size[size] = results
            for path in work.glob("*/*"):  # keep the disk small between sizes
                if path.is_file() and path.suffix == ".pth":
                    path.unlink()
        async_tracker.close()
        shim.close(timeout=60)
        tr.shutdown(timeout=60)
        tr.shutdown(timeout=60, name=calls_actor)
        ray.kill(bare)
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)

    header = ["variant", "p50 ms", "p99 ms", "p50 vs verl", "dumps/s", "dumps/s vs verl"]
    for size, results in by_size.items():
        base = results["verl original"]
        rows = []
        for label, res in results.items():
            lat = res["latency"]
            res["p50_speedup_vs_original"] = base["latency"]["p50_us"] / lat["p50_us"]
            res["throughput_vs_original"] = res["dumps_per_s"] / base["dumps_per_s"]
            rows.append(
                [
                    label,
                    f"{lat['p50_us'] / 1000:.3f}",
                    f"{lat['p99_us'] / 1000:.3f}",
                    f"{res['p50_speedup_vs_original']:.1f}x",
                    f"{res['dumps_per_s']:.1f}",
                    f"{res['throughput_vs_original']:.1f}x",
                ]
            )
        print(f"\n{size} payload ({plan[size]} dumps per measurement)")
        print(table(rows, header))
    path = write_results(
        "ray-quick" if args.quick else "ray",
        {
            "payloads": list(plan),
            "dumps_per_measurement": plan,
            "pause_between_timed_calls_s": PAUSE,
            "ray": ray.__version__,
            "torch": torch.__version__,
            "verl": VERL_VERSION,
            "results": by_size.get("4KB", {}),
            "by_size": by_size,
        },
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
