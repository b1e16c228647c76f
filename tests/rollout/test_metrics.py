from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from trajtrack.rollout import DEFAULT_RULES, Aggregation, AggregationRules, MetricsAggregator

STEP_1 = {
    "timing_s/gen": 1.0,
    "timing_s/step": 4.0,
    "perf/total_num_tokens": 100,
    "perf/time_per_step": 2.0,
    "perf/throughput": 25.0,
    "critic/score/mean": 0.5,
    "prompt_length/max": 10,
    "prompt_length/min": 3,
    "fully_async/count/total_generated_samples": 5,
    "timing_per_token_ms/gen": 0.2,
    "admin/queue_len": 4,
    "reward/weighted_avg": 1.0,
    "actor/lr": torch.tensor(1e-3, dtype=torch.float64),
    "np_metric": np.float32(0.25),
    "only_first": 2.0,
    "text": "hello",
    "vec": torch.tensor([1.0, 2.0]),
}
STEP_2 = {
    "timing_s/gen": 3.0,
    "timing_s/step": 4.0,
    "perf/total_num_tokens": 300,
    "perf/time_per_step": 3.0,
    "perf/throughput": 50.0,
    "critic/score/mean": 1.5,
    "prompt_length/max": 8,
    "prompt_length/min": 1,
    "fully_async/count/total_generated_samples": 9,
    "timing_per_token_ms/gen": 0.4,
    "admin/queue_len": 6,
    "reward/weighted_avg": 3.0,
    "actor/lr": torch.tensor([2e-3], dtype=torch.float64),
    "np_metric": np.int64(3),
    "fully_async/partial/total_partial_num": 4,
    "none_value": None,
}


def two_steps(**kwargs: object) -> MetricsAggregator:
    agg = MetricsAggregator(total_gpus=4, **kwargs)  # type: ignore[arg-type]
    agg.add_step_metrics(STEP_1, sample_count=2, timestamp=100.0)
    agg.add_step_metrics(STEP_2, sample_count=6, timestamp=101.0)
    return agg


def test_aggregates_two_steps_by_hand() -> None:
    result = two_steps().get_aggregated_metrics()
    assert result == pytest.approx(
        {
            "timing_s/gen": 4.0,  # time_sum
            "timing_s/step": 8.0,  # time_sum
            "perf/total_num_tokens": 400.0,  # sum ("total")
            "perf/time_per_step": 5.0,  # exact time_sum
            "perf/throughput": 20.0,  # recomputed: 400 / (5 * 4 GPUs)
            "critic/score/mean": 1.0,  # avg
            "prompt_length/max": 10.0,
            "prompt_length/min": 1.0,
            "fully_async/count/total_generated_samples": 9.0,  # last
            "timing_per_token_ms/gen": 0.3,  # default mean; verl's substring rule gave min 0.2
            "admin/queue_len": 5.0,  # default mean; verl gave min 4
            "reward/weighted_avg": 2.5,  # (1*2 + 3*6) / 8; the plain mean would be 2.0
            "actor/lr": 1.5e-3,  # one-element tensors, any shape
            "np_metric": 1.625,  # (0.25 + 3) / 2
            "only_first": 2.0,  # mean over the one step it appeared in
            "fully_async/partial/total_partial_num": 4.0,  # sum over the one step
            "fully_async/trainer/idle_ratio": 0.5,  # timing_s/gen / timing_s/step = 4 / 8
        }
    )


def test_current_stats_count_skipped_values() -> None:
    stats = two_steps().get_current_stats()
    assert stats["step_count"] == 2
    assert stats["total_samples"] == 8
    assert stats["skipped_values"] == 3
    assert stats["skipped_names"] == ["none_value", "text", "vec"]
    assert stats["metric_count"] == 16
    assert "text" not in stats["metric_names"] and "only_first" in stats["metric_names"]


def test_empty_aggregator_and_reset() -> None:
    agg = MetricsAggregator(total_gpus=1)
    assert agg.get_aggregated_metrics() == {}
    assert agg.get_current_stats() == {
        "step_count": 0,
        "metric_count": 0,
        "total_samples": 0,
        "metric_names": [],
        "skipped_values": 0,
        "skipped_names": [],
    }
    agg = two_steps()
    agg.reset()
    assert agg.get_aggregated_metrics() == {}
    assert agg.step_count == 0
    agg.add_step_metrics({"x": 1}, sample_count=1)
    assert agg.get_aggregated_metrics() == {"x": 1.0}


def test_step_without_metrics_counts_as_a_step() -> None:
    agg = MetricsAggregator(total_gpus=1)
    agg.add_step_metrics({}, sample_count=3)
    assert agg.step_count == 1
    assert agg.get_aggregated_metrics() == {}


