"""Real verl 0.9.1 objects dumped and read back as data, without ``--unsafe`` (#33 items 1, 7, 8).

A synchronous trainer (a subprocess: verl's own objects, ``trajtrack.dump_data`` with
``VERL_ENABLE_TRACKER=1``) dumps a consolidated, a nested, an empty-batch and a numpy-form
``DataProto``, verl's ``RolloutSample`` and a bare (non-consolidated) ``TensorDict``, one a
step; ``SyncRun.load``, ``trajtrack show`` and ``trajtrack diff`` read them. Values are
compared with ``torch.equal`` and numpy's equality against the originals. verl's
``RolloutSample`` module imports verl's trainer (torchdata, datasets...); where that is not
installed the class is built from verl's own source
(``_support.verl_cases.verl_rollout_sample_class``) under its real name.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from _support.expect import assert_same
from _support.require import require_module
from _support.verl_cases import FIXTURES, NAMES, expected, real_object, write_fixtures
from cli._runs import run_cli
from trajtrack.reader import SyncRun, load_dump_file
from trajtrack.rollout import RolloutBatch

require_module(
    "verl.protocol",
    required_by="TRAJTRACK_REQUIRE_VERL",
    hint="pip install --no-deps verl==0.9.1 && pip install tensordict==0.10.0 omegaconf "
    "'transformers<5.11' ray",
)

pytestmark = pytest.mark.verl

TESTS = Path(__file__).resolve().parent.parent
STEPS = ("consolidated", "nested", "empty_batch", "numpy_form", "verl_sample", "bare_tensordict")

TRAINER = """
import sys

import trajtrack
from _support.verl_cases import real_object, serialization_method


def main():
    changed = sys.argv[1]
    for step, name in enumerate(sys.argv[2:]):
        obj, method = real_object(name)
        if name == changed:
            obj.batch["old_log_probs"][1, 2] += 1.0
        with serialization_method(method):  # verl reads it when the DataProto is pickled
            trajtrack.dump_data(obj, f"step{step}/{name}")
            trajtrack.get_tracker().flush()
    trajtrack.get_tracker().close()


if __name__ == "__main__":
    main()
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Runs ``a`` and ``same`` (identical) and ``changed`` (one element of one step differs)."""
    root = tmp_path_factory.mktemp("verl-runs")
    script = root / "trainer.py"
    script.write_text(TRAINER)
    changes = {"a": "-", "same": "-", "changed": "nested"}
    procs = {}
    for run, changed in changes.items():
        env = dict(os.environ, VERL_ENABLE_TRACKER="1", TRAJTRACK_DIR=str(root / run))
        env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(TESTS.parent / "src")])
        env.pop("VERL_DATAPROTO_SERIALIZATION_METHOD", None)
        procs[run] = subprocess.Popen(
            [sys.executable, str(script), changed, *STEPS],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    for run, proc in procs.items():
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{run}: {out}"
    return {run: root / run for run in changes}


def leaves(batch: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a TensorDict or a nested dict, by key path (no trajtrack code)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            out[prefix + key] = value
        else:
            out.update(leaves(value, f"{prefix}{key}."))
    return out


def assert_matches_original(loaded: RolloutBatch, proto: Any) -> None:
    """*loaded* holds exactly *proto*'s data: torch.equal per tensor, numpy per array."""
    want = leaves(proto.batch) if proto.batch is not None else {}
    got = leaves(loaded.batch)
    assert list(got) == list(want)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key
    assert list(loaded.non_tensor_batch) == list(proto.non_tensor_batch)
    for key, array in proto.non_tensor_batch.items():
        assert type(loaded.non_tensor_batch[key]) is np.ndarray
        assert loaded.non_tensor_batch[key].dtype == array.dtype
        assert loaded.non_tensor_batch[key].tolist() == array.tolist(), key
    assert loaded.meta_info == proto.meta_info


def test_fixtures_written_now_read_like_the_committed_ones(tmp_path: Path) -> None:
    write_fixtures(tmp_path)
    for name in NAMES:
        fresh = load_dump_file(tmp_path / f"{name}.pt")
        assert_same(fresh, expected(name), name)
        assert_same(load_dump_file(FIXTURES / f"{name}.pt"), fresh, name)
        original, _ = real_object(name)
        if isinstance(fresh, RolloutBatch):
            assert_matches_original(fresh, original)
    sample = load_dump_file(tmp_path / "verl_sample.pt")
    assert_matches_original(sample.full_batch, real_object("verl_sample")[0].full_batch)


