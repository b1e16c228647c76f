"""Run.replay / SyncRun.replay: steps in numeric order, a bounded prefetch, manifests."""

from __future__ import annotations

import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import trajtrack
from cli._runs import WritesMarker, write_run
from trajtrack._exceptions import (
    ConfigurationError,
    StorageNotFoundError,
    TrackerStateError,
    UnsafeLoadError,
)
from trajtrack.reader import Run, SyncRun
from trajtrack.rollout import record_step_manifest

LAYOUTS = ["files", "shards"]


def sample(step: int, i: int) -> dict[str, Any]:
    return {"step": step, "i": i, "x": torch.full((3,), float(step * 100 + i))}


async def write(dest: str, names: list[tuple[str, Any]], layout: str = "files") -> None:
    async with trajtrack.Tracker(dest, layout=layout) as tracker:  # type: ignore[arg-type]
        for name, obj in names:
            await (await tracker.dump(obj, name))


def shuffled_steps() -> list[tuple[str, Any]]:
    """Steps 1, 2, 10 with samples 1, 9, 10 each, dumped in a shuffled (completion) order."""
    names = [(f"step{s}/sample{i}", sample(s, i)) for s in (1, 2, 10) for i in (1, 9, 10)]
    random.Random(3).shuffle(names)
    return names


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_steps_in_numeric_order_and_samples_by_their_number(
    tmp_path: Path, layout: str
) -> None:
    await write(str(tmp_path), [*shuffled_steps(), ("other/x", 1)], layout)
    seen = []
    async with trajtrack.open_run(tmp_path) as run, run.replay("step{step}/sample{i}") as steps:
        assert steps.steps == [1, 2, 10]
        async for step, objects in steps:
            seen.append((step, [(o["step"], o["i"]) for o in objects]))
            for o in objects:  # each object is the one dumped under its name
                assert torch.equal(o["x"], torch.full((3,), float(o["step"] * 100 + o["i"])))
    assert seen == [(s, [(s, 1), (s, 9), (s, 10)]) for s in (1, 2, 10)]


async def test_steps_argument_picks_steps_and_a_missing_one_is_an_error(tmp_path: Path) -> None:
    await write(str(tmp_path), shuffled_steps())
    async with trajtrack.open_run(tmp_path) as run:
        async with run.replay("step{step}/sample{i}", steps=[10, 1]) as steps:
            assert [step async for step, _ in steps] == [1, 10]
        with pytest.raises(StorageNotFoundError, match=r"step\(s\) \[3\]"):
            async with run.replay("step{step}/sample{i}", steps=[1, 3]):
                pass


def test_sync_replay_yields_the_same_and_stops_on_break(tmp_path: Path) -> None:
    anyio.run(write, str(tmp_path), shuffled_steps())
    with SyncRun(tmp_path) as run:
        got = [(step, [o["i"] for o in objs]) for step, objs in run.replay("step{step}/sample{i}")]
        assert got == [(1, [1, 9, 10]), (2, [1, 9, 10]), (10, [1, 9, 10])]
        first = None
        for step, _ in run.replay("step{step}/sample{i}", prefetch=1):
            first = step
            break  # the generator closes the replay block: its loads are cancelled
        assert first == 1
        assert run.load("step2/sample9")["i"] == 9  # the portal still serves


