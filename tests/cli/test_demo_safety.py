"""``trajtrack demo DIR`` replaces only what it wrote itself, and checks that before any change."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ._runs import run_cli, write_run

SMALL = ("--steps", "1", "--prompts", "1")


def _tree(root: Path) -> dict[str, str]:
    """Every entry below *root* (links not followed): path -> file bytes, link target or dir."""
    found: dict[str, str] = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder, name)
            key = str(path.relative_to(root))
            if path.is_symlink():
                found[key] = "link -> " + os.readlink(path)
            elif path.is_dir():
                found[key] = "dir"
            else:
                found[key] = path.read_bytes().hex()
    return found


def test_empty_folders_and_links_are_the_users(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "keep.txt").write_text("keep me")
    dest = tmp_path / "demo"
    (dest / "run_a" / "experiments" / "2024" / "empty_for_later").mkdir(parents=True)
    (dest / "run_a" / "link_to_data").symlink_to(tmp_path / "data")
    before = _tree(dest)
    code, out, err = run_cli(capsys, "demo", str(dest), *SMALL)
    assert code == 2, out + err
    assert f"{dest / 'run_a'} already holds files" in err and "Traceback" not in err
    assert _tree(dest) == before  # nothing deleted, nothing written (no run_b, no report)
    assert (tmp_path / "data" / "keep.txt").read_text() == "keep me"


def test_a_link_as_a_run_folder_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "x.txt").write_text("x")
    dest = tmp_path / "demo"
    dest.mkdir()
    (dest / "run_b").symlink_to(tmp_path / "mine", target_is_directory=True)
    code, _, err = run_cli(capsys, "demo", str(dest), *SMALL)
    assert code == 2 and "symbolic link" in err
    assert _tree(dest) == {"run_b": f"link -> {tmp_path / 'mine'}"}
    assert (tmp_path / "mine" / "x.txt").read_text() == "x"


@pytest.mark.parametrize("kind", ["user file", "trajtrack diff report"])
def test_a_report_the_demo_did_not_write_is_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    dest = tmp_path / "demo"
    assert run_cli(capsys, "demo", str(dest), *SMALL)[0] == 0
    report = dest / "diff-report.html"
    if kind == "user file":
        report.write_text("<p>my notes</p>")
    else:  # a report of the user's own diff: not the demo's either
        pytest.importorskip("matplotlib")
        run_cli(capsys, "diff", str(dest / "run_a"), str(dest / "run_b"), "--html", str(report))
    before = _tree(dest)
    code, _, err = run_cli(capsys, "demo", str(dest), *SMALL)
    assert code == 2 and f"refusing to replace {report}" in err
    assert "--overwrite" not in err  # the demo has no such flag: only show and diff
    assert _tree(dest) == before  # the runs were not replaced either


def test_the_demo_replaces_its_own_runs_and_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    dest = tmp_path / "demo"
    assert run_cli(capsys, "demo", str(dest), *SMALL)[0] == 0
    assert (
        '<meta name="generator" content="trajtrack demo">'
        in (dest / "diff-report.html").read_text()
    )
    code, out, err = run_cli(capsys, "demo", str(dest), "--steps", "2", "--prompts", "1")
    assert code == 0, out + err
    assert "step1/sample0" in run_cli(capsys, "ls", str(dest / "run_a"))[1]


def test_a_refusal_changes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dest = tmp_path / "demo"
    assert run_cli(capsys, "demo", str(dest), *SMALL)[0] == 0
    # run_a stays the demo's; run_b becomes a folder of the user's (a file added to it)
    (dest / "run_b" / "notes.txt").write_text("mine")
    before = _tree(dest)
    code, _, err = run_cli(capsys, "demo", str(dest), *SMALL)
    assert code == 2 and f"{dest / 'run_b'} already holds files" in err and "notes.txt" in err
    assert _tree(dest) == before  # run_a was not cleared before run_b was refused


def test_an_empty_folder_added_to_a_demo_run_is_the_users(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "demo"
    assert run_cli(capsys, "demo", str(dest), *SMALL)[0] == 0
    (dest / "run_a" / "keep_me").mkdir()
    code, _, err = run_cli(capsys, "demo", str(dest), *SMALL)
    assert code == 2 and "keep_me" in err
    assert (dest / "run_a" / "keep_me").is_dir()
    (dest / "run_a" / "keep_me").rmdir()
    assert run_cli(capsys, "demo", str(dest), *SMALL)[0] == 0


def test_an_unfinished_demo_run_is_not_replaced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A marker that lists nothing (a demo interrupted mid-run, or an older trajtrack's):
    # what the folder holds cannot be told from the user's files.
    dest = tmp_path / "demo"
    write_run(str(dest / "run_a"), {"mine": torch.arange(3)})
    (dest / "run_a" / ".trajtrack" / "demo-run").write_text("written by `trajtrack demo`\n")
    before = _tree(dest)
    code, _, err = run_cli(capsys, "demo", str(dest), *SMALL)
    assert code == 2 and "did not finish" in err
    assert _tree(dest) == before


@pytest.mark.parametrize("inside", [False, True])
def test_a_dir_that_is_a_run_or_inside_one_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], inside: bool
) -> None:
    run = tmp_path / "u1"
    write_run(str(run), {"step0/obs": torch.arange(3)})
    before = _tree(run)
    dest = run / "sub" if inside else run
    code, _, err = run_cli(capsys, "demo", str(dest), *SMALL)
    assert code == 2 and "trajtrack run" in err
    assert _tree(run) == before  # no run_a, run_b or report put into the user's run
    assert run_cli(capsys, "verify", str(run))[0] == 0
