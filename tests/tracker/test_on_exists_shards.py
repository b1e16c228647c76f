"""``on_exists="error"`` refuses every dump path the reader would list, whichever layout wrote
it: members of a shard no record names (a writer that died between the shard's rename and
its record), and, for a files-layout writer, dumps held in shards.

Each run is written by a real tracker to a local destination; the unrecorded shard is what a
crash leaves (its record segments are removed, the shard is kept), and what the reader
returns is compared against the first dump's own value.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import anyio
import pytest
import torch

from trajtrack import DumpExistsError, Tracker
from trajtrack.reader import open_run

pytestmark = pytest.mark.anyio

FIRST = {"v": torch.tensor([1.0, 2.0])}


async def _sharded_run(dest: Path, *, recorded: bool) -> None:
    async with Tracker(dest, layout="shards") as tracker:
        await (await tracker.dump(FIRST, "step1/obs")).wait(30)
    if not recorded:  # what a crash after the shard's rename, before its record, leaves
        shutil.rmtree(dest / ".trajtrack" / "records")
    async with open_run(dest) as run:
        assert [info.recorded for info in await run.list()] == [recorded]


async def _stored(dest: Path) -> torch.Tensor:
    async with open_run(dest) as run:
        loaded = await run.load("step1/obs")
    assert isinstance(loaded, dict)
    return loaded["v"]


async def _refused_and_kept(dest: Path, layout: str) -> None:
    async with Tracker(dest, layout=layout, on_exists="error") as tracker:
        again = await tracker.dump({"v": torch.zeros(2)}, "step1/obs")
        other = await tracker.dump({"v": torch.ones(2)}, "step1/act")
        with anyio.fail_after(30), pytest.raises(DumpExistsError, match="step1/obs"):
            await again
        assert (await other.wait(30)).path == "step1/act.pth"
        with pytest.raises(DumpExistsError):
            await tracker.flush(timeout=30)
    assert torch.equal(await _stored(dest), FIRST["v"])


@pytest.mark.parametrize("layout", ["shards", "files"])
async def test_a_member_of_an_unrecorded_shard_is_not_written_again(
    tmp_path: Path, layout: str
) -> None:
    await _sharded_run(tmp_path / "run", recorded=False)
    await _refused_and_kept(tmp_path / "run", layout)


async def test_a_files_layout_writer_refuses_a_recorded_shard_member(tmp_path: Path) -> None:
    await _sharded_run(tmp_path / "run", recorded=True)
    await _refused_and_kept(tmp_path / "run", "files")


async def test_overwrite_still_replaces_a_shard_member(tmp_path: Path) -> None:
    await _sharded_run(tmp_path / "run", recorded=True)
    async with Tracker(tmp_path / "run") as tracker:  # on_exists="overwrite", the default
        await (await tracker.dump({"v": torch.zeros(2)}, "step1/obs")).wait(30)
    assert torch.equal(await _stored(tmp_path / "run"), torch.zeros(2))