class _CountingRun(Run):
    """A run that counts the step reads in flight (each replay step is one read_many)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.in_flight = 0
        self.most = 0
        self.started = 0

    async def read_many(self, infos: Any) -> Any:
        self.in_flight += 1
        self.started += 1
        self.most = max(self.most, self.in_flight)
        try:
            await anyio.sleep(0.01)  # let other step loads start, if the bound allowed them
            return await super().read_many(infos)
        finally:
            self.in_flight -= 1


@pytest.mark.parametrize("prefetch", [1, 3])
async def test_prefetch_bounds_the_steps_loading_ahead(tmp_path: Path, prefetch: int) -> None:
    await write(str(tmp_path), [(f"s{s}/x{i}", sample(s, i)) for s in range(8) for i in range(2)])
    run = _CountingRun(str(tmp_path))
    async with run, run.replay("s{step}/x{i}", prefetch=prefetch) as steps:
        taken = 0
        async for _step, _objects in steps:
            taken += 1
            await anyio.sleep(0.05)  # a slow consumer: the loads run as far ahead as allowed
            assert run.started <= taken + prefetch
        assert run.most == prefetch
        assert taken == 8


async def test_leaving_the_block_early_cancels_the_loads_ahead(tmp_path: Path) -> None:
    await write(str(tmp_path), [(f"s{s}/x", sample(s, 0)) for s in range(6)])
    run = _CountingRun(str(tmp_path))
    async with run:
        async with run.replay("s{step}/x", prefetch=2) as steps:
            async for step, _ in steps:
                assert step == 0
                break
        assert run.in_flight == 0
        assert run.started <= 3


async def test_a_step_manifest_names_the_samples_and_their_order(tmp_path: Path) -> None:
    dest = str(tmp_path)
    async with trajtrack.Tracker(dest) as tracker:
        for k in range(6):  # a fully-async rollouter: samples named after themselves
            await (await tracker.dump(sample(0, k), f"rollout/sample_0_{k}"))
        step2 = ["rollout/sample_0_4", "rollout/sample_0_1"]
        await (await record_step_manifest(tracker.dump, 2, step2))
        await (await record_step_manifest(tracker.dump, 1, ["rollout/sample_0_3"]))
    async with trajtrack.open_run(dest) as run, run.replay("manifest/step{step}") as steps:
        got = [(step, [o["i"] for o in objs]) async for step, objs in steps]
    assert got == [(1, [3]), (2, [4, 1])]


async def test_a_manifest_takes_precedence_over_the_pattern_for_its_step(tmp_path: Path) -> None:
    dest = str(tmp_path)
    async with trajtrack.Tracker(dest) as tracker:
        for s, i in [(1, 0), (1, 1), (2, 0), (2, 1)]:
            await (await tracker.dump(sample(s, i), f"step{s}/sample{i}"))
        await (await record_step_manifest(tracker.dump, 2, ["step2/sample1"]))
    async with trajtrack.open_run(dest) as run:
        async with run.replay("step{step}/sample{i}") as steps:
            got = [(step, [o["i"] for o in objs]) async for step, objs in steps]
        assert got == [(1, [0, 1]), (2, [1])]
        async with run.replay("step{step}/sample{i}", manifest=None) as steps:
            got = [(step, [o["i"] for o in objs]) async for step, objs in steps]
        assert got == [(1, [0, 1]), (2, [0, 1])]


async def test_a_manifest_naming_a_missing_dump_fails_that_step(tmp_path: Path) -> None:
    async with trajtrack.Tracker(str(tmp_path)) as tracker:
        await (await tracker.dump(sample(0, 0), "rollout/a"))
        await (await record_step_manifest(tracker.dump, 0, ["rollout/a", "rollout/gone"]))
    async with trajtrack.open_run(tmp_path) as run:
        with pytest.raises(StorageNotFoundError, match="rollout/gone"):
            async with run.replay("manifest/step{step}") as steps:
                async for _ in steps:
                    pass


def test_replay_is_safe_by_default(tmp_path: Path) -> None:
    marker = tmp_path / "owned"  # a sync test: blockbuster's wrapped os.mkdir does not pickle
    write_run(str(tmp_path / "run"), {"s1/x0": sample(1, 0), "s1/x1": WritesMarker(str(marker))})
    with SyncRun(tmp_path / "run") as run, pytest.raises(UnsafeLoadError, match="mkdir"):
        list(run.replay("s{step}/x{i}"))
    assert not marker.exists()


@pytest.mark.parametrize(
    "pattern",
    ["sample{i}", "step{step}/{a}/{b}", "step{step:03d}", "step{step}/{step}", "step{0}"],
)
def test_bad_patterns_are_refused_at_once(tmp_path: Path, pattern: str) -> None:
    with pytest.raises(ConfigurationError, match="pattern"):
        Run(str(tmp_path)).replay(pattern)


def test_prefetch_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="prefetch"):
        Run(str(tmp_path)).replay("s{step}", prefetch=0)


async def test_a_bare_async_for_yields_the_same_steps_loading_none_ahead(tmp_path: Path) -> None:
    await write(str(tmp_path), [(f"s{s}/x{i}", sample(s, i)) for s in (1, 2, 10) for i in range(2)])
    run = _CountingRun(str(tmp_path))
    async with run:
        seen = []
        async for step, objects in run.replay("s{step}/x{i}", prefetch=3):
            await anyio.sleep(0.05)  # a slow consumer: nothing may load ahead of it
            assert run.started == len(seen) + 1
            seen.append((step, [o["i"] for o in objects]))
    assert seen == [(1, [0, 1]), (2, [0, 1]), (10, [0, 1])]


async def test_anext_outside_the_block_is_a_clear_error(tmp_path: Path) -> None:
    await write(str(tmp_path), [("s1", 1)])
    async with trajtrack.open_run(tmp_path) as run:
        with pytest.raises(TrackerStateError, match="async with"):
            await run.replay("s{step}").__anext__()


def test_the_docs_example_re_runs_one_trainer_step(tmp_path: Path) -> None:
    # In its own process: the example widens torch's allow-list there (allow_in_this_process)
    doc = Path(__file__).resolve().parents[2] / "docs" / "rollout.md"
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(encoding="utf-8"), re.DOTALL)
    (example,) = [b for b in blocks if "run.replay(" in b]
    code = example.replace("/tmp/trajtrack-replay-demo", str(tmp_path / "run"))
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(list((tmp_path / "run" / "rollout").glob("sample_0_*.pth"))) == 6
