"""``trajtrack ls`` and ``trajtrack show``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from trajtrack.rollout import RolloutBatch, RolloutSample

from ._runs import WritesMarker, run_cli, run_json, write_run


@pytest.fixture
def run(tmp_path: Path) -> Path:
    dest = tmp_path / "run"
    write_run(
        str(dest),
        {
            "step0/obs": {"x": torch.tensor([[1.0, float("nan")], [3.0, 5.0]]), "tag": "a" * 200},
            "step1/obs": {"x": torch.zeros(2, 2)},
            "sample": RolloutSample(
                full_batch=RolloutBatch(
                    {"responses": torch.tensor([[7, 0], [8, 9]])},
                    {"uid": np.array(["u0", "u1"], dtype=object)},
                    {"eos_token_id": 2},
                ),
                sample_id="sample_0_1",
            ),
        },
    )
    return dest


def test_ls_lists_in_dump_order(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "ls", str(run))
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "SIZE", "WRITER", "TIME"]
    assert [line.split()[0] for line in lines[1:4]] == ["step0/obs", "step1/obs", "sample"]
    assert lines[-1].startswith("3 dumps, ")


def test_ls_glob_and_json(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, report = run_json(capsys, "ls", str(run), "--glob", "step*")
    assert code == 0
    assert [d["name"] for d in report["dumps"]] == ["step0/obs", "step1/obs"]
    first = report["dumps"][0]
    assert first["recorded"] and first["present"]
    assert first["size"] == (run / "step0/obs.pth").stat().st_size
    assert first["checksum"].startswith("crc32:") and first["writer"]


def test_ls_never_lists_temp_files_and_flags_unrecorded(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (run / "step0/.obs.pth.tmp~h~1~ab").write_bytes(b"partial")
    torch.save(torch.ones(1), run / "by_hand.pth")
    (run / "step1/obs.pth").unlink()
    code, out, _ = run_cli(capsys, "ls", str(run))
    assert code == 0
    assert "tmp~" not in out and ".trajtrack" not in out
    rows = {line.split()[0]: line for line in out.splitlines()[1:-1]}
    assert rows["by_hand"].endswith("unrecorded")
    assert rows["step1/obs"].endswith("missing")


def test_ls_of_missing_directory_is_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_cli(capsys, "ls", str(tmp_path / "nope"))
    assert code == 2 and "no such directory" in err


def test_show_prints_structure_and_statistics(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run_cli(capsys, "show", str(run), "step0/obs")
    assert code == 0
    assert "['x']: Tensor float32 [2, 2] cpu min=1 max=5 mean=3 nan=1 inf=0" in out
    assert "['tag']: str 'aaaa" in out and "..." in out  # abbreviated
    assert len(max(out.splitlines(), key=len)) < 150


def test_show_rollout_sample(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "show", str(run), "sample")
    assert code == 0
    assert out.splitlines()[1].startswith("RolloutSample")
    assert ".full_batch: RolloutBatch" in out
    assert "['responses']: Tensor int64 [2, 2] cpu min=0 max=9 mean=6" in out
    assert "['uid']: ndarray object [2] ['u0', 'u1']" in out
    assert ".sample_id: str 'sample_0_1'" in out


def test_show_json_parses(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, report = run_json(capsys, "show", str(run), "step1/obs.pth")  # a path works too
    assert code == 0
    assert report["dump"]["name"] == "step1/obs"
    (child,) = report["structure"]["children"]
    assert child["key"] == "['x']" and child["shape"] == [2, 2] and child["mean"] == 0.0


def test_show_unknown_name_is_exit_2(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "show", str(run), "nope")
    assert code == 2 and "no dump named 'nope'" in err


def test_show_refuses_malicious_dump(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dest, marker = tmp_path / "run", tmp_path / "pwned"
    write_run(str(dest), {"evil": [WritesMarker(str(marker))]})
    code, out, err = run_cli(capsys, "show", str(dest), "evil")
    assert code == 2
    assert out == ""
    assert "refusing to load" in err and "mkdir" in err
    assert not marker.exists()


def test_show_corrupt_dump_is_exit_2(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (run / "step1/obs.pth").write_bytes(b"not a torch file")
    code, _, err = run_cli(capsys, "show", str(run), "step1/obs")
    assert code == 2 and "cannot be loaded" in err
