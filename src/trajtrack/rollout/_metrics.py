"""Aggregating per-step training metrics over one parameter-sync window.

In fully-async training several trainer steps share one parameter version; the trainer
feeds each step's metrics to :class:`MetricsAggregator` and logs one aggregate per version.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ._rules import DEFAULT_RULES, Aggregation, AggregationRules, NamePattern

__all__ = ["MetricsAggregator"]

logger = logging.getLogger(__name__)


class MetricsAggregator:
    """Combine the metric dicts of several training steps into one dict.

    Each metric is aggregated over the steps in which it appeared, with the aggregation
    chosen by :class:`AggregationRules` (exact names, then word patterns, then the
    default: a plain mean). Derived metrics are then recomputed from the aggregates:

    * ``global_seqlen/minmax_diff`` = ``global_seqlen/max - global_seqlen/min`` (when the
      diff and both partners are present; otherwise the diff's own aggregate is kept);
    * ``perf/throughput`` = ``perf/total_num_tokens / (perf/time_per_step * total_gpus)``;
    * ``fully_async/trainer/idle_ratio`` = ``timing_s/gen / timing_s/step``;
    * ``dynamic_resource/train_resource_utilization`` =
      ``train_compute_time_s / train_allocated_time_s``;
    * ``dynamic_resource/resource_utilization`` (with ``rollout_resource_utilization``),
      as in verl 0.9.1.

    Differences from verl's ``MetricsAggregator``, which this re-implements:

    * ``weighted_avg`` is reachable: names with the word run ``weighted_avg`` use it, each
      value weighted by the ``sample_count`` of the step that reported it (verl tested
      ``"avg"`` first, so it never ran).
    * Patterns match whole words of the name, not substrings: ``timing_per_token_ms/x`` and
      ``admin/x`` are no longer aggregated with ``min``.
    * A derived metric whose inputs are missing is left alone instead of raising
      ``KeyError``; a zero denominator leaves it alone instead of raising.
    * Values of unsupported types (strings, arrays, multi-element tensors, ``None``…) are
      skipped and counted in :meth:`get_current_stats` (verl skipped most silently and
      raised on multi-element tensors).
    * Rules are data: pass ``exact_rules`` / ``pattern_rules`` or a whole ``rules`` object.

    Args:
        total_gpus: GPUs used to recompute ``perf/throughput`` (verl passes trainer plus
            rollout GPUs).
        hybrid_gpus: Trainer GPUs that can also roll out (verl 0.9.1 resource utilization).
        standalone_gpus: Rollout-only GPUs.
        rules: Replaces :data:`DEFAULT_RULES`.
        exact_rules: Extra exact-name rules, overriding those in ``rules``.
        pattern_rules: Extra patterns, checked before those in ``rules``.

    Raises:
        ValueError: ``total_gpus`` is below 1, a GPU count is negative, or a rule is invalid.
    """

    def __init__(
        self,
        total_gpus: int,
        hybrid_gpus: int = 0,
        standalone_gpus: int = 0,
        *,
        rules: AggregationRules | None = None,
        exact_rules: Mapping[str, Aggregation | str] | None = None,
        pattern_rules: Iterable[tuple[NamePattern, Aggregation | str]] = (),
    ) -> None:
        if total_gpus < 1:
            raise ValueError(f"total_gpus must be at least 1, got {total_gpus}")
        if hybrid_gpus < 0 or standalone_gpus < 0:
            raise ValueError(
                "GPU counts must not be negative: "
                f"hybrid={hybrid_gpus}, standalone={standalone_gpus}"
            )
        self.total_gpus = total_gpus
        self.hybrid_gpus = hybrid_gpus
        self.standalone_gpus = standalone_gpus
        self.rules = (rules or DEFAULT_RULES).extended(exact_rules, pattern_rules)
        self._values: dict[str, list[float]] = {}
        self._weights: dict[str, list[float]] = {}
        self._sample_counts: list[int] = []
        self._timestamps: list[float] = []
        self._skipped: dict[str, int] = {}

    @property
    def step_count(self) -> int:
        """Number of steps added since the last :meth:`reset`."""
        return len(self._sample_counts)

    def add_step_metrics(
        self, metrics: Mapping[str, Any], sample_count: int, timestamp: float | None = None
    ) -> None:
        """Record one training step's metrics.

        Args:
            metrics: Name → value. ``int``, ``float`` (``bool`` counts as an int), numpy
                numeric scalars and one-element tensors are recorded; other values are
                skipped and counted.
            sample_count: Samples this step trained on; the weight for ``weighted_avg``.
            timestamp: When the step finished (``time.time()`` if omitted). Kept for
                inspection only.

        Raises:
            ValueError: ``sample_count`` is negative.
        """
        if sample_count < 0:
            raise ValueError(f"sample_count must not be negative, got {sample_count}")
        self._sample_counts.append(int(sample_count))
        self._timestamps.append(time.time() if timestamp is None else float(timestamp))
        for name, value in metrics.items():
            number = _as_float(value)
            if number is None:
                self._skipped[name] = self._skipped.get(name, 0) + 1
                logger.debug("skipping metric %r: unsupported value of type %s", name, type(value))
                continue
            self._values.setdefault(name, []).append(number)
            self._weights.setdefault(name, []).append(float(sample_count))

    def get_aggregated_metrics(
        self, rollout_resource_utilization: float | None = None
    ) -> dict[str, float]:
        """Aggregate everything recorded since the last :meth:`reset`.

        Does not reset; call :meth:`reset` after logging.

        Args:
            rollout_resource_utilization: The rollouter's utilization for this window; with
                it, ``dynamic_resource/resource_utilization`` is derived (verl 0.9.1).

        Returns:
            Name → aggregated value; ``{}`` when no step was added.
        """
        if self.step_count == 0:
            return {}
        started = time.perf_counter()
        aggregated = {
            name: _aggregate(self.rules.classify(name), values, self._weights[name])
            for name, values in self._values.items()
        }
        self._derive(aggregated, rollout_resource_utilization)
        logger.debug(
            "aggregated %d metrics over %d steps in %.4fs",
            len(aggregated),
            self.step_count,
            time.perf_counter() - started,
        )
        return aggregated

    def reset(self) -> None:
        """Forget all recorded steps; rules and GPU counts are kept."""
        self._values.clear()
        self._weights.clear()
        self._sample_counts.clear()
        self._timestamps.clear()
        self._skipped.clear()

    def get_current_stats(self) -> dict[str, Any]:
        """Describe what is recorded (for debugging).

        Returns:
            ``step_count``, ``metric_count``, ``total_samples``, ``metric_names``,
            ``skipped_values`` (how many values were skipped) and ``skipped_names``.
        """
        return {
            "step_count": self.step_count,
            "metric_count": len(self._values),
            "total_samples": sum(self._sample_counts),
            "metric_names": list(self._values),
            "skipped_values": sum(self._skipped.values()),
            "skipped_names": sorted(self._skipped),
        }

    def _derive(self, agg: dict[str, float], rollout_utilization: float | None) -> None:
        seq_max, seq_min = agg.get("global_seqlen/max"), agg.get("global_seqlen/min")
        if "global_seqlen/minmax_diff" in agg and seq_max is not None and seq_min is not None:
            agg["global_seqlen/minmax_diff"] = seq_max - seq_min
        tokens, step_time = agg.get("perf/total_num_tokens"), agg.get("perf/time_per_step")
        if "perf/throughput" in agg and tokens is not None and step_time:
            agg["perf/throughput"] = tokens / (step_time * self.total_gpus)
        gen, step = agg.get("timing_s/gen"), agg.get("timing_s/step")
        if gen is not None and step:
            agg["fully_async/trainer/idle_ratio"] = gen / step
        compute = agg.get("dynamic_resource/train_compute_time_s")
        allocated = agg.get("dynamic_resource/train_allocated_time_s")
        if compute is not None and allocated:
            agg["dynamic_resource/train_resource_utilization"] = compute / allocated
        self._derive_resource_utilization(agg, rollout_utilization)

    def _derive_resource_utilization(
        self, agg: dict[str, float], rollout_utilization: float | None
    ) -> None:
        train_utilization = agg.get("dynamic_resource/train_resource_utilization")
        step = agg.get("timing_s/step", 0.0)
        gpus = self.hybrid_gpus + self.standalone_gpus
        if train_utilization is None or rollout_utilization is None or gpus <= 0 or step <= 0:
            return
        wait = agg.get("timing_s/wait_for_enough_samples", 0.0)
        x = min(max(wait / step, 0.0), 1.0)
        a, b = self.hybrid_gpus, self.standalone_gpus
        agg["dynamic_resource/rollout_resource_utilization"] = float(rollout_utilization)
        agg["dynamic_resource/resource_utilization"] = (
            (1 - x) * a * train_utilization + (x * a + b) * rollout_utilization
        ) / (a + b)


def _as_float(value: Any) -> float | None:
    if isinstance(value, int | float | np.integer | np.floating | np.bool_):
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        return float(value.item())
    return None


def _aggregate(kind: Aggregation, values: Sequence[float], weights: Sequence[float]) -> float:
    if kind is Aggregation.LAST:
        return values[-1]
    if kind in (Aggregation.SUM, Aggregation.TIME_SUM):
        return math.fsum(values)
    if kind is Aggregation.MAX:
        return max(values)
    if kind is Aggregation.MIN:
        return min(values)
    if kind is Aggregation.WEIGHTED_AVG:
        total = math.fsum(weights)
        if total > 0:
            return math.fsum(v * w for v, w in zip(values, weights, strict=True)) / total
    return math.fsum(values) / len(values)
