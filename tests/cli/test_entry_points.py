"""The real entry points (``python -m trajtrack``, the console script), help, and the demo."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ._runs import run_cli, write_run

COMMANDS = ["ls", "show", "diff", "verify", "demo"]


def trajtrack(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trajtrack", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        check=False,
    )


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_everywhere(command: str | None, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--help"] if command is None else [command, "--help"]
    code, out, _ = run_cli(capsys, *argv)
    assert code == 0
    assert out.startswith("usage: trajtrack")
    if command is None:
        assert "exit codes:" in out and all(c in out for c in COMMANDS)


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys)
    assert code == 2 and "usage:" in err


def test_python_m_trajtrack_diff_exit_codes_and_json(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    write_run(str(a), {"x": torch.zeros(3)})
    write_run(str(b), {"x": torch.tensor([0.0, 1.0, 0.0])})
    same = trajtrack("diff", str(a), str(a))
    assert same.returncode == 0, same.stderr
    differ = trajtrack("diff", str(a), str(b), "--json")
    assert differ.returncode == 1, differ.stderr
    assert json.loads(differ.stdout)["dumps"][0]["differences"][0]["index"] == [1]
    assert differ.stderr == ""  # no progress bar when stderr is not a terminal
    broken = trajtrack("diff", str(a), str(tmp_path / "missing"))
    assert broken.returncode == 2 and "error" in broken.stderr


@pytest.mark.skipif(shutil.which("trajtrack") is None, reason="console script not installed")
def test_console_script(tmp_path: Path) -> None:
    write_run(str(tmp_path / "r"), {"x": torch.zeros(1)})
    done = subprocess.run(
        ["trajtrack", "ls", str(tmp_path / "r"), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert [d["name"] for d in json.loads(done.stdout)["dumps"]] == ["x"]


def test_demo_pinpoints_the_perturbed_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    done = trajtrack("demo", str(tmp_path / "demo"))
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "first divergence: step2/sample3" in out
    assert "DIFFERENT  step2/sample3\n    .full_batch.batch['old_log_probs']" in out
    assert "first at index [1, 2]" in out
    assert "(exit code 1)" in out
    assert "webhdfs://" in out and "trajtrack.ray" in out  # what to try next
    report = tmp_path / "demo" / "diff-report.html"
    assert f"HTML report: {report}" in out
    assert 'id="first-divergence">step2/sample3</strong>' in report.read_text()
    # The demo's runs are real runs that verify; running it again replaces them.
    assert run_cli(capsys, "verify", str(tmp_path / "demo/run_a"))[0] == 0
    code, out, _ = run_cli(capsys, "demo", str(tmp_path / "demo"), "--steps", "3")
    assert code == 0 and "3 steps x 8 concurrent prompts" in out
    assert "step3/" not in run_cli(capsys, "ls", str(tmp_path / "demo/run_a"))[1]


def test_demo_refuses_to_replace_a_foreign_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "run_a").mkdir()
    (tmp_path / "run_a" / "precious.txt").write_text("keep me")
    code, _, err = run_cli(capsys, "demo", str(tmp_path))
    assert code == 2 and f"{tmp_path / 'run_a'} already holds files" in err
    assert (tmp_path / "run_a" / "precious.txt").read_text() == "keep me"


def test_demo_never_replaces_a_trajtrack_run_it_did_not_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A user's own run called run_a (the demo's hints suggest such names): a real trajtrack
    # run, .trajtrack/ and all, but not the demo's.
    mine = tmp_path / "run_a"
    write_run(str(mine), {"mine/obs": torch.arange(5)})
    before = {p: p.read_bytes() for p in mine.rglob("*") if p.is_file()}
    code, out, err = run_cli(capsys, "demo", str(tmp_path), "--steps", "1", "--prompts", "1")
    assert code == 2, out + err
    assert str(mine) in err and "did not write" in err
    assert {p: p.read_bytes() for p in mine.rglob("*") if p.is_file()} == before
    assert not (tmp_path / "run_b").exists()  # refused before writing anything
    code, out, _ = run_cli(capsys, "verify", str(mine), "--json")
    assert code == 0 and json.loads(out)["counts"]["ok"] == 1


def test_demo_help_says_what_it_writes_and_replaces(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "demo", "--help")
    text = " ".join(out.split())
    assert code == 0
    assert "DIR/run_a, DIR/run_b" in text and ".trajtrack/demo-run" in text
    assert "refused with exit 2" in text


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        [],
        ["bogus"],
        ["--version"],
        ["ls"],
        ["verify", "--help"],
        ["export", "RUN"],
        ["show", "--help"],
        ["show", "RUN"],
        ["diff"],
        ["diff", "A", "B", "--rtol", "x"],
        ["demo", "--help"],
        ["demo", "--steps", "x"],
    ],
    ids=[
        "help",
        "no-command",
        "unknown",
        "version",
        "ls-no-url",
        "verify-help",
        "export-no-dest",
        "show-help",
        "show-no-name",
        "diff-no-urls",
        "diff-bad-rtol",
        "demo-help",
        "demo-bad-steps",
    ],
)
def test_help_and_usage_errors_import_no_torch(argv: list[str]) -> None:
    # #31: `trajtrack --help` took seconds: it imported torch, which no answer here needs.
    code = (
        "import sys\nfrom trajtrack.cli import main\n"
        f"code = main({argv!r})\nprint('exit', code, 'torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    exit_code = 0 if argv[-1:] in (["--help"], ["--version"]) else 2
    assert done.stdout.splitlines()[-1] == f"exit {exit_code} False", done.stdout + done.stderr


def test_demo_claims_runs_on_other_storages_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # a remote DIR's report goes to the current folder
    small = ["--steps", "1", "--prompts", "1"]
    for _ in range(2):  # the second run replaces the demo's own runs
        code, out, err = run_cli(capsys, "demo", "memory://demo-claims/d", *small)
        assert code == 0, out + err
    code, out, _ = run_cli(capsys, "ls", "memory://demo-claims/d/run_a", "--json")
    listing = json.loads(out)
    assert code == 0 and len(listing["dumps"]) == 3  # 1 sample, 1 batch, metrics
    assert listing["record_segments"] == 1  # the first run's files were deleted
    write_run("memory://demo-claims/e/run_a", {"mine": torch.arange(3)})
    code, _, err = run_cli(capsys, "demo", "memory://demo-claims/e", *small)
    assert code == 2 and "memory://demo-claims/e/run_a already holds files" in err
    code, out, _ = run_cli(capsys, "ls", "memory://demo-claims/e/run_a", "--json")
    assert [d["name"] for d in json.loads(out)["dumps"]] == ["mine"]
