from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from trajtrack.rollout import (
    BatchKeyError,
    RolloutBatch,
    RolloutSample,
    addition_process,
    assemble_batch_from_rollout_samples,
    compute_response_mask,
)

from ._fakes import FakeDataProto

# Two prompts, two trajectories each; prompt length 3, response length 2.
MASK_A = [[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
MASK_B = [[1, 1, 1, 0, 0], [0, 0, 1, 1, 0]]


def tensors(mask: list[list[int]]) -> dict[str, torch.Tensor]:
    return {
        "attention_mask": torch.tensor(mask),
        "responses": torch.zeros(2, 2, dtype=torch.long),
    }


def sample(
    mask: list[list[int]],
    columns: dict[str, list[Any]],
    status: dict[str, Any] | None = None,
    cls: type = RolloutBatch,
    **fields: Any,
) -> RolloutSample:
    arrays = {k: np.array(v, dtype=object) for k, v in columns.items()}
    return RolloutSample(
        full_batch=cls(tensors(mask), arrays, {}), rollout_status=status or {}, **fields
    )


def two_samples(cls: type = RolloutBatch) -> list[RolloutSample]:
    a = sample(
        MASK_A,
        {
            "processing_times": [1.0, 2.0],
            "tool_calls_times": [0.0, 0.5],
            "param_version_start": [3, 3],
            "param_version_end": [3, 5],
        },
        {"count/total_generated_samples": 10, "monitor/active_tasks_size": 4},
        cls,
    )
    b = sample(
        MASK_B,
        {
            "processing_times": [3.0, 10.0],
            "tool_calls_times": [1.5, 0.0],
            "param_version_start": [3, 4],
            "param_version_end": [4, 4],
        },
        {"count/total_generated_samples": 12},
        cls,
    )
    return [a, b]


# Hand-computed over processing times [1, 2, 3, 10]: mean 4; numpy's linear percentile at
# index q/100 * 3 -> tp50 at 1.5: 2 + .5*1 = 2.5; tp95 at 2.85: 3 + .85*7 = 8.95;
# tp99 at 2.97: 3 + .97*7 = 9.79.
EXPECTED_PROCESSING = {
    "fully_async/processing_time/avg": 4.0,
    "fully_async/processing_time/max": 10.0,
    "fully_async/processing_time/min": 1.0,
    "fully_async/processing_time/tp50": 2.5,
    "fully_async/processing_time/tp95": 8.95,
    "fully_async/processing_time/tp99": 9.79,
}
# Tool-call times [0, .5, 1.5, 0].
EXPECTED_TOOLS = {
    "timing_s/agent_loop/tool_calls/max": 1.5,
    "timing_s/agent_loop/tool_calls/min": 0.0,
    "timing_s/agent_loop/tool_calls/mean": 0.5,
}
# Spans |end - start|: 0, 2, 1, 0 -> 2 partial of 4, longest 2.
EXPECTED_PARTIAL = {
    "fully_async/partial/total_partial_num": 2,
    "fully_async/partial/partial_ratio": 0.5,
    "fully_async/partial/max_partial_span": 2,
}


def assert_stats(meta: dict[str, Any], expected: dict[str, Any]) -> None:
    for key, value in expected.items():
        assert meta[key] == pytest.approx(value), key


def test_full_statistics() -> None:
    out = assemble_batch_from_rollout_samples(two_samples(), tokenizer=None, config=None)
    assert isinstance(out, RolloutBatch)
    assert len(out) == 4
    assert out.batch["response_mask"].tolist() == [[1, 0], [1, 1], [0, 0], [1, 0]]
    meta = out.meta_info
    assert meta["global_token_num"] == [3, 5, 3, 2]
    assert_stats(meta, EXPECTED_PROCESSING | EXPECTED_TOOLS | EXPECTED_PARTIAL)
    assert meta["param_version_diversity"] == 3  # end versions {3, 5, 4}
    assert meta["trajectory_param_versions"] == [3, 5, 4, 4]
    # Later samples win per key; keys only the earlier sample had are kept.
    assert meta["fully_async/count/total_generated_samples"] == 12
    assert meta["fully_async/monitor/active_tasks_size"] == 4
    assert all(type(meta[k]) is float for k in EXPECTED_PROCESSING)
    assert type(meta["fully_async/partial/total_partial_num"]) is int


def test_key_sets_are_exactly_the_documented_ones() -> None:
    meta = assemble_batch_from_rollout_samples(two_samples(), None, None).meta_info
    expected = {
        "global_token_num",
        "param_version_diversity",
        "trajectory_param_versions",
        "fully_async/count/total_generated_samples",
        "fully_async/monitor/active_tasks_size",
        *EXPECTED_PROCESSING,
        *EXPECTED_TOOLS,
        *EXPECTED_PARTIAL,
    }
    assert set(meta) == expected


def test_empty_input_raises_value_error() -> None:
    with pytest.raises(ValueError, match="Empty rollout_samples"):
        assemble_batch_from_rollout_samples([], None, None)


def test_verl_091_columns() -> None:
    samples = two_samples()
    for rs in samples:
        arrays = rs.full_batch.non_tensor_batch
        arrays["min_global_steps"] = arrays.pop("param_version_start")
        arrays["max_global_steps"] = arrays.pop("param_version_end")
    meta = assemble_batch_from_rollout_samples(samples, None, None).meta_info
    assert_stats(meta, EXPECTED_PARTIAL)
    assert meta["trajectory_param_versions"] == [3, 5, 4, 4]


def test_snapshot_columns_win_over_091_columns() -> None:
    samples = two_samples()
    for rs in samples:  # 0.9.1 columns that would give spans of 9 everywhere
        rs.full_batch.non_tensor_batch["min_global_steps"] = np.array([0, 0], dtype=object)
        rs.full_batch.non_tensor_batch["max_global_steps"] = np.array([9, 9], dtype=object)
    meta = assemble_batch_from_rollout_samples(samples, None, None).meta_info
    assert_stats(meta, EXPECTED_PARTIAL)
    assert meta["trajectory_param_versions"] == [3, 5, 4, 4]


def test_none_versions_are_left_out() -> None:
    samples = two_samples()
    samples[1].full_batch.non_tensor_batch["param_version_start"] = np.array(
        [None, 4], dtype=object
    )
    samples[1].full_batch.non_tensor_batch["param_version_end"] = np.array([None, 4], dtype=object)
    meta = assemble_batch_from_rollout_samples(samples, None, None).meta_info
    # Spans over the three known trajectories: 0, 2, 0.
    assert meta["fully_async/partial/total_partial_num"] == 1
    assert meta["fully_async/partial/partial_ratio"] == pytest.approx(1 / 3)
    assert meta["fully_async/partial/max_partial_span"] == 2
    assert meta["param_version_diversity"] == 3  # {3, 5, 4}
    assert meta["trajectory_param_versions"] == [3, 5, None, 4]


def test_agent_loop_metrics_path_of_verl_091() -> None:
    samples = [
        RolloutSample(
            RolloutBatch(
                tensors(MASK_A),
                {},
                {
                    "metrics": [
                        {"generate_sequences": 1.0, "tool_calls": 0.0},
                        {"generate_sequences": 2.0, "tool_calls": 0.5},
                    ]
                },
            )
        ),
        RolloutSample(
            RolloutBatch(
                tensors(MASK_B),
                {},
                {
                    "metrics": [
                        {"generate_sequences": 3.0, "tool_calls": 1.5},
                        {"generate_sequences": 10.0},
                    ]
                },
            )
        ),
    ]
    out = assemble_batch_from_rollout_samples(samples, None, None)
    assert_stats(out.meta_info, EXPECTED_PROCESSING | EXPECTED_TOOLS)
    assert "metrics" not in out.meta_info
    assert out.non_tensor_batch["processing_times"].tolist() == [1.0, 2.0, 3.0, 10.0]


def test_addition_process_accepts_objects_and_dict_of_lists() -> None:
    class Record:
        def __init__(self, gen: float, tools: float) -> None:
            self.generate_sequences = gen
            self.tool_calls = tools

    batch = RolloutBatch(meta_info={"metrics": [Record(1.0, 0.25), Record(2.0, 0.0)]})
    assert addition_process(batch) is batch
    assert batch.non_tensor_batch["processing_times"].tolist() == [1.0, 2.0]
    assert batch.non_tensor_batch["tool_calls_times"].tolist() == [0.25, 0.0]
    assert "metrics" not in batch.meta_info

    batch = RolloutBatch(
        meta_info={"metrics": {"generate_sequences": [4.0, 5.0], "tool_calls": [1.0, 2.0]}}
    )
    addition_process(batch)
    assert batch.non_tensor_batch["processing_times"].tolist() == [4.0, 5.0]

    with pytest.raises(BatchKeyError, match="generate_sequences"):
        addition_process(RolloutBatch(meta_info={"metrics": [{"tool_calls": 1.0}]}))


def test_dataclass_fields_are_the_fallback_source() -> None:
    samples = [
        RolloutSample(
            RolloutBatch(tensors(MASK_A)),
            processing_times=[1.0, 2.0],
            tool_calls=[0.0, 0.5],
            param_version_start=[3, 3],
            param_version_end=[3, 5],
        ),
        RolloutSample(
            RolloutBatch(tensors(MASK_B)),
            processing_times=[3.0, 10.0],
            tool_calls=[1.5, 0.0],
            param_version_start=[3, 4],
            param_version_end=[4, 4],
        ),
    ]
    meta = assemble_batch_from_rollout_samples(samples, None, None).meta_info
    assert_stats(meta, EXPECTED_PROCESSING | EXPECTED_TOOLS | EXPECTED_PARTIAL)
    assert meta["trajectory_param_versions"] == [3, 5, 4, 4]


def test_param_version_is_the_last_fallback() -> None:
    samples = [
        RolloutSample(RolloutBatch(tensors(MASK_A)), param_version=7),
        RolloutSample(RolloutBatch(tensors(MASK_B)), param_version=8),
    ]
    meta = assemble_batch_from_rollout_samples(samples, None, None).meta_info
    assert meta["trajectory_param_versions"] == [7, 7, 8, 8]
    assert meta["param_version_diversity"] == 2
    assert not any(k.startswith("fully_async/partial/") for k in meta)
    assert not any(k.startswith("fully_async/processing_time/") for k in meta)


def test_no_tool_stats_without_tool_time() -> None:
    samples = two_samples()
    for rs in samples:
        rs.full_batch.non_tensor_batch["tool_calls_times"] = np.array([0.0, 0.0], dtype=object)
    meta = assemble_batch_from_rollout_samples(samples, None, None).meta_info
    assert not any(k.startswith("timing_s/") for k in meta)


def test_existing_response_mask_is_kept() -> None:
    samples = two_samples()
    for rs in samples:
        rs.full_batch.batch["response_mask"] = torch.tensor([[1, 1], [0, 0]])
    out = assemble_batch_from_rollout_samples(samples, None, None)
    assert out.batch["response_mask"].tolist() == [[1, 1], [0, 0], [1, 1], [0, 0]]


def test_response_mask_needs_responses() -> None:
    with pytest.raises(BatchKeyError, match="no 'responses'"):
        compute_response_mask(RolloutBatch({"attention_mask": torch.ones(2, 3)}))
    samples = [RolloutSample(RolloutBatch({"attention_mask": torch.ones(1, 3)}))]
    with pytest.raises(BatchKeyError, match="response_mask"):
        assemble_batch_from_rollout_samples(samples, None, None)


def test_response_mask_is_a_copy() -> None:
    batch = RolloutBatch(tensors(MASK_A))
    mask = compute_response_mask(batch)
    mask.zero_()
    assert batch.batch["attention_mask"].tolist() == MASK_A


def test_balance_callback_reorders_and_its_metrics_are_kept() -> None:
    calls: list[int] = []

    def balance(batch: Any, *, metrics: dict[str, Any]) -> None:
        calls.append(len(batch))
        batch.reorder([3, 2, 1, 0])
        metrics.update(
            {"global_seqlen/min": 5, "global_seqlen/max": 8, "global_seqlen/minmax_diff": 3}
        )

    out = assemble_batch_from_rollout_samples(two_samples(), None, None, balance_batch=balance)
    assert calls == [4]
    assert out.meta_info["global_token_num"] == [2, 3, 5, 3]  # computed after balancing
    assert out.meta_info["global_seqlen/minmax_diff"] == 3
    assert out.meta_info["global_seqlen/max"] == 8
    assert out.non_tensor_batch["processing_times"].tolist() == [10.0, 3.0, 2.0, 1.0]


def test_balance_callback_may_return_a_new_batch() -> None:
    def balance(batch: Any, *, metrics: dict[str, Any]) -> Any:
        return batch.select(batch_keys=["attention_mask", "responses"], non_tensor_batch_keys=[])

    out = assemble_batch_from_rollout_samples(two_samples(), None, None, balance_batch=balance)
    assert "response_mask" not in out.batch
    assert "fully_async/processing_time/avg" not in out.meta_info


def test_mismatched_sample_keys_raise() -> None:
    samples = two_samples()
    del samples[1].full_batch.non_tensor_batch["tool_calls_times"]
    with pytest.raises(BatchKeyError, match=r"missing \['tool_calls_times'\]"):
        assemble_batch_from_rollout_samples(samples, None, None)


def test_works_on_a_foreign_dataproto_class() -> None:
    out = assemble_batch_from_rollout_samples(two_samples(FakeDataProto), None, None)
    assert type(out) is FakeDataProto
    assert out.batch["response_mask"].tolist() == [[1, 0], [1, 1], [0, 0], [1, 0]]
    assert_stats(out.meta_info, EXPECTED_PROCESSING | EXPECTED_TOOLS | EXPECTED_PARTIAL)