def test_weighted_avg_with_metric_missing_in_some_steps() -> None:
    agg = MetricsAggregator(total_gpus=1)
    agg.add_step_metrics({"score/weighted_avg": 10.0}, sample_count=1)
    agg.add_step_metrics({"other": 0.0}, sample_count=2)
    agg.add_step_metrics({"score/weighted_avg": 20.0}, sample_count=3)
    # Weighted by the counts of the steps that reported it: (10*1 + 20*3) / 4.
    assert agg.get_aggregated_metrics()["score/weighted_avg"] == pytest.approx(17.5)


def test_weighted_avg_with_zero_weights_is_the_plain_mean() -> None:
    agg = MetricsAggregator(total_gpus=1)
    agg.add_step_metrics({"score/weighted_avg": 1.0}, sample_count=0)
    agg.add_step_metrics({"score/weighted_avg": 4.0}, sample_count=0)
    assert agg.get_aggregated_metrics()["score/weighted_avg"] == pytest.approx(2.5)


def test_accepted_value_types() -> None:
    agg = MetricsAggregator(total_gpus=1)
    agg.add_step_metrics(
        {
            "flag": True,
            "np_flag": np.bool_(True),
            "t0": torch.tensor(2.0),
            "t2": torch.tensor([[3]]),
            "int": 7,
            "np16": np.float16(0.5),
            "arr": np.array([1.0]),
            "cplx": torch.tensor(1 + 2j),
            "lst": [1.0],
        },
        sample_count=1,
    )
    assert agg.get_aggregated_metrics() == {
        "flag": 1.0,
        "np_flag": 1.0,
        "t0": 2.0,
        "t2": 3.0,
        "int": 7.0,
        "np16": 0.5,
    }
    assert agg.get_current_stats()["skipped_names"] == ["arr", "cplx", "lst"]


def test_global_seqlen_minmax_diff_is_recomputed() -> None:
    agg = MetricsAggregator(total_gpus=1)
    agg.add_step_metrics(
        {"global_seqlen/max": 10, "global_seqlen/min": 4, "global_seqlen/minmax_diff": 6}, 1
    )
    agg.add_step_metrics(
        {"global_seqlen/max": 12, "global_seqlen/min": 7, "global_seqlen/minmax_diff": 5}, 1
    )
    result = agg.get_aggregated_metrics()
    assert result["global_seqlen/minmax_diff"] == 8.0  # 12 - 4, not max(6, 5)


def test_missing_partner_keys_never_raise() -> None:
    agg = MetricsAggregator(total_gpus=2)
    agg.add_step_metrics(
        {"global_seqlen/minmax_diff": 6, "perf/throughput": 10.0, "timing_s/gen": 1.0}, 1
    )
    agg.add_step_metrics(
        {"global_seqlen/minmax_diff": 5, "perf/throughput": 30.0, "timing_s/gen": 2.0}, 1
    )
    assert agg.get_aggregated_metrics() == {
        "global_seqlen/minmax_diff": 6.0,  # max, as verl classified it
        "perf/throughput": 20.0,  # plain mean, not recomputed
        "timing_s/gen": 3.0,  # no idle ratio without timing_s/step
    }


def test_zero_denominators_leave_metrics_alone() -> None:
    agg = MetricsAggregator(total_gpus=2)
    agg.add_step_metrics(
        {
            "perf/throughput": 10.0,
            "perf/total_num_tokens": 5,
            "perf/time_per_step": 0.0,
            "timing_s/gen": 1.0,
            "timing_s/step": 0.0,
        },
        1,
    )
    result = agg.get_aggregated_metrics()
    assert result["perf/throughput"] == 10.0
    assert "fully_async/trainer/idle_ratio" not in result


