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
