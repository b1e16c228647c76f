"""How trajtrack's rollout records pickle: one call of a rebuild function over plain data.

A record pickles as ``rebuild_<kind>(state)`` (``__reduce__``): no ``NEWOBJ`` and ``BUILD``
of the class, and no numpy reconstructor: a :class:`RolloutBatch`'s numpy columns travel as
tensors (numeric dtypes torch has), as lists of their items (object arrays: the raw prompts,
the uids) or as their raw bytes with a dtype string (strings, bytes, dates). Both loaders take
that form: ``torch.load(weights_only=True)`` once the three rebuild functions are allow-listed
(they are in :data:`trajtrack.rollout.SAFE_GLOBALS`; torch calls an allow-listed function in
``REDUCE``), and trajtrack's fast loader (:mod:`trajtrack.reader._fast_load`), which maps
these names to the same functions. Each function checks what it is given and raises
:class:`~trajtrack.rollout.BatchTypeError` (a ``TypeError``) for anything else, before any
allocation sized by its input.

Dumps written before this form (``NEWOBJ`` + ``BUILD`` with numpy's reconstructors inside)
still load: the classes keep their ``__setstate__``, and trajtrack's loader sends them to
torch with the allow-list.
"""

from __future__ import annotations

import math
from typing import Any, TypeVar

import numpy as np
import torch

from ._batch import RolloutBatch
from ._errors import BatchTypeError
from ._samples import RolloutSample, ValidateMetrics

__all__ = ["REBUILDS", "rebuild_batch", "rebuild_metrics", "rebuild_sample"]

# numpy dtypes that travel as a tensor of the same dtype (torch.from_numpy / Tensor.numpy).
_AS_TENSOR = frozenset(
    np.dtype(code) for code in ("?", "b", "h", "i", "l", "q", "B", "e", "f", "d", "F", "D")
)


def reduce_record(obj: RolloutSample | ValidateMetrics) -> tuple[Any, tuple[Any, ...]]:
    """``__reduce__`` of a :class:`RolloutSample` or :class:`ValidateMetrics`."""
    rebuild = rebuild_sample if type(obj) is RolloutSample else rebuild_metrics
    return rebuild, (dict(vars(obj)),)


def reduce_batch(batch: RolloutBatch) -> tuple[Any, tuple[Any, ...]]:
    """``__reduce__`` of a :class:`RolloutBatch`."""
    columns = {key: _column(value) for key, value in batch.non_tensor_batch.items()}
    return rebuild_batch, (dict(batch.batch), columns, dict(batch.meta_info))


def rebuild_sample(state: Any) -> RolloutSample:
    """A :class:`RolloutSample` from its attributes (what :func:`reduce_record` gave)."""
    return _with_state(RolloutSample, state)


def rebuild_metrics(state: Any) -> ValidateMetrics:
    """A :class:`ValidateMetrics` from its attributes (what :func:`reduce_record` gave)."""
    return _with_state(ValidateMetrics, state)


def rebuild_batch(batch: Any, columns: Any, meta_info: Any) -> RolloutBatch:
    """A :class:`RolloutBatch` from its tensors, encoded columns and ``meta_info``.

    Raises:
        BatchTypeError: A part is not what :func:`reduce_batch` writes.
        BatchSizeError: The parts disagree on the number of rows.
    """
    if type(batch) is not dict or type(columns) is not dict or type(meta_info) is not dict:
        raise BatchTypeError("a pickled RolloutBatch needs three dicts")
    arrays = {key: _array(key, value) for key, value in columns.items()}
    return RolloutBatch(batch, arrays, meta_info)


REBUILDS: tuple[Any, ...] = (rebuild_sample, rebuild_metrics, rebuild_batch)
"""The functions a pickled record calls (allow-listed for torch's weights-only load)."""


R = TypeVar("R", RolloutSample, ValidateMetrics)


def _with_state(cls: type[R], state: Any) -> R:
    if type(state) is not dict or not all(type(key) is str for key in state):
        raise BatchTypeError(f"a pickled {cls.__name__} needs a dict of attributes")
    obj = object.__new__(cls)
    vars(obj).update(state)
    return obj


def _column(array: np.ndarray[Any, Any]) -> tuple[Any, ...]:
    """One numpy column as plain data: ``("tensor", t)``, ``("object", shape, items)`` or
    ``("raw", dtype string, shape, uint8 tensor)``."""
    shape = list(array.shape)
    if array.dtype == np.dtype(object):
        return ("object", shape, array.reshape(-1).tolist())
    if array.dtype in _AS_TENSOR and array.dtype.isnative:
        return ("tensor", torch.from_numpy(np.ascontiguousarray(array)))
    if array.dtype.hasobject or array.dtype.fields is not None:
        raise BatchTypeError(f"a column of dtype {array.dtype} cannot be pickled")
    raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return ("raw", array.dtype.str, shape, torch.from_numpy(raw.copy()))


def _array(key: Any, column: Any) -> np.ndarray[Any, Any]:
    """The numpy array of one column :func:`_column` encoded."""
    kind = column[0] if type(column) is tuple and column else None
    if kind == "tensor" and len(column) == 2 and type(column[1]) is torch.Tensor:
        return _tensor_array(key, column[1])
    if kind == "object" and len(column) == 3 and type(column[2]) is list:
        shape = _shape(key, column[1])
        if math.prod(shape) != len(column[2]):
            raise BatchTypeError(f"column {key!r}: {len(column[2])} items for shape {shape}")
        out = np.empty(len(column[2]), dtype=object)
        for index, item in enumerate(column[2]):  # item by item: a list stays one element
            out[index] = item
        return out.reshape(shape)
    if kind == "raw" and len(column) == 4 and type(column[1]) is str:
        return _raw_array(key, column[1], _shape(key, column[2]), column[3])
    raise BatchTypeError(f"column {key!r} is not a pickled RolloutBatch column")


def _tensor_array(key: Any, tensor: torch.Tensor) -> np.ndarray[Any, Any]:
    if tensor.requires_grad or tensor.layout is not torch.strided:
        raise BatchTypeError(f"column {key!r}: not a plain tensor")
    try:
        array: np.ndarray[Any, Any] = tensor.numpy()
    except (TypeError, RuntimeError) as exc:  # a dtype numpy has not (bfloat16...)
        raise BatchTypeError(f"column {key!r}: {exc}") from exc
    return array


def _raw_array(key: Any, descr: str, shape: list[int], data: Any) -> np.ndarray[Any, Any]:
    try:
        dtype = np.dtype(descr)
    except (TypeError, ValueError) as exc:
        raise BatchTypeError(f"column {key!r}: bad dtype {descr!r}") from exc
    if dtype.hasobject or dtype.fields is not None:
        raise BatchTypeError(f"column {key!r}: dtype {dtype} cannot be unpickled")
    if type(data) is not torch.Tensor or data.dtype != torch.uint8 or data.dim() != 1:
        raise BatchTypeError(f"column {key!r}: raw data must be a 1-D uint8 tensor")
    if data.numel() != math.prod(shape) * dtype.itemsize or not data.is_contiguous():
        raise BatchTypeError(f"column {key!r}: {data.numel()} bytes for {shape} of {dtype}")
    try:
        return data.numpy().view(dtype).reshape(shape)
    except ValueError as exc:  # e.g. a dtype of size 0
        raise BatchTypeError(f"column {key!r}: {exc}") from exc


def _shape(key: Any, shape: Any) -> list[int]:
    if type(shape) is not list or not all(type(n) is int and n >= 0 for n in shape):
        raise BatchTypeError(f"column {key!r}: bad shape {shape!r}")
    return shape
