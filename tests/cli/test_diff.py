"""``trajtrack diff``: pairing, tolerance, NaN policy, mismatches, ordering, exit codes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from _support.require import require_module

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
    code, report = run_json(capsys, "diff", a, b)
    notes = {d["name"]: d["notes"] for d in report["dumps"]}
    assert code == 0 and notes["fine"] == [] and "refusing to load" in notes["x"][0]
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


# --- issue 33: rows, ignore, errors apart, equal archives, containers by content ----------------


@pytest.fixture
def fresh(tmp_path: Path) -> tuple[str, str]:
    return str(tmp_path / "a"), str(tmp_path / "b")


def _rows_dump(bump_rows: range = range(0)) -> dict[str, object]:
    logp = torch.linspace(0, 1, 40 * 3).reshape(40, 3)
    for row in bump_rows:
        logp[row, 1] += 1.0
    return {"logp": logp, "uid": [f"uid-{i}" for i in range(40)]}


def test_every_differing_row_with_its_uid(
    fresh: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = fresh
    write_run(a, {"step0/batch": _rows_dump()})
    write_run(b, {"step0/batch": _rows_dump(range(5, 35))})  # rows 5..34 differ
    code, out, _ = run_cli(capsys, "diff", a, b)
    assert code == 1
    shown = ", ".join(f"{r} (uid uid-{r})" for r in range(5, 15))
    assert f"; 30 rows differ: {shown} and 20 more (--json lists all)" in out
    code, report = run_json(capsys, "diff", a, b)
    (entry,) = [d for d in report["dumps"] if d["status"] == "different"]
    (difference,) = entry["differences"]
    assert difference["rows"] == list(range(5, 35))
    assert difference["row_ids"] == [f"uid-{r}" for r in range(5, 35)]
    assert difference["id_column"] == "uid"


def _sample(generated: int, seconds: float, logp: float) -> object:
    from trajtrack.rollout import RolloutBatch, RolloutSample

    batch = RolloutBatch(
        {"old_log_probs": torch.full((2, 3), logp)},
        {"uid": ["u0", "u1"]},
        {"timing_s/gen": seconds},
    )
    status = {"count/total_generated_samples": generated, "static/max_queue_size": 8}
    return RolloutSample(batch, sample_id="s0", rollout_status=status, processing_times=[seconds])


def test_ignore_patterns_and_the_volatile_preset(
    fresh: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = fresh
    write_run(a, {"step0/sample0": _sample(3, 1.5, 0.0)})
    write_run(b, {"step0/sample0": _sample(7, 2.5, 0.0)})
    code, out, _ = run_cli(capsys, "diff", a, b)
    assert code == 1 and "rollout_status['count/total_generated_samples']" in out
    code, out, _ = run_cli(capsys, "diff", a, b, "--ignore-volatile")
    assert code == 0, out
    assert "ignored: '*timing_s*'" in out and ": 4 keys in 1 dumps" in out
    code, out, _ = run_cli(
        capsys, "diff", a, b, "--ignore", "*timing_s*", "--ignore", ".rollout_status[*]"
    )
    assert code == 1  # processing_times still differ
    assert "ignored: '*timing_s*' '.rollout_status[*]': 3 keys in 1 dumps" in out
    assert ".processing_times[0]: numbers differ" in out
    assert "total_generated_samples" not in out.split("ignored:")[1].split("\n", 1)[1]
    code, report = run_json(capsys, "diff", a, b, "--ignore-volatile")
    (entry,) = report["dumps"]
    assert entry["status"] == "equal" and sorted(entry["ignored"]) == [
        ".full_batch.meta_info['timing_s/gen']",
        ".processing_times",
        ".rollout_status",
        ".tool_calls",
    ]
    assert report["ignore"][0] == "*timing_s*"


def test_errors_alone_are_never_a_divergence(
    fresh: tuple[str, str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    a, b = fresh
    write_run(a, {"step0/x": WritesMarker(str(tmp_path / "m1")), "step1/y": {"v": torch.ones(2)}})
    write_run(b, {"step0/x": WritesMarker(str(tmp_path / "m2")), "step1/y": {"v": torch.ones(2)}})
    code, out, _ = run_cli(capsys, "diff", a, b)
    assert code == 2
    assert "first divergence" not in out
    assert "not compared: 1 dumps (errors, below; not divergences)" in out
    assert "ERROR      step0/x" in out and "refusing to load" in out
    code, report = run_json(capsys, "diff", a, b)
    assert (code, report["first_divergence"], report["differ"]) == (2, None, False)
    assert report["errors"] == ["step0/x"]
    assert not (tmp_path / "m1").exists() and not (tmp_path / "m2").exists()


def _serialization_id_replaced(path: Path) -> None:
    """Give the archive at *path* another per-save id (same length), nothing else changed."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith("/.data/serialization_id")]
        old = archive.read(name)
    data = path.read_bytes()
    assert data.count(old) == 1
    new = bytes(reversed(old)) if bytes(reversed(old)) != old else b"1" * len(old)
    path.write_bytes(data.replace(old, new))


