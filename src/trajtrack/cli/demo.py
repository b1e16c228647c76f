"""``trajtrack demo [DIR]``: two simulated async-rollouter runs, then ``ls`` and ``diff``.

Each run is an asyncio program with many concurrent generation tasks (as in a fully-async
rollouter): every task builds one :class:`~trajtrack.rollout.RolloutSample` with the rollout
data layer and dumps it through a :class:`~trajtrack.Tracker`; after each step the samples are
assembled into a training batch (also dumped) and the step's metrics aggregated. Both runs use
the same seeds, except that run B perturbs one element of one tensor in one sample, so the
``diff`` that follows must point at exactly that dump, key and index. The diff's HTML report
goes to ``DIR/diff-report.html`` (for a remote DIR: ``./trajtrack-demo-diff-report.html``).

What it replaces when run again: only what it wrote itself. Each run it wrote carries
:data:`DEMO_MARKER`, which lists every entry of the run once it is complete; a run folder
holding anything else (a file, a link, an empty folder of the user's), an unfinished demo run
or a run of the user's is refused. Its report is marked ``trajtrack demo`` in the page (see
:func:`trajtrack.reader._html.report_generator`); any other file at that path is refused. All
of it is checked before anything is deleted or written.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
import torch

import trajtrack.cli.diff as diff_command
import trajtrack.cli.ls as ls_command
from trajtrack._exceptions import (
    ConfigurationError,
    MissingDependencyError,
    StorageNotFoundError,
)
from trajtrack.backends import BytesPayload, open_storage, scheme_of
from trajtrack.backends.local import LocalStorage
from trajtrack.cli._common import EXIT_DIFFERENT, EXIT_OK, Streams, format_size
from trajtrack.cli._parsers import DEMO_MARKER, DemoConfig
from trajtrack.reader import check_report_target
from trajtrack.rollout import (
    MetricsAggregator,
    RolloutBatch,
    RolloutSample,
    assemble_batch_from_rollout_samples,
    prepare_single_generation_data,
)
from trajtrack.tracker import Tracker, TrackerStatistics

__all__ = ["DEMO_GENERATOR", "DEMO_MARKER", "DemoConfig", "run", "simulate_run"]

DEMO_GENERATOR = "trajtrack demo"
"""The generator its report names: the only report at its path that a rerun replaces."""
_MARKER_TEXT = "written by `trajtrack demo`: a rerun replaces this run if it holds nothing else"
_MAX_MARKER = 16 << 20  # a marker larger than this is not the demo's
_RUN_DIR = DEMO_MARKER.partition("/")[0]  # a run's own folder, .trajtrack: a run has one

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
    report = _report_path(base)
    # Everything is checked before anything is deleted or written: a refusal changes nothing.
    await _check_not_in_a_run(base)
    claims = [await _check_claim(url) for url in (url_a, url_b)]
    await anyio.to_thread.run_sync(_check_report, report)
    for claim in claims:
        await claim.take()
    target = f"step{config.perturb_step}/sample{config.perturb_prompt}"
    streams.line(
        f"Simulating 2 runs of an async rollouter: {config.steps} steps x {config.prompts} "
        f"concurrent prompts x n={config.n}, seed {config.seed}; run B adds "
        f"{config.perturbation:g} to one element of {target}; layout: {config.layout}."
    )
    for label, url, perturb in (("A", url_a, False), ("B", url_b, True)):
        started = time.perf_counter()
        stats = await simulate_run(url, config, perturb=perturb)
        await _seal(url)
        elapsed = time.perf_counter() - started
        streams.line(f"  run {label}: {url}  {_stats_line(stats)}  ({elapsed:.2f} s)")
    glob = f"step{config.perturb_step}/*"
    streams.line("")
    streams.line(f"$ trajtrack ls {url_b} --glob '{glob}'")
    await ls_command.run(argparse.Namespace(url=url_b, glob=glob, json=False), streams)
    streams.line("")
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
            await write_diff_report(
                result, report, run_a=run_a, run_b=run_b, generator=DEMO_GENERATOR
            )
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


def _check_report(report: Path) -> None:
    """Refuse a file at *report* unless it is the demo's own report (DIR may not exist yet)."""
    if os.path.lexists(report) or os.path.isdir(report.parent):
        check_report_target(report, replaces=(DEMO_GENERATOR,))


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


@dataclass
class _Claim:
    """A run folder checked as the demo's to (re)write: absent, empty, or the demo's own run."""

    url: str
    root: Path | None  # a local folder (None: another storage)
    entries: dict[str, str] = field(default_factory=dict)  # what to delete: path -> kind

    async def take(self) -> None:
        """Delete what was checked (the demo's files, nothing else), then mark the run."""
        storage = await anyio.to_thread.run_sync(open_storage, self.url)
        try:
            if self.root is not None:
                await anyio.to_thread.run_sync(_remove, self.root, self.entries)
            else:
                for path in self.entries:
                    await storage.delete(path)
            await storage.prepare()
            marker = BytesPayload(f"{_MARKER_TEXT}\n".encode())  # unfinished: no entries yet
            await storage.write_atomic(DEMO_MARKER, marker, overwrite=True)
        finally:
            await storage.aclose()


