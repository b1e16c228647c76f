"""Mid-size dumps serialized at ``dump()`` into the writer process's shared memory."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from trajtrack import Tracker, open_run
from trajtrack.backends import _staging as staging
from trajtrack.backends._staging import Arena, Block, StagedPayload
from trajtrack.cli.verify import verify_run
from trajtrack.layouts.names import WriterIdentity
from trajtrack.tracker import _snapshotter as snapshotter
from trajtrack.tracker._files import BATCH_BYTES, BATCH_ITEMS, _batch_cost
from trajtrack.tracker._payloads import ObjectPayload, SerializedPayload
from trajtrack.tracker._queue import FullPolicy, Job, PendingQueue
from trajtrack.tracker._serialize import torch_save
from trajtrack.tracker._snapshotter import Snapshotter

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="memfd staging is Linux-only")


def _mid() -> dict[str, torch.Tensor]:  # ~520 KB: above the small size, below inline_bytes
    return {"obs": torch.randn(100_000), "ids": torch.arange(15_000)}


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    made: list[object] = []
    real = snapshotter.serialize_staged

    def recording(obj: Any, stage: Any, max_bytes: int) -> object:
        made.append(result := real(obj, stage, max_bytes))
        return result

    monkeypatch.setattr(snapshotter, "serialize_staged", recording)
    return made


async def test_mid_size_dumps_are_staged_keep_their_values_and_verify(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = _spy(monkeypatch)
    obj = _mid()
    before = {k: v.clone() for k, v in obj.items()}
    async with Tracker(tmp_path / "run", on_exists="error") as tracker:
        await tracker.dump(obj, "a")
        obj["obs"].add_(1.0)  # after dump() returned: must not reach "a"
        await tracker.dump(obj, "b")
        await tracker.flush()
        storage: Any = tracker._storage
        assert storage._writer._arena.in_use() == 0  # every block given back once committed
    assert [type(p) for p in made] == [StagedPayload, StagedPayload]
    a = torch.load(tmp_path / "run/a.pth", weights_only=True)
    b = torch.load(tmp_path / "run/b.pth", weights_only=True)
    assert torch.equal(a["obs"], before["obs"]) and torch.equal(a["ids"], before["ids"])
    assert torch.equal(b["obs"], before["obs"] + 1.0)
    async with open_run(tmp_path / "run") as run:
        assert {f.problem for f in await verify_run(run)} == {"ok"}


async def test_the_shards_layout_and_other_storages_do_not_stage(tmp_path: Path) -> None:
    async with Tracker(tmp_path / "shards", layout="shards") as tracker:
        assert tracker._snapshots._staging is None
    async with Tracker(tmp_path / "threads", storage_options={"writer_process": False}) as t:
        assert t._snapshots._staging is None
    async with Tracker("memory://staged-test") as tracker:
        assert tracker._snapshots._staging is None


class _FakeStaging:
    """No block at first; one after a wait (or never, if *frees* is False)."""

    def __init__(self, frees: bool) -> None:
        self._arena = Arena(4 << 20)
        self._frees = frees
        self.free = False
        self.waits: list[float] = []
        self.max_bytes = 1 << 20

    def take(self, nbytes: int) -> Block | None:
        return self._arena.take(nbytes) if self.free else None

    async def freed(self, timeout: float) -> bool:
        self.waits.append(timeout)
        self.free = self._frees
        return self._frees


def _snapshotter(fake: _FakeStaging) -> Snapshotter:
    taker = Snapshotter(
        torch_save, inline_bytes=4 << 20, spool_dir=None, who=WriterIdentity.current(), threads=2
    )
    taker.use_staging_of(fake)  # type: ignore[arg-type]
    return taker


async def test_a_dump_that_finds_no_block_waits_for_one_under_the_block_policy() -> None:
    fake = _FakeStaging(frees=True)
    payload = await _snapshotter(fake).take(_mid())
    assert isinstance(payload, StagedPayload)
    assert fake.waits == [snapshotter.STAGE_WAIT]


async def test_a_dump_that_waited_in_vain_or_must_not_wait_is_copied() -> None:
    fake = _FakeStaging(frees=False)
    assert isinstance(await _snapshotter(fake).take(_mid()), ObjectPayload)
    assert fake.waits == [snapshotter.STAGE_WAIT]
    other = _FakeStaging(frees=True)
    assert isinstance(await _snapshotter(other).take(_mid(), wait=False), ObjectPayload)
    assert other.waits == []
    assert isinstance(_snapshotter(other).take_here(_mid()), ObjectPayload)  # never waits
    assert other.waits == []


async def test_the_raise_and_drop_policies_never_wait_for_a_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    waits: list[float] = []

    async def no_block(self: Any, timeout: float) -> bool:
        waits.append(timeout)
        return False

    monkeypatch.setattr(staging.Staging, "take", lambda self, nbytes: None)
    monkeypatch.setattr(staging.Staging, "freed", no_block)
    async with Tracker(tmp_path / "run", full_policy="raise") as tracker:
        await tracker.dump(_mid(), "a")
        await tracker.dump(_mid(), "b", policy="drop_newest")
        assert waits == []
        await tracker.dump(_mid(), "c", policy="block")
        assert waits == [snapshotter.STAGE_WAIT]
    for name in "abc":  # copied instead, and written as usual
        assert torch.equal(torch.load(tmp_path / f"run/{name}.pth")["ids"], _mid()["ids"])


async def test_small_dumps_are_not_staged_and_staged_ones_batch_many_to_a_hop() -> None:
    fake = _FakeStaging(frees=True)
    fake.free = True
    taker = _snapshotter(fake)
    assert isinstance(taker.take_here({"x": torch.zeros(100)}), SerializedPayload)
    queue = PendingQueue(
        asyncio.get_running_loop(), max_bytes=1 << 30, max_items=100, on_drop=lambda j, w: None
    )
    for i in range(6):
        staged = taker.take_here(_mid())
        assert isinstance(staged, StagedPayload)
        job = Job(name=f"s{i}", path=f"s{i}.pth", payload=staged, nbytes=staged.nbytes, future=None)
        assert queue.offer(job, FullPolicy.BLOCK)
    for i in range(2):
        copied = Job(name=f"c{i}", path=f"c{i}.pth", payload=None, nbytes=600_000, future=None)
        assert queue.offer(copied, FullPolicy.BLOCK)
    first = await queue.get_batch(BATCH_ITEMS, BATCH_BYTES, _batch_cost)
    assert [job.name for job in first] == ["s0", "s1", "s2", "s3", "s4", "s5", "c0"]
    assert [job.name for job in await queue.get_batch(BATCH_ITEMS, BATCH_BYTES, _batch_cost)] == [
        "c1"
    ]


async def test_a_dump_larger_than_a_quarter_of_the_arena_is_copied_without_waiting() -> None:
    fake = _FakeStaging(frees=True)
    big = {"obs": torch.randn(300_000)}  # 1.2 MB archive, over the fake's 1 MiB
    assert isinstance(await _snapshotter(fake).take(big), ObjectPayload)
    assert fake.waits == []
    assert isinstance(await _snapshotter(fake).take(_mid()), StagedPayload)  # and ~0.5 MB is
    assert staging.Staging(Arena(8 << 20), lambda: True).max_bytes == 2 << 20
