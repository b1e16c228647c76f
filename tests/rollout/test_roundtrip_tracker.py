"""A RolloutSample dumped through the tracker reads back equal (rollouter -> tracker -> trainer)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

import trajtrack
from _support.expect import assert_same
from trajtrack.rollout import (
    SAFE_GLOBALS,
    RolloutBatch,
    RolloutSample,
    assemble_batch_from_rollout_samples,
)


def make_sample(version: int, times: list[float]) -> RolloutSample:
    batch = RolloutBatch(
        {
            "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]),
            "responses": torch.tensor([[7, 0], [8, 9]]),
            "rm_scores": torch.tensor([[0.0, 0.5], [0.0, 1.0]]),
        },
        {
            "uid": np.array([f"uid-{version}"] * 2, dtype=object),
            "index": np.array([version, version], dtype=object),
            "processing_times": np.array(times, dtype=object),
            "param_version_start": np.array([version, version], dtype=object),
            "param_version_end": np.array([version, version + 1], dtype=object),
        },
        {"eos_token_id": 2},
    )
    return RolloutSample(
        full_batch=batch,
        sample_id=f"sample_0_{version}",
        epoch=0,
        param_version=version,
        rollout_status={"count/total_generated_samples": version},
    )


async def test_dump_rollout_sample_and_read_it_back(tmp_path: Path) -> None:
    sample = make_sample(3, [1.0, 3.0])
    async with trajtrack.Tracker(str(tmp_path)) as tracker:
        handle = await tracker.dump(sample, "step1/sample0")
        sample.full_batch.batch["rm_scores"].fill_(-1.0)  # the dump is a snapshot
        record = await handle
    assert record.path == "step1/sample0.pth"
    assert record.size == (tmp_path / record.path).stat().st_size
    with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
        loaded = torch.load(tmp_path / record.path, weights_only=True)
    sample.full_batch.batch["rm_scores"].copy_(torch.tensor([[0.0, 0.5], [0.0, 1.0]]))
    assert_same(loaded, sample)


async def test_rollouter_tracker_trainer_round_trip(tmp_path: Path) -> None:
    samples = [make_sample(3, [1.0, 3.0]), make_sample(4, [2.0, 6.0])]
    async with trajtrack.Tracker(str(tmp_path)) as tracker:
        handles = [await tracker.dump(s, f"queue/{s.sample_id}") for s in samples]
        records = [await h for h in handles]
    with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
        loaded = [torch.load(tmp_path / r.path, weights_only=True) for r in records]
    batch = assemble_batch_from_rollout_samples(loaded, tokenizer=None, config=None)
    assert batch.non_tensor_batch["uid"].tolist() == ["uid-3", "uid-3", "uid-4", "uid-4"]
    assert batch.meta_info["fully_async/processing_time/avg"] == 3.0  # (1 + 3 + 2 + 6) / 4
    assert batch.meta_info["fully_async/partial/total_partial_num"] == 2  # spans 0, 1, 0, 1
    assert batch.meta_info["fully_async/count/total_generated_samples"] == 4
