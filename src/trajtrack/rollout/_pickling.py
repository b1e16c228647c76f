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
allocation sized by its input. A record's state must be its class's own fields (every one
without a default present, each of its declared type where that is a plain one):
:class:`RecordStateError`, a ``BatchTypeError`` and a :class:`~trajtrack.DumpLoadError`,
otherwise. Its attributes are what ``dataclasses`` and every walk over a loaded record read:
a ``__dataclass_fields__`` among them would shadow the class's own field list.

Dumps written before this form (``NEWOBJ`` + ``BUILD`` with numpy's reconstructors inside)
still load: trajtrack's loader sends them to torch with the allow-list, whose ``BUILD`` calls
the classes' ``__setstate__`` (:func:`restore_state`: the same checks).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

import numpy as np
import torch

from trajtrack._exceptions import DumpLoadError

from ._batch import RolloutBatch
from ._errors import BatchTypeError
from ._samples import RolloutSample, ValidateMetrics

__all__ = ["REBUILDS", "RecordStateError", "rebuild_batch", "rebuild_metrics", "rebuild_sample"]

# numpy dtypes that travel as a tensor of the same dtype (torch.from_numpy / Tensor.numpy).
_AS_TENSOR = frozenset(
    np.dtype(code) for code in ("?", "b", "h", "i", "l", "q", "B", "e", "f", "d", "F", "D")
)

# What a field declared as one of these plain types may hold once loaded (numpy scalars, an
# array or tensor for a list of numbers: what a rollouter plausibly stored there).
_PLAIN_TYPES: dict[Any, tuple[type, ...]] = {
    str: (str,),
    int: (numbers.Integral,),
    float: (numbers.Real,),
    type(None): (type(None),),
    list: (list, tuple, np.ndarray, torch.Tensor),
    dict: (Mapping,),
}


class RecordStateError(BatchTypeError, DumpLoadError):
    """A pickled record's state is not its class's fields.

    A :class:`~trajtrack.rollout.BatchTypeError`, as every rebuild here raises, and a
    :class:`~trajtrack.DumpLoadError`, as the reader's callers expect of a dump it cannot load.
    """


def reduce_record(obj: Any) -> tuple[Any, tuple[Any, ...]]:
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
    return cls(**checked_state(cls, state))


def restore_state(obj: Any, state: Any) -> None:
    """The ``BUILD`` of a dump written before the rebuild form (*obj* a
    :class:`RolloutSample` or :class:`ValidateMetrics`): *state* checked as
    :func:`checked_state` checks it, the fields it leaves out at their defaults."""
    built = rebuild_sample(state) if type(obj) is RolloutSample else rebuild_metrics(state)
    vars(obj).update(vars(built))


def checked_state(cls: type, state: Any) -> dict[str, Any]:
    """*state*, the attributes of a pickled dataclass *cls*, once checked to be its fields.

    Raises:
        RecordStateError: Not a dict of str keys, a key that is not a field of *cls*, a field
            without a default missing, or a value not of its field's plain declared type.
    """
    name = cls.__name__
    if type(state) is not dict or not all(type(key) is str for key in state):
        raise RecordStateError(f"a pickled {name} needs a dict of attributes")
    accepted, required = _field_types(cls)
    unknown = [key for key in state if key not in accepted]
    if unknown:
        raise RecordStateError(f"refusing a pickled {name}: unknown field(s) {_few(unknown)}")
    missing = [key for key in required if key not in state]
    if missing:
        raise RecordStateError(f"refusing a pickled {name}: missing field(s) {_few(missing)}")
    for key, value in state.items():
        if accepted[key] and not isinstance(value, accepted[key]):
            kind = type(value).__name__
            raise RecordStateError(f"refusing a pickled {name}: field {key!r} holds a {kind}")
    return state


@functools.cache
def _field_types(cls: type) -> tuple[dict[str, tuple[type, ...]], tuple[str, ...]]:
    """Each field of dataclass *cls* with the types it may hold (``()``: any), and the names
    of those without a default. Read from the class: an instance's own attributes could
    shadow its field list."""
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    required = tuple(
        f.name
        for f in fields
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )
    return {f.name: _plain_types(hints[f.name]) for f in fields}, required


def _plain_types(hint: Any) -> tuple[type, ...]:
    """What a field declared *hint* may hold; ``()`` unless every part of it is plain."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    parts = typing.get_args(hint) if union else (hint,)
    accepted: list[type] = []
    for part in parts:
        plain = _PLAIN_TYPES.get(typing.get_origin(part) or part)
        if plain is None:  # Any, or a type this check does not judge
            return ()
        accepted.extend(plain)
    return tuple(accepted)


def _few(names: list[str]) -> str:
    """Up to 5 names, each cut to 40 characters: they come from the file."""
    shown = ", ".join(repr(name[:40]) for name in names[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")


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
