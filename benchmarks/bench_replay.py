"""Benchmark: ``Run.replay`` of a recorded run against one thread's unsafe loads of its files.

A run of S steps (default 4) x N verl-shaped ``trajtrack.rollout.RolloutSample`` records
(default 256; ~12 KB each: one row of a 128-token prompt and a 192-token response, the
tensors verl's fully-async trainer receives, uid / raw prompt / reward columns, rollout
status) is written once per layout by a real Tracker as ``step{s}/sample{i}``. Then, in one
process, alternated round by round, best of ``--repeat`` each:

* **one thread, unsafe**: each step's dumps read in order by one thread (``open().read()`` of
  each file; in the shards layout each shard read whole once and sliced) and each
  ``torch.load(weights_only=False)``-ed: the floor a user's own script gets, without safety;
* **Run.replay**: ``async with run.replay("step{step}/sample{i}") as steps`` iterated to the
  end (safe loading, ``prefetch=2``), after ``allow_in_this_process()`` as a trainer process
  does (the records then load in this process, not in trajtrack's load worker). Its time
  includes opening the run and scanning its listing; the thread gets its list of dumps, in
  step order, for free;
* **Run.replay(unsafe=True)**: the same with ``torch.load(weights_only=False)``: what the
  replay machinery (listing, batched reads, prefetch, worker threads) costs apart from the
  safe loading.

Issue 35's target: replay within 1.5x of the unsafe thread. With ``--hdfs`` the same run is
written to the HDFS test cluster (files layout) and replay is compared with a raw read of its
files (16 requests in flight) plus the same unsafe loads; target within 2x.

Run: ``python benchmarks/bench_replay.py [--quick] [--steps S] [--samples N] [--repeat R]
[--hdfs [--cluster-dir D]]``. Writes ``benchmarks/results/replay.json`` (``replay-quick``).
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import cluster_env, table, with_hdfs_cluster, write_results
from trajtrack import Tracker
from trajtrack.backends import open_storage
from trajtrack.reader import DumpInfo, Run, allow_in_this_process, gather_bounded, open_run
from trajtrack.rollout import RolloutBatch, RolloutSample

PATTERN = "step{step}/sample{i}"
PROMPT, RESPONSE = 128, 192


def rollout_sample(step: int, i: int) -> RolloutSample:
    """One verl-shaped record: a generated row as verl's fully-async trainer receives it."""
    gen = torch.Generator().manual_seed(step * 10_000 + i)
    prompts = torch.randint(3, 32_000, (1, PROMPT), generator=gen)
    prompts[:, : i % 32] = 0  # left padding
    responses = torch.randint(3, 32_000, (1, RESPONSE), generator=gen)
    responses[:, RESPONSE - i % 48 :] = 0  # right padding
    attention = torch.cat([prompts != 0, responses != 0], dim=1).long()
    batch = RolloutBatch(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention,
            "position_ids": torch.clamp(attention.cumsum(-1) - 1, min=0),
            "response_mask": (responses != 0).long(),
            "rm_scores": torch.zeros(1, RESPONSE),
        },
        {
            "uid": np.array([f"uid-{step}-{i}"], dtype=object),
            "index": np.array([i], dtype=object),
            "data_source": np.array(["gsm8k"], dtype=object),
            "raw_prompt": np.array(
                [[{"role": "user", "content": f"question {i} of step {step}"}]], dtype=object
            ),
            "reward_model": np.array([{"ground_truth": str(i), "style": "rule"}], dtype=object),
        },
        {"eos_token_id": 2, "pad_token_id": 0, "global_steps": step},
    )
    return RolloutSample(
        full_batch=batch,
        sample_id=f"sample_0_{step * 1000 + i}",
        processing_times=[0.5 + i / 1000],
        param_version=step,
        param_version_start=[step],
        param_version_end=[step],
        rollout_status={"count/total_generated_samples": step * 1000 + i},
    )


async def write_run(url: str, steps: int, samples: int, layout: str) -> None:
    async with Tracker(url, layout=layout) as tracker:  # type: ignore[arg-type]
        for step in range(1, steps + 1):
            for i in range(samples):
                await tracker.dump(rollout_sample(step, i), f"step{step}/sample{i}")
        await tracker.flush(timeout=600)


def _in_step_order(infos: list[DumpInfo]) -> list[DumpInfo]:
    def key(info: DumpInfo) -> tuple[int, int]:
        step, sample = info.name.removeprefix("step").split("/sample")
        return int(step), int(sample)

    return sorted(infos, key=key)


