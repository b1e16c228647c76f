"""The reader never leaves the run: hostile record paths and links out are reported, never read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
import torch

from trajtrack import StoragePermissionError
from trajtrack.backends.memory import MemoryStorage
from trajtrack.layouts.records import RECORDS_PREFIX
from trajtrack.reader import SyncRun

from ._runs import run_cli, run_json, write_run

SECRET = b"the contents of a file outside the run"


def _record_line(path: str, **extra: Any) -> str:
    line = {
        "v": 1,
        "name": path.removesuffix(".pth"),
        "path": path,
        "size": 10,
        "checksum": "crc32:00000000",
        "host": "h",
        "pid": 1,
        "rank": 0,
        "writer": "evil",
        "time": 1.0,
        **extra,
    }
    return json.dumps(line) + "\n"


def _plant_record(run: Path, *lines: str) -> None:
    segment = run / RECORDS_PREFIX / "evil-000000.jsonl"
    segment.parent.mkdir(parents=True, exist_ok=True)
    segment.write_text("".join(lines))


@pytest.fixture
def hostile_run(tmp_path: Path) -> Path:
    """A real run, plus a record line pointing outside and a link leading out."""
    run = tmp_path / "run"
    write_run(str(run), {"good": {"x": torch.arange(3)}})
    (tmp_path / "outside.pth").write_bytes(SECRET)
    torch.save({"x": torch.zeros(2)}, tmp_path / "elsewhere.pth")
    (run / "linked.pth").symlink_to(tmp_path / "elsewhere.pth")
    _plant_record(
        run,
        _record_line("../outside.pth"),
        _record_line("sub/../../outside.pth"),
        _record_line("inshard.pth", shard="../outside.pth", offset=0),
    )
    return run


def test_each_shard_member_is_judged_by_its_own_shard_and_place(tmp_path: Path) -> None:
    # Shards are checked once each, places once per member: members sharing a shard share
    # its verdict and no more (a bad offset refuses that member only).
    run = tmp_path / "run"
    write_run(str(run), {"good": {"x": torch.arange(3)}})
    real = ".trajtrack/shards/w-000001.tar"
    _plant_record(
        run,
        _record_line("a.pth", shard=real, offset=0),
        _record_line("b.pth", shard=real, offset=-1),
        _record_line("c.pth", shard=real, offset=512),
        _record_line("d.pth", shard="step0/w.tar", offset=0),
        _record_line("e.pth", shard="step0/w.tar", offset=512),
        _record_line("f.pth", shard="../w.tar", offset=0),
    )
    with SyncRun(run) as reader:
        problems = {d.path: d.problem for d in reader.list()}
    assert problems["good.pth"] is None
    assert problems["a.pth"] is None and problems["c.pth"] is None
    assert problems["b.pth"] == "its place in the shard (-1, 10 bytes) is invalid"
    for path in ("d.pth", "e.pth"):
        assert problems[path] == "its shard 'step0/w.tar' is not a shard of the run"
    assert problems["f.pth"] == "its shard '../w.tar' is not a path inside the run"


def test_ls_reports_every_escape_as_a_problem(
    hostile_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, listing = run_json(capsys, "ls", str(hostile_run))
    assert code == 0
    problems = {d["path"]: d["problem"] for d in listing["dumps"]}
    assert problems["good.pth"] is None
    for path in ("../outside.pth", "sub/../../outside.pth", "inshard.pth", "linked.pth"):
        assert problems[path], path
    code, out, _ = run_cli(capsys, "ls", str(hostile_run))
    assert out.count("refused:") == 4


@pytest.mark.parametrize("name", ["../outside", "sub/../../outside", "inshard", "linked"])
def test_show_refuses_to_read_outside_the_run(
    hostile_run: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, "show", str(hostile_run), name)
    assert code == 2
    assert "refusing to read" in err
    assert "outside" not in out and SECRET.decode() not in out + err


def test_load_and_read_bytes_refuse(hostile_run: Path) -> None:
    with SyncRun(hostile_run) as run:
        for name in ("../outside", "linked", "inshard"):
            with pytest.raises(StoragePermissionError):
                run.read_bytes(name)
            with pytest.raises(StoragePermissionError):
                run.load(name)
        assert run.load("good")["x"].tolist() == [0, 1, 2]


def test_verify_fails_on_escapes_without_reading_them(
    hostile_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, report = run_json(capsys, "verify", str(hostile_run), "--allow-unrecorded")
    assert code == 1
    outside = {p["path"] for p in report["problems"] if p["problem"] == "outside"}
    assert outside == {"../outside.pth", "sub/../../outside.pth", "inshard.pth", "linked.pth"}


def test_diff_reports_escapes_as_errors(
    hostile_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "other"
    write_run(str(other), {"good": {"x": torch.arange(3)}, "linked": {"x": torch.zeros(2)}})
    code, result = run_json(capsys, "diff", str(hostile_run), str(other))
    assert code == 2
    statuses = {d["name"]: d["status"] for d in result["dumps"]}
    assert statuses["good"] == "equal"
    assert statuses["linked"] == "error"


def test_memory_storage_refuses_traversal_by_name() -> None:
    storage = MemoryStorage("memory://contain/run")
    with pytest.raises(StoragePermissionError):
        storage.put_raw("../x", b"x")


def _link_out_after_listing(run: Path, tmp_path: Path) -> None:
    """Replace a listed dump by a link out of the run (the listing already said it is fine)."""
    target = tmp_path / "elsewhere.pth"
    (run / "good.pth").unlink()
    (run / "good.pth").symlink_to(target)


def test_a_link_planted_after_listing_is_not_loaded_by_path(
    hostile_run: Path, tmp_path: Path
) -> None:
    # Local files are loaded by path (torch opens them): the path is checked where it is opened.
    with SyncRun(hostile_run) as run:
        info = run.info("good")
        assert info.problem is None
        _link_out_after_listing(hostile_run, tmp_path)
        with pytest.raises(StoragePermissionError, match="outside the run"):
            run.load(info)


async def test_diff_compares_no_file_out_of_the_run_in_place(
    hostile_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import trajtrack.reader._diff as diff_module
    from trajtrack.reader import diff_runs, open_run

    other = tmp_path / "other"
    await anyio.to_thread.run_sync(write_run, str(other), {"good": {"x": torch.zeros(2)}})
    real_compare = diff_module.compare_files

    def compare_after_planting(*args: Any) -> Any:  # the link appears after listing
        _link_out_after_listing(hostile_run, tmp_path)
        return real_compare(*args)

    monkeypatch.setattr(diff_module, "compare_files", compare_after_planting)
    monkeypatch.setattr(diff_module, "_SMALL", 0)  # compared in place (small pairs are read)
    async with open_run(hostile_run) as run_a, open_run(other) as run_b:
        result = await diff_runs(run_a, run_b, names="good")
    (good,) = result.comparisons
    assert good.status == "error" and "outside the run" in (good.error or "")


async def test_a_shard_replaced_by_a_link_out_after_listing_is_not_read(tmp_path: Path) -> None:
    # Batches of shard members (diff, verify, export) open each shard checked not to lead out.
    from trajtrack import Tracker
    from trajtrack.reader import open_run

    run, outside = tmp_path / "run", tmp_path / "outside"
    async with Tracker(run, layout="shards") as tracker:
        for i in range(3):
            await tracker.dump({"x": torch.full((4,), i)}, f"d{i}")
    (shard,) = (run / ".trajtrack" / "shards").glob("*.tar")
    async with open_run(run) as opened:
        infos = await opened.list()
        assert [d.problem for d in infos] == [None] * 3
        outside.mkdir()
        shard.rename(outside / shard.name)
        shard.symlink_to(outside / shard.name)
        results = await opened.read_many(infos)
    assert len(results) == 3
    for result in results:
        assert isinstance(result, StoragePermissionError) and "outside the run" in str(result)
