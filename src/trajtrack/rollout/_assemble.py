"""Assembling many :class:`RolloutSample` objects into one training batch.

Works on :class:`RolloutBatch` and on verl's ``DataProto`` alike: it only uses the batch's
``batch`` / ``non_tensor_batch`` / ``meta_info`` attributes and its class's ``concat``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from ._errors import BatchKeyError

__all__ = [
    "BalanceBatchFn",
    "addition_process",
    "assemble_batch_from_rollout_samples",
    "compute_response_mask",
]

logger = logging.getLogger(__name__)

# (start, end) column pairs, in priority order: the Jan-2026 snapshot's names first (the
# issue pins them), then verl 0.9.1's weight-version columns.
_VERSION_COLUMNS = (
    ("param_version_start", "param_version_end"),
    ("min_global_steps", "max_global_steps"),
)
_PERCENTILES = (50, 95, 99)


class BalanceBatchFn(Protocol):
    """A callback that reorders a batch's rows in place and reports metrics.

    verl's ``RayPPOTrainer._balance_batch`` has this shape. It may return a new batch
    instead of reordering in place; any other return value is ignored.
    """

    def __call__(self, batch: Any, *, metrics: dict[str, Any]) -> Any: ...


def compute_response_mask(batch: Any) -> torch.Tensor:
    """Return the last ``responses.size(1)`` columns of ``attention_mask`` (a copy).

    This marks every non-pad response token, tool output included, like verl's fallback.

    Raises:
        BatchKeyError: The batch lacks ``responses`` or ``attention_mask``.
    """
    tensors = batch.batch if batch.batch is not None else {}
    for key in ("responses", "attention_mask"):
        if key not in tensors:
            raise BatchKeyError(f"cannot compute 'response_mask': the batch has no {key!r} tensor")
    response_length = int(tensors["responses"].size(1))
    mask: torch.Tensor = tensors["attention_mask"][:, -response_length:]
    return mask.clone()


def addition_process(batch: Any) -> Any:
    """Move per-trajectory agent-loop timings from ``meta_info`` into columns, in place.

    verl 0.9.1 workers put a list of per-trajectory metric records (mappings or objects
    with ``generate_sequences`` and ``tool_calls`` seconds) in ``meta_info["metrics"]``.
    This pops it and sets ``non_tensor_batch["processing_times"]`` and
    ``["tool_calls_times"]`` as float arrays (verl stored plain lists). A dict of lists
    (what ``concat`` makes of several such lists) is accepted too. A batch without
    ``meta_info["metrics"]`` is returned unchanged.

    Args:
        batch: A ``RolloutBatch`` or ``DataProto``; modified in place.

    Returns:
        The same batch.

    Raises:
        BatchKeyError: A metric record has no ``generate_sequences``.
    """
    if "metrics" not in batch.meta_info:
        return batch
    records = _metric_records(batch.meta_info.pop("metrics"))
    processing = [_record_field(r, "generate_sequences", required=True) for r in records]
    tools = [_record_field(r, "tool_calls", required=False) for r in records]
    batch.non_tensor_batch["processing_times"] = np.asarray(processing, dtype=np.float64)
    batch.non_tensor_batch["tool_calls_times"] = np.asarray(tools, dtype=np.float64)
    return batch


def assemble_batch_from_rollout_samples(
    rollout_samples: Sequence[Any],
    tokenizer: Any = None,
    config: Any = None,
    balance_batch: BalanceBatchFn | None = None,
) -> Any:
    """Concatenate the samples' batches into a training batch and attach statistics.

    Steps: apply :func:`addition_process` to each sample's batch that still carries
    ``meta_info["metrics"]`` (in place, as verl does); ``concat`` the batches; add
    ``response_mask`` if absent (:func:`compute_response_mask`); call ``balance_batch``
    if given and **keep** its metrics in ``meta_info`` (verl discarded them); set
    ``meta_info["global_token_num"]`` from ``attention_mask``; then add to ``meta_info``:

    * ``param_version_diversity`` (number of distinct end versions) and
      ``trajectory_param_versions`` (per-trajectory end version, a list);
    * ``fully_async/processing_time/{avg,max,min,tp50,tp95,tp99}`` over all trajectories;
    * the samples' ``rollout_status`` with each key prefixed ``fully_async/``;
    * ``fully_async/partial/{total_partial_num,partial_ratio,max_partial_span}`` from
      ``|end - start|`` per trajectory;
    * ``timing_s/agent_loop/tool_calls/{max,min,mean}`` — only when some trajectory spent
      non-zero time in tool calls (verl emitted zeros for tool-less batches).

    Sources: timings come from the ``processing_times`` / ``tool_calls_times`` columns,
    else from the samples' ``processing_times`` / ``tool_calls`` fields. Versions come from
    the ``param_version_start``/``param_version_end`` columns, which win over verl 0.9.1's
    ``min_global_steps``/``max_global_steps`` when both exist; else from the samples'
    ``param_version_start``/``param_version_end`` fields; else (end only) each sample's
    ``param_version`` for each of its rows. Trajectories whose version is ``None`` are left
    out of the version statistics (verl raised ``TypeError``). A group whose source is
    absent is omitted.

    ``rollout_status``: verl took the first sample's only, i.e. the oldest snapshot. Here
    the samples' statuses are merged in order, so each key carries the value from the
    latest sample that reported it.

    Statistics are Python ``int``/``float`` values (verl returned numpy scalars).

    Args:
        rollout_samples: The samples, in queue order.
        tokenizer: Unused; kept for verl's signature.
        config: Unused; kept for verl's signature.
        balance_batch: Optional row-balancing callback, see :class:`BalanceBatchFn`.

    Returns:
        The assembled batch, of the first sample's batch class.

    Raises:
        ValueError: ``rollout_samples`` is empty.
        BatchKeyError: ``response_mask`` is absent and cannot be computed, or the batches
            do not share keys.
        BatchConflictError: The batches' ``meta_info`` disagree.
    """
    del tokenizer, config  # verl's signature; neither is needed
    started = time.perf_counter()
    samples = list(rollout_samples)
    if not samples:
        raise ValueError("Empty rollout_samples provided for batch assembly")
    logger.debug("assembling a batch from %d rollout samples", len(samples))
    batches = [_prepare_sample_batch(rs.full_batch) for rs in samples]
    final = type(batches[0]).concat(batches)
    if "response_mask" not in _tensor_keys(final):
        final.batch["response_mask"] = compute_response_mask(final)
    stats: dict[str, Any] = {}
    if balance_batch is not None:
        final = _balance(final, balance_batch, stats)
    if "attention_mask" in _tensor_keys(final):
        final.meta_info["global_token_num"] = final.batch["attention_mask"].sum(-1).tolist()
    start_versions, end_versions = _version_columns(final, samples)
    stats.update(_version_stats(end_versions))
    stats.update(
        _processing_time_stats(_timings(final, samples, "processing_times", "processing_times"))
    )
    stats.update(_rollout_status(samples))
    stats.update(_partial_stats(start_versions, end_versions))
    stats.update(_tool_call_stats(_timings(final, samples, "tool_calls_times", "tool_calls")))
    final.meta_info.update(stats)
    logger.debug("batch assembly completed in %.3fs", time.perf_counter() - started)
    return final


# -- steps ----------------------------------------------------------------------------------


def _prepare_sample_batch(batch: Any) -> Any:
    if "processing_times" not in batch.non_tensor_batch and "metrics" in batch.meta_info:
        addition_process(batch)
    return batch


def _tensor_keys(batch: Any) -> Iterable[str]:
    return batch.batch.keys() if batch.batch is not None else ()


def _balance(final: Any, balance_batch: BalanceBatchFn, metrics: dict[str, Any]) -> Any:
    result = balance_batch(final, metrics=metrics)
    if result is not None and hasattr(result, "non_tensor_batch"):
        return result
    return final


def _metric_records(raw: Any) -> list[Any]:
    if isinstance(raw, Mapping):  # dict of per-trajectory lists, e.g. after concat
        keys = list(raw)
        columns = [list(raw[k]) for k in keys]
        return [dict(zip(keys, row, strict=True)) for row in zip(*columns, strict=True)]
    return list(raw)


def _record_field(record: Any, name: str, *, required: bool) -> float:
    value = record.get(name) if isinstance(record, Mapping) else getattr(record, name, None)
    if value is None:
        if required:
            raise BatchKeyError(f"agent-loop metric record has no {name!r}: {record!r}")
        return 0.0
    return float(value)


def _concat_field(samples: list[Any], field: str) -> list[Any]:
    out: list[Any] = []
    for rs in samples:
        out.extend(getattr(rs, field, None) or [])
    return out


def _timings(final: Any, samples: list[Any], column: str, field: str) -> list[float]:
    if column in final.non_tensor_batch:
        values: Iterable[Any] = final.non_tensor_batch[column]
    else:
        values = _concat_field(samples, field)
    return [float(v) for v in values if v is not None]


def _version_columns(final: Any, samples: list[Any]) -> tuple[list[Any] | None, list[Any]]:
    arrays = final.non_tensor_batch
    for start_key, end_key in _VERSION_COLUMNS:
        if end_key in arrays:
            start = _plain_list(arrays[start_key]) if start_key in arrays else None
            return start, _plain_list(arrays[end_key])
    end = _concat_field(samples, "param_version_end")
    if end:
        return _plain_list(_concat_field(samples, "param_version_start")) or None, _plain_list(end)
    per_row = [
        getattr(rs, "param_version", None) for rs in samples for _ in range(len(rs.full_batch))
    ]
    return None, _plain_list(per_row)


def _plain_list(values: Iterable[Any]) -> list[Any]:
    return [v.item() if isinstance(v, np.generic) else v for v in values]


# -- statistics -----------------------------------------------------------------------------


def _version_stats(end_versions: list[Any]) -> dict[str, Any]:
    known = {v for v in end_versions if v is not None}
    return {
        "param_version_diversity": len(known),
        "trajectory_param_versions": list(end_versions),
    }


def _processing_time_stats(times: list[float]) -> dict[str, float]:
    if not times:
        return {}
    values = np.asarray(times, dtype=np.float64)
    prefix = "fully_async/processing_time/"
    stats = {
        f"{prefix}avg": float(values.mean()),
        f"{prefix}max": float(values.max()),
        f"{prefix}min": float(values.min()),
    }
    for q in _PERCENTILES:
        stats[f"{prefix}tp{q}"] = float(np.percentile(values, q))
    return stats


def _rollout_status(samples: list[Any]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for rs in samples:
        merged.update(getattr(rs, "rollout_status", None) or {})
    return {f"fully_async/{key}": value for key, value in merged.items()}


def _partial_stats(start: list[Any] | None, end: list[Any]) -> dict[str, Any]:
    if start is None:
        return {}
    if len(start) != len(end):
        logger.warning(
            "skipping partial-rollout stats: %d start versions but %d end versions",
            len(start),
            len(end),
        )
        return {}
    spans = [
        abs(int(e) - int(s))
        for s, e in zip(start, end, strict=True)
        if s is not None and e is not None
    ]
    if not spans:
        return {}
    partial = sum(1 for span in spans if span != 0)
    return {
        "fully_async/partial/total_partial_num": partial,
        "fully_async/partial/partial_ratio": partial / len(spans),
        "fully_async/partial/max_partial_span": max(spans),
    }


def _tool_call_stats(times: list[float]) -> dict[str, float]:
    if not any(t != 0 for t in times):
        return {}
    values = np.asarray(times, dtype=np.float64)
    return {
        "timing_s/agent_loop/tool_calls/max": float(values.max()),
        "timing_s/agent_loop/tool_calls/min": float(values.min()),
        "timing_s/agent_loop/tool_calls/mean": float(values.mean()),
    }
