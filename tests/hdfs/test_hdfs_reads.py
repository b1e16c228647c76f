"""Bulk reads of a sharded run on the real HDFS test cluster: one ranged ``OPEN`` per span of
neighbouring members, not one per member."""

from __future__ import annotations

import anyio.to_thread
import pytest
import torch

import trajtrack
from trajtrack.backends.webhdfs import WebHdfsStorage
from trajtrack.cli.verify import verify_run

pytestmark = pytest.mark.hdfs


class _Counting(WebHdfsStorage):
    def __init__(self, url: str) -> None:
        super().__init__(url)  # reads no configuration for a webhdfs:// URL
        self.ranged: list[tuple[str, int, int]] = []

    async def read_range(self, path: str, offset: int, length: int) -> bytes:
        self.ranged.append((path, offset, length))
        return await super().read_range(path, offset, length)


async def test_a_sharded_run_on_hdfs_is_read_a_span_at_a_time(hdfs_url: str) -> None:
    url = f"{hdfs_url}/spans"
    async with trajtrack.Tracker(url, layout="shards") as tracker:
        for i in range(40):
            await tracker.dump({"i": i, "x": torch.full((64,), float(i))}, f"s/{i:02d}")
    storage = await anyio.to_thread.run_sync(_Counting, url)
    async with trajtrack.open_run(url, storage=storage) as run:
        infos = await run.list()
        assert len(infos) == 40 and len({i.shard for i in infos}) == 1
        one_by_one = [await run.read_bytes(i) for i in infos]
        assert len(storage.ranged) == 40
        storage.ranged.clear()
        assert await run.read_many(infos) == one_by_one
        assert len(storage.ranged) == 1
        storage.ranged.clear()
        findings = await verify_run(run)
        assert [f.problem for f in findings] == ["ok"] * 40
        assert len(storage.ranged) == 1  # verify's one batch of 40: one request
    await storage.aclose()


@pytest.mark.parametrize("layout", ["files", "shards"])
async def test_replay_from_hdfs_in_step_order(hdfs_url: str, layout: str) -> None:
    url = f"{hdfs_url}/replay-{layout}"
    async with trajtrack.Tracker(url, layout=layout) as tracker:  # type: ignore[arg-type]
        for step in (10, 2, 1):  # completion order is not step order
            for i in (10, 9):
                await tracker.dump({"x": torch.full((4,), float(step * 100 + i))}, f"s{step}/x{i}")
    seen = []
    async with trajtrack.open_run(url) as run, run.replay("s{step}/x{i}") as steps:
        async for step, objects in steps:
            seen.append(step)
            for i, obj in zip((9, 10), objects, strict=True):
                assert torch.equal(obj["x"], torch.full((4,), float(step * 100 + i)))
    assert seen == [1, 2, 10]
