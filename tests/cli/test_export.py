"""``trajtrack export`` run again, part-way, into a folder that differs, and on broken runs."""

from __future__ import annotations

import io
import json
import os
import tarfile
import zlib
from pathlib import Path

import anyio
import pytest
import torch

import trajtrack
from trajtrack._exceptions import StorageError
from trajtrack.backends.memory import MemoryStorage
from trajtrack.reader import export_run, open_run

from ._runs import run_cli, run_json


def write_sharded(dest: Path, values: dict[str, float]) -> None:
    """A sharded run (the layout export exists for): one small dump per name."""

    async def go() -> None:
        async with trajtrack.Tracker(dest, layout="shards") as tracker:
            for name, value in values.items():
                await tracker.dump({"x": torch.full((4,), value)}, name)
            await tracker.flush(timeout=60)  # seals the shard now, not after its age

    anyio.run(go)


def crcs(folder: Path) -> dict[str, int]:
    """zlib's CRC-32 of every ``.pth`` file below *folder*, by relative path."""
    return {str(p.relative_to(folder)): zlib.crc32(p.read_bytes()) for p in folder.rglob("*.pth")}


def values(count: int = 3, *, changed: str | None = None) -> dict[str, float]:
    names = [f"step{s}/sample{i}" for s in range(2) for i in range(count)]
    return {n: (100.0 if n == changed else float(k)) for k, n in enumerate(names)}


def test_exporting_again_skips_what_is_there_and_records_everything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, dest = tmp_path / "run", tmp_path / "dest"
    write_sharded(run, values())
    code, first = run_json(capsys, "export", str(run), str(dest), "--glob", "step1/*")
    assert (code, first["written"], first["skipped"]) == (0, 3, [])
    code, again = run_json(capsys, "export", str(run), str(dest))  # the rest, then all
    assert code == 0, again
    assert (again["written"], again["unchanged"], again["skipped"]) == (3, 3, [])
    code, out, err = run_cli(capsys, "export", str(run), str(dest))
    assert code == 0, out + err
    assert "exported 0 dumps (0 B)" in out and "6 already there, unchanged" in out
    # Every file in the destination has a record, and its bytes are the source's.
    code, checked = run_json(capsys, "verify", str(dest))
    assert code == 0 and checked["counts"]["ok"] == 6 and checked["problems"] == [], checked
    with trajtrack.SyncRun(run) as source:
        want = {i.path: zlib.crc32(source.read_bytes(i)) for i in source.list()}
    assert crcs(dest) == want


def test_other_bytes_in_the_destination_are_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_a, run_b, dest = tmp_path / "a", tmp_path / "b", tmp_path / "dest"
    write_sharded(run_a, values())
    write_sharded(run_b, values(changed="step1/sample0"))
    assert run_cli(capsys, "export", str(run_a), str(dest))[0] == 0
    before = crcs(dest)
    code, out, err = run_cli(capsys, "export", str(run_b), str(dest))
    assert code == 1, out + err  # "some dumps were skipped", as the help says
    assert "SKIPPED  step1/sample0: " in out and "5 already there, unchanged" in out
    assert "step1/sample0" in err and "--overwrite" in err
    assert "Traceback" not in err and "ExceptionGroup" not in err
    assert crcs(dest) == before  # kept as it was
    code, result = run_json(capsys, "export", str(run_b), str(dest))
    assert code == 1 and result["existing"] == ["step1/sample0"]
    assert [s["name"] for s in result["skipped"]] == ["step1/sample0"]
    code, result = run_json(capsys, "export", str(run_b), str(dest), "--overwrite")
    assert code == 0 and result["written"] == 6 and result["skipped"] == []
    loaded = torch.load(dest / "step1" / "sample0.pth", weights_only=True)
    assert torch.equal(loaded["x"], torch.full((4,), 100.0))
    assert run_json(capsys, "verify", str(dest))[0] == 0


