"""Benchmark: safe loading of rollout records against an unrestricted ``torch.load``.

One training step of a fully-async run: 256 verl-shaped trajtrack ``RolloutSample``\\ s (each a
``RolloutBatch`` of one prompt's ``rollout.n`` responses with ``prompts``, ``responses``,
``input_ids``, ``attention_mask``, ``position_ids``, ``old_log_probs``; ``non_tensor_batch``
with a ``uid`` and the raw chat prompt; ``meta_info``; ``rollout_status`` and
``processing_times``), written by a real ``SyncTracker`` as one dump per sample
(``step0/sample<i>``, as the rollouter dumps them) to local disk. Then, in one process, one
torch thread, the page cache warm, best of ``--repeat``:

* **torch.load(weights_only=False)**: each file's bytes (read first, not timed) unpickled
  without restriction: the speed limit of loading these bytes at all;
* **load_dump_bytes**: trajtrack's safe loader on the same bytes (what ``show``, ``diff`` and
  ``SyncRun.load`` run for each dump);
* **torch.load(path, weights_only=False)**: each file opened and unpickled without
  restriction, the baseline of
* **SyncRun.load**: the whole step through the public API (each file read, two thread hops
  of the blocking facade and the run's event loop included).

The ratios are the safe load's time over the unrestricted one's on the same input; issue
#33's target: <= 1.5.

Run: ``python benchmarks/bench_rollout_load.py [--quick] [--samples N] [--repeat N]``. Writes
``benchmarks/results/rollout_load.json``.
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

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import table, write_results
from trajtrack import SyncRun, SyncTracker
from trajtrack.reader import load_dump_bytes
from trajtrack.rollout import RolloutBatch, RolloutSample


def verl_sample(i: int, n: int = 4, prompt: int = 32, response: int = 48) -> RolloutSample:
    """One prompt's rollout, shaped as verl's fully-async rollouter hands it to the trainer."""
    g = torch.Generator().manual_seed(i)
    length = prompt + response
    prompts = torch.randint(0, 32_000, (n, prompt), generator=g)
    responses = torch.randint(0, 32_000, (n, response), generator=g)
    batch = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": torch.ones(n, length, dtype=torch.int64),
        "position_ids": torch.arange(length).expand(n, length).clone(),
        "old_log_probs": torch.randn(n, response, generator=g),
    }
    chat = [{"role": "user", "content": f"Question {i}: what is {i} + {i}?"}]
    non_tensor = {
        "uid": np.array([f"uid-{i}"] * n, dtype=object),
        "raw_prompt": [chat] * n,
        "data_source": np.array(["gsm8k"] * n, dtype=object),
    }
    meta = {"global_token_num": [length] * n, "temperature": 1.0}
    return RolloutSample(
        full_batch=RolloutBatch(batch, non_tensor, meta),
        sample_id=f"sample_0_{i}",
        epoch=0,
        processing_times=[0.5 + 0.01 * j for j in range(n)],
        param_version=3,
        param_version_start=[3] * n,
        param_version_end=[3] * n,
        rollout_status={"count/total_generated_samples": i, "timing_s/generate": 1.25},
    )


def best(repeat: int, fn: Callable[[], Any]) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32 samples, 2 rounds")
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    samples, repeat = (32, 2) if args.quick else (args.samples, args.repeat)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        run = Path(scratch) / "run"
        tracker = SyncTracker(str(run))
        for i in range(samples):
            tracker.dump(verl_sample(i), f"step0/sample{i}")
        tracker.close()
        files = sorted(p for p in run.rglob("sample*") if p.is_file())
        blobs = [p.read_bytes() for p in files]
        assert len(blobs) == samples, (len(blobs), samples)
        total = sum(map(len, blobs))
        for blob in blobs[:2]:  # the safe load gives what the unrestricted one gives
            assert load_dump_bytes(blob) == torch.load(io.BytesIO(blob), weights_only=False)

        def unrestricted() -> None:
            for blob in blobs:
                torch.load(io.BytesIO(blob), weights_only=False)

        def unrestricted_files() -> None:
            for path in files:
                torch.load(path, weights_only=False)

        def safe() -> None:
            for blob in blobs:
                load_dump_bytes(blob)

        with SyncRun(run) as reader:
            names = [info.name for info in reader.list()]

            def public() -> None:
                for name in names:
                    reader.load(name)

            public()  # warm: the listing, the page cache
            figures = {
                "torch.load(weights_only=False)": best(repeat, unrestricted),
                "load_dump_bytes": best(repeat, safe),
                "torch.load(path, weights_only=False)": best(repeat, unrestricted_files),
                "SyncRun.load": best(repeat, public),
            }
    base = figures["torch.load(weights_only=False)"]
    rows = [[name, f"{t * 1e3:.1f}", f"{t / base:.2f}"] for name, t in figures.items()]
    rows[-1][2] = f"{figures['SyncRun.load'] / figures['torch.load(path, weights_only=False)']:.2f}"
    print(f"{samples} RolloutSamples, {total / 2**20:.2f} MiB, one torch thread, best of {repeat}")
    print(table(rows, ["load", "ms per step", "x unrestricted (SyncRun: x by path)"]))
    result = {
        "samples": samples,
        "bytes": total,
        "seconds": figures,
        "safe_vs_unrestricted": figures["load_dump_bytes"] / base,
        "syncrun_vs_unrestricted": figures["SyncRun.load"]
        / figures["torch.load(path, weights_only=False)"],
    }
    write_results("rollout_load-quick" if args.quick else "rollout_load", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