async def _check_claim(url: str) -> _Claim:
    """*url* as the demo may take it: absent, empty, or a complete demo run and nothing else.

    Every entry is looked at (files, folders, empty ones too, links, which are never the
    demo's); a run counts as the demo's only when its marker lists each of them. Nothing is
    changed here.

    Raises:
        ConfigurationError: *url* holds anything the demo did not write.
    """
    storage = await anyio.to_thread.run_sync(open_storage, url)
    try:
        if isinstance(storage, LocalStorage):
            root = storage.root
            found = await anyio.to_thread.run_sync(_scan_local, root, url)
            marker = await anyio.to_thread.run_sync(_read_local_marker, root, found)
        else:
            root = None
            found = {info.path: "file" for info in await storage.list()}
            marker = await storage.read(DEMO_MARKER) if found.get(DEMO_MARKER) else None
    finally:
        await storage.aclose()
    if not found:
        return _Claim(url, root)
    listed = _listed_entries(marker)
    own = {DEMO_MARKER: "file", _RUN_DIR: "dir"} if marker is not None else {}
    foreign = [
        path
        for path, kind in found.items()
        if own.get(path, listed.get(path)) != kind or kind not in ("file", "dir")
    ]
    if marker is not None and listed == {} and foreign:
        raise ConfigurationError(
            f"{url} holds a demo run that did not finish (or one written by an older "
            "trajtrack): refusing to replace it, as what it holds cannot be told from files "
            "the demo did not write; choose another DIR (or remove that folder yourself)"
        )
    if foreign:
        raise ConfigurationError(
            f"{url} already holds files that `trajtrack demo` did not write (such as "
            f"{min(foreign)}); refusing to replace them: choose another DIR (or remove that "
            "folder yourself)"
        )
    return _Claim(url, root, found)


async def _seal(url: str) -> None:
    """Rewrite the marker of the finished run at *url* with the list of all it holds."""
    storage = await anyio.to_thread.run_sync(open_storage, url)
    try:
        if isinstance(storage, LocalStorage):
            entries = await anyio.to_thread.run_sync(_scan_local, storage.root, url)
        else:
            entries = {info.path: "file" for info in await storage.list()}
        entries.pop(DEMO_MARKER, None)
        listing = json.dumps({"entries": entries}, sort_keys=True)
        marker = BytesPayload(f"{_MARKER_TEXT}\n{listing}\n".encode())
        await storage.write_atomic(DEMO_MARKER, marker, overwrite=True)
    finally:
        await storage.aclose()


def _listed_entries(marker: bytes | None) -> dict[str, str]:
    """The entries a demo marker lists (``{}``: none, or not a marker of a finished run)."""
    if marker is None or not marker.startswith(b"written by `trajtrack demo`"):
        return {}
    _, _, listing = marker.partition(b"\n")
    try:
        entries = json.loads(listing)["entries"]
    except (ValueError, KeyError, TypeError):
        return {}
    if not isinstance(entries, dict):
        return {}
    return {str(p): str(k) for p, k in entries.items()}


def _scan_local(root: Path, url: str) -> dict[str, str]:
    """Every entry below *root*, as ``path -> "file" | "dir" | "other"`` (links: other).

    Raises:
        ConfigurationError: *root* is there but is no folder (a file, or a link).
    """
    try:
        mode = os.lstat(root).st_mode
    except FileNotFoundError:
        return {}
    except NotADirectoryError:
        raise ConfigurationError(f"cannot write {url}: a folder above it is a file") from None
    if not stat.S_ISDIR(mode):
        kind = "a symbolic link" if stat.S_ISLNK(mode) else "not a folder"
        raise ConfigurationError(
            f"{url} exists and is {kind}: refusing to replace it; choose another DIR"
        )
    return dict(_walk(str(root), ""))


def _walk(top: str, prefix: str) -> Iterator[tuple[str, str]]:
    with os.scandir(top) as entries:
        for entry in entries:
            path = prefix + entry.name
            if entry.is_dir(follow_symlinks=False):
                yield path, "dir"
                yield from _walk(entry.path, path + "/")
            elif entry.is_file(follow_symlinks=False):
                yield path, "file"
            else:  # a link (to a folder too: never followed), a FIFO, a socket, a device
                yield path, "other"


def _read_local_marker(root: Path, found: dict[str, str]) -> bytes | None:
    if found.get(DEMO_MARKER) != "file" or found.get(_RUN_DIR) != "dir":
        return None
    with open(root / DEMO_MARKER, "rb") as file:
        data = file.read(_MAX_MARKER + 1)
    return None if len(data) > _MAX_MARKER else data


def _remove(root: Path, entries: dict[str, str]) -> None:
    """Delete *entries* below *root*: files, then folders deepest first (each must be empty)."""
    for path, kind in entries.items():
        if kind != "dir":
            os.unlink(root / path)
    for path in sorted((p for p, k in entries.items() if k == "dir"), key=len, reverse=True):
        os.rmdir(root / path)


async def _check_not_in_a_run(base: str) -> None:
    """Refuse a DIR that is a trajtrack run, or inside one: the demo writes next to runs.

    Raises:
        ConfigurationError: DIR (or a folder above it, for a local DIR) holds ``.trajtrack``.
    """
    storage = await anyio.to_thread.run_sync(open_storage, base)
    try:
        if isinstance(storage, LocalStorage):
            found = await anyio.to_thread.run_sync(_enclosing_run, storage.root)
            run, itself = (None if found is None else str(found)), found == storage.root
        else:
            try:
                run, itself = (base if await storage.list(_RUN_DIR) else None), True
            except StorageNotFoundError:
                run = None
    finally:
        await storage.aclose()
    if run is not None:
        where = "is a trajtrack run" if itself else f"is inside the trajtrack run {run}"
        raise ConfigurationError(
            f"{base} {where}: the demo writes its own runs next to runs, never into one; "
            "choose another DIR"
        )


def _enclosing_run(root: Path) -> Path | None:
    for folder in (root, *root.parents):
        if os.path.isdir(folder / _RUN_DIR):
            return folder
    return None


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