def test_a_run_that_cannot_be_read_leaves_nothing_and_json_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "dest"
    code, out, err = run_cli(capsys, "export", str(tmp_path / "missing"), str(dest), "--json")
    assert code == 2
    result = json.loads(out)  # JSON on failure too
    assert result["exit_code"] == 2 and "missing" in result["error"]
    assert "error" in err
    assert not dest.exists()  # not even DEST/.trajtrack/spool/
    code, out, err = run_cli(capsys, "export", str(tmp_path / "missing"), str(dest))
    assert code == 2 and out == "" and "trajtrack export: error:" in err
    assert not dest.exists()


def test_a_dangling_link_is_reported_and_the_rest_exported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, dest = tmp_path / "run", tmp_path / "dest"

    async def go() -> None:
        async with trajtrack.Tracker(run) as tracker:  # the files layout
            for i in range(3):
                await (await tracker.dump({"x": torch.arange(i + 2)}, f"s/d{i}"))

    anyio.run(go)
    (run / "s" / "d1.pth").unlink()
    os.symlink("gone.pth", run / "s" / "d1.pth")  # inside the run, leading nowhere
    code, out, err = run_cli(capsys, "export", str(run), str(dest))
    assert code == 1, out + err
    assert "SKIPPED  s/d1: not read" in out and "exported 2 dumps" in out
    assert "Traceback" not in err and "ExceptionGroup" not in err
    assert sorted(crcs(dest)) == ["s/d0.pth", "s/d2.pth"]
    assert run_json(capsys, "verify", str(dest))[0] == 0


async def test_a_size_that_changed_since_the_listing_is_reported(tmp_path: Path) -> None:
    run = tmp_path / "run"

    def save_unrecorded() -> None:  # no record: no checksum, the listing's size is all there is
        run.mkdir()
        for i in range(3):
            torch.save({"x": torch.arange(i + 2)}, run / f"d{i}.pth")

    def grow() -> None:
        with open(run / "d1.pth", "ab") as grown:
            grown.write(b"more")

    await anyio.to_thread.run_sync(save_unrecorded)
    async with open_run(run) as source:
        await source.list()  # the listing, cached
        await anyio.to_thread.run_sync(grow)
        result = await export_run(source, MemoryStorage("memory://export-size/dest"))
    assert result.written == 2
    assert [n for n, _ in result.skipped] == ["d1"] and "recorded" in result.skipped[0][1]


async def test_a_write_failure_part_way_raises_typed_and_records_what_was_written(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    await anyio.to_thread.run_sync(write_sharded, run, values(count=40))

    def full_disk(operation: str, path: str) -> None:
        if operation == "write" and path.startswith("step1/"):
            raise StorageError(f"{path}: no space left on the device")

    dest = MemoryStorage("memory://export-fail/dest", fault=full_disk)
    async with open_run(run) as source:
        with pytest.raises(StorageError, match="no space left"):  # typed, not a group
            await export_run(source, dest)
    async with open_run("memory://export-fail/dest") as copy:
        listed = await copy.list()
    assert listed and all(i.recorded for i in listed)  # nothing left without a record
    assert {i.name.split("/")[0] for i in listed} == {"step0"}


def test_a_hostile_name_in_a_warning_reaches_the_terminal_escaped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The library's warnings quote run-supplied names; the CLI's log lines escape them, as
    it escapes everything else it prints (SECURITY.md)."""
    run, dest = tmp_path / "run", tmp_path / "dest"
    shards = run / ".trajtrack" / "shards"
    shards.mkdir(parents=True)
    member = io.BytesIO()
    torch.save(torch.arange(3.0), member)
    with tarfile.open(shards / "w-000000.tar", "w", format=tarfile.PAX_FORMAT) as tar:
        for name in ("a\x1b[2Jb.pth", "ok.pth"):  # unrecorded members: ESC [2J clears a screen
            info = tarfile.TarInfo(name)
            info.size = len(member.getvalue())
            tar.addfile(info, io.BytesIO(member.getvalue()))
    code, out, err = run_cli(capsys, "export", str(run), str(dest))
    assert "\x1b" not in out + err
    assert "not exported: a\\x1b[2Jb" in err, err
    assert code == 1 and "exported 1 dump" in out, out
