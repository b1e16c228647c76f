"""Readers and the CLI on sharded runs, files runs and mixes of the two; export."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import trajtrack
from trajtrack.backends import register_backend
from trajtrack.backends.local import LocalStorage
from trajtrack.layouts.records import RECORDS_PREFIX
from trajtrack.layouts.shards import SHARDS_DIR
from trajtrack.reader import SyncRun

from ._runs import run_cli, run_json

DUMPS = {
    f"step{i // 5}/sample{i % 5}": {"i": i, "x": torch.arange(50) * float(i)} for i in range(20)
}


def write(dest: Path, layout: str, dumps: dict[str, Any] = DUMPS, **options: Any) -> None:
    async def go() -> None:
        async with trajtrack.Tracker(dest, layout=layout, **options) as tracker:  # type: ignore[arg-type]
            for name, obj in dumps.items():
                await tracker.dump(obj, name)

    anyio.run(go)


@pytest.fixture
def sharded(tmp_path: Path) -> Path:
    write(tmp_path / "sharded", "shards", shard_max_bytes=20_000)
    return tmp_path / "sharded"


@pytest.fixture
def files(tmp_path: Path) -> Path:
    write(tmp_path / "files", "files")
    return tmp_path / "files"


def test_ls_show_and_verify_on_a_sharded_run(
    sharded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert len(list((sharded / SHARDS_DIR).glob("*.tar"))) >= 2
    code, listing = run_json(capsys, "ls", str(sharded))
    assert code == 0
    assert [d["name"] for d in listing["dumps"]] == list(DUMPS)
    assert all(d["shard"] and d["present"] and d["problem"] is None for d in listing["dumps"])
    code, shown = run_json(capsys, "show", str(sharded), "step2/sample3")
    assert code == 0
    x = next(c for c in shown["structure"]["children"] if c["key"] == "['x']")
    assert x["max"] == 49 * 13.0
    code, report = run_json(capsys, "verify", str(sharded))
    assert (code, report["ok"], report["counts"]["ok"]) == (0, True, 20)


def test_diff_of_a_sharded_run_against_a_files_run_of_the_same_data(
    sharded: Path, files: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, result = run_json(capsys, "diff", str(sharded), str(files))
    assert code == 0, result
    assert result["counts"]["equal"] == 20


def test_diff_names_the_dump_that_differs_in_a_shard(
    tmp_path: Path, sharded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    changed = dict(DUMPS)
    changed["step1/sample2"] = {"i": 7, "x": torch.arange(50) * 7.0 + 0.5}
    write(tmp_path / "other", "shards", changed)
    code, result = run_json(capsys, "diff", str(sharded), str(tmp_path / "other"))
    assert code == 1
    assert result["first_divergence"] == "step1/sample2"
    assert result["counts"] == {
        "equal": 19,
        "different": 1,
        "only_in_a": 0,
        "only_in_b": 0,
        "error": 0,
    }


def test_a_mixed_run_lists_both_layouts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dest = tmp_path / "mixed"
    write(dest, "files", {"a": DUMPS["step0/sample1"], "dup": {"v": 1}})
    write(dest, "shards", {"b": DUMPS["step0/sample2"], "dup": {"v": 2}})
    with SyncRun(dest) as run:
        listed = {d.name: d for d in run.list()}
        assert set(listed) == {"a", "b", "dup"}
        assert listed["a"].shard is None and listed["b"].shard is not None
        assert run.load("dup") == {"v": 2}  # the latest commit wins, across layouts
    code, _report = run_json(capsys, "verify", str(dest))
    assert code == 0


def test_verify_names_the_dump_whose_bytes_changed(
    sharded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with SyncRun(sharded) as run:
        target = run.info("step3/sample1")
    shard = sharded / str(target.shard)
    data = bytearray(shard.read_bytes())
    data[int(target.offset or 0) + target.size // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    code, report = run_json(capsys, "verify", str(sharded))
    assert code == 1
    assert [(p["name"], p["problem"]) for p in report["problems"]] == [("step3/sample1", "corrupt")]


class CountingLocal(LocalStorage):
    """A local storage that counts the bytes it reads (and how: whole files, or ranges)."""

    whole = 0
    ranged = 0

    async def read(self, path: str) -> bytes:
        data = await super().read(path)
        if not path.startswith(RECORDS_PREFIX):
            CountingLocal.whole += len(data)
        return data

    async def read_range(self, path: str, offset: int, length: int) -> bytes:
        data = await super().read_range(path, offset, length)
        CountingLocal.ranged += len(data)
        return data


def test_show_of_one_dump_reads_only_that_dumps_bytes(
    sharded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    register_backend(
        "counting", lambda url, **o: CountingLocal(url.removeprefix("counting://"), **o)
    )
    with SyncRun(sharded) as run:
        size = run.info("step1/sample1").size
    code, _out, _err = run_cli(capsys, "show", f"counting://{sharded}", "step1/sample1")
    assert code == 0
    assert (CountingLocal.whole, CountingLocal.ranged) == (0, size)


def test_a_shard_without_its_record_is_indexed_from_its_headers(
    sharded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for segment in (sharded / RECORDS_PREFIX).glob("*.jsonl"):  # a crash before the record
        segment.unlink()
    code, listing = run_json(capsys, "ls", str(sharded))
    assert code == 0
    assert sorted(d["name"] for d in listing["dumps"]) == sorted(DUMPS)
    assert not any(d["recorded"] for d in listing["dumps"])
    with SyncRun(sharded) as run:
        assert run.load("step2/sample4")["i"] == 14


def test_an_unrecorded_shard_whose_first_header_is_corrupt_is_reported(
    sharded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with SyncRun(sharded) as run:
        first = str(run.info("step0/sample0").shard)
        lost = {d.name for d in run.list() if d.shard == first}
    for segment in (sharded / RECORDS_PREFIX).glob("*.jsonl"):  # a crash before the record
        segment.unlink()
    with (sharded / first).open("r+b") as shard:  # the first member's name: its checksum fails
        shard.write(b"\xff" * 16)
    code, listing = run_json(capsys, "ls", str(sharded))
    assert code == 0
    (refused,) = [d for d in listing["dumps"] if d["problem"]]
    assert refused["path"] == first
    assert refused["problem"] == "its dumps could not be listed: a corrupt tar header at 0"
    assert sorted(d["name"] for d in listing["dumps"] if d is not refused) == sorted(
        set(DUMPS) - lost
    )
    code, out, _err = run_cli(capsys, "ls", str(sharded))
    assert code == 0
    assert any(first in line and "could not be listed" in line for line in out.splitlines())
    code, report = run_json(capsys, "verify", str(sharded), "--allow-unrecorded")
    assert code == 1  # the unrecorded dumps allowed, the shard not
    failing = [p for p in report["problems"] if p["problem"] != "unrecorded"]
    assert [(p["path"], p["problem"]) for p in failing] == [(first, "outside")]


def test_an_unrecorded_shard_cut_short_is_reported_with_the_dumps_before_the_cut(
    sharded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with SyncRun(sharded) as run:
        first = str(run.info("step0/sample0").shard)
        held = sorted((d for d in run.list() if d.shard == first), key=lambda d: d.offset or 0)
    for segment in (sharded / RECORDS_PREFIX).glob("*.jsonl"):  # a crash before the record
        segment.unlink()
    last = held[-1]
    assert last.offset is not None
    with (sharded / first).open("r+b") as shard:  # cut inside its last member
        shard.truncate(last.offset + last.size // 2)
    code, listing = run_json(capsys, "ls", str(sharded))
    assert code == 0
    (refused,) = [d for d in listing["dumps"] if d["problem"]]
    assert refused["path"] == first
    assert refused["problem"].startswith(
        f"its dumps after the first {len(held) - 1} could not be listed: the shard is cut short"
    )
    listed = {d["name"] for d in listing["dumps"] if d is not refused}
    assert listed == set(DUMPS) - {last.name}
    with SyncRun(sharded) as run:  # the complete members before the cut are still read
        assert run.load(held[0].name)["i"] == DUMPS[held[0].name]["i"]
    code, report = run_json(capsys, "verify", str(sharded), "--allow-unrecorded")
    assert code == 1  # the unrecorded dumps allowed, the cut shard not
    assert first in {p["path"] for p in report["problems"] if p["problem"] != "unrecorded"}


def test_export_writes_the_files_layout_with_its_record(
    sharded: Path, files: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "exported"
    code, result = run_json(capsys, "export", str(sharded), str(out))
    assert (code, result["written"], result["skipped"]) == (0, 20, [])
    loaded = torch.load(out / "step3/sample2.pth", weights_only=True)  # what old scripts do
    assert loaded["i"] == 17 and torch.equal(loaded["x"], torch.arange(50) * 17.0)
    assert not (out / SHARDS_DIR).exists()
    code, report = run_json(capsys, "verify", str(out))
    assert (code, report["counts"]["ok"]) == (0, 20)
    code, _diff = run_json(capsys, "diff", str(out), str(files))
    assert code == 0
    code, result = run_json(
        capsys, "export", str(sharded), str(tmp_path / "some"), "--glob", "step1/*"
    )
    assert result["written"] == 5


def test_export_refuses_to_launder_corruption(
    sharded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with SyncRun(sharded) as run:
        target = run.info("step0/sample3")
    shard = sharded / str(target.shard)
    data = bytearray(shard.read_bytes())
    data[int(target.offset or 0) + 5] ^= 0xFF
    shard.write_bytes(bytes(data))
    code, result = run_json(capsys, "export", str(sharded), str(tmp_path / "out"))
    assert code == 1
    assert [s["name"] for s in result["skipped"]] == ["step0/sample3"]
    assert not (tmp_path / "out" / "step0/sample3.pth").exists()


def test_tar_tools_read_a_shard_as_it_is(sharded: Path) -> None:
    for shard in (sharded / SHARDS_DIR).glob("*.tar"):
        with tarfile.open(shard) as archive:
            for member in archive:
                data = archive.extractfile(member).read()  # type: ignore[union-attr]
                obj = torch.load(__import__("io").BytesIO(data), weights_only=True)
                assert json.dumps(obj["i"])  # every member loads


def test_diff_html_report_of_a_sharded_run_against_a_files_run(
    sharded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib", reason="the report extra: pip install 'trajtrack[report]'")
    changed = dict(DUMPS)
    changed["step2/sample1"] = {"i": 11, "x": torch.arange(50) * 11.0 + 0.5}
    other = tmp_path / "other-files"
    write(other, "files", changed)
    report = tmp_path / "report.html"
    code, _, err = run_cli(capsys, "diff", str(sharded), str(other), "--html", str(report))
    assert code == 1, err
    page = report.read_text()
    assert 'id="first-divergence">step2/sample1</strong>' in page
    # The first divergent tensor was read again from its shard for the histogram.
    assert "step2/sample1 [&#x27;x&#x27;]: float32 [50], a - b of 50 elements" in page