def test_archives_equal_apart_from_their_serialization_id_are_equal_unloaded(
    fresh: tuple[str, str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    a, b = fresh
    marker = tmp_path / "pwned"
    objects = {"evil": {"p": WritesMarker(str(marker))}, "big": {"x": torch.arange(100_000.0)}}
    write_run(a, objects)
    write_run(b, objects)
    for name in ("evil", "big"):  # one small pair, one compared as local files
        (path,) = Path(b).glob(f"{name}*.pth")
        _serialization_id_replaced(path)
        assert path.read_bytes() != next(Path(a).glob(f"{name}*.pth")).read_bytes()
    code, out, _ = run_cli(capsys, "diff", a, b)
    assert code == 0, out
    assert "2 dumps: 2 equal" in out
    assert "the archives are equal apart from torch's per-save serialization id" in out
    assert not marker.exists()
    # Any other byte changed: no longer equal (here: refused when loaded, an error).
    (evil,) = Path(b).glob("evil*.pth")
    data = evil.read_bytes()
    evil.write_bytes(data.replace(b"pwned", b"pwneD"))
    code, out, _ = run_cli(capsys, "diff", a, b)
    assert code == 2 and "ERROR      evil" in out


@pytest.mark.verl
def test_runs_before_and_after_switching_to_dataproto_diff_equal(
    fresh: tuple[str, str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    require_module("verl.protocol", required_by="TRAJTRACK_REQUIRE_VERL", hint="see .ci/run")
    import verl.protocol as protocol

    from trajtrack.rollout import RolloutBatch

    a, b = fresh
    tensors = {"responses": torch.arange(12).view(3, 4), "logp": torch.zeros(3, 4)}
    uids = np.array(["a", "b", "c"], dtype=object)
    proto = protocol.DataProto.from_dict(
        tensors=dict(tensors), non_tensors={"uid": uids}, meta_info={"step": 1}
    )
    write_run(a, {"step0/batch": RolloutBatch(dict(tensors), {"uid": uids}, {"step": 1})})
    write_run(b, {"step0/batch": proto})
    code, out, _ = run_cli(capsys, "diff", a, b)  # safe: the DataProto is read as data
    assert code == 0 and "1 dumps: 1 equal" in out, out
    report = tmp_path / "r.html"
    code, out, _ = run_cli(capsys, "diff", a, b, "--unsafe", "--html", str(report))
    assert code == 0, out
    assert "note: RolloutBatch vs DataProto at <root>: compared by content" in out
    assert "note: dict vs TensorDict at .batch: compared by content" in out
    assert "RolloutBatch vs DataProto at &lt;root&gt;: compared by content" in report.read_text()
    proto.batch["logp"][2, 1] = 1.0
    write_run(str(tmp_path / "c"), {"step0/batch": proto})
    for safety in ((), ("--unsafe",)):
        code, out, _ = run_cli(capsys, "diff", a, str(tmp_path / "c"), *safety)
        assert code == 1, out
        assert ".batch['logp']: 1 of 12 elements differ" in out, out
        assert "1 row differs: 2 (uid c)" in out, out
