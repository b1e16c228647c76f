"""What :class:`~trajtrack.rollout.RolloutBatch`'s operations compute, on its parts.

``concat``, ``repeat`` and ``select`` build a new batch from new dicts of tensors, arrays and
metadata; the functions here make those dicts (and check the inputs, with the same errors as
``DataProto``'s operations), the batch class builds the batch from them. Kept apart so that
the class reads as the container it is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ._equality import values_equal
from ._errors import BatchConflictError, BatchKeyError, BatchSizeError

if TYPE_CHECKING:  # the batch module imports this one
    from ._batch import RolloutBatch

__all__ = ["concat_parts", "repeat_parts", "subset"]

logger = logging.getLogger(__name__)

Parts = tuple[dict[str, torch.Tensor], dict[str, np.ndarray[Any, Any]], dict[str, Any]]


def concat_parts(data: Sequence[RolloutBatch]) -> Parts:
    """The tensors, arrays and merged ``meta_info`` of *data* (not empty) concatenated.

    Raises:
        BatchKeyError: The batches do not have the same keys.
        BatchSizeError: Tensors under one key differ beyond the first dimension.
        BatchConflictError: A ``meta_info`` key has different values.
    """
    first = data[0]
    for index, item in enumerate(data[1:], start=1):
        _check_same_keys("batch", first.batch.keys(), item.batch.keys(), index)
        _check_same_keys(
            "non_tensor_batch",
            first.non_tensor_batch.keys(),
            item.non_tensor_batch.keys(),
            index,
        )
    tensors = {key: _cat_tensors(key, [d.batch[key] for d in data]) for key in first.batch}
    arrays = {
        key: _cat_arrays(key, [d.non_tensor_batch[key] for d in data])
        for key in first.non_tensor_batch
    }
    return tensors, arrays, _merge_meta([d.meta_info for d in data])


def repeat_parts(
    batch: Mapping[str, torch.Tensor],
    non_tensor_batch: Mapping[str, np.ndarray[Any, Any]],
    repeat_times: int,
    interleave: bool,
) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray[Any, Any]]]:
    """Every row repeated *repeat_times* times (``[a, a, b, b]``, or ``[a, b, a, b]``).

    Raises:
        ValueError: ``repeat_times`` is not a positive integer.
    """
    if isinstance(repeat_times, bool) or not isinstance(repeat_times, int) or repeat_times < 1:
        raise ValueError(f"repeat_times must be a positive integer, got {repeat_times!r}")
    if interleave:
        tensors = map_tensors(lambda v: v.repeat_interleave(repeat_times, dim=0), batch)
        arrays = {k: np.repeat(v, repeat_times, axis=0) for k, v in non_tensor_batch.items()}
    else:
        tensors = map_tensors(lambda v: v.repeat(repeat_times, *([1] * (v.dim() - 1))), batch)
        arrays = {
            k: np.tile(v, (repeat_times,) + (1,) * (v.ndim - 1))
            for k, v in non_tensor_batch.items()
        }
    return tensors, arrays


def _check_same_keys(part: str, first: Iterable[str], other: Iterable[str], index: int) -> None:
    a, b = set(first), set(other)
    if a != b:
        raise BatchKeyError(
            f"cannot concat: {part} keys of batch {index} differ from batch 0 "
            f"(missing {sorted(a - b)}, extra {sorted(b - a)})"
        )


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], batch: Mapping[str, Any]) -> Any:
    """*batch* with *fn* applied to every tensor; nested mappings (nested TensorDicts) kept."""
    return {k: map_tensors(fn, v) if isinstance(v, Mapping) else fn(v) for k, v in batch.items()}


def _cat_tensors(key: str, tensors: list[Any]) -> Any:
    if isinstance(tensors[0], Mapping):  # a nested TensorDict: its tensors, key by key
        for index, item in enumerate(tensors):
            if not isinstance(item, Mapping):
                raise BatchKeyError(f"cannot concat {key!r}: batch {index} has a tensor there")
            _check_same_keys(f"batch[{key!r}]", tensors[0].keys(), item.keys(), index)
        return {k: _cat_tensors(f"{key}.{k}", [t[k] for t in tensors]) for k in tensors[0]}
    tail = tuple(tensors[0].shape[1:])
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise BatchKeyError(f"cannot concat {key!r}: batch {index} has a mapping there")
        if tuple(tensor.shape[1:]) != tail:
            raise BatchSizeError(
                f"cannot concat {key!r}: batch {index} has shape {tuple(tensor.shape)}, "
                f"batch 0 has trailing dimensions {tail}"
            )
    return torch.cat(tensors, dim=0)


def _cat_arrays(key: str, arrays: list[np.ndarray[Any, Any]]) -> np.ndarray[Any, Any]:
    try:
        return np.concatenate(arrays, axis=0)
    except ValueError as exc:
        shapes = [a.shape for a in arrays]
        raise BatchSizeError(f"cannot concat {key!r}: incompatible shapes {shapes}") from exc


def _merge_meta(metas: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    metrics: list[Any] = []
    saw_metrics = False
    for index, meta in enumerate(metas):
        for key, value in meta.items():
            if key == "metrics":
                saw_metrics = True
                metrics.extend(value if isinstance(value, list) else [value])
            elif key not in merged:
                merged[key] = value
            elif not values_equal(merged[key], value):
                raise BatchConflictError(
                    f"cannot concat: meta_info[{key!r}] of batch {index} "
                    "differs from earlier batches"
                )
    if saw_metrics:
        merged["metrics"] = _list_of_dicts_to_dict_of_lists(metrics)
    return merged


def _list_of_dicts_to_dict_of_lists(items: list[Any]) -> Any:
    if not items or not all(isinstance(item, Mapping) for item in items):
        return items
    out: dict[str, list[Any]] = {}
    for item in items:
        for key, value in item.items():
            out.setdefault(key, []).append(value)
    return out


def subset(part: str, source: dict[str, Any], keys: Iterable[str] | None) -> dict[str, Any]:
    """The entries of *source* (a copy) under *keys*, in their order; all of them for ``None``.

    Raises:
        BatchKeyError: A key is missing (*part* names the dict in the message).
    """
    if keys is None:
        return dict(source)
    wanted = list(keys)
    missing = [k for k in wanted if k not in source]
    if missing:
        raise BatchKeyError(f"{part} has no key(s) {missing}; available: {sorted(source)}")
    return {k: source[k] for k in wanted}
