"""Ray adapter benchmark: caller-visible ``dump_data`` latency and end-to-end dumps/s.

Side by side in one run, on one local Ray instance, for a 4 KB tensor dict:

* **verl original** — verl 0.9.1's own ``trajectory_tracker.py`` (+ ``hdfs_io.py``), loaded
  from the wheel by path (``pip download verl==0.9.1 --no-deps`` into a cache outside the
  repository; nothing of verl is copied here). It writes through ``shutil.copy`` for local
  paths; ``wait_for_hdfs`` is its flush.
* **trajtrack.ray acknowledged** — ``trajtrack.ray.dump_data(obj, name)`` (the default).
* **trajtrack.ray pipelined** — ``dump_data(obj, name, wait=False)`` (64 in flight).
* **trajtrack.dump_data** — the per-process sync shim (no Ray in the path), for scale.
* **bare actor call** — the floor of any acknowledged dump: ``ray.get`` of a no-op method of an
  async actor (same options as the tracker actor) given the already serialized 4 KB bytes, a
  name and the writer tuple. Nothing is written.
* **serialize only** — the caller's ``torch.save`` of the dict, the floor of the pipelined mode.

Latency: each call timed alone, with a 2 ms pause between calls (a loop that does other work
between dumps). Throughput: a tight loop of dumps, then the variant's flush; dumps/s over the
whole. Every file is checked to exist after the flush.

Run: ``python benchmarks/bench_ray.py [--quick]``. Prints a table with ratios against the
original, writes ``benchmarks/results/ray.json`` (``ray-quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
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


def latency(dump: Callable[[Any, str], Any], obj: Any, prefix: str, count: int) -> list[float]:
    samples = []
    for i in range(count):
        start = time.perf_counter()
        dump(obj, f"{prefix}_{i}")
        samples.append(time.perf_counter() - start)
        time.sleep(PAUSE)
    return samples


def throughput(
    dump: Callable[[Any, str], Any], flush: Callable[[], Any], obj: Any, prefix: str, count: int
) -> float:
    start = time.perf_counter()
    for i in range(count):
        dump(obj, f"{prefix}_{i}")
    flush()
    return count / (time.perf_counter() - start)


def check_files(dest: Path, prefix: str, count: int) -> None:
    missing = [i for i in range(count) if not (dest / f"{prefix}_{i}.pth").exists()]
    if missing:
        raise SystemExit(f"{dest}: {len(missing)} of {count} {prefix} dumps missing after flush")


def run_variant(
    label: str,
    dump: Callable[[Any, str], Any],
    flush: Callable[[], Any],
    dest: Path | None,
    obj: Any,
    count: int,
    warmup: int,
) -> dict[str, Any]:
    for i in range(warmup):
        dump(obj, f"warm_{i}")
    flush()
    lat = latency(dump, obj, "lat", count)
    flush()
    rate = throughput(dump, flush, obj, "tput", count)
    if dest is not None:
        check_files(dest, "lat", count)
        check_files(dest, "tput", count)
    print(f"  {label}: p50 {percentiles(lat)['p50_us']:.0f} us, {rate:.0f} dumps/s", flush=True)
    return {"latency": percentiles(lat), "dumps_per_s": rate}


class _Noop:
    """The bare actor: the same shape of call as ``TrackerActor.dump``, doing nothing."""

    async def dump(self, data: bytes, name: str, who: Any) -> None:
        return None


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer dumps (a smoke run)")
    args = parser.parse_args()
    count, warmup = (60, 10) if args.quick else (400, 30)

    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ["VERL_ENABLE_TRACKER"] = "1"
    import ray
    import torch

    import trajtrack
    import trajtrack.ray as tr

    original = load_original()
    obj = payload("4KB")
    work = Path(tempfile.mkdtemp(prefix="trajtrack-bench-ray-"))
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        _temp_dir=str(work / "ray"),
    )
    results: dict[str, Any] = {}
    try:
        print(f"4 KB tensor dict, {count} dumps per measurement, Ray {ray.__version__}")

        dest = work / "verl"  # must not exist: the original's makedirs has exist_ok=False
        os.environ["VERL_TRACKER_HDFS_DIR"] = str(dest)
        verl_tracker = original.get_trajectory_tracker()
        results["verl original"] = run_variant(
            "verl original",
            original.dump_data,
            lambda: ray.get(verl_tracker.wait_for_hdfs.remote()),
            dest,
            obj,
            count,
            warmup,
        )

        for label, wait in (
            ("trajtrack.ray acknowledged", True),
            ("trajtrack.ray pipelined", False),
        ):
            dest = work / label.split()[-1]
            os.environ["TRAJTRACK_DIR"] = str(dest)
            os.environ["TRAJTRACK_RAY_ACTOR"] = f"bench-{label.split()[-1]}"
            results[label] = run_variant(
                label,
                lambda o, n, wait=wait: tr.dump_data(o, n, wait=wait),
                lambda: tr.flush(),
                dest,
                obj,
                count,
                warmup,
            )
            tr.shutdown(timeout=60)

        dest = work / "shim"
        os.environ["TRAJTRACK_DIR"] = str(dest)
        shim = trajtrack.get_tracker()
        results["trajtrack.dump_data (per process)"] = run_variant(
            "trajtrack.dump_data (per process)",
            trajtrack.dump_data,
            lambda: shim.flush(),
            dest,
            obj,
            count,
            warmup,
        )
        shim.close(timeout=60)

        from trajtrack.ray import _client

        bare = ray.remote(_Noop).options(**_client._ACTOR_DEFAULTS).remote()
        data, who = _client._serialize(obj), _client._who()
        ray.get(bare.dump.remote(data, "warm", who))
        results["bare actor call (no-op, 4 KB bytes)"] = run_variant(
            "bare actor call (no-op, 4 KB bytes)",
            lambda o, n: ray.get(bare.dump.remote(data, n, who)),
            lambda: None,
            None,
            obj,
            count,
            warmup,
        )
        ray.kill(bare)
        results["serialize only (torch.save in the caller)"] = run_variant(
            "serialize only (torch.save in the caller)",
            lambda o, n: _client._serialize(o),
            lambda: None,
            None,
            obj,
            count,
            warmup,
        )
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)

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
                f"{res['dumps_per_s']:.0f}",
                f"{res['throughput_vs_original']:.1f}x",
            ]
        )
    print()
    print(
        table(
            rows,
            ["variant", "p50 ms", "p99 ms", "p50 vs verl", "dumps/s", "dumps/s vs verl"],
        )
    )
    path = write_results(
        "ray-quick" if args.quick else "ray",
        {
            "payload": "4KB tensor dict",
            "dumps_per_measurement": count,
            "pause_between_timed_calls_s": PAUSE,
            "ray": ray.__version__,
            "torch": torch.__version__,
            "verl": VERL_VERSION,
            "results": results,
        },
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
