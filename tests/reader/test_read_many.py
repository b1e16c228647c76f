"""``Run.read_many``: several dumps' bytes at once, each read's error in its own slot."""

from __future__ import annotations

import os
from pathlib import Path

import anyio.to_thread
import pytest
import torch

from trajtrack import StorageNotFoundError, StoragePermissionError, Tracker
from trajtrack.backends.memory import MemoryStorage
from trajtrack.reader import open_run


async def _write(root: Path | str, layout: str, **options: object) -> None:
    async with Tracker(root, layout=layout, **options) as tracker:  # type: ignore[arg-type]
        for i in range(6):
            await tracker.dump({"x": torch.full((50,), float(i))}, f"d{i}")


@pytest.mark.parametrize("layout", ["files", "shards"])
async def test_the_bytes_of_each_dump_as_read_bytes_gives_them(tmp_path: Path, layout: str) -> None:
    await _write(tmp_path, layout)
    async with open_run(tmp_path) as run:
        infos = await run.list()
        assert [await run.read_bytes(i) for i in infos] == await run.read_many(infos)
        if layout == "shards":
            assert {i.shard for i in infos} != {None}


async def test_a_failed_read_is_reported_in_its_slot_only(tmp_path: Path) -> None:
    root = tmp_path / "run"
    await _write(root, "files")
    (tmp_path / "elsewhere.pth").write_bytes(b"secret")
    async with open_run(root) as run:
        infos = await run.list()

        def break_two() -> None:
            os.unlink(root / "d1.pth")
            os.unlink(root / "d4.pth")
            os.symlink(tmp_path / "elsewhere.pth", root / "d4.pth")  # a link out, planted late

        await anyio.to_thread.run_sync(break_two)
        got = dict(zip((info.name for info in infos), await run.read_many(infos), strict=True))
    assert isinstance(got.pop("d1"), StorageNotFoundError)
    assert isinstance(got.pop("d4"), StoragePermissionError)
    assert len(got) == 4 and all(isinstance(data, bytes) and data for data in got.values())


async def test_other_storages_read_one_by_one_with_the_same_outcomes() -> None:
    storage = MemoryStorage("memory://many/run")
    await _write("memory://many/run", "shards", storage=storage)
    async with open_run("memory://many/run", storage=storage) as run:
        infos = await run.list()
        assert [await run.read_bytes(i) for i in infos] == await run.read_many(infos)


def test_group_small_keeps_the_order_and_puts_each_large_item_alone() -> None:
    from trajtrack.reader import group_small

    items = [1, 2, 30, 4, 5, 6, 70, 8]
    assert group_small(items, lambda x: x < 10, 2) == [[1, 2], [30], [4, 5], [70], [6, 8]]
    assert group_small([], lambda x: True, 3) == []
    groups = group_small(list(range(10)), lambda x: True, 4)
    assert [x for group in groups for x in group] == list(range(10))
