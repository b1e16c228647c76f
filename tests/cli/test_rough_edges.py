"""What a new user meets first: options where typed, messages that say what is wrong."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from ._runs import run_cli, write_run


@pytest.fixture
def run(tmp_path: Path) -> Path:
    path = tmp_path / "run"
    write_run(str(path), {"step0/obs": torch.arange(4), "step0/act": torch.ones(2)})
    return path


def test_verbose_after_the_subcommand(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "ls", str(run), "-v")
    assert code == 0 and "unrecognized arguments" not in err
    assert "2 dumps" in out
    assert _cli_log_level() == logging.INFO
    code, _, _ = run_cli(capsys, "verify", str(run), "-vv", "--json")
    assert code == 0 and _cli_log_level() == logging.DEBUG
    assert run_cli(capsys, "ls", str(run))[0] == 0 and _cli_log_level() == logging.WARNING


def _cli_log_level() -> int:
    """The level of the handler the command line put on the ``trajtrack`` logger."""
    (handler,) = [
        h for h in logging.getLogger("trajtrack").handlers if getattr(h, "_trajtrack_cli", False)
    ]
    return handler.level


def test_ls_of_a_file_says_it_is_not_a_directory(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = run / "step0" / "obs.pth"
    code, _, err = run_cli(capsys, "ls", str(a_file))
    assert code == 2
    assert f"{a_file} is not a directory" in err and "no such directory" not in err


@pytest.mark.parametrize("command", ["show", "diff"])
def test_html_into_a_missing_folder_names_the_given_path(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    pytest.importorskip("matplotlib")
    target = tmp_path / "nowhere" / "report.html"
    args = [str(run), "step0/obs"] if command == "show" else [str(run), str(run)]
    code, _, err = run_cli(capsys, command, *args, "--html", str(target))
    assert code == 2
    assert f"cannot write {target}" in err and ".tmp" not in err
    assert not target.parent.exists()


def test_verify_of_an_empty_run_says_it_has_no_dumps(
    tmp_path: Path, run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out, _ = run_cli(capsys, "verify", str(empty))
    assert code == 1  # nothing was verified: not "OK" (see verify --help)
    assert "the run has no dumps" in out and "OK" not in out
    code, out, _ = run_cli(capsys, "verify", str(run), "--glob", "nothing/*", "--json")
    assert code == 1 and json.loads(out)["no_dumps"] is True
    assert run_cli(capsys, "verify", str(run))[0] == 0


def test_diff_against_an_empty_run_says_which_has_no_dumps(
    tmp_path: Path, run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out, _ = run_cli(capsys, "diff", str(run), str(empty))
    assert code == 1
    assert "B has no dumps" in out and "A has no dumps" not in out
    code, out, _ = run_cli(capsys, "diff", str(empty), str(run))
    assert "A has no dumps" in out and "B has no dumps" not in out
    code, out, _ = run_cli(capsys, "diff", str(run), str(run))
    assert code == 0 and "has no dumps" not in out
