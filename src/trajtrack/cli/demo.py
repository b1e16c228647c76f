"""``trajtrack demo [DIR]``: two simulated async-rollouter runs, then ``ls`` and ``diff``.

Each run is an asyncio program with many concurrent generation tasks (as in a fully-async
rollouter): every task builds one :class:`~trajtrack.rollout.RolloutSample` with the rollout
data layer and dumps it through a :class:`~trajtrack.Tracker`; after each step the samples are
assembled into a training batch (also dumped) and the step's metrics aggregated. Both runs use
the same seeds, except that run B perturbs one element of one tensor in one sample, so the
``diff`` that follows must point at exactly that dump, key and index. The diff's HTML report
goes to ``DIR/diff-report.html`` (for a remote DIR: ``./trajtrack-demo-diff-report.html``).
"""

from __future__ import annotations

import argparse
import functools
import shutil
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
import torch

import trajtrack.cli.diff as diff_command
import trajtrack.cli.ls as ls_command
from trajtrack._exceptions import ConfigurationError, MissingDependencyError
from trajtrack.backends import BytesPayload, open_storage, scheme_of
from trajtrack.backends.local import LocalStorage
from trajtrack.cli._common import EXIT_DIFFERENT, EXIT_OK, Streams, format_size
from trajtrack.cli._parsers import DEMO_MARKER, DemoConfig
from trajtrack.rollout import (
    MetricsAggregator,
    RolloutBatch,
    RolloutSample,
    assemble_batch_from_rollout_samples,
    prepare_single_generation_data,
)
from trajtrack.tracker import Tracker, TrackerStatistics

__all__ = ["DEMO_MARKER", "DemoConfig", "run", "simulate_run"]

_PROMPT_LEN = 16
_RESPONSE_LEN = 24


async def run(args: argparse.Namespace, streams: Streams) -> int:
    config = DemoConfig(
        steps=args.steps,
        prompts=args.prompts,
        n=args.n,
        seed=args.seed,
        perturb_step=min(DemoConfig.perturb_step, args.steps - 1),
        perturb_prompt=min(DemoConfig.perturb_prompt, args.prompts - 1),
        layout=args.layout,
    )
    if config.steps < 1 or config.prompts < 1 or config.n < 2:
        raise ConfigurationError("the demo needs --steps >= 1, --prompts >= 1 and --n >= 2")
    base = args.dest.rstrip("/") or args.dest
    url_a, url_b = f"{base}/run_a", f"{base}/run_b"
    for url in (url_a, url_b):
        await _claim(url)
    target = f"step{config.perturb_step}/sample{config.perturb_prompt}"
    streams.line(
        f"Simulating 2 runs of an async rollouter: {config.steps} steps x {config.prompts} "
        f"concurrent prompts x n={config.n}, seed {config.seed}; run B adds "
        f"{config.perturbation:g} to one element of {target}; layout: {config.layout}."
    )
    for label, url, perturb in (("A", url_a, False), ("B", url_b, True)):
        started = time.perf_counter()
        stats = await simulate_run(url, config, perturb=perturb)
        elapsed = time.perf_counter() - started
        streams.line(f"  run {label}: {url}  {_stats_line(stats)}  ({elapsed:.2f} s)")
    glob = f"step{config.perturb_step}/*"
    streams.line("")
    streams.line(f"$ trajtrack ls {url_b} --glob '{glob}'")
    await ls_command.run(argparse.Namespace(url=url_b, glob=glob, json=False), streams)
    streams.line("")
    report = _report_path(base)
    streams.line(f"$ trajtrack diff {url_a} {url_b} --html {report}")
    code, first = await _diff(url_a, url_b, streams, report)
    streams.line(f"(exit code {code})")
    _try_next(streams, base, url_a, url_b, target)
    if code == EXIT_DIFFERENT and first == target:
        return EXIT_OK
    streams.note(f"demo: expected the first divergence at {target}, got {first!r} (exit {code})")
    return EXIT_DIFFERENT