def unsafe_thread(root: Path, infos: list[DumpInfo]) -> int:
    """One thread: read each dump's bytes (a shard once, whole) and torch.load them unsafely."""
    shards: dict[str, bytes] = {}
    loaded = 0
    for info in infos:
        if info.shard is None:
            data = (root / info.path).read_bytes()
        else:
            if info.shard not in shards:
                shards[info.shard] = (root / info.shard).read_bytes()
            start = info.offset or 0
            data = shards[info.shard][start : start + info.size]
        torch.load(io.BytesIO(data), weights_only=False)
        loaded += 1
    return loaded


async def replay_all(run: Run, unsafe: bool = False) -> int:
    loaded = 0
    async with run.replay(PATTERN, unsafe=unsafe) as steps:
        async for _step, objects in steps:
            loaded += len(objects)
    return loaded


async def remote_unsafe(url: str, infos: list[DumpInfo]) -> int:
    """HDFS: the files read raw, 16 requests in flight, then each loaded unsafely (one thread)."""
    storage = open_storage(url)
    try:
        datas = await gather_bounded(infos, lambda info: storage.read(info.path), limit=16)
    finally:
        await storage.aclose()
    return await anyio.to_thread.run_sync(
        lambda: sum(1 for d in datas if torch.load(io.BytesIO(d), weights_only=False) is not None)
    )


def _timed(work: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = work()
    return time.perf_counter() - start, result


def measure(url: str, root: Path | None, repeat: int, expected: int) -> dict[str, float]:
    async def replayed(unsafe: bool = False) -> int:
        async with open_run(url) as run:
            await run.scan()
            return await replay_all(run, unsafe)

    async def listing() -> list[DumpInfo]:
        async with open_run(url) as run:
            return _in_step_order(await run.list())

    infos = anyio.run(listing)
    assert len(infos) == expected, (len(infos), expected)
    if root is not None:
        baseline: Callable[[], Any] = lambda: unsafe_thread(root, infos)  # noqa: E731
    else:
        baseline = lambda: anyio.run(remote_unsafe, url, infos)  # noqa: E731
    times: dict[str, list[float]] = {"baseline_s": [], "replay_s": [], "replay_unsafe_s": []}
    for _ in range(repeat):  # alternated, so that a busy moment of the machine hits each
        for key, work in (
            ("baseline_s", baseline),
            ("replay_s", lambda: anyio.run(replayed)),
            ("replay_unsafe_s", lambda: anyio.run(replayed, True)),
        ):
            t, loaded = _timed(work)
            times[key].append(t)
            assert loaded == expected, (key, loaded, expected)
    best = {key: min(values) for key, values in times.items()}
    best["ratio"] = best["replay_s"] / best["baseline_s"]
    best["ratio_unsafe"] = best["replay_unsafe_s"] / best["baseline_s"]
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 steps x 64 samples")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--samples", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--hdfs", action="store_true", help="also on the HDFS test cluster")
    parser.add_argument("--cluster-dir", type=Path, default=None, help="a running cluster")
    args = parser.parse_args()
    steps = args.steps or (2 if args.quick else 4)
    samples = args.samples or (64 if args.quick else 256)
    torch.set_num_threads(1)
    allow_in_this_process()
    result: dict[str, Any] = {"steps": steps, "samples": samples, "repeat": args.repeat}
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-replay-") as tmp:
        for layout in ("files", "shards"):
            root = Path(tmp) / layout
            anyio.run(write_run, str(root), steps, samples, layout)
            result[layout] = measure(str(root), root, args.repeat, steps * samples)
            rows.append([f"local {layout}", *_row(result[layout])])
    if args.hdfs:

        def on_cluster(directory: Path, _quick: bool) -> dict[str, float]:
            url = f"{cluster_env(directory)['WEBHDFS_URL']}/bench-replay-{time.time_ns()}"
            anyio.run(write_run, url, steps, samples, "files")
            return measure(url, None, args.repeat, steps * samples)

        result["hdfs"] = with_hdfs_cluster(on_cluster, args.cluster_dir, args.quick)
        rows.append(["HDFS files", *_row(result["hdfs"])])
    print(
        f"\nreplay of {steps} steps x {samples} verl-shaped RolloutSamples, best of {args.repeat}"
    )
    header = ["run", "one thread, unsafe (s)", "Run.replay (s)", "replay / thread"]
    print(table(rows, [*header, "replay(unsafe=True) (s)", "/ thread"]))
    print(f"wrote {write_results('replay-quick' if args.quick else 'replay', result)}")
    return 0


def _row(figures: dict[str, float]) -> list[str]:
    return [
        f"{figures['baseline_s']:.3f}",
        f"{figures['replay_s']:.3f}",
        f"{figures['ratio']:.2f}x",
        f"{figures['replay_unsafe_s']:.3f}",
        f"{figures['ratio_unsafe']:.2f}x",
    ]


if __name__ == "__main__":
    sys.exit(main())
