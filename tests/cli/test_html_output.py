"""``show``/``diff --html FILE``: never replaces the user's files, fails before the work, and
writes any name (non-UTF-8 bytes too) escaped."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import trajtrack.cli.diff as diff_command
import trajtrack.cli.show as show_command

from ._runs import run_cli, write_run

pytest.importorskip("matplotlib")

FF = os.fsdecode(b"\xff")  # a byte that is not UTF-8, as the file system gives it: '\udcff'


@pytest.fixture
def runs(tmp_path: Path) -> tuple[Path, Path]:
    a, b = tmp_path / "a", tmp_path / "b"
    write_run(str(a), {"step0/obs": torch.arange(4.0), "step1/obs": torch.ones(3)})
    write_run(str(b), {"step0/obs": torch.arange(4.0) + 1, "step1/obs": torch.ones(3)})
    return a, b


def _args(command: str, runs: tuple[Path, Path]) -> list[str]:
    a, b = runs
    return [command, str(a), "step0/obs"] if command == "show" else [command, str(a), str(b)]


@pytest.mark.parametrize("command", ["show", "diff"])
def test_a_file_that_is_not_a_report_is_never_replaced(
    runs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    dump = runs[0] / "step1" / "obs.pth"
    data = dump.read_bytes()
    code, _, err = run_cli(capsys, *_args(command, runs), "--html", str(dump))
    assert code == 2 and f"refusing to replace {dump}" in err and "Traceback" not in err
    assert dump.read_bytes() == data
    link = tmp_path / "link.html"  # a link: replaced, it would be gone; it is the user's
    link.symlink_to(dump)
    code, _, err = run_cli(capsys, *_args(command, runs), "--html", str(link))
    assert code == 2 and "symbolic link" in err
    assert link.is_symlink() and dump.read_bytes() == data


@pytest.mark.parametrize("command", ["show", "diff"])
def test_a_report_is_replaced_by_the_next(
    runs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    report = tmp_path / "r.html"
    first = run_cli(capsys, *_args(command, runs), "--html", str(report))[0]
    assert '<meta name="generator" content="trajtrack">' in report.read_text()  # the mark
    assert run_cli(capsys, *_args(command, runs), "--html", str(report))[0] == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "r.html"]  # no temp left


def test_the_output_path_is_checked_before_the_diff(
    runs: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def no_diff(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the diff ran before the output path was checked")

    monkeypatch.setattr(diff_command, "diff_runs", no_diff)
    target = tmp_path / "nodir" / "x.html"
    code, out, err = run_cli(capsys, *_args("diff", runs), "--html", str(target), "--json")
    assert code == 2 and out == ""  # no JSON saying exit_code 1, then exit 2
    assert f"cannot write {target}" in err
    folder = tmp_path / "adir"
    folder.mkdir()
    code, out, err = run_cli(capsys, *_args("diff", runs), "--html", str(folder))
    assert code == 2 and out == ""
    assert f"cannot write {folder}: it is a directory" in err and ".tmp" not in err
    assert list(folder.iterdir()) == []


def test_non_utf8_names_are_escaped_in_the_reports(
    runs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = runs
    odd = tmp_path / f"{FF}b"  # a run folder named with a non-UTF-8 byte
    shutil.copytree(b, odd)
    shutil.copy(b / "step0" / "obs.pth", odd / f"{FF}bad.pth")  # and a dump, in the plots
    report = tmp_path / "diff.html"
    code, out, err = run_cli(capsys, "diff", str(a), str(odd), "--html", str(report))
    assert code == 1, out + err
    page = report.read_text(encoding="utf-8")
    assert "\\udcffb" in page and "\\udcffbad" in page  # visible, as the text output shows it
    shown = tmp_path / "show.html"
    code, out, err = run_cli(capsys, "show", str(odd), f"{FF}bad", "--html", str(shown))
    assert code == 0, out + err
    assert "\\udcffbad" in shown.read_text(encoding="utf-8")


NOTES = b"<p>my notes</p>\n"  # a file of the user's: no report trajtrack wrote


def _leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("command", ["show", "diff"])
def test_without_overwrite_the_refusal_names_the_flag(
    runs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    mine = tmp_path / "notes.html"
    mine.write_bytes(NOTES)
    code, out, err = run_cli(capsys, *_args(command, runs), "--html", str(mine))
    assert code == 2 and out == "", err
    assert (
        f"refusing to replace {mine}: it exists and is not an HTML report trajtrack wrote; "
        "rerun with --overwrite to replace it, or choose another file"
    ) in err
    assert mine.read_bytes() == NOTES


@pytest.mark.parametrize("command", ["show", "diff"])
def test_overwrite_replaces_a_file_that_is_not_a_report(
    runs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    mine = tmp_path / "notes.html"
    mine.write_bytes(NOTES)
    code, _, err = run_cli(capsys, *_args(command, runs), "--html", str(mine), "--overwrite")
    assert code == (0 if command == "show" else 1), err
    assert f"HTML report written to {mine}" in err
    assert '<meta name="generator" content="trajtrack">' in mine.read_text()
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("command", ["show", "diff"])
def test_overwrite_replaces_a_link_as_a_link_never_its_target(
    runs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    mine = target / "notes.html"
    mine.write_bytes(NOTES)
    link = tmp_path / "link.html"
    link.symlink_to(mine)
    code, _, err = run_cli(capsys, *_args(command, runs), "--html", str(link), "--overwrite")
    assert code == (0 if command == "show" else 1), err
    assert not link.is_symlink()  # the link itself was replaced by the report
    assert '<meta name="generator" content="trajtrack">' in link.read_text()
    assert mine.read_bytes() == NOTES  # never written through
    assert sorted(p.name for p in target.iterdir()) == ["notes.html"]
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("command", ["show", "diff"])
def test_overwrite_still_refuses_a_directory_and_a_missing_folder_before_the_work(
    runs: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    command: str,
) -> None:
    def no_work(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the work began before the output path was checked")

    if command == "diff":
        monkeypatch.setattr(diff_command, "diff_runs", no_work)
    else:
        monkeypatch.setattr(show_command, "open_run", no_work)
    folder = tmp_path / "adir"
    folder.mkdir()
    (folder / "keep").write_bytes(NOTES)
    code, out, err = run_cli(capsys, *_args(command, runs), "--html", str(folder), "--overwrite")
    assert code == 2 and out == ""
    assert f"cannot write {folder}: it is a directory" in err and "Traceback" not in err
    assert sorted(p.name for p in folder.iterdir()) == ["keep"]
    assert (folder / "keep").read_bytes() == NOTES
    missing = tmp_path / "nodir" / "x.html"
    code, out, err = run_cli(capsys, *_args(command, runs), "--html", str(missing), "--overwrite")
    assert code == 2 and out == ""
    assert f"cannot write {missing}: no such directory" in err
    assert not missing.parent.exists()


@pytest.mark.parametrize("command", ["show", "diff"])
def test_overwrite_without_html_is_a_usage_error(
    runs: tuple[Path, Path], capsys: pytest.CaptureFixture[str], command: str
) -> None:
    code, out, err = run_cli(capsys, *_args(command, runs), "--overwrite")
    assert code == 2 and out == ""
    assert err.startswith("usage: trajtrack ")
    assert f"trajtrack {command}: error: --overwrite applies only to --html FILE" in err
