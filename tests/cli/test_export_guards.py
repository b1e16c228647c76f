"""``trajtrack export`` into its own run, of names no record holds, and into a folder that
holds something else where a dump goes: refused before writing, or that dump skipped."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from ._runs import run_cli, write_run

DUMPS = {"step0/obs": torch.arange(4), "step1/obs": torch.ones(3), "step2/obs": torch.zeros(2)}


@pytest.fixture
def run(tmp_path: Path) -> Path:
    path = tmp_path / "runs" / "r1"
    write_run(str(path), DUMPS)
    return path


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


@pytest.mark.parametrize("where", ["inside", "itself", "holds", "link"])
def test_export_into_its_own_run_is_refused_before_writing(
    where: str, tmp_path: Path, run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _files(tmp_path)
    if where == "link":  # a link elsewhere that leads into the run
        (tmp_path / "elsewhere").symlink_to(run)
        before = _files(tmp_path)
    dest = {
        "inside": run / "exp",
        "itself": run,
        "holds": tmp_path / "runs",
        "link": tmp_path / "elsewhere" / "exp",
    }[where]
    for _ in range(2):  # a second export would copy the first copy along
        code, _, err = run_cli(capsys, "export", str(run), str(dest))
        assert code == 2
        assert "refusing to export" in err and "Traceback" not in err
    assert _files(tmp_path) == before  # nothing written
    code, out, _ = run_cli(capsys, "export", str(run), str(dest), "--json")
    assert code == 2 and "refusing to export" in json.loads(out)["error"]
    assert run_cli(capsys, "verify", str(run))[0] == 0


def test_export_next_to_its_run_is_not_refused(
    tmp_path: Path, run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "runs" / "r1-export"  # a name that starts like the run's: a sibling
    code, out, _ = run_cli(capsys, "export", str(run), str(dest))
    assert code == 0 and "exported 3 dumps" in out
    assert run_cli(capsys, "verify", str(dest))[0] == 0


def test_a_name_no_record_holds_is_skipped_and_verify_dest_passes(
    tmp_path: Path, run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    buffer = io.BytesIO()
    torch.save(torch.arange(3), buffer)
    (run / "step0" / "esc\x1b[31mred.pth").write_bytes(buffer.getvalue())  # in no record
    dest = tmp_path / "dest"
    code, out, err = run_cli(capsys, "export", str(run), str(dest))
    assert code == 1  # skipped, reported: as other dumps that cannot be exported
    assert "SKIPPED  step0/esc\\x1b[31mred:" in out and "\x1b" not in out + err
    assert "exported 3 dumps" in out and "1 skipped" in out
    assert not any("red" in name for name in _files(dest))
    code, out, _ = run_cli(capsys, "verify", str(dest))
    assert code == 0, out  # as the docs promise after an export


def test_something_else_in_a_dumps_place_skips_that_dump_only(
    tmp_path: Path, run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "dest"
    (dest / "step0" / "obs.pth").mkdir(parents=True)  # a folder where a file goes
    (dest / "step1").write_bytes(b"mine")  # a file where a folder goes
    code, out, err = run_cli(capsys, "export", str(run), str(dest), "--overwrite")
    assert code == 1, err  # not 2: the export carries on past both
    assert "SKIPPED  step0/obs:" in out and "SKIPPED  step1/obs:" in out
    assert "exported 1 dumps" in out and "2 skipped" in out
    assert (dest / "step2" / "obs.pth").is_file()
    assert (dest / "step0" / "obs.pth").is_dir() and (dest / "step1").read_bytes() == b"mine"
    code, out, _ = run_cli(capsys, "export", str(run), str(dest))  # without --overwrite too
    assert code == 1 and "SKIPPED  step1/obs:" in out and "already there, unchanged" in out