def test_dynamic_resource_utilization() -> None:
    agg = MetricsAggregator(total_gpus=4, hybrid_gpus=2, standalone_gpus=2)
    for compute, mq in ((3.0, 7), (5.0, 2)):
        agg.add_step_metrics(
            {
                "dynamic_resource/train_compute_time_s": compute,
                "dynamic_resource/train_allocated_time_s": 10.0,
                "dynamic_resource/mq_size": mq,
                "timing_s/step": 4.0,
                "timing_s/wait_for_enough_samples": 1.0,
                "training/global_step": compute,
            },
            sample_count=1,
        )
    result = agg.get_aggregated_metrics(rollout_resource_utilization=0.8)
    assert result["dynamic_resource/train_compute_time_s"] == 8.0
    assert result["dynamic_resource/mq_size"] == 2.0  # last
    assert result["training/global_step"] == 5.0  # last
    assert result["dynamic_resource/train_resource_utilization"] == pytest.approx(0.4)  # 8 / 20
    assert result["dynamic_resource/rollout_resource_utilization"] == 0.8
    # x = wait / step = 2 / 8 = .25; ((1-x)*2*.4 + (x*2 + 2)*.8) / 4 = (.6 + 2.0) / 4
    assert result["dynamic_resource/resource_utilization"] == pytest.approx(0.65)
    without = agg.get_aggregated_metrics()
    assert "dynamic_resource/resource_utilization" not in without


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("timing_s/gen", "time_sum"),
        ("timing_s/agent_loop/tool_calls/max", "max"),
        ("timing_s/agent_loop/tool_calls/min", "min"),
        ("timing_s/agent_loop/tool_calls/mean", "avg"),
        ("perf/time_per_step", "time_sum"),
        ("perf/total_num_tokens", "sum"),
        ("perf/throughput", "avg"),
        ("fully_async/total_wait_time", "sum"),
        ("fully_async/processing_time/tp99", "avg"),
        ("fully_async/partial/total_partial_num", "sum"),
        ("fully_async/partial/max_partial_span", "max"),
        ("fully_async/static/max_queue_size", "max"),
        ("fully_async/count/current_param_version", "last"),
        ("dynamic_resource/train_allocated_time_s", "sum"),
        ("global_seqlen/minmax_diff", "max"),
        ("global_seqlen/balanced_min", "min"),
        ("critic/score/mean", "avg"),
        ("actor/entropy_average", "avg"),
        ("response/length_maximum", "max"),
        ("reward/weighted_avg", "weighted_avg"),
        ("reward_weighted_avg", "weighted_avg"),
        ("timing_per_token_ms/gen", "avg"),  # verl: min ("timing" contains "min")
        ("admin/count", "avg"),  # verl: min
        ("maxwell/x", "avg"),  # verl: max
        ("summary/loss", "avg"),  # verl: sum
        ("TIMING_S/X", "time_sum"),  # case-insensitive like verl
        ("x/timing_s/y", "avg"),  # the timing prefix must start the name
        ("x/MIN", "min"),
    ],
)
def test_default_classification(name: str, expected: str) -> None:
    assert DEFAULT_RULES.classify(name) == expected


def test_user_rules_override_defaults() -> None:
    agg = MetricsAggregator(
        total_gpus=1,
        exact_rules={"critic/score/mean": "max"},
        pattern_rules=[("lr", Aggregation.LAST), (re.compile(r"^custom/"), "sum")],
    )
    agg.add_step_metrics({"critic/score/mean": 1.0, "actor/lr": 0.1, "custom/x_mean": 1.0}, 1)
    agg.add_step_metrics({"critic/score/mean": 3.0, "actor/lr": 0.2, "custom/x_mean": 2.0}, 1)
    assert agg.get_aggregated_metrics() == pytest.approx(
        {"critic/score/mean": 3.0, "actor/lr": 0.2, "custom/x_mean": 3.0}
    )
    assert DEFAULT_RULES.classify("critic/score/mean") == "avg"  # defaults untouched


def test_replacing_all_rules() -> None:
    rules = AggregationRules(exact={"a": "sum"}, patterns=[("b", "max")], default="last")
    agg = MetricsAggregator(total_gpus=1, rules=rules)
    agg.add_step_metrics({"a": 1, "x/b": 5, "timing_s/c": 1}, 1)
    agg.add_step_metrics({"a": 2, "x/b": 4, "timing_s/c": 7}, 1)
    assert agg.get_aggregated_metrics() == {"a": 3.0, "x/b": 5.0, "timing_s/c": 7.0}
    assert agg.rules.classify("timing_s/c") == Aggregation.LAST


def test_extended_puts_new_patterns_first() -> None:
    rules = DEFAULT_RULES.extended(patterns=[("total", "last")], default="max")
    assert rules.classify("perf/total_num_tokens") == "last"
    assert rules.classify("unmatched") == "max"
    assert rules.patterns[0] == ("total", Aggregation.LAST)


def test_invalid_rules_and_arguments() -> None:
    with pytest.raises(ValueError, match="median"):
        AggregationRules(exact={"x": "median"})
    with pytest.raises(ValueError, match="empty"):
        AggregationRules(patterns=[("", "sum")])
    with pytest.raises(ValueError, match="total_gpus"):
        MetricsAggregator(total_gpus=0)
    with pytest.raises(ValueError, match="negative"):
        MetricsAggregator(total_gpus=1, hybrid_gpus=-1)
    with pytest.raises(ValueError, match="sample_count"):
        MetricsAggregator(total_gpus=1).add_step_metrics({}, sample_count=-1)


def test_aggregation_is_a_string_enum() -> None:
    assert Aggregation("weighted_avg") is Aggregation.WEIGHTED_AVG
    assert str(Aggregation.TIME_SUM) == "time_sum"
