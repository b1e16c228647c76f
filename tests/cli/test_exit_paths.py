"""How the command ends when there is nothing to say yes to, a dump is corrupt, its reader
closes stdout, or Ctrl-C comes early: a clear line and the documented exit code."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio.to_thread
import pytest
import torch

from trajtrack.reader import diff_runs, open_run, render_diff_report
from trajtrack.reader._safe_load import first_line

from ._runs import run_cli, run_json, write_run


@pytest.fixture
def run(tmp_path: Path) -> Path:
    path = tmp_path / "run"
    write_run(str(path), {"step0/obs": torch.arange(4), "step1/obs": torch.ones(3)})
    return path


def test_diff_that_compared_nothing_is_not_equal(
    tmp_path: Path, run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, "diff", str(run), str(run), "--names", "step9*")
    assert code == 1  # a typo in a CI check must not pass (as verify: nothing to verify)
    assert "nothing to compare" in err and "'step9*'" in err
    assert "A has no dumps" in out and "B has no dumps" in out
    assert out.rstrip().endswith("nothing to compare: not 'equal'")
    code, report = run_json(capsys, "diff", str(run), str(run), "--names", "step9*")
    assert code == 1
    assert report["equal"] is False and report["no_dumps"] is True
    assert report["exit_code"] == 1 and report["differ"] is False
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty2").mkdir()
    code, _, err = run_cli(capsys, "diff", str(tmp_path / "empty"), str(tmp_path / "empty2"))
    assert code == 1 and "nothing to compare" in err
    code, report = run_json(capsys, "diff", str(run), str(run))  # something compared: equal
    assert code == 0 and report["equal"] is True and report["no_dumps"] is False


def _corrupt_copy(tmp_path: Path) -> tuple[Path, Path]:
    """A run, and a copy in which one small dump is garbage, one small dump has a flipped
    byte (same size) and one large dump (compared as local files) is truncated."""
    dumps = {
        "step0/obs": torch.arange(4),
        "step1/obs": torch.ones(3),
        "step2/obs": torch.zeros(40_000),  # 160 KB: a large pair, loaded from its files
    }
    good, bad = tmp_path / "good", tmp_path / "bad"
    write_run(str(good), dumps)
    write_run(str(bad), dumps)
    (bad / "step0" / "obs.pth").write_bytes(b"garbage")
    flipped = bytearray((bad / "step1" / "obs.pth").read_bytes())
    flipped[flipped.index(b"\x80\x02") + 2] ^= 0xFF  # the pickle's first opcode
    (bad / "step1" / "obs.pth").write_bytes(bytes(flipped))
    big = bad / "step2" / "obs.pth"
    big.write_bytes(big.read_bytes()[:70_000])
    return good, bad


def test_a_corrupt_dump_says_what_is_wrong_never_to_load_it_unsafely(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good, bad = _corrupt_copy(tmp_path)
    code, _, err = run_cli(capsys, "show", str(bad), "step0/obs")
    assert code == 2
    assert "Unsupported operand" in err  # the cause torch gives, not its advice
    assert "weights_only" not in err and "Traceback" not in err
    code, report = run_json(capsys, "diff", str(good), str(bad))
    assert code == 2
    errors = {d["name"]: d["error"] for d in report["dumps"] if d["status"] == "error"}
    assert set(errors) == {"step0/obs", "step1/obs", "step2/obs"}
    assert all("weights_only" not in e for e in errors.values())
    # Where the stored bytes disagree with the record, that comes first.
    assert errors["step0/obs"].startswith("B:step0/obs: 7 bytes stored,")
    assert "Unsupported operand" in errors["step0/obs"]
    assert errors["step1/obs"].startswith("B:step1/obs: checksum crc32:")
    assert errors["step2/obs"].startswith("B:step2/obs: 70000 bytes stored,")
    code, out, _ = run_cli(capsys, "diff", str(good), str(bad))
    assert code == 2 and "weights_only" not in out and "changed since it was written" in out


def test_show_of_a_dump_changed_since_written_gives_the_hint_diff_gives(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good, bad = _corrupt_copy(tmp_path)
    _, report = run_json(capsys, "diff", str(good), str(bad))
    hints = {  # diff's text on run B's dump, before the loader's error
        d["name"]: d["error"].split("; ")[0].removeprefix("B:")
        for d in report["dumps"]
        if d["status"] == "error"
    }
    assert hints["step1/obs"].startswith("step1/obs: checksum crc32:")  # same size, CRC-32 not
    assert hints["step2/obs"].startswith("step2/obs: 70000 bytes stored,")
    for name, hint in hints.items():
        assert "changed since it was written" in hint
        code, out, err = run_cli(capsys, "show", str(bad), name)
        assert (code, out) == (2, "")
        assert err.startswith(f"trajtrack show: error: {hint}; {name}: "), err
        assert "Traceback" not in err and "weights_only" not in err
    code, _, err = run_cli(capsys, "show", str(good), "step1/obs")  # the same dump, unchanged
    assert code == 0 and err == ""


def test_first_line_keeps_the_cause_of_torchs_refusal() -> None:
    refusal = None
    try:
        torch.load(io.BytesIO(b"garbage"), weights_only=True)
    except Exception as exc:  # torch's UnpicklingError, with its paragraphs of advice
        refusal = exc
    assert refusal is not None
    assert first_line(refusal) == "UnpicklingError: Unsupported operand 103"
    old_style = RuntimeError(
        "Weights only load failed. Re-running `torch.load` with `weights_only` set to `False` "
        "will likely succeed, but it can result in arbitrary code execution.\n Please file an "
        "issue with the following so that we can make `weights_only=True` compatible with "
        "your use case: WeightsUnpickler error: Unsupported operand 7"
    )
    assert first_line(old_style) == "RuntimeError: Unsupported operand 7"
    assert "weights_only" not in first_line(RuntimeError("set weights_only=False, it works"))


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONWARNINGS": "ignore"}


def test_a_closed_pipe_ends_quietly_with_141(tmp_path: Path) -> None:
    big = tmp_path / "big"
    # 600 rows of ~190 characters: far more than a pipe's buffer holds.
    write_run(str(big), {f"step{i}/{'a' * 150}": torch.arange(2) for i in range(600)})
    with subprocess.Popen(
        [sys.executable, "-m", "trajtrack", "ls", str(big)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(),
    ) as process:
        assert process.stdout is not None and process.stderr is not None
        try:
            assert process.stdout.readline().startswith(b"NAME")
            process.stdout.close()  # `| head -1`
            err = process.stderr.read().decode()
            code = process.wait(timeout=120)
        finally:
            process.kill()
    assert code == 141, err  # 128 + SIGPIPE, as git and coreutils: never 0, never 2
    assert err == ""  # no "Broken pipe" error line, no "Exception ignored" at exit


# Ctrl-C while torch is being imported: the import is held (deterministically) until the
# test has sent SIGINT; then the command runs on, as `python -m trajtrack` does.
_SLOW_TORCH_IMPORT = r"""
import runpy, sys, time