async def _diff(url_a: str, url_b: str, streams: Streams, report: Path) -> tuple[int, str | None]:
    from trajtrack.reader import Tolerance, diff_runs, open_run, write_diff_report

    async with open_run(url_a) as run_a, open_run(url_b) as run_b:
        result = await diff_runs(run_a, run_b, tolerance=Tolerance())
        for line in diff_command.render(result, max_dumps=5, per_dump=3):
            streams.line(line)
        try:
            await write_diff_report(result, report, run_a=run_a, run_b=run_b)
        except MissingDependencyError as exc:  # the demo runs without the report extra too
            streams.line(f"(no HTML report: {exc})")
        else:
            streams.line(f"HTML report: {report}  (open it in a browser)")
    first = result.first_divergence()
    return result.exit_code, first.name if first else None


def _report_path(base: str) -> Path:
    """``DIR/diff-report.html`` for a local DIR; in the current directory for other storages."""
    if scheme_of(base) != "file":
        return Path("trajtrack-demo-diff-report.html")
    if base.startswith("file://"):
        return LocalStorage(base).root / "diff-report.html"  # its parsing of file:// URLs
    return Path(base).expanduser() / "diff-report.html"


def _try_next(streams: Streams, base: str, url_a: str, url_b: str, target: str) -> None:
    streams.line("")
    streams.line("Try next:")
    for line in (
        f"  trajtrack show {url_b} {target}      # structure and statistics of one dump",
        f"  trajtrack diff {url_a} {url_b} --atol 1e-2   # within tolerance: exit 0",
        f"  trajtrack diff {url_a} {url_b} --json        # for scripts",
        f"  trajtrack verify {url_a}                     # sizes and checksums vs the record",
        f"  trajtrack export {url_a} {base}/run_a_files   # one .pth per dump, for torch.load",
        "  HDFS (pip install 'trajtrack[hdfs]'):",
        "    trajtrack demo webhdfs://NAMENODE:9870/user/$USER/trajtrack-demo",
        "    trajtrack diff hdfs://NAMESERVICE/user/$USER/run_a hdfs://NAMESERVICE/user/$USER/run_b",
        "  Ray, one detached tracker actor for the whole cluster (pip install 'trajtrack[ray]'):",
        "    in any Ray task: import trajtrack.ray as tr; tr.dump_data(obj, f'step{step}/x')",
        f"    with VERL_ENABLE_TRACKER=1 VERL_TRACKER_HDFS_DIR={base}/ray, then: "
        f"trajtrack ls {base}/ray",
    ):
        streams.line(line)


def _stats_line(stats: TrackerStatistics) -> str:
    p50 = stats.commit_latency_p50
    latency = f", commit p50 {p50 * 1000:.1f} ms" if p50 is not None else ""
    return (
        f"{stats.committed} dumps committed, {format_size(stats.bytes_written)}, "
        f"{stats.failed} failed, {stats.dropped_total} dropped{latency}"
    )


async def _claim(url: str) -> None:
    """Make *url* the demo's run: empty, or an earlier demo run (cleared); refuse anything else.

    The demo marks each run it writes (:data:`DEMO_MARKER`); a folder holding files but no
    mark is someone's data (a run of their own may well be called ``run_a``), never replaced.

    Raises:
        ConfigurationError: *url* holds files the demo did not write.
    """
    storage = await anyio.to_thread.run_sync(open_storage, url)
    try:
        files = await storage.list()
        if files and not any(f.path == DEMO_MARKER for f in files):
            raise ConfigurationError(
                f"{url} already holds files that `trajtrack demo` did not write; refusing to "
                "replace them: choose another DIR (or remove that folder yourself)"
            )
        if isinstance(storage, LocalStorage):  # the whole tree, empty folders included
            await anyio.to_thread.run_sync(
                functools.partial(shutil.rmtree, storage.root, ignore_errors=True)
            )
        else:
            for info in files:
                await storage.delete(info.path)
        await storage.prepare()
        marker = BytesPayload(b"written by `trajtrack demo`: it replaces this run when rerun\n")
        await storage.write_atomic(DEMO_MARKER, marker, overwrite=True)
    finally:
        await storage.aclose()


