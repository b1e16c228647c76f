"""``trajtrack verify``: flipped bytes, truncation, deletion, unrecorded files, JSON."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ._runs import run_cli, run_json, write_run


@pytest.fixture
def run(tmp_path: Path) -> Path:
    dest = tmp_path / "run"
    write_run(str(dest), {f"step{i}/t": torch.arange(100.0) * i for i in range(4)})
    return dest


def test_clean_run_verifies(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "verify", str(run))
    assert code == 0
    assert "OK: 4 dumps checked: 4 ok" in out


def test_flipped_byte_is_corrupt(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = run / "step1/t.pth"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    code, report = run_json(capsys, "verify", str(run))
    assert code == 1
    (problem,) = report["problems"]
    assert (problem["name"], problem["path"], problem["problem"]) == (
        "step1/t",
        "step1/t.pth",
        "corrupt",
    )
    assert problem["detail"].startswith("checksum crc32:")
    out = run_cli(capsys, "verify", str(run))[1]
    assert "corrupt" in out and "step1/t" in out and "FAILED" in out


def test_truncated_file(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = run / "step2/t.pth"
    size = target.stat().st_size
    os.truncate(target, size - 10)
    code, report = run_json(capsys, "verify", str(run))
    assert code == 1
    (problem,) = report["problems"]
    assert problem["problem"] == "truncated" and problem["name"] == "step2/t"
    assert f"{size - 10} bytes stored, {size} recorded" == problem["detail"]


def test_deleted_file_is_missing(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (run / "step0/t.pth").unlink()
    code, report = run_json(capsys, "verify", str(run))
    assert code == 1
    assert [(p["name"], p["problem"]) for p in report["problems"]] == [("step0/t", "missing")]
    assert report["counts"]["ok"] == 3


def test_unrecorded_file(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.save({"x": 1}, run / "copied_in.pth")
    code, report = run_json(capsys, "verify", str(run))
    assert code == 1
    assert [(p["name"], p["problem"]) for p in report["problems"]] == [("copied_in", "unrecorded")]
    assert run_cli(capsys, "verify", str(run), "--allow-unrecorded")[0] == 0


def test_temp_files_are_not_reported(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (run / "step0/.t.pth.tmp~host~123~abcd").write_bytes(b"partial")
    assert run_cli(capsys, "verify", str(run))[0] == 0


def test_several_problems_at_once(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (run / "step0/t.pth").unlink()
    os.truncate(run / "step1/t.pth", 5)
    code, report = run_json(capsys, "verify", str(run))
    assert code == 1
    assert report["counts"] == {
        "ok": 2,
        "missing": 1,
        "truncated": 1,
        "oversized": 0,
        "corrupt": 0,
        "unrecorded": 0,
        "outside": 0,
    }
