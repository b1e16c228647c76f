"""``trajtrack diff``: pairing, tolerance, NaN policy, mismatches, ordering, exit codes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ._runs import WritesMarker, run_cli, run_json, write_run


def base_dumps() -> dict[str, object]:
    gen = torch.Generator().manual_seed(0)
    return {
        f"step{i}/obs": {
            "x": torch.randn(4, 5, generator=gen),
            "ids": torch.arange(6),
            "labels": np.array(["a", "b"], dtype=object),
            "meta": {"step": i, "tag": "t"},
        }
        for i in range(3)
    }


@pytest.fixture
def runs(tmp_path: Path) -> tuple[str, str]:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_run(a, base_dumps())
    return a, b


def test_identical_runs_exit_0(runs: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    a, b = runs
    write_run(b, base_dumps())
    code, out, _ = run_cli(capsys, "diff", a, b)
    assert code == 0
    assert "3 dumps: 3 equal, 0 different" in out
    assert "first divergence" not in out


def test_one_element_differs_names_dump_key_and_index(
    runs: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = runs
    dumps = base_dumps()
    dumps["step1/obs"]["x"][2, 3] += 0.5  # type: ignore[index]
    write_run(b, dumps)
    code, out, _ = run_cli(capsys, "diff", a, b)
    assert code == 1
    assert "first divergence: step1/obs" in out
    assert "step1/obs\n    ['x']: 1 of 20 elements differ" in out
    assert "first at index [2, 3]" in out
    code, report = run_json(capsys, "diff", a, b)
    assert code == 1 and report["first_divergence"] == "step1/obs"
    (entry,) = [d for d in report["dumps"] if d["status"] != "equal"]
    (difference,) = entry["differences"]
    assert difference["path"] == "['x']" and difference["index"] == [2, 3]
    assert difference["max_abs"] == pytest.approx(0.5, rel=1e-5)


def test_within_tolerance_exit_0(runs: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    a, b = runs
    dumps = base_dumps()
    dumps["step0/obs"]["x"][0, 0] += 1e-4  # type: ignore[index]
    write_run(b, dumps)
    assert run_cli(capsys, "diff", a, b)[0] == 1
    assert run_cli(capsys, "diff", a, b, "--atol", "1e-3")[0] == 0
    assert run_cli(capsys, "diff", a, b, "--rtol", "0.5")[0] == 0


def test_missing_and_extra_dumps(runs: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    a, b = runs
    dumps = base_dumps()
    del dumps["step2/obs"]
    dumps["step3/extra"] = {"y": torch.zeros(1)}
    write_run(b, dumps)
    code, report = run_json(capsys, "diff", a, b)
    assert code == 1
    status = {d["name"]: d["status"] for d in report["dumps"]}
    assert status["step2/obs"] == "only_in_a" and status["step3/extra"] == "only_in_b"
    code, out, _ = run_cli(capsys, "diff", a, b)
    assert "ONLY IN A  step2/obs" in out and "ONLY IN B  step3/extra" in out


@pytest.mark.parametrize("side", ["only_in_a", "only_in_b"])
def test_a_dump_in_one_run_only_is_a_difference_on_its_own(
    runs: tuple[str, str], side: str, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = runs
    dumps = base_dumps()
    if side == "only_in_a":
        del dumps["step1/obs"]  # everything else equal: only that one dump is missing in B
    else:
        dumps["step9/new"] = {"y": torch.zeros(1)}
    write_run(b, dumps)
    code, report = run_json(capsys, "diff", a, b)
    assert code == 1
    assert report["equal"] is False
    counts = report["counts"]
    assert (counts["different"], counts["error"], counts[side]) == (0, 0, 1)
    assert report["first_divergence"] == ("step1/obs" if side == "only_in_a" else "step9/new")


def test_missing_and_extra_keys(runs: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    a, b = runs
    dumps = base_dumps()
    del dumps["step0/obs"]["ids"]  # type: ignore[attr-defined]
    dumps["step0/obs"]["new"] = 1  # type: ignore[index]
    write_run(b, dumps)
    code, out, _ = run_cli(capsys, "diff", a, b)
    assert code == 1
    assert "['ids']: only in A" in out and "['new']: only in B: 1" in out


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda x: x.double(), "dtype float32 vs float64"),
        (lambda x: x[:3], "shape [4, 5] vs [3, 5]"),
    ],
)
def test_dtype_and_shape_mismatch(
    runs: tuple[str, str], capsys: pytest.CaptureFixture[str], change: object, expected: str
) -> None:
    a, b = runs
    dumps = base_dumps()
    dumps["step1/obs"]["x"] = change(dumps["step1/obs"]["x"])  # type: ignore[index, operator]
    write_run(b, dumps)
    code, out, _ = run_cli(capsys, "diff", a, b)
    assert code == 1
    assert f"['x']: {expected}" in out


def test_nan_in_both_is_equal_by_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    value = torch.tensor([1.0, float("nan"), 3.0])
    write_run(a, {"v": {"t": value, "f": float("nan")}})
    write_run(b, {"v": {"t": value.clone(), "f": float("nan")}})
    assert run_cli(capsys, "diff", a, b)[0] == 0
    code, out, _ = run_cli(capsys, "diff", a, b, "--nan-unequal")
    assert code == 1
    assert "NaN != NaN" in out and "first at index [1]" in out


def test_nan_against_a_number_differs_even_with_tolerance(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_run(a, {"v": torch.tensor([1.0, 2.0])})
    write_run(b, {"v": torch.tensor([1.0, float("nan")])})
    assert run_cli(capsys, "diff", a, b, "--atol", "100")[0] == 1


def test_first_divergence_in_dump_order_is_on_top(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    names = ["z_first", "m_second", "a_third"]  # dump order differs from name order
    write_run(a, {n: torch.zeros(3) for n in names})
    write_run(b, {n: torch.ones(3) if n != "m_second" else torch.zeros(3) for n in names})
    code, report = run_json(capsys, "diff", a, b)
    assert code == 1
    assert [d["name"] for d in report["dumps"]] == names
    assert report["first_divergence"] == "z_first"
    out = run_cli(capsys, "diff", a, b)[1]
    assert out.index("z_first") < out.index("a_third")


def test_names_glob_limits_the_comparison(
    runs: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = runs
    dumps = base_dumps()
    dumps["step2/obs"]["meta"]["tag"] = "changed"  # type: ignore[index]
    write_run(b, dumps)
    assert run_cli(capsys, "diff", a, b)[0] == 1
    code, report = run_json(capsys, "diff", a, b, "--names", "step[01]/*")
    assert code == 0 and report["counts"]["equal"] == 2


def test_unreadable_run_is_exit_2(
    runs: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    a, _ = runs
    code, _, err = run_cli(capsys, "diff", a, a + "-does-not-exist")
    assert code == 2
    assert "no such directory" in err


def test_usage_error_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(capsys, "diff", "only-one-url")[0] == 2
    assert run_cli(capsys, "diff", "a", "b", "--atol", "-1")[0] == 2


def test_malicious_dump_is_refused_and_never_executed(
    runs: tuple[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = runs
    marker = tmp_path / "pwned"
    dumps = base_dumps()
    dumps["step1/obs"] = {"payload": WritesMarker(str(marker))}
    write_run(b, dumps)
    code, out, _ = run_cli(capsys, "diff", a, b)
    assert code == 2
    assert "ERROR      step1/obs" in out
    assert ".mkdir" in out and "refusing to load" in out
    assert not marker.exists()


def test_malicious_dump_in_both_runs_is_equal_without_loading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Byte-identical pairs are not loaded (nothing to compare): equal, even when a safe load
    # would refuse them (issue 33: errors are not divergences, and equal bytes need no
    # loading); the static scan's refusal is a note, and nothing runs.
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    marker = tmp_path / "pwned"
    write_run(a, {"x": {"payload": WritesMarker(str(marker))}, "fine": {"v": torch.ones(2)}})
    Path(b).mkdir()
    for path in Path(a).rglob("*"):
        target = Path(b) / path.relative_to(a)
        if path.is_dir():
            target.mkdir(exist_ok=True)
        else:
            target.write_bytes(path.read_bytes())
    code, out, _ = run_cli(capsys, "diff", a, b)
    assert code == 0
    assert "2 dumps: 2 equal, 0 different" in out
    assert "note: equal bytes, compared without loading (a safe load refuses it" in out
    assert "refusing to load" in out
    assert not marker.exists()


def test_unsafe_flag_really_unpickles(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The counterpart of the test above: the refusal is what kept the marker away.
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    marker = tmp_path / "pwned"
    write_run(a, {"x": {"payload": WritesMarker(str(marker))}})
    write_run(b, {"x": {"payload": 1}})
    code, _, err = run_cli(capsys, "diff", a, b, "--unsafe")
    assert code == 1
    assert marker.exists()
    assert "unsafe=True" in err
