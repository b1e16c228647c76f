"""The fully-async rollout data layer: samples, batches and metric aggregation.

A clean-room re-implementation of the data structures and helpers of verl's fully-async
training (``verl/experimental/fully_async_policy/detach_utils.py``), usable with or
without verl: a rollouter builds one :class:`RolloutSample` per prompt
(:func:`prepare_single_generation_data`), a trainer assembles many into a training batch
(:func:`assemble_batch_from_rollout_samples`) and aggregates per-step metrics over one
parameter version (:class:`MetricsAggregator`). :class:`RolloutBatch` is a small
``DataProto``-compatible container; the functions also accept verl's ``DataProto``.

Records dumped with trajtrack load with ``torch.load(path, weights_only=True)`` inside
``torch.serialization.safe_globals(list(SAFE_GLOBALS))``. See ``docs/rollout.md``.

Read the modules in this order::

    _samples.py    the records a fully-async rollouter hands to the trainer (RolloutSample)
    _prepare.py    one dataloader item turned into the batch a rollouter generates from
    _batch.py      RolloutBatch: a small container compatible with verl's ``DataProto``
    _batch_ops.py  ... what its operations compute, on its parts
    _equality.py   ... deep, tensor- and array-aware equality it uses
    _assemble.py   many RolloutSample objects assembled into one training batch
    _config.py     nested settings read from whatever config object the caller has
    _metrics.py    MetricsAggregator: per-step metrics over one parameter-sync window
    _rules.py      which aggregation applies to which metric name, as extendable data
    _manifest.py   which samples made up a trainer step: a per-step manifest, via the tracker
    _pickling.py   how the records pickle: one rebuild call over plain data
    _safe.py       SAFE_GLOBALS: the allow-list for ``torch.load(..., weights_only=True)``
    _errors.py     the errors this layer raises
"""

from __future__ import annotations

from ._assemble import (
    BalanceBatchFn,
    addition_process,
    assemble_batch_from_rollout_samples,
    compute_response_mask,
)
from ._batch import RolloutBatch, to_object_array
from ._errors import (
    BatchConflictError,
    BatchError,
    BatchKeyError,
    BatchSizeError,
    BatchTypeError,
)
from ._manifest import STEP_MANIFEST, manifest_dumps, record_step_manifest, step_manifest
from ._metrics import MetricsAggregator
from ._pickling import REBUILDS as RECORD_REBUILDS
from ._prepare import (
    MULTI_TURN_AGENT,
    NO_AGENT_NAME,
    SINGLE_TURN_AGENT,
    VERL_091_SINGLE_TURN_AGENT,
    prepare_single_generation_data,
)
from ._rules import DEFAULT_RULES, Aggregation, AggregationRules, NamePattern
from ._safe import SAFE_GLOBALS
from ._samples import RolloutSample, ValidateMetrics

__all__ = [
    "DEFAULT_RULES",
    "MULTI_TURN_AGENT",
    "NO_AGENT_NAME",
    "RECORD_REBUILDS",
    "SAFE_GLOBALS",
    "SINGLE_TURN_AGENT",
    "STEP_MANIFEST",
    "VERL_091_SINGLE_TURN_AGENT",
    "Aggregation",
    "AggregationRules",
    "BalanceBatchFn",
    "BatchConflictError",
    "BatchError",
    "BatchKeyError",
    "BatchSizeError",
    "BatchTypeError",
    "MetricsAggregator",
    "NamePattern",
    "RolloutBatch",
    "RolloutSample",
    "ValidateMetrics",
    "addition_process",
    "assemble_batch_from_rollout_samples",
    "compute_response_mask",
    "manifest_dumps",
    "prepare_single_generation_data",
    "record_step_manifest",
    "step_manifest",
    "to_object_array",
]