async def simulate_run(url: str, config: DemoConfig, *, perturb: bool) -> TrackerStatistics:
    """One simulated run: concurrent generation tasks dumping samples, per-step batches.

    Content depends only on the seed (and *perturb*), never on task timing, so two runs with
    the same config are equal dump for dump.
    """
    aggregator = MetricsAggregator(total_gpus=8)
    async with Tracker(url, record_interval=1.0, layout=config.layout) as tracker:
        for step in range(config.steps):
            samples: list[Any] = [None] * config.prompts

            async def generate(prompt: int, step: int = step, samples: list[Any] = samples) -> None:
                sample = _generate(config, step, prompt, perturb=perturb)
                await anyio.sleep(sample.processing_times[0] / 1000)  # the "LLM" latency
                samples[prompt] = sample
                await tracker.dump(sample, f"step{step}/sample{prompt}")

            async with anyio.create_task_group() as group:
                for prompt in range(config.prompts):
                    group.start_soon(generate, prompt)
            batch = assemble_batch_from_rollout_samples(samples)
            await tracker.dump(batch, f"step{step}/batch")
            aggregator.add_step_metrics(_step_metrics(batch), len(batch), timestamp=float(step))
        await tracker.dump(aggregator.get_aggregated_metrics(), "metrics")
        await tracker.flush()
        return tracker.statistics()


def _generate(config: DemoConfig, step: int, prompt: int, *, perturb: bool) -> RolloutSample:
    gen = torch.Generator().manual_seed(config.seed * 1_000_003 + step * 1_009 + prompt)
    prompt_ids = torch.randint(3, 1000, (1, _PROMPT_LEN), generator=gen)
    prepared = prepare_single_generation_data(
        {
            "input_ids": prompt_ids,
            "attention_mask": torch.ones(1, _PROMPT_LEN, dtype=torch.long),
            "uid": np.array([f"uid-{step}-{prompt}"], dtype=object),
        },
        {"actor_rollout_ref": {"rollout": {"n": config.n}}},
    )
    rows = len(prepared)
    lengths = torch.randint(4, _RESPONSE_LEN + 1, (rows,), generator=gen)
    response_mask = (torch.arange(_RESPONSE_LEN) < lengths[:, None]).long()
    log_probs = -torch.rand(rows, _RESPONSE_LEN, generator=gen) * 3 * response_mask
    if perturb and (step, prompt) == (config.perturb_step, config.perturb_prompt):
        log_probs[1, 2] += config.perturbation
    times = (5 + 20 * torch.rand(rows, generator=gen, dtype=torch.float64)).tolist()
    output = RolloutBatch(
        {
            "prompts": prepared.batch["input_ids"],
            "responses": torch.randint(3, 1000, (rows, _RESPONSE_LEN), generator=gen)
            * response_mask,
            "attention_mask": torch.cat([prepared.batch["attention_mask"], response_mask], 1),
            "old_log_probs": log_probs,
            "rm_scores": torch.randn(rows, generator=gen),
        },
        {
            **prepared.non_tensor_batch,
            "processing_times": np.array(times, dtype=object),
            "param_version_start": np.array([step] * rows, dtype=object),
            "param_version_end": np.array([step] * rows, dtype=object),
        },
        {},
    )
    return RolloutSample(
        full_batch=output,
        sample_id=f"sample_0_{step}",
        epoch=0,
        processing_times=times,
        param_version=step,
        param_version_start=[step] * rows,
        param_version_end=[step] * rows,
        rollout_status={"count/generated_samples": step * config.prompts + prompt + 1},
    )


def _step_metrics(batch: Any) -> dict[str, float]:
    mask = batch.batch["response_mask"].bool()
    return {
        "critic/score/mean": float(batch.batch["rm_scores"].mean()),
        "actor/old_log_prob/mean": float(batch.batch["old_log_probs"][mask].mean()),
        "response_length/mean": float(mask.sum(-1).double().mean()),
        "response_length/max": float(mask.sum(-1).max()),
    }
