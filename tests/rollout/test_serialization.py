from __future__ import annotations

import io
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from _support.expect import assert_same
from trajtrack.rollout import SAFE_GLOBALS, RolloutBatch, RolloutSample, ValidateMetrics


def make_sample() -> RolloutSample:
    batch = RolloutBatch(
        {
            "input_ids": torch.tensor([[1, 2, 3], [4, 5, 6]]),
            "attention_mask": torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool),
            "old_log_probs": torch.tensor([[-0.5, -1.25, 0.0], [-2.0, -0.125, -1.0]]),
        },
        {
            "uid": np.array(["prompt-7", "prompt-7"], dtype=object),
            "raw_prompt_ids": [[101, 102], [101, 102, 103]],
            "index": np.array([7, 7], dtype=object),
            "reward_extra": [{"acc": 1.0, "tags": ("a", "b")}, None],
            "score": np.array([0.5, 1.0]),
            "lang": np.array(["en", "zh"]),
        },
        {"global_steps": 3, "temperature": np.float64(0.7), "versions": np.array([1, 2])},
    )
    return RolloutSample(
        full_batch=batch,
        agent_loop_output_list=[{"turns": 2}],
        sample_id="sample_0_3",
        epoch=1,
        processing_times=[1.5, 2.25],
        tool_calls=[0.0, 0.5],
        param_version=4,
        param_version_start=[3, 4],
        param_version_end=[4, 4],
        rollout_status={
            "count/total_generated_samples": 12,
            "monitor/queue/mq_queue_size": np.int64(5),
        },
    )


def safe_load(source: io.BytesIO | Path) -> object:
    with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
        return torch.load(source, weights_only=True)


def test_rollout_sample_round_trips_with_weights_only(tmp_path: Path) -> None:
    sample = make_sample()
    path = tmp_path / "sample.pth"
    torch.save(sample, path)
    loaded = safe_load(path)
    assert isinstance(loaded, RolloutSample)
    assert isinstance(loaded.full_batch, RolloutBatch)
    assert_same(loaded, sample)
    arrays = loaded.full_batch.non_tensor_batch
    assert arrays["uid"].dtype == object and arrays["uid"].tolist() == ["prompt-7", "prompt-7"]
    assert arrays["raw_prompt_ids"][1] == [101, 102, 103]
    assert arrays["reward_extra"][0] == {"acc": 1.0, "tags": ("a", "b")}
    assert arrays["lang"].tolist() == ["en", "zh"]
    assert loaded.full_batch.batch["attention_mask"].dtype == torch.bool
    assert loaded.rollout_status["monitor/queue/mq_queue_size"] == 5


def test_validate_metrics_round_trips_with_weights_only() -> None:
    metrics = ValidateMetrics(
        timing_raw={"gen": 1.5}, metrics={"val/score": 0.75}, global_steps=9, param_version=3
    )
    buf = io.BytesIO()
    torch.save(metrics, buf)
    buf.seek(0)
    assert safe_load(buf) == metrics


def test_weights_only_load_fails_without_allow_list() -> None:
    buf = io.BytesIO()
    torch.save(make_sample(), buf)
    buf.seek(0)
    with pytest.raises(pickle.UnpicklingError, match="rebuild_sample"):
        torch.load(buf, weights_only=True)


def test_safe_globals_lists_our_classes_and_stand_ins_under_numpy_names() -> None:
    names = {g[1] if isinstance(g, tuple) else g.__qualname__ for g in SAFE_GLOBALS}
    assert {
        "RolloutSample",
        "ValidateMetrics",
        "RolloutBatch",
        "numpy.ndarray",
        "numpy.dtype",
        "numpy._core.multiarray._reconstruct",
        "numpy.core.multiarray._reconstruct",
        "numpy._core.multiarray.scalar",
    } <= names
    # numpy's own reconstructors take a dtype's flags from the file (#32): never allow-listed.
    targets = [g[0] if isinstance(g, tuple) else g for g in SAFE_GLOBALS]
    numpy_own = [np.empty(0).__reduce__()[0], np.float64(0).__reduce__()[0], np.ndarray, np.dtype]
    assert not any(t is own for t in targets for own in numpy_own)


def test_sample_defaults_allow_verl_091_keyword_construction() -> None:
    sample = RolloutSample(
        full_batch=None, sample_id="sample_0_1", epoch=0, rollout_status={"a": 1}
    )
    assert sample.agent_loop_output_list == [] and sample.param_version == 0
    assert sample.processing_times == [] and sample.param_version_end == []


def test_sample_equality_is_deep_and_array_aware() -> None:
    a = make_sample()
    b = make_sample()
    a.rollout_status["hist"] = np.array([1, 2])
    b.rollout_status["hist"] = np.array([1, 2])
    assert a == b
    b.agent_loop_output_list.append(torch.ones(2))
    assert a != b
    assert a != "not a sample"
    assert ValidateMetrics(timing_raw={"t": torch.tensor(1.0)}) == ValidateMetrics(
        timing_raw={"t": torch.tensor(1.0)}
    )


SURVIVES_SAFE_GLOBALS = """
import io, sys
import torch
sys.path.insert(0, sys.argv[1])
from rollout.test_serialization import make_sample
from trajtrack.reader import allow_in_this_process
from trajtrack.rollout import SAFE_GLOBALS

buffer = io.BytesIO()
torch.save(make_sample(), buffer)
allow_in_this_process()
with torch.serialization.safe_globals(list(SAFE_GLOBALS)):  # docs/rollout.md's recipe
    pass
torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)  # still allowed after the block
print("loaded")
"""


def test_allow_in_this_process_survives_a_safe_globals_block(tmp_path: Path) -> None:
    """#33 item 7: the block removed what allow_in_this_process() had added (the same entries)."""
    tests = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-c", SURVIVES_SAFE_GLOBALS, str(tests)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0 and "loaded" in done.stdout, done.stderr[-2000:]