class HoldTorchImport:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            sys.stderr.write("importing torch\n")
            sys.stderr.flush()
            time.sleep(60)  # SIGINT comes here
        return None

sys.meta_path.insert(0, HoldTorchImport())
sys.argv = ["trajtrack", *sys.argv[1:]]
runpy.run_module("trajtrack", run_name="__main__", alter_sys=True)
"""


def test_ctrl_c_while_torch_is_imported_says_interrupted(run: Path) -> None:
    with subprocess.Popen(
        [sys.executable, "-c", _SLOW_TORCH_IMPORT, "ls", str(run)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(),
        text=True,
    ) as process:
        assert process.stderr is not None
        try:
            assert process.stderr.readline() == "importing torch\n"
            process.send_signal(signal.SIGINT)
            out, err = process.communicate(timeout=120)
        finally:
            process.kill()
    assert process.returncode == 130, err
    assert err == "trajtrack: interrupted\n"  # no traceback
    assert out == ""


def test_exit_codes_are_in_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0 and "141" in out and "130" in out and "no dumps to compare" in out


async def test_the_html_verdict_of_nothing_compared(run: Path) -> None:
    async with open_run(run) as a, open_run(run) as b:
        result = await diff_runs(a, b, names="step9*")
    page = await anyio.to_thread.run_sync(render_diff_report, result, None)
    assert "nothing to compare: no dumps (exit 1)" in page
    assert "equal within tolerance" not in page