def test_syncrun_loads_what_the_trainer_dumped(runs: dict[str, Path]) -> None:
    with SyncRun(str(runs["a"])) as run:
        names = [info.name for info in run.list()]
        assert names == [f"step{step}/{name}" for step, name in enumerate(STEPS)]
        for step, name in enumerate(STEPS):
            loaded = run.load(f"step{step}/{name}")
            original, _ = real_object(name)
            assert_same(loaded, expected(name), name)
            if name == "bare_tensordict":  # a TensorDict dumped by itself: nested dicts
                want = leaves(original)
                assert list(leaves(loaded)) == list(want)
                assert all(torch.equal(leaves(loaded)[k], v) for k, v in want.items())
                continue
            if name == "verl_sample":
                assert loaded.sample_id == original.sample_id
                assert loaded.rollout_status == original.rollout_status
                loaded, original = loaded.full_batch, original.full_batch
            assert_matches_original(loaded, original)
        # Each form was really written: verl's numpy form has no TensorDict pickle inside.
        forms = {
            name: globals_in(run.read_bytes(f"step{step}/{name}"))
            for step, name in enumerate(STEPS)
        }
        assert "tensordict._reductions._rebuild_tensordict_files_consolidated" in forms["nested"]
        assert "tensordict._reductions._make_td" in forms["empty_batch"]
        assert "tensordict._reductions._make_td" in forms["bare_tensordict"]
        assert not any(name.startswith("tensordict") for name in forms["numpy_form"])
        assert "verl.protocol.DataProto" in forms["numpy_form"]


def globals_in(archive: bytes) -> set[str]:
    """The globals an archive's pickle names, its DataProto's inner archive included."""
    import io
    import pickletools
    import zipfile

    names: set[str] = set()
    with zipfile.ZipFile(io.BytesIO(archive)) as zf:
        pickle_bytes = zf.read(next(n for n in zf.namelist() if n.endswith("/data.pkl")))
    for opcode, arg, _ in pickletools.genops(pickle_bytes):
        if opcode.name == "GLOBAL":
            names.add(str(arg).replace(" ", "."))
        elif opcode.name in ("BINUNICODE", "SHORT_BINUNICODE") and str(arg).startswith("PK"):
            names |= globals_in(str(arg).encode("latin1"))  # _codecs.encode(batch_bytes)
    return names


def test_show_reads_a_dataproto_without_unsafe(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, "show", str(runs["a"]), "step1/nested")
    assert code == 0, err
    assert out.splitlines()[1] == "RolloutBatch (3 items)"
    assert "['critic']: dict (2 items)" in out and "['uid']: ndarray object [3]" in out


def test_diff_names_the_changed_key_and_finds_identical_runs_equal(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    report = runs["a"].parent / "report.html"
    code, out, _ = run_cli(
        capsys, "diff", str(runs["a"]), str(runs["changed"]), "--html", str(report)
    )
    assert code == 1, out
    assert "old_log_probs&#x27;]: 1 of 15 elements differ" in report.read_text()
    assert "DIFFERENT  step1/nested" in out
    assert ".batch['old_log_probs']: 1 of 15 elements differ" in out
    assert "6 dumps: 5 equal, 1 different" in out
    code, out, _ = run_cli(capsys, "diff", str(runs["a"]), str(runs["same"]))
    assert code == 0, out
    assert "6 dumps: 6 equal, 0 different" in out and "0 errors" in out


def test_converters_round_trip_nested_tensordicts() -> None:
    from tensordict import TensorDict
    from verl.protocol import DataProto

    proto, _ = real_object("nested")
    batch = RolloutBatch.from_dataproto(proto)
    assert_matches_original(batch, proto)
    assert batch.batch["critic"]["values"] is proto.batch["critic", "values"]  # shared
    back = batch.to_dataproto()
    assert type(back) is DataProto and isinstance(back.batch["critic"], TensorDict)
    assert back.batch.batch_size == proto.batch.batch_size
    assert_matches_original(RolloutBatch.from_dataproto(back), proto)
    empty = RolloutBatch(non_tensor_batch={"uid": ["a", "b"]}).to_dataproto()
    assert empty.batch is None and empty.non_tensor_batch["uid"].tolist() == ["a", "b"]


def test_a_loaded_dump_converts_back_to_the_original_dataproto(tmp_path: Path) -> None:
    proto, _ = real_object("nested")
    loaded = load_dump_file(FIXTURES / "nested.pt")
    back = loaded.to_dataproto()
    assert_matches_original(RolloutBatch.from_dataproto(back), proto)
